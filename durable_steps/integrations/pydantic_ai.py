"""pydantic-ai agents inside a step: every model request and tool call recorded.

Two names. :class:`DurableAgent` wraps a pydantic-ai ``Agent`` so that a run of
it inside a step is made of journaled calls: each model request is a
``ctx.acall``, each tool the user marks as side-effecting is a ``ctx.aeffect``
with its own idempotency key, which the tool reads with
:func:`idempotency_key`. A crash (or a retry) at any point of the agent run
re-runs the step, and the finished model requests and tool calls replay from
the checkpoint instead of being paid for, or fired, again::

    from durable_steps.integrations.pydantic_ai import DurableAgent, idempotency_key

    @agent.tool
    def charge(run_ctx, amount: int) -> str:
        return payments.charge(amount, idempotency_key=idempotency_key(run_ctx))

    durable = DurableAgent(agent, effects={"charge"})      # tool names with side effects

    @wf.step()
    def turn(state, ctx):
        result = durable.run_sync(state["prompt"], ctx=ctx)  # (and `await durable.run(...)`)

It follows the public seams pydantic-ai's own durable wrappers (Temporal,
DBOS, Prefect) are built on: a ``WrapperModel`` whose ``request`` is a
durable unit, a ``WrapperToolset`` whose ``call_tool`` is one, both put in
place for one run with ``Agent.override`` (a context variable: other runs of
the same agent, in other threads or tasks, are untouched). Nothing is
monkeypatched, and the agent still runs normally outside ``DurableAgent``.

What is recorded, under which name (numbered in order, so a re-run of the
step finds the same names):

``model:1``, ``model:2``, ...
    Each model request, in the order the agent makes them. The
    ``ModelResponse`` is stored as JSON (pydantic-ai's
    ``ModelMessagesTypeAdapter``) and rebuilt from that JSON on both paths,
    so a replayed response equals a live one. A streamed request (an
    ``event_stream_handler``) is drained into one response and its events
    are replayed from the parts, live or not.
``tool:<tool_call_id>``
    Each tool call. A tool named in ``effects`` is an *effect*: its intent
    and key are durable before it starts, and a crash inside it makes it *in
    doubt* (the step's ``in_doubt`` policy decides; by default it fires again
    with the same key). Every other tool is a journaled *call*: its result
    is recorded too, because the model requests after it were made with
    that result, and a read that answered differently on replay would give
    the model a transcript it never saw. A ``ModelRetry`` the tool raises is
    recorded like a result (the model is told again, not the tool asked
    again); other exceptions (``ApprovalRequired``, errors) record nothing.
    Results are stored as JSON (``pydantic_core.to_jsonable_python``; a
    ``ToolReturn`` keeps its shape), so a tool returning a model gets back
    its JSON form on both paths.
A second agent run in the same step
    is prefixed ``agent2:``, ``agent3:``... (``agent2:model:1``).

**Conversation history without user code.** ``state=`` keeps the
conversation in ``state[history_key]`` (``"messages"`` by default) as JSON:
read as ``message_history`` before the run, replaced by all the run's
messages after it. So a multi-turn agent is one step per turn::

    @wf.step()
    def turn(state, ctx):
        result = durable.run_sync(state["prompt"], ctx=ctx, state=state)
        state["reply"] = result.output

The state changes only once the agent run finished, so a step that crashed
halfway commits nothing of it, and its re-run replays the requests.

Not covered: ``run_stream``/``iter`` (use ``run`` with an
``event_stream_handler``), listing the tools of MCP or dynamic toolsets
(it runs again on replay; it has no side effects), and multimodal tool
results (stored as their JSON form).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Collection, Iterator, MutableMapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse, ToolReturn
from pydantic_ai.models import CompletedStreamedResponse, StreamedResponse, infer_model
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, WrapperToolset
from pydantic_core import PydanticSerializationError, to_jsonable_python

from ..errors import DefinitionError, SerializationError

if TYPE_CHECKING:
    from pydantic_ai.agent import AgentRunResult
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import RunContext
    from pydantic_ai.toolsets import ToolsetTool

    from .._context import Context

__all__ = ["DurableAgent", "idempotency_key"]

_TOOL_RETURN: TypeAdapter[ToolReturn[Any]] = TypeAdapter(ToolReturn)
_SHAPES = frozenset({"return", "retry", "tool_return"})
"""How a tool's outcome is recorded: ``{"return": json}``, ``{"retry": message}``
(a ``ModelRetry``) or ``{"tool_return": ToolReturn as JSON}``."""


@dataclass
class _Binding:
    """One agent run inside a step: where its calls are recorded, and their names."""

    ctx: Context
    prefix: str
    effects: frozenset[str]
    requests: int = 0
    tools: set[str] = field(default_factory=set)

    def tool_name(self, run_ctx: RunContext[Any]) -> str:
        call_id = run_ctx.tool_call_id or run_ctx.tool_name or "?"
        name = f"{self.prefix}tool:{call_id}"
        if name in self.tools:  # a model that reuses ids across responses (TestModel does)
            name = f"{name}@{run_ctx.run_step}"
        self.tools.add(name)
        return name


_binding: ContextVar[_Binding | None] = ContextVar("durable_steps_pydantic_ai", default=None)
_key: ContextVar[tuple[str | None, str] | None] = ContextVar(
    "durable_steps_pydantic_ai_key", default=None
)
"""The (tool call id, idempotency key) of the effect tool running in this context."""

_runs: weakref.WeakKeyDictionary[Context, tuple[int, int]] = weakref.WeakKeyDictionary()
"""Per step context: (attempt, agent runs so far in it), to name later runs apart."""


def idempotency_key(run_ctx: RunContext[Any]) -> str:
    """The idempotency key of the effect tool call ``run_ctx`` belongs to.

    The same on every re-fire of this tool call (a retry of the step, a
    resume after a crash), different for every other tool call, step, pass
    and run; at most 64 printable ASCII characters. Pass it to the API the
    tool calls, so that a re-fire is deduplicated there. Only a tool named
    in ``DurableAgent(effects=...)``, run by that agent inside a step, has one.
    """
    found = _key.get()
    if found is None or found[0] != run_ctx.tool_call_id:
        raise DefinitionError(
            f"idempotency_key() was called in tool {run_ctx.tool_name!r}, which is not running "
            "as an effect: name it in DurableAgent(agent, effects={...}) and run the agent with "
            "durable.run_sync(..., ctx=ctx) (or await durable.run(...)) inside a step."
        )
    return found[1]


def _dump_response(response: ModelResponse) -> Any:
    return ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]


def _load_response(data: Any) -> ModelResponse:
    message = ModelMessagesTypeAdapter.validate_python([data])[0]
    assert isinstance(message, ModelResponse)
    return message


class _JournaledModel(WrapperModel):
    """The agent's model, each request a journaled call of the bound step."""

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        """A recorded model request (replayed if the step recorded it before)."""
        binding = _binding.get()
        if binding is None:
            return await super().request(messages, model_settings, model_request_parameters)
        binding.requests += 1
        name = f"{binding.prefix}model:{binding.requests}"

        async def live() -> Any:
            response = await self.wrapped.request(
                messages, model_settings, model_request_parameters
            )
            return _dump_response(response)

        return _load_response(await binding.ctx.acall(name, live))

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """A streamed request, drained and recorded as one response; its events replay."""
        binding = _binding.get()
        if binding is None:
            async with super().request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as live_stream:
                yield live_stream
            return
        binding.requests += 1
        name = f"{binding.prefix}model:{binding.requests}"

        async def live() -> Any:
            async with self.wrapped.request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as stream:
                async for _ in stream:
                    pass
            return _dump_response(stream.get())

        response = _load_response(await binding.ctx.acall(name, live))
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )


