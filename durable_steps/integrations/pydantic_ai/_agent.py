"""DurableAgent: a pydantic-ai agent whose runs inside a step are journaled calls."""

from __future__ import annotations

import asyncio
import re
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Iterator, MutableMapping, Sequence
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

    from ..._execution.context import Context

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NUMBERED = re.compile(r"agent[0-9]+")


class _Series:
    """The runs of one name (or of no name) in one attempt of a step.

    ``count`` numbers them; ``owner`` is the asyncio task or thread the last
    one started in (weakly: an ended task must not pass for a new one);
    ``active`` says whether one of them is running now.
    """

    def __init__(self) -> None:
        self.count = 0
        self.owner: Callable[[], object | None] = lambda: None
        self.active = False


_runs: weakref.WeakKeyDictionary[Context, tuple[int, dict[str | None, _Series]]] = (
    weakref.WeakKeyDictionary()
)
"""Per step context: its attempt and the series of agent runs in it, to name runs apart."""
_runs_lock = threading.Lock()


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

    Each entry point also takes ``run_name=``. Runs one after another in a
    step need none (they are numbered: ``model:1``, then ``agent2:model:1``);
    runs that overlap or start in different tasks or threads of one step
    (``asyncio.gather``, threads) each need their own, because the order they
    start in is timing's, and numbered they would replay each other's
    records after a retry or a crash. Without it the second such run raises
    :class:`~durable_steps.DefinitionError` naming the step. Tool bodies run
    outside the durable run (no binding, the agent's own overrides): an
    ``agent.run`` inside a tool is a plain run, part of the tool's result.

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
        _refuse_model_choosers(getattr(agent, "root_capability", None), "the agent has")
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
        run_name: str | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """Run the agent in a sync step (see :meth:`run`); the agent's ``run_sync``."""
        with self._bound(ctx, state, run_name, kwargs) as (run_kwargs, turn, bound):
            result = self.wrapped.run_sync(user_prompt, **run_kwargs)
        bound.settle_sync(result.all_messages())  # a final answer a hook gave
        _keep(turn, result.all_messages())
        return result

    async def run(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """Run the agent inside a step, each model request and tool call recorded.

        ``ctx`` is the step's context. With ``state``, the conversation so far
        is read from ``state[history_key]`` and the run's new messages are
        appended there, as JSON (then ``message_history=`` is not allowed).
        Other keywords (``deps``, ``model``, ``usage_limits``,
        ``event_stream_handler``...) go to the agent's ``run``.
        """
        with self._bound(ctx, state, run_name, kwargs) as (run_kwargs, turn, bound):
            result = await self.wrapped.run(user_prompt, **run_kwargs)
        await bound.settle(result.all_messages())  # a final answer a hook gave
        _keep(turn, result.all_messages())
        return result

    @asynccontextmanager
    async def iter(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AgentRun[Any, Any]]:
        """The agent's ``iter`` inside a step: drive the run node by node.

        Each model request and tool call is recorded as in :meth:`run`
        (a node's ``stream`` streams the recorded response back). The
        history is kept once the run reached its end.
        """
        with self._bound(ctx, state, run_name, kwargs) as (run_kwargs, turn, bound):
            async with self.wrapped.iter(user_prompt, **run_kwargs) as agent_run:
                try:
                    yield agent_run
                finally:  # a final answer a hook gave, even if the caller's block fails
                    if agent_run.result is not None:
                        await bound.settle(agent_run.result.all_messages())
        if agent_run.result is not None:
            _keep(turn, agent_run.result.all_messages())

    @asynccontextmanager
    async def run_stream(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[StreamedRunResult[Any, Any]]:
        """The agent's ``run_stream`` inside a step.

        The response is drained inside its journaled call and streamed back
        from the record (see the package docstring): text and output arrive
        in the same pieces as from the plain agent, once the model finished.
        The history is kept when the stream was read to its end.
        """
        with self._bound(ctx, state, run_name, kwargs) as (run_kwargs, turn, bound):
            async with self.wrapped.run_stream(user_prompt, **run_kwargs) as result:
                try:
                    yield result
                finally:  # a final answer a hook gave, even if the caller's block fails
                    if result.is_complete:
                        await bound.settle(result.all_messages())
        if result.is_complete:
            _keep(turn, result.all_messages())

    @asynccontextmanager
    async def run_stream_events(
        self,
        user_prompt: Any = None,
        *,
        ctx: Context,
        state: MutableMapping[str, Any] | None = None,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AgentRunEvents[Any]]:
        """The agent's ``run_stream_events`` inside a step (an async context
        manager, as the agent's): every event of the run, then an
        ``AgentRunResultEvent``. The history is kept once the run finished.
        """
        with self._bound(ctx, state, run_name, kwargs) as (run_kwargs, turn, bound):
            async with self.wrapped.run_stream_events(user_prompt, **run_kwargs) as events:
                try:
                    yield events
                finally:  # a final answer a hook gave, even if the caller's block fails
                    if events.result is not None:
                        await bound.settle(events.result.all_messages())
        if events.result is not None:
            _keep(turn, events.result.all_messages())

    # --- one run ---------------------------------------------------------------

    @contextmanager
    def _bound(
        self,
        ctx: Context,
        state: MutableMapping[str, Any] | None,
        run_name: str | None,
        kwargs: dict[str, Any],
    ) -> Iterator[tuple[dict[str, Any], Turn | None, Binding]]:
        """Our model and toolsets in place, the run bound to ``ctx``; yields the
        keywords for the agent's entry point, the history's turn and the binding.
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
        for capability in run_kwargs.get("capabilities") or ():
            _refuse_model_choosers(capability, f"{where}: the run was given", ctx)
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
        prefix, series = _claim(ctx, run_name)
        outer = _override_vars(self.wrapped)
        bound = Binding(ctx, prefix, self.effects, self.live, outer=outer)
        token = binding.set(bound)
        try:
            # tools=[]: the agent's own tools are in its function toolset, wrapped above.
            with self.wrapped.override(
                model=JournaledModel(infer_model(model)), toolsets=toolsets, tools=[]
            ):
                yield run_kwargs, turn, bound
        finally:
            binding.reset(token)
            series.active = False


def _model_choosers() -> tuple[type[Any], ...]:
    """pydantic-ai's capabilities that pick the model of a request, as far as this
    release has them (2.54 has ``SelectModel`` and not ``ModelFallback``).
    """
    from pydantic_ai import capabilities

    kinds = (getattr(capabilities, n, None) for n in ("ModelFallback", "SelectModel"))
    return tuple(k for k in kinds if isinstance(k, type))


def _refuse_model_choosers(capability: Any, who: str, ctx: Context | None = None) -> None:
    """Refuse a capability that picks the model of a request: the run's model is ours
    (``Agent.override(model=)``, which outranks it), so ``SelectModel`` would be
    ignored and a ``ModelFallback`` model's answers not recorded (asked anew on a
    re-run: a fresh answer, its tool calls fired again).
    """
    kinds = _model_choosers()
    if capability is None or not kinds:
        return
    try:
        from pydantic_ai.capabilities.abstract import leaf_capabilities
    except ImportError:
        return
    found = [c for c in leaf_capabilities(capability) if isinstance(c, kinds)]
    if found:
        names = ", ".join(sorted({type(c).__name__ for c in found}))
        raise DefinitionError(
            f"DurableAgent: {who} the capability {names}, which picks the model of each "
            "request; DurableAgent records the requests of one model and cannot record those "
            "(a re-run would ask them anew). Give the agent a FallbackModel as its model "
            "instead (the whole fallback is then one recorded request), or pick the model "
            "per run with model=.",
            run=None if ctx is None else f"{ctx.workflow}/{ctx.run_id}",
            step=None if ctx is None else ctx.step,
        )


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


def _override_vars(agent: Agent[Any, Any]) -> dict[ContextVar[Any], Any]:
    """The agent's ``override`` context variables and their values outside our run.

    A tool body gets these back (see ``_tools.outside``): an ``agent.run`` in
    it is then the plain run it would be without ``DurableAgent``. Found by
    name, not listed, because releases add overridable settings.
    """
    return {
        var: var.get()
        for attr, var in vars(agent).items()
        if attr.startswith("_override_") and isinstance(var, ContextVar)
    }


def _owner() -> object:
    """The asyncio task this code runs in, else its thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop running in this thread
        task = None
    return task if task is not None else threading.current_thread()


def _claim(ctx: Context, run_name: str | None) -> tuple[str, _Series]:
    """The journal prefix of a run starting now, and its series (marked active).

    Runs are told apart by their prefix, so it must be the same on every
    re-run of the step (a retry, a resume after a crash). Runs one after
    another in one task or thread are numbered in that order (``""``,
    ``agent2:``...), which the code fixes. Runs in different tasks or threads
    (``asyncio.gather``, a thread pool), or overlapping, start in an order
    that timing decides: numbered, they would replay each other's records.
    Such a run is refused unless ``run_name=`` names it (``<name>:``, then
    ``<name>#2:`` for the same name's next run). A run that overlaps one
    that has another name is fine: its name is its own.
    """
    where = f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}"
    if run_name is not None and (
        not isinstance(run_name, str)
        or not _NAME.fullmatch(run_name)
        or _NUMBERED.fullmatch(run_name)
    ):
        raise DefinitionError(
            f"{where}: run_name={run_name!r} is not a run name: use up to 64 letters, digits, "
            "'_', '-' or '.', and not agentN (the names of unnamed runs).",
            run=f"{ctx.workflow}/{ctx.run_id}",
            step=ctx.step,
        )
    owner = _owner()
    with _runs_lock:
        attempt, series_by_name = _runs.get(ctx, (ctx.attempt, {}))
        if attempt != ctx.attempt:
            series_by_name = {}
        _runs[ctx] = (ctx.attempt, series_by_name)
        series = series_by_name.setdefault(run_name, _Series())
        if series.count and (series.active or series.owner() is not owner):
            shown = "an unnamed" if run_name is None else f"a run_name={run_name!r}"
            why = "is still running" if series.active else "ran in another task or thread"
            raise DefinitionError(
                f"{where}: a DurableAgent run started while {shown} run of this step "
                f"{why}; runs that start in an order timing decides (asyncio.gather, "
                "threads) would replay each other's records after a retry or a crash. "
                "Give each concurrent run its own name: run_sync(..., ctx=ctx, "
                "run_name='refund') (its calls are recorded as refund:model:1...).",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            )
        series.count += 1
        series.owner = weakref.ref(owner)
        series.active = True
        number = series.count
    if run_name is None:
        return ("" if number == 1 else f"agent{number}:"), series
    return (f"{run_name}:" if number == 1 else f"{run_name}#{number}:"), series


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
