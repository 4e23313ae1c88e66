"""pydantic-ai agents inside a step: every model request and tool call recorded.

Two names. :class:`DurableAgent` wraps a pydantic-ai ``Agent`` so that a run of
it inside a step is made of journaled calls: each model request is a
journaled call, each tool the user marks as side-effecting an effect with
its own idempotency key, which the tool reads with :func:`idempotency_key`.
A crash (or a retry) at any point of the agent run re-runs the step, and the
finished model requests and tool calls replay from the checkpoint instead of
being paid for, or fired, again::

    from durable_steps.integrations.pydantic_ai import DurableAgent, idempotency_key

    @agent.tool
    def charge(run_ctx, amount: int) -> str:
        return payments.charge(amount, idempotency_key=idempotency_key(run_ctx))

    durable = DurableAgent(agent, effects={"charge"})      # tool names with side effects

    @wf.step()
    def turn(state, ctx):
        result = durable.run_sync(state["prompt"], ctx=ctx)  # (and `await durable.run(...)`)

``DurableAgent(agent, *, effects=(), live=(), history_key="messages")``. Its
entry points are the agent's: ``run_sync``, ``run``, ``iter``,
``run_stream`` and ``run_stream_events``, each with ``ctx=`` (the step's
context), ``state=`` (below) and ``run_name=`` (below); every other keyword
goes to the agent's own.

It follows the public seams pydantic-ai's own durable wrappers (Temporal,
DBOS, Prefect) are built on: a ``WrapperModel`` whose requests are durable
units (``_model``), a ``WrapperToolset`` whose ``call_tool`` is one
(``_tools``), both put in place for one run with ``Agent.override`` (a
context variable: other runs of the same agent, in other threads or tasks,
are untouched). Nothing is monkeypatched, and the agent still runs normally
outside ``DurableAgent``. An ``agent.override(model=...)`` around a run is
honoured (that model is the one called and recorded).

What is recorded, under which name (numbered in order, so a re-run of the
step finds the same names), and shown under which title (what ``show``,
``resolve``, events and spans display):

``model:1``, ``model:2``, ... (title ``model request 1 (function:...)``)
    Each model request, in the order the agent makes them. The
    ``ModelResponse`` is stored as JSON (pydantic-ai's
    ``ModelMessagesTypeAdapter``) and rebuilt from that JSON on both paths,
    so a replayed response equals a live one. A streamed request is drained
    and recorded with all its events, which stream back on both paths:
    start, deltas and end of each part, as from the plain agent (``_model``).
``tool:<tool_call_id>`` (title ``refund(order='4411', cents=500)``)
    Each tool call. A tool named in ``effects`` is an *effect*: its intent
    and key are durable before it starts, and a crash inside it makes it *in
    doubt* (the step's ``in_doubt`` policy decides; by default it fires again
    with the same key). Every other tool is a journaled *call*: its result
    is recorded too, because the model requests after it were made with
    that result, and a read that answered differently on replay would give
    the model a transcript it never saw. Results come back as the types the
    tool's return annotation names (``-> Order``, ``-> list[Order]``,
    ``-> Order | Refund``: nested too), pydantic-ai's multimodal content
    (``BinaryImage``, ``DocumentUrl``...) as itself anywhere in the result,
    anything else as its JSON form, on both paths; with the usage a
    sub-agent run inside the tool added (``_tools``). A record never names
    a module to import. A ``ModelRetry`` the tool raises is recorded like a
    result; other exceptions (``ApprovalRequired``, errors) record nothing.
Tools named in ``live``
    are not recorded at all: they run on every re-run of the step, as in a
    plain agent (a tool that changes ``deps``, picks a toolset, reads the
    clock). Their results must not be side effects worth deduplicating.
A second agent run in the same step
    is prefixed ``agent2:``, ``agent3:``... (``agent2:model:1``), when the
    runs come one after another in one task or thread. Runs that overlap, or
    start in different tasks or threads (``asyncio.gather``, a thread
    pool), start in an order timing decides, so numbered they would replay
    each other's records after a retry or a crash: each needs
    ``run_name="refund"`` (recorded as ``refund:model:1``, the same name's
    next run ``refund#2:``), else the second is a ``DefinitionError``.
Tool bodies
    run outside the durable run: an ``agent.run`` inside a tool (the agent
    delegating to itself, or any agent) is a plain run, part of the tool's
    recorded result.

**Conversation history without user code.** ``state=`` keeps the
conversation in ``state[history_key]`` (``"messages"`` by default) as JSON:
read as ``message_history`` before the run, the run's new messages appended
after it, at a cost per turn proportional to the new messages, plus one
comparison in C of the kept messages with their stored form, which is what
lets an item edited in place reach the model as after a resume (``_history``).
So a multi-turn agent is one step per turn::

    @wf.step()
    def turn(state, ctx):
        result = durable.run_sync(state["prompt"], ctx=ctx, state=state)
        state["reply"] = result.output

The state changes only once the agent run finished, so a step that crashed
halfway commits nothing of it, and its re-run replays the requests.

Not covered: listing the tools of MCP or dynamic toolsets (it runs again on
replay; it has no side effects); a streamed response reaches the consumer
once the model finished, not token by token.
"""

from ._agent import DurableAgent
from ._tools import idempotency_key

__all__ = ["DurableAgent", "idempotency_key"]