@dataclass
class _JournaledToolset(WrapperToolset[Any]):
    """A toolset whose calls are journaled calls (effects: ``ctx.aeffect``)."""

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        """A recorded tool call (replayed if the step recorded it before)."""
        binding = _binding.get()
        if binding is None:
            return await super().call_tool(name, tool_args, ctx, tool)
        journal_name = binding.tool_name(ctx)

        async def call() -> Any:
            try:
                result = await self.wrapped.call_tool(name, tool_args, ctx, tool)
            except ModelRetry as exc:
                return {"retry": exc.message}
            return _dump_tool_result(result, name, binding)

        async def fire(*, idempotency_key: str) -> Any:
            token = _key.set((ctx.tool_call_id, idempotency_key))
            try:
                return await call()
            finally:
                _key.reset(token)

        if name in binding.effects:
            recorded = await binding.ctx.aeffect(journal_name, fire)
        else:
            recorded = await binding.ctx.acall(journal_name, call)
        return _load_tool_result(recorded)


def _dump_tool_result(result: Any, tool: str, binding: _Binding) -> Any:
    try:
        if isinstance(result, ToolReturn):
            return {"tool_return": _TOOL_RETURN.dump_python(result, mode="json")}
        return {"return": to_jsonable_python(result)}
    except PydanticSerializationError as exc:
        ctx = binding.ctx
        then = (
            "It has fired: a retry of the step fires it again with the same idempotency key."
            if tool in binding.effects
            else "Nothing was recorded: the tool runs again when the step does."
        )
        raise SerializationError(
            f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: the result of tool {tool!r} "
            f"cannot be recorded as JSON ({exc}). {then} Return a JSON-able value (a str, "
            "dict, list, a pydantic model or dataclass).",
            run=f"{ctx.workflow}/{ctx.run_id}",
            step=ctx.step,
        ) from exc


