"""OpenAI Agents SDK agents inside a step: every model response and tool call recorded.

Two names. :class:`DurableRunner` runs an ``agents.Agent`` the way
``Runner.run`` does, inside a step, so that the run is made of journaled
calls: each model response is a ``ctx.acall``, each function tool a call or,
when named in ``effects``, an effect with its own idempotency key, which the
tool reads with :func:`idempotency_key`. A crash (or a retry) anywhere in the
agent run re-runs the step, and the finished responses and tool calls replay
from the checkpoint instead of being paid for, or fired, again::

    from agents import Agent, RunContextWrapper, function_tool
    from durable_steps.integrations.openai_agents import DurableRunner, idempotency_key

    @function_tool
    def refund(ctx: RunContextWrapper[Any], order: str, cents: int) -> str:
        return payments.refund(order, cents, idempotency_key=idempotency_key(ctx))

    runner = DurableRunner(effects={"refund"})

    @wf.step()
    def turn(state, ctx):
        result = runner.run_sync(agent, state["input"], ctx=ctx)   # (async: await runner.run(...))

It is in the shape of ``DurableAgent`` (the pydantic-ai integration): the
same ``effects`` and ``live``, the same names in the journal, the same
guarantees. Nothing is monkeypatched: each run works on journaled copies of
the agents it reaches (see :mod:`._graph`), and the agents still run
normally with ``Runner.run``.

What is recorded, under which name (numbered in order, so a re-run of the
step finds the same names), with a title a person can read in ``show``,
``resolve``, events and traces:

``model:1``, ``model:2``, ...
    Each model response, of whichever agent the run is at (handoff targets
    included), stored as the SDK's own items (see :mod:`._items`) and
    rebuilt as typed output items with their ``Usage`` on both paths. Title:
    the model and the response's number.
``tool:<call id>``
    Each function tool call, titled with the tool and its arguments
    (``refund(order='A1', cents=500)``). A tool named in ``effects`` is an
    *effect*: its intent and key are durable before it starts, and a crash
    inside it makes it *in doubt* (the step's ``in_doubt`` policy decides; by
    default it fires again with the same key). Every other tool is a
    journaled *call*: the responses after it were made with its result.
    Parallel tool calls are recorded concurrently. An exception the SDK
    turns into a message to the model (its default) is recorded as that
    message. Tools in ``live`` are never recorded.
``handoff:N``
    Each handoff made through a ``Handoff`` object: its ``on_handoff``
    callback runs once, a replay goes to the recorded target.
``guardrail:input:<name>:N``, ``guardrail:output:<name>:N``
    Each guardrail's verdict (tripwire and ``output_info``, as JSON).
``session:get_items:N``, ``session:add_items:N``...
    The reads and writes of a ``session=`` the user passes (see
    :mod:`._session`); a server-side ``OpenAIConversationsSession`` is not
    wrapped.
``signal:approve:<call id>``
    A tool with ``needs_approval``: the run suspends until that signal
    decides it (see :mod:`._approvals`), then goes on without a new model call.
A second agent run in the same step
    is prefixed ``agent2:``, ``agent3:``... (``agent2:model:1``).

Structured output, handoffs, ``max_turns``, hooks and ``context`` work as
with ``Runner.run``: they are decided by the (replayed) responses.

Not covered: ``run_streamed`` (refused, with what to use instead), and
tools that are not function tools (computer, shell, a local MCP server's).
An SDK-managed model retry (``ModelSettings(retry=...)``) names its retry
``model:N.2``, and a re-run replays the try that succeeded (see
``integrations._names``); the client's own retries (``max_retries``) happen
inside the recorded call.

SDK internals. Everything is read through the SDK's public names (``from
agents import ...``) except what openai-agents 0.24 and 0.25 have no public
name for — which is why the ``openai-agents`` extra pins ``<0.26`` (each new
minor release is tried by CI's newest-releases lane before the cap moves):
``Handoff._agent_ref`` (a handoff's target, to copy and journal it),
``Model._cleanup_on_run_end`` (the run-end hook the SDK calls on the
journaled model, forwarded to the user's), ``RunResult._last_agent`` (set
back to the user's agent, as ``last_agent`` has no setter) and
``agents.usage.serialize_usage``/``deserialize_usage`` (the SDK's own JSON
form of ``Usage``, the one its ``RunState`` uses, for recorded responses).
Importing this package checks that the installed SDK has each of them and
raises an ``ImportError`` naming the SDK's version otherwise (see
:mod:`._sdk`, which says why each is needed).
"""

from . import _sdk  # noqa: F401 - first: an SDK lacking an internal we read fails here
from ._binding import idempotency_key
from ._runner import DurableRunner

__all__ = ["DurableRunner", "idempotency_key"]
