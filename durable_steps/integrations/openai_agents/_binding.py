"""One agent run inside a step: where its calls are recorded, and under which names.

Names must be the same on every re-run of the step, so they come from what
the run itself determines: the order of the model responses, the tool call
ids the (recorded) responses carry, a guardrail's name and how often it ran.
A second agent run in the same attempt of a step is prefixed ``agent2:``...,
numbered in the order the runs start: so runs must start in the same order
on every re-run. Runs one after another do; runs that overlap (under
``asyncio.gather``, in threads, or a run inside a tool, which a replay of
that tool skips) may not, so an unnamed run that starts while another is
running is refused: each such run is named by the caller (``run_name=``),
and its records are found by that name.
"""

from __future__ import annotations

import re
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import DefinitionError
from .._names import response_name, tool_call_name

if TYPE_CHECKING:
    from agents import RunContextWrapper

    from ..._execution.context import Context

__all__ = ["Binding", "errors_var", "idempotency_key", "key_var", "prefix", "running"]


@dataclass
class Binding:
    """The journal of one ``DurableRunner`` run: its step context, names and counters."""

    ctx: Context
    prefix: str
    effects: frozenset[str]
    live: frozenset[str]
    responses: int = 0
    """Model responses recorded so far: the next one is ``model:<responses + 1>``."""
    tries: int = 0
    """Failed tries of the next response in this attempt (an SDK-managed model retry)."""
    tools: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)

    def model_name(self) -> str:
        """The name of the next model response (``model:3``; ``model:3.2`` for a retry,
        see ``integrations._names``, "Model responses").
        """
        return response_name(self.prefix, self.responses + 1, self.tries, self.ctx._recorded)

    def tool_name(self, call_id: str) -> str:
        """``tool:<call id>`` (a long id shortened, see ``integrations._names``); a
        model that reuses an id gets ``@2``, ``@3``...
        """
        name = tool_call_name(self.prefix, call_id)
        count = 1
        while name in self.tools:
            count += 1
            name = tool_call_name(self.prefix, call_id, f"@{count}")
        self.tools.add(name)
        return name

    def numbered(self, kind: str) -> str:
        """``<kind>:1``, ``<kind>:2``... (guardrails, session operations)."""
        count = self.counts.get(kind, 0) + 1
        self.counts[kind] = count
        return f"{self.prefix}{kind}:{count}"


key_var: ContextVar[tuple[str | None, str] | None] = ContextVar(
    "durable_steps_openai_agents_key", default=None
)
"""The (tool call id, idempotency key) of the effect tool running in this context.

A context variable: each tool call runs in a task of its own (a sync tool in
``asyncio.to_thread``, which copies the context), so parallel tool calls each
see their own key.
"""

errors_var: ContextVar[list[BaseException] | None] = ContextVar(
    "durable_steps_openai_agents_errors", default=None
)
"""Our errors raised in the body of a journaled tool, to raise again after it.

The SDK's failure handler turns a tool's exception into a message to the
model, so a mistake (``idempotency_key()`` in a tool that is no effect, an
unnamed agent run inside a tool) would be recorded as a failed tool call and
never seen: the tool's wrapper raises the first one once the SDK returns.
"""


def surfaced(error: BaseException) -> BaseException:
    """``error``, noted for the journaled tool running in this context (if any)."""
    found = errors_var.get()
    if found is not None:
        found.append(error)
    return error


_runs: weakref.WeakKeyDictionary[Context, tuple[int, int]] = weakref.WeakKeyDictionary()
"""Per step context: (attempt, agent runs so far in it), to name later runs apart."""

running: weakref.WeakKeyDictionary[Context, int] = weakref.WeakKeyDictionary()
"""Per step context: how many agent runs are running in it right now."""

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")


def prefix(ctx: Context, run_name: str | None = None) -> str:
    """``""`` for the first agent run in this attempt of the step, then ``agent2:``...;
    ``<run_name>:`` for a named run. An unnamed run that starts while another
    runs in this step is refused (see the module docstring).
    """
    where = f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}"
    if run_name is not None:
        if not isinstance(run_name, str) or not _RUN_NAME.fullmatch(run_name):
            raise surfaced(
                DefinitionError(
                    f"{where}: run_name={run_name!r} must be 1-40 letters, digits, '.', '_' "
                    "or '-', starting with a letter or digit",
                    run=f"{ctx.workflow}/{ctx.run_id}",
                    step=ctx.step,
                )
            )
        return f"{run_name}:"
    if running.get(ctx, 0):
        raise surfaced(
            DefinitionError(
                f"{where}: an agent run started while another agent run of this step was "
                "still running (asyncio.gather, threads, or a run inside a tool). Overlapping "
                "runs can start in another order when the step runs again, and would replay "
                "each other's records: give each of them a name of its own, "
                "runner.run(agent, input, ctx=ctx, run_name='refunds').",
                run=f"{ctx.workflow}/{ctx.run_id}",
                step=ctx.step,
            )
        )
    attempt, count = _runs.get(ctx, (ctx.attempt, 0))
    count = count + 1 if attempt == ctx.attempt else 1
    _runs[ctx] = (ctx.attempt, count)
    return "" if count == 1 else f"agent{count}:"


def idempotency_key(tool_ctx: RunContextWrapper[Any]) -> str:
    """The idempotency key of the effect tool call ``tool_ctx`` belongs to.

    The same on every re-fire of this tool call (a retry of the step, a
    resume after a crash), different for every other tool call, step, pass
    and run; at most 64 printable ASCII characters. Pass it to the API the
    tool calls, so that a re-fire is deduplicated there. Only a tool named in
    ``DurableRunner(effects=...)``, run by that runner inside a step, has one.
    """
    found = key_var.get()
    call_id = getattr(tool_ctx, "tool_call_id", None)
    if found is None or (call_id is not None and found[0] != call_id):
        tool = getattr(tool_ctx, "tool_name", None) or "?"
        raise surfaced(
            DefinitionError(
                f"idempotency_key() was called in tool {tool!r}, which is not running as an "
                "effect: name it in DurableRunner(effects={...}) and run the agent with "
                "runner.run_sync(agent, input, ctx=ctx) (or await runner.run(...)) inside a step."
            )
        )
    return found[1]