def _load_tool_result(recorded: Any) -> Any:
    if not (isinstance(recorded, dict) and len(recorded) == 1 and recorded.keys() & _SHAPES):
        # Not one of ours: what `wf.resolve(fired=True, result=...)` recorded for an
        # effect in doubt (None without a result), which is the tool's return value.
        return recorded
    if "retry" in recorded:
        raise ModelRetry(recorded["retry"])
    if "tool_return" in recorded:
        return _TOOL_RETURN.validate_python(recorded["tool_return"])
    return recorded["return"]


class DurableAgent:
    """A pydantic-ai agent whose runs inside a step are journaled calls.

    ``effects`` names the tools with side effects (a charge, an email): each
    of their calls is a ``ctx.aeffect`` whose key the tool reads with
    :func:`idempotency_key`. ``history_key`` is the state key that
    ``state=`` keeps the conversation under. See the module docstring for
    what is recorded and how it replays.

    Like pydantic-ai's own durable wrappers it puts its model and toolsets in
    place with ``Agent.override`` for the length of one run; unlike them it
    does not subclass ``WrapperAgent``, whose ``run`` signature changes with
    pydantic-ai releases: ``run``/``run_sync`` take ``ctx`` (and ``state``)
    and pass every other keyword to the agent's own ``run``.
    """

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        effects: Collection[str] = (),
        history_key: str = "messages",
    ) -> None:
        if isinstance(effects, str):
            raise DefinitionError(
                f"DurableAgent(effects={effects!r}): effects is a collection of tool names, "
                f"not one string; write effects={{{effects!r}}}"
            )
        self.wrapped = agent
        self.effects = frozenset(effects)
        self.history_key = history_key
        unknown = self.effects - _known_tools(agent.toolsets)
        if unknown and _all_function_toolsets(agent.toolsets):
            names = ", ".join(sorted(map(repr, unknown)))
            raise DefinitionError(
                f"DurableAgent(effects=...): the agent has no tool named {names}; "
                f"its tools are {sorted(_known_tools(agent.toolsets))}. A misspelt effect would "
                "run as a plain call, without an idempotency key."
            )

    def run_sync(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """Run the agent in a sync step (see :meth:`run`); the agent's ``run_sync``."""
        with self._bound(ctx, state, kwargs) as run_kwargs:
            result = self.wrapped.run_sync(user_prompt, **run_kwargs)
        self._keep_history(result, state)
        return result

    async def run(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """Run the agent inside a step, each model request and tool call recorded.

        ``ctx`` is the step's context. With ``state``, the conversation so far
        is read from ``state[history_key]`` and all the run's messages are
        written back there, as JSON (then ``message_history=`` is not
        allowed). Other keywords (``deps``, ``model``, ``usage_limits``,
        ``event_stream_handler``...) go to the agent's ``run``.
        """
        with self._bound(ctx, state, kwargs) as run_kwargs:
            result = await self.wrapped.run(user_prompt, **run_kwargs)
        self._keep_history(result, state)
        return result

    # --- one run ---------------------------------------------------------------

    @contextmanager
    def _bound(
        self, ctx: Context, state: MutableMapping[str, Any] | None, kwargs: dict[str, Any]
    ) -> Iterator[dict[str, Any]]:
        """Our model and toolsets in place, the run bound to ``ctx``; yields the
        keywords for the agent's ``run``.
        """
        run_kwargs = dict(kwargs)
        if state is not None:
            if "message_history" in run_kwargs:
                raise DefinitionError(
                    f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: pass state= or "
                    "message_history=, not both (state= keeps the history in "
                    f"state[{self.history_key!r}])",
                    run=f"{ctx.workflow}/{ctx.run_id}",
                    step=ctx.step,
                )
            run_kwargs["message_history"] = self._history(ctx, state)
        model = run_kwargs.pop("model", None) or self.wrapped.model
        if model is None:
            raise DefinitionError(
                f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: the agent has no model; "
                "give it one (Agent(model)) or pass model= to run.",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            )
        # Per-run toolsets are ignored under override(toolsets=), so they join ours.
        extra: Sequence[AbstractToolset[Any]] = run_kwargs.pop("toolsets", None) or ()
        toolsets = [_JournaledToolset(t) for t in (*self.wrapped.toolsets, *extra)]
        token = _binding.set(_Binding(ctx, _prefix(ctx), self.effects))
        try:
            # tools=[]: the agent's own tools are in its function toolset, wrapped above.
            with self.wrapped.override(
                model=_JournaledModel(infer_model(model)), toolsets=toolsets, tools=[]
            ):
                yield run_kwargs
        finally:
            _binding.reset(token)

    def _history(self, ctx: Context, state: MutableMapping[str, Any]) -> list[ModelMessage]:
        stored = state.get(self.history_key)
        if stored is None:
            return []
        try:
            return ModelMessagesTypeAdapter.validate_python(stored)
        except ValueError as exc:
            raise DefinitionError(
                f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: "
                f"state[{self.history_key!r}] is not a pydantic-ai message history ({exc}). "
                "Leave that key to DurableAgent, or give it another history_key=.",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            ) from exc

    def _keep_history(self, result: AgentRunResult[Any], state: Any) -> None:
        if state is not None:
            state[self.history_key] = ModelMessagesTypeAdapter.dump_python(
                result.all_messages(), mode="json"
            )


def _prefix(ctx: Context) -> str:
    """``""`` for the first agent run in this attempt of the step, then ``agent2:``..."""
    attempt, count = _runs.get(ctx, (ctx.attempt, 0))
    count = count + 1 if attempt == ctx.attempt else 1
    _runs[ctx] = (ctx.attempt, count)
    return "" if count == 1 else f"agent{count}:"


def _leaves(toolsets: Sequence[AbstractToolset[Any]]) -> list[AbstractToolset[Any]]:
    found: list[AbstractToolset[Any]] = []
    for toolset in toolsets:
        toolset.apply(found.append)
    return found


def _known_tools(toolsets: Sequence[AbstractToolset[Any]]) -> set[str]:
    return {
        name
        for leaf in _leaves(toolsets)
        if isinstance(leaf, FunctionToolset)
        for name in leaf.tools
    }


def _all_function_toolsets(toolsets: Sequence[AbstractToolset[Any]]) -> bool:
    """Whether every tool is known before a run (no MCP server, no dynamic toolset)."""
    return all(isinstance(leaf, FunctionToolset) for leaf in _leaves(toolsets))
