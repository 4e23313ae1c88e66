"""DurableAgent: a pydantic-ai agent whose runs inside a step are journaled calls."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Collection, Iterator, MutableMapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from pydantic_ai import Agent
from pydantic_ai.models import infer_model
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset

from ...errors import DefinitionError
from ._history import Histories, Turn
from ._model import JournaledModel
from ._tools import Binding, JournaledToolset, binding

if TYPE_CHECKING:
    from pydantic_ai.agent import AgentRun, AgentRunResult
    from pydantic_ai.agent.abstract import AgentRunEvents
    from pydantic_ai.result import StreamedRunResult

    from ..._context import Context

_runs: weakref.WeakKeyDictionary[Context, tuple[int, int]] = weakref.WeakKeyDictionary()
"""Per step context: (attempt, agent runs so far in it), to name later runs apart."""


class DurableAgent:
    """A pydantic-ai agent whose runs inside a step are journaled calls.

    ``effects`` names the tools with side effects (a charge, an email): each
    of their calls is an effect whose key the tool reads with
    :func:`idempotency_key`. ``live`` names tools that always run and are
    never recorded (a tool that changes ``deps``, reads the clock, or picks
    the next toolset): on a re-run of the step they run again, as a plain
    agent would. ``history_key`` is the state key that ``state=`` keeps the
    conversation under. See the package docstring for what is recorded and
    how it replays.

    Like pydantic-ai's own durable wrappers it puts its model and toolsets in
    place with ``Agent.override`` for the length of one run; unlike them it
    does not subclass ``WrapperAgent``, whose ``run`` signature changes with
    pydantic-ai releases: every entry point takes ``ctx`` (and ``state``) and
    passes every other keyword to the agent's own. An ``agent.override(model=
    ...)`` around a run is honoured: the overriding model is the one
    recorded.
    """

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        effects: Collection[str] = (),
        live: Collection[str] = (),
        history_key: str = "messages",
    ) -> None:
        for label, names in (("effects", effects), ("live", live)):
            if isinstance(names, str):
                raise DefinitionError(
                    f"DurableAgent({label}={names!r}): {label} is a collection of tool names, "
                    f"not one string; write {label}={{{names!r}}}"
                )
        self.wrapped = agent
        self.effects = frozenset(effects)
        self.live = frozenset(live)
        self.history_key = history_key
        self._histories = Histories()
        both = self.effects & self.live
        if both:
            raise DefinitionError(
                f"DurableAgent: {sorted(both)} named in both effects= and live=; an effect is "
                "recorded with its idempotency key, a live tool is never recorded: pick one."
            )
        known = _known_tools(agent.toolsets)
        for label, names in (("effects", self.effects), ("live", self.live)):
            unknown = names - known
            if unknown and _all_function_toolsets(agent.toolsets):
                raise DefinitionError(
                    f"DurableAgent({label}=...): the agent has no tool named "
                    f"{', '.join(sorted(map(repr, unknown)))}; its tools are {sorted(known)}. "
                    "A misspelt name would run the tool as a plain recorded call."
                )

    # --- the entry points, as the agent's own --------------------------------

    def run_sync(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """Run the agent in a sync step (see :meth:`run`); the agent's ``run_sync``."""
        with self._bound(ctx, state, kwargs) as (run_kwargs, turn):
            result = self.wrapped.run_sync(user_prompt, **run_kwargs)
        _keep(turn, result.all_messages())
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
        is read from ``state[history_key]`` and the run's new messages are
        appended there, as JSON (then ``message_history=`` is not allowed).
        Other keywords (``deps``, ``model``, ``usage_limits``,
        ``event_stream_handler``...) go to the agent's ``run``.
        """
        with self._bound(ctx, state, kwargs) as (run_kwargs, turn):
            result = await self.wrapped.run(user_prompt, **run_kwargs)
        _keep(turn, result.all_messages())
        return result

    @asynccontextmanager
    async def iter(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AgentRun[Any, Any]]:
        """The agent's ``iter`` inside a step: drive the run node by node.

        Each model request and tool call is recorded as in :meth:`run`
        (a node's ``stream`` streams the recorded response back). The
        history is kept once the run reached its end.
        """
        with self._bound(ctx, state, kwargs) as (run_kwargs, turn):
            async with self.wrapped.iter(user_prompt, **run_kwargs) as agent_run:
                yield agent_run
        if agent_run.result is not None:
            _keep(turn, agent_run.result.all_messages())

    @asynccontextmanager
    async def run_stream(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[StreamedRunResult[Any, Any]]:
        """The agent's ``run_stream`` inside a step.

        The response is drained inside its journaled call and streamed back
        from the record (see the package docstring): text and output arrive
        in the same pieces as from the plain agent, once the model finished.
        The history is kept when the stream was read to its end.
        """
        with self._bound(ctx, state, kwargs) as (run_kwargs, turn):
            async with self.wrapped.run_stream(user_prompt, **run_kwargs) as result:
                yield result
        if result.is_complete:
            _keep(turn, result.all_messages())

    @asynccontextmanager
    async def run_stream_events(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AgentRunEvents[Any]]:
        """The agent's ``run_stream_events`` inside a step (an async context
        manager, as the agent's): every event of the run, then an
        ``AgentRunResultEvent``. The history is kept once the run finished.
        """
        with self._bound(ctx, state, kwargs) as (run_kwargs, turn):
            async with self.wrapped.run_stream_events(user_prompt, **run_kwargs) as events:
                yield events
        if events.result is not None:
            _keep(turn, events.result.all_messages())

    # --- one run ---------------------------------------------------------------

    @contextmanager
    def _bound(
        self, ctx: Context, state: MutableMapping[str, Any] | None, kwargs: dict[str, Any]
    ) -> Iterator[tuple[dict[str, Any], Turn | None]]:
        """Our model and toolsets in place, the run bound to ``ctx``; yields the
        keywords for the agent's entry point and the history's turn.
        """
        run_kwargs = dict(kwargs)
        where = f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}"
        turn = None
        if state is not None:
            if "message_history" in run_kwargs:
                raise DefinitionError(
                    f"{where}: pass state= or message_history=, not both (state= keeps the "
                    f"history in state[{self.history_key!r}])",
                    run=f"{ctx.workflow}/{ctx.run_id}",
                    step=ctx.step,
                )
            turn = Turn(self._histories, ctx, state, self.history_key)
            run_kwargs["message_history"] = turn.read()
        given = run_kwargs.pop("model", None)
        model = _overriding_model(self.wrapped) or given or self.wrapped.model
        if model is None:
            raise DefinitionError(
                f"{where}: the agent has no model; give it one (Agent(model)) or pass model= "
                "to run.",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            )
        # Per-run toolsets are ignored under override(toolsets=), so they join ours.
        extra: Sequence[AbstractToolset[Any]] = run_kwargs.pop("toolsets", None) or ()
        toolsets = [JournaledToolset(t) for t in (*self.wrapped.toolsets, *extra)]
        token = binding.set(Binding(ctx, _prefix(ctx), self.effects, self.live))
        try:
            # tools=[]: the agent's own tools are in its function toolset, wrapped above.
            with self.wrapped.override(
                model=JournaledModel(infer_model(model)), toolsets=toolsets, tools=[]
            ):
                yield run_kwargs, turn
        finally:
            binding.reset(token)


def _keep(turn: Turn | None, messages: list[Any]) -> None:
    if turn is not None:
        turn.keep(messages)


def _overriding_model(agent: Agent[Any, Any]) -> Any:
    """The model of an ``agent.override(model=...)`` around this run, if any.

    pydantic-ai keeps it in a context variable of the agent (the same in every
    release since 2.54); the run must record the model the user chose, not
    the agent's own, so it is read here before ours takes its place.
    """
    found = getattr(agent, "_override_model", None)
    some = found.get() if isinstance(found, ContextVar) else None
    return getattr(some, "value", None)


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
