"""``DurableRunner``: ``Runner.run`` of an agent inside a step, every seam journaled."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import warnings
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, NoReturn

from agents import Agent, Model, MultiProvider, OpenAIConversationsSession, RunConfig, Runner

from ..._fleet.approval import APPROVAL
from ...errors import DefinitionError
from ._approvals import decide, signal_name
from ._binding import Binding, prefix, running
from ._graph import Graph, wrap_guardrails
from ._model import JournaledModel, JournaledProvider
from ._session import JournaledSession

if TYPE_CHECKING:
    from agents import RunResult

    from ..._execution.context import Context

__all__ = ["DurableRunner"]


def _names(value: Collection[str], what: str) -> frozenset[str]:
    if isinstance(value, str):
        raise DefinitionError(
            f"DurableRunner({what}={value!r}): {what} is a collection of tool names, not one "
            f"string; write {what}={{{value!r}}}"
        )
    return frozenset(value)


class DurableRunner:
    """Runs OpenAI Agents SDK agents inside a step, each model response and tool call recorded.

    ``effects`` names the function tools with side effects (a refund, an
    email): each of their calls is an effect whose key the tool reads with
    :func:`~durable_steps.integrations.openai_agents.idempotency_key`.
    ``live`` names tools that always run, recorded never (one that reads
    the clock or changes the run's context). Every other function tool is a
    journaled call. ``approval_timeout`` (seconds) bounds each wait for a
    tool approval: past it ``ds.SignalTimeout`` is raised in the step.

    One runner serves any number of agents, runs and threads: it holds no
    state of a run. See the package docstring for what is recorded.
    """

    def __init__(
        self,
        *,
        effects: Collection[str] = (),
        live: Collection[str] = (),
        approval_timeout: float | None = None,
    ) -> None:
        self.effects = _names(effects, "effects")
        self.live = _names(live, "live")
        both = self.effects & self.live
        if both:
            raise DefinitionError(
                f"DurableRunner: {sorted(both)} are named in both effects= and live=; a tool "
                "is either an effect (fired once, with a key) or live (run on every replay)"
            )
        self.approval_timeout = approval_timeout

    def run_sync(
        self,
        starting_agent: Agent[Any],
        input: Any,
        *,
        ctx: Context,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> RunResult:
        """:meth:`run` in a sync step, on the thread's event loop (as ``Runner.run_sync``)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise DefinitionError(
                f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: runner.run_sync() was "
                "called on a running event loop; in an async step use "
                "`await runner.run(agent, input, ctx=ctx)`.",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            )
        # The thread's default loop, kept open, as Runner.run_sync does: sessions and
        # clients bind loop-bound primitives to it between calls.
        policy = asyncio.get_event_loop_policy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                loop = policy.get_event_loop()
            except RuntimeError:
                loop = policy.new_event_loop()
                policy.set_event_loop(loop)
        if loop.is_closed():
            loop = policy.new_event_loop()
            policy.set_event_loop(loop)
        task = loop.create_task(
            self.run(starting_agent, input, ctx=ctx, run_name=run_name, **kwargs)
        )
        try:
            return loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(task)
            raise

    async def run(
        self,
        starting_agent: Agent[Any],
        input: Any,
        *,
        ctx: Context,
        run_name: str | None = None,
        **kwargs: Any,
    ) -> RunResult:
        """Run ``starting_agent`` on ``input`` inside a step, as ``Runner.run`` does.

        ``ctx`` is the step's context; every other keyword (``context``,
        ``max_turns``, ``hooks``, ``run_config``, ``session``...) goes to
        ``Runner.run``. Tool approvals are waited for durably (see the
        package docstring), so the result has no ``interruptions``.
        ``result.last_agent`` is the user's agent, not the runner's copy of it.

        ``run_name`` names this run's records (and its approvals' signals):
        needed for runs that overlap in one step (``asyncio.gather``,
        threads, a run inside a tool), which an unnamed run refuses; runs one
        after another are numbered in order.
        """
        binding = Binding(ctx, prefix(ctx, run_name), self.effects, self.live)
        running[ctx] = running.get(ctx, 0) + 1
        try:
            return await self._run(binding, starting_agent, input, kwargs)
        finally:
            running[ctx] -= 1

    async def _run(
        self, binding: Binding, starting_agent: Agent[Any], input: Any, kwargs: dict[str, Any]
    ) -> RunResult:
        ctx = binding.ctx
        graph = Graph(binding)
        self._check_names(ctx, graph, starting_agent)
        run_config, owned = self._run_config(kwargs.pop("run_config", None), binding)
        session = kwargs.pop("session", None)
        if session is not None and not isinstance(session, OpenAIConversationsSession):
            session = JournaledSession(session, binding)
        if session is not None:
            kwargs["session"] = session
        start = graph.agent(starting_agent)
        try:
            result = await Runner.run(start, input, run_config=run_config, **kwargs)
            resume = {k: v for k, v in kwargs.items() if k != "context"}  # the state has it
            taken: set[str] = set()  # an earlier version's name decides one call only
            while result.interruptions:
                state = result.to_state()
                for item in result.interruptions:
                    signal = signal_name(
                        item,
                        binding.prefix,
                        ctx.iteration,
                        lambda entry: entry not in taken and ctx._recorded(entry),
                    )
                    taken.add(f"signal:{signal}")
                    payload = ctx.wait_for(signal, self.approval_timeout, accepts=APPROVAL)
                    where = f"{ctx.workflow}/{ctx.run_id}"
                    approved, message = decide(payload, where, ctx.step, signal)
                    if approved:
                        state.approve(item)
                    else:
                        state.reject(item, rejection_message=message)
                result = await Runner.run(start, state, run_config=run_config, **resume)
        finally:
            if owned is not None:
                await owned.aclose()
        with contextlib.suppress(AttributeError):
            result._last_agent = graph.original(result.last_agent)
        return result

    def run_streamed(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: a streamed run cannot be journaled; use :meth:`run`."""
        ctx = kwargs.get("ctx")
        where = f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: " if ctx else ""
        raise DefinitionError(
            f"{where}DurableRunner.run_streamed() is not supported: a streamed response is "
            "not recorded as it arrives, so a crash mid-stream could not be replayed. Use "
            "`await runner.run(agent, input, ctx=ctx)` (or runner.run_sync) inside the step "
            "and read result.new_items after it.",
            run=f"{ctx.workflow}/{ctx.run_id}" if ctx else None,
            step=ctx.step if ctx else None,
        )

    # --- one run -------------------------------------------------------------------

    def _check_names(self, ctx: Context, graph: Graph, agent: Agent[Any]) -> None:
        """Refuse an effect or live name no agent of the run has (a typo would run
        an effect as a plain call, without a key).
        """
        known, complete = graph.tool_names(agent)
        unknown = (self.effects | self.live) - known
        if unknown and complete:
            names = ", ".join(sorted(map(repr, unknown)))
            raise DefinitionError(
                f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: DurableRunner names "
                f"{names}, but no agent this run can reach has such a function tool; its "
                f"tools are {sorted(known)}. A misspelt effect would run as a plain call, "
                "without an idempotency key.",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            )

    def _run_config(
        self, given: RunConfig | dict[str, Any] | None, binding: Binding
    ) -> tuple[RunConfig, MultiProvider | None]:
        """The user's run config with its model, provider and guardrails journaled;
        and the provider made for this run (to close after it), if none was given.
        """
        config = RunConfig(**given) if isinstance(given, dict) else given or RunConfig()
        owned = None
        provider = config.model_provider
        if given is None or (isinstance(given, dict) and "model_provider" not in given):
            owned = provider if isinstance(provider, MultiProvider) else None
        changes: dict[str, Any] = {
            "model_provider": JournaledProvider(provider, binding),
            "input_guardrails": wrap_guardrails(config.input_guardrails, binding, "input"),
            "output_guardrails": wrap_guardrails(config.output_guardrails, binding, "output"),
        }
        if isinstance(config.model, Model):
            changes["model"] = JournaledModel(config.model, binding)
        return dataclasses.replace(config, **changes), owned
