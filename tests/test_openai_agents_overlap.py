"""Agent runs that overlap in one step, and our mistakes inside a tool's body.

Runs one after another are numbered in the order they start; overlapping
runs (``asyncio.gather``, a run inside a tool) could start in another order
when the step runs again, so an unnamed one is refused and named ones are
found by their names. A scripted ``Model`` answers in process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents")

from agents import (
    Agent,
    ModelResponse,
    RunContextWrapper,
    function_tool,
    set_tracing_disabled,
)
from agents.models.interface import Model

import durable_steps as ds
from durable_steps.integrations.openai_agents import DurableRunner, idempotency_key
from tests.sdkscript import message, response, told, tool_call

pytestmark = pytest.mark.openai_agents
set_tracing_disabled(True)  # no export to OpenAI


class Answers(Model):
    """Answers ``<label>-answer``, after a delay (live calls are slow, replays instant)."""

    def __init__(self, label: str, delay: float = 0.0, tool: str | None = None) -> None:
        self.label, self.delay, self.tool, self.calls = label, delay, tool, 0

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.tool and not told(input):
            return response([tool_call(self.tool, {}, "call_1")])
        return response([message(f"{self.label}-answer")])

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def workflow(tmp_path: Path, body: Any) -> ds.Workflow:
    return ds.Workflow("agents", steps=[ds.step(body, name="turn")], store=str(tmp_path / "s"))


def test_overlapping_unnamed_runs_are_refused_and_named_ones_replay_by_name(
    tmp_path: Path,
) -> None:
    """Under gather, the first run waits for a journaled call that is slow live and
    instant on replay, so the runs start in another order on the retry: unnamed, that
    is refused; named, each replays its own response."""
    runner = DurableRunner()
    a, b = Agent(name="a", model=Answers("A")), Agent(name="b", model=Answers("B"))
    attempts: list[int] = []

    async def first(ctx: ds.Context, name: str | None) -> str:
        await ctx.acall("lookup", asyncio.sleep, 0.2 if ctx.attempt == 1 else 0)
        return str((await runner.run(a, "hi", ctx=ctx, run_name=name)).final_output)

    async def second(ctx: ds.Context, name: str | None) -> str:
        return str((await runner.run(b, "hi", ctx=ctx, run_name=name)).final_output)

    def turn_with(named: bool) -> Any:
        async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
            attempts.append(ctx.attempt)
            state["a"], state["b"] = await asyncio.gather(
                first(ctx, "a" if named else None), second(ctx, "b" if named else None)
            )
            if ctx.attempt == 1:
                raise RuntimeError("once: the retry replays both runs")

        return turn

    retry = ds.Retry(attempts=2, wait=0, on=RuntimeError)
    unnamed = ds.Workflow(
        "agents",
        steps=[ds.step(turn_with(False), name="turn", retry=retry)],
        store=str(tmp_path / "u"),
    )
    with pytest.raises(ds.StepFailed) as failed:
        asyncio.run(unnamed.arun("r1", {}))
    assert "run_name=" in str(failed.value.__cause__)
    named = ds.Workflow(
        "agents",
        steps=[ds.step(turn_with(True), name="turn", retry=retry)],
        store=str(tmp_path / "n"),
    )
    assert asyncio.run(named.arun("r1", {})) == {"a": "A-answer", "b": "B-answer"}
    assert attempts[-2:] == [1, 2]


def test_a_mistake_inside_a_tool_fails_the_step_instead_of_becoming_a_message(
    tmp_path: Path,
) -> None:
    """idempotency_key() in a tool that is no effect, and an unnamed agent run inside a
    tool, are our errors: the SDK's failure handler would tell the model 'an error
    occurred' and the run would go on; they fail the step, saying what to do."""

    @function_tool
    def refund(tool_ctx: RunContextWrapper[Any]) -> str:
        return idempotency_key(tool_ctx)  # refund is not named in effects=

    agent = Agent(name="desk", model=Answers("desk", tool="refund"), tools=[refund])
    runner = DurableRunner()

    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = (await runner.run(agent, "refund please", ctx=ctx)).final_output

    with pytest.raises(ds.StepFailed) as failed:
        asyncio.run(workflow(tmp_path / "key", turn).arun("r1", {}))
    assert "DurableRunner(effects=" in str(failed.value.__cause__)

    inner = Agent(name="inner", model=Answers("inner"))

    @function_tool
    async def delegate(tool_ctx: RunContextWrapper[Any]) -> str:
        ctx = tool_ctx.context["ctx"]
        return str((await runner.run(inner, "sub-task", ctx=ctx)).final_output)

    outer = Agent(name="outer", model=Answers("outer", tool="delegate"), tools=[delegate])

    async def nested(state: dict[str, Any], ctx: ds.Context) -> None:
        result = await runner.run(outer, "go", ctx=ctx, context={"ctx": ctx})
        state["out"] = result.final_output

    with pytest.raises(ds.StepFailed) as failed:
        asyncio.run(workflow(tmp_path / "nested", nested).arun("r1", {}))
    assert "run_name=" in str(failed.value.__cause__)


def test_a_run_name_must_be_a_short_plain_name(tmp_path: Path) -> None:
    runner = DurableRunner()
    agent = Agent(name="a", model=Answers("A"))

    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        await runner.run(agent, "hi", ctx=ctx, run_name="no spaces")

    with pytest.raises(ds.StepFailed) as failed:
        asyncio.run(workflow(tmp_path, turn).arun("r1", {}))
    assert "run_name='no spaces' must be" in str(failed.value.__cause__)
