"""DurableAgent runs that start concurrently in one step, and the records they trust.

Concurrent runs (``asyncio.gather``, threads) start in an order timing
decides, so they are refused unless each is named with ``run_name=``; named,
a retry that starts them in the other order still replays each run's own
records. A record never makes the integration import a module: only the
classes the tool's return annotation names are rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import threading
import warnings
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
            finally:  # the loop run_sync may have set for this thread: close it, as an exit would
                with warnings.catch_warnings(), contextlib.suppress(RuntimeError):
                    warnings.simplefilter("ignore", DeprecationWarning)
                    asyncio.get_event_loop_policy().get_event_loop().close()

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


class Order(BaseModel):
    """A tool's typed result."""

    id: int


class Refund(BaseModel):
    """Another."""

    id: int


@dataclasses.dataclass
class Point:
    """A dataclass inside a dict."""

    x: int


def _returns(messages: list[ModelMessage]) -> dict[str, Any]:
    return {
        p.tool_name: p.content
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    }


def _calling_four_tools() -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not _returns(messages):
            return ModelResponse(
                parts=[
                    ToolCallPart(tool, {}, tool_call_id=f"c{i}")
                    for i, tool in enumerate(("orders", "points", "either", "untyped"))
                ]
            )
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(model)


def test_results_keep_the_types_their_annotation_names_nested_too_live_and_replayed() -> None:
    seen: list[dict[str, Any]] = []
    agent = Agent(_calling_four_tools())

    @agent.tool_plain
    def orders() -> list[Order]:
        return [Order(id=1), Order(id=2)]

    @agent.tool_plain
    def points() -> dict[str, Point]:
        return {"p": Point(3)}

    @agent.tool_plain
    def either() -> Order | Refund:
        return Refund(id=7)  # the recorded type picks the union's member

    @agent.tool_plain
    def untyped() -> Any:
        return [Order(id=1)]

    durable = DurableAgent(agent)
    wf = ds.Workflow("types", store=ds.MemoryStore())

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=TimeoutError))
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        seen.append(_returns(durable.run_sync("go", ctx=ctx).all_messages()))
        if ctx.attempt == 1:
            raise TimeoutError("retry: the tools replay from their records")

    wf.run("r", {})
    live, replayed = seen
    assert live == replayed
    assert live["orders"] == [Order(id=1), Order(id=2)]
    assert live["points"] == {"p": Point(3)}
    assert isinstance(live["either"], Refund)
    assert live["untyped"] == [{"id": 1}]  # no annotation: the JSON form, on both paths


def test_a_record_never_imports_the_module_its_type_names(tmp_path: Any) -> None:
    from durable_steps.integrations.pydantic_ai._tools import load_result

    (tmp_path / "planted_by_a_record.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n"
        "class Thing:\n    def __init__(self, value):\n        self.value = value\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        agent = Agent(FunctionModel(_echo))

        @agent.tool_plain
        def refund() -> Order:
            return Order(id=1)

        tool = type("Tool", (), {"toolset": agent._function_toolset, "original_name": None})()
        out = load_result({"return": 1, "type": "planted_by_a_record:Thing"}, None, tool, "refund")  # type: ignore[arg-type]
    finally:
        sys.path.remove(str(tmp_path))
    assert "planted_by_a_record" not in sys.modules
    assert not (tmp_path / "planted_by_a_record.ran").exists()
    assert out == 1  # not an Order either: the JSON form


def test_a_history_item_edited_in_place_reaches_the_model_as_after_a_resume() -> None:
    """The parsed messages kept from the last turn are not used for an item changed
    inside: the model sees the stored (redacted) form, as a resumed run, which parses
    the stored state, would.
    """
    seen: list[list[Any]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append([getattr(p, "content", None) for m in messages for p in m.parts])
        return ModelResponse(parts=[TextPart(f"reply {len(messages)}")])

    durable = DurableAgent(Agent(FunctionModel(model)))
    wf = ds.Workflow("edits", store=ds.MemoryStore(), until=lambda s: s["t"] == 3)

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        if state["t"] == 1:
            state["messages"][0]["parts"][0]["content"] = "REDACTED"
        if state["t"] == 2:
            state["messages"][-1]["parts"][0]["content"] = "edited reply"
        durable.run_sync(f"q{state['t']}", ctx=ctx, state=state)
        state["t"] += 1

    wf.run("r", {"t": 0})
    assert seen == [
        ["q0"],
        ["REDACTED", "reply 1", "q1"],
        ["REDACTED", "reply 1", "q1", "edited reply", "q2"],
    ]
