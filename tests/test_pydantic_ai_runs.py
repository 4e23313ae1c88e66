"""DurableAgent runs that start concurrently in one step, and the records they trust.

Concurrent runs (``asyncio.gather``, threads) start in an order timing
decides, so they are refused unless each is named with ``run_name=``; named,
a retry that starts them in the other order still replays each run's own
records. A record never makes the integration import a module: only the
classes the tool's return annotation names are rebuilt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import durable_steps as ds
from durable_steps.integrations.pydantic_ai import DurableAgent

pytestmark = pytest.mark.pydantic_ai


def _echo(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart(f"answer to {messages[-1].parts[-1].content}")])


def _gathering(run_names: dict[str, str | None]) -> tuple[ds.Workflow, list[str | None]]:
    """Two prompts asked together, the one that starts first swapped on the retry."""
    durable = DurableAgent(Agent(FunctionModel(_echo)))
    names: list[str | None] = []
    wf = ds.Workflow(
        "gather",
        store=ds.MemoryStore(),
        on_event=[lambda e: names.append(e.call) if e.kind == "call_recorded" else None],
    )

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=TimeoutError))
    async def ask_both(state: dict[str, Any], ctx: ds.Context) -> None:
        first = "refund?" if ctx.attempt == 1 else "ship?"

        async def ask(question: str) -> str:
            await asyncio.sleep(0 if question == first else 0.05)  # a lookup first
            result = await durable.run(question, ctx=ctx, run_name=run_names[question])
            return str(result.output)

        state["refund"], state["ship"] = await asyncio.gather(ask("refund?"), ask("ship?"))
        if ctx.attempt == 1:
            raise TimeoutError("retry me")

    return wf, names


def test_concurrent_unnamed_runs_are_refused_naming_the_step_and_the_fix() -> None:
    wf, _ = _gathering({"refund?": None, "ship?": None})
    with pytest.raises(ds.StepFailed) as failed:
        asyncio.run(wf.arun("r", {}))
    cause = failed.value.__cause__
    assert isinstance(cause, ds.DefinitionError)
    assert "step 'ask_both'" in str(cause)
    assert "run_name=" in str(cause)


def test_named_concurrent_runs_replay_their_own_records_whatever_the_order() -> None:
    wf, names = _gathering({"refund?": "refund", "ship?": "ship"})
    final = asyncio.run(wf.arun("r", {}))
    assert final == {"refund": "answer to refund?", "ship": "answer to ship?"}
    assert sorted(names) == ["refund:model:1", "ship:model:1"]  # the retry replayed both


def test_a_run_in_another_thread_of_a_sync_step_is_refused_unnamed() -> None:
    alpha = DurableAgent(Agent(FunctionModel(lambda m, i: ModelResponse(parts=[TextPart("a")]))))
    beta = DurableAgent(Agent(FunctionModel(lambda m, i: ModelResponse(parts=[TextPart("b")]))))
    errors: list[BaseException] = []
    wf = ds.Workflow("threads", store=ds.MemoryStore())

    @wf.step()
    def both(state: dict[str, Any], ctx: ds.Context) -> None:
        state["a"] = alpha.run_sync("who?", ctx=ctx).output

        def other() -> None:
            try:
                state["b"] = beta.run_sync("who?", ctx=ctx).output
            except ds.DefinitionError as exc:
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()

    final = wf.run("r", {})
    assert final == {"a": "a"}
    assert len(errors) == 1
    assert "another task or thread" in str(errors[0])


def test_sequential_runs_of_one_name_are_numbered_and_bad_names_refused() -> None:
    durable = DurableAgent(Agent(FunctionModel(_echo)))
    names: list[str | None] = []
    wf = ds.Workflow(
        "named",
        store=ds.MemoryStore(),
        on_event=[lambda e: names.append(e.call) if e.kind == "call_recorded" else None],
    )

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        for question in ("one", "two"):
            durable.run_sync(question, ctx=ctx, run_name="triage")
        with pytest.raises(ds.DefinitionError, match="not a run name"):
            durable.run_sync("x", ctx=ctx, run_name="agent2")

    wf.run("r", {})
    assert names == ["triage:model:1", "triage#2:model:1"]
