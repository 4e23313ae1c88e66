"""DurableAgent behaves as the plain agent: same output, events, messages and usage.

Each scenario runs the same scripted ``FunctionModel`` agent twice: plainly
(``agent.run``), and through :class:`DurableAgent` in a step that fails after
the agent run once, so its second attempt replays every recorded request and
tool call. Both attempts must look like the plain run. The same scenarios,
killed with a real SIGKILL, are in ``test_pydantic_ai_crash.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    BinaryImage,
    DocumentUrl,
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.models.test import TestModel

import durable_steps as ds
from durable_steps.integrations.pydantic_ai import DurableAgent, idempotency_key
from tests.pydaiscenes import Order, build, norm_events, norm_messages, usage_of

pytestmark = pytest.mark.pydantic_ai


def retried(
    tmp_path: Path,
    body: Callable[[ds.Context], Awaitable[Any]],
    names: list[str | None] | None = None,
) -> list[Any]:
    """``body(ctx)`` in a step that fails once after it: what each attempt returned;
    the names of the calls recorded go to ``names`` when given."""
    record = [] if names is None else names
    wf = ds.Workflow(
        "parity",
        store=ds.LocalStore(tmp_path),
        on_event=[lambda e: record.append(e.call) if e.kind == "call_recorded" else None],
    )
    seen: list[Any] = []

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        seen.append(await body(ctx))
        if ctx.attempt == 1:
            raise RuntimeError("after the agent run: the retry replays it")

    asyncio.run(wf.arun("r", {}))
    assert len(seen) == 2
    return seen


@pytest.mark.parametrize("scene", ["tools", "multimodal", "subagent", "live"])
def test_run_replayed_gives_the_plain_output_messages_and_usage(tmp_path: Path, scene: str) -> None:
    """run(): output, messages (tool results as their own types) and usage equal the
    plain agent's, live and replayed; the model and the recorded tools run once."""
    plain_agent, _, _ = build(scene)
    plain = asyncio.run(plain_agent.run("go", deps={"mode": "basic"}))
    _, durable, calls = build(scene)

    async def body(ctx: ds.Context) -> Any:
        return await durable.run("go", ctx=ctx, deps={"mode": "basic"})

    for result in retried(tmp_path, body):
        assert result.output == plain.output
        assert norm_messages(result.all_messages()) == norm_messages(plain.all_messages())
        assert usage_of(result) == usage_of(plain)
    assert calls["model"] == plain_calls(scene)
    if scene == "live":
        assert calls["live"] == 2  # ran on the replay too
    if scene == "subagent":
        assert usage_of(plain)["requests"] == 4


def test_test_model_runs_durably_as_plainly(tmp_path: Path) -> None:
    """pydantic-ai's TestModel (every tool called, then their results as JSON): the
    same output and usage plainly, live and replayed; each tool runs once."""
    ran: list[str] = []

    def agent_with_tools() -> Agent[None, str]:
        agent: Agent[None, str] = Agent(TestModel())

        @agent.tool_plain
        def weather(city: str) -> str:
            ran.append(city)
            return f"sunny in {city}"

        @agent.tool_plain
        def order(id: int) -> Order:
            return Order(id=id, total=20)

        return agent

    plain = asyncio.run(agent_with_tools().run("go"))
    durable = DurableAgent(agent_with_tools())
    ran.clear()

    async def body(ctx: ds.Context) -> Any:
        return await durable.run("go", ctx=ctx)

    for result in retried(tmp_path, body):
        assert result.output == plain.output
        assert usage_of(result) == usage_of(plain)
        assert norm_messages(result.all_messages()) == norm_messages(plain.all_messages())
    assert len(ran) == 1


def plain_calls(scene: str) -> int:
    """Model requests the plain run of ``scene`` makes (the durable one makes no more)."""
    agent, _, calls = build(scene)
    asyncio.run(agent.run("go", deps={"mode": "basic"}))
    return calls["model"]


def test_tool_results_come_back_as_the_types_the_tools_returned(tmp_path: Path) -> None:
    """A pydantic model, a BinaryImage and a DocumentUrl replay as themselves, not dicts."""
    _, durable, _ = build("multimodal")

    async def body(ctx: ds.Context) -> Any:
        return await durable.run("go", ctx=ctx, deps={"mode": "basic"})

    for result in retried(tmp_path, body):
        returns = {
            p.tool_name: p.content
            for m in result.all_messages()
            for p in m.parts
            if p.part_kind == "tool-return"
        }
        assert returns["order"] == Order(id=42, total=20)
        assert isinstance(returns["picture"], BinaryImage)
        assert returns["picture"].data == b"\x89PNG\x00\xff"
        assert isinstance(returns["manual"], DocumentUrl)


class SpecialOrder(Order):
    """A subclass no tool annotation names."""

    note: str


def _returning(fn: Callable[[], Any]) -> Callable[[], Agent[None, str]]:
    """An agent that calls ``fn`` as its one tool, then answers with what it was shown."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart(fn.__name__, {}, tool_call_id="c1")])
        shown = [p.model_response_str() for p in messages[-1].parts if p.part_kind == "tool-return"]
        return ModelResponse(parts=[TextPart(f"shown {shown}")])

    def make() -> Agent[None, str]:
        agent = Agent(FunctionModel(model))
        agent.tool_plain(fn)
        return agent

    return make


def as_float() -> float:
    return 1  # an int where the annotation says float: shown as 1


def coerced() -> dict[str, int]:
    return {"a": "007"}  # type: ignore[dict-item]  # a str the annotation would make 7


def subclass() -> Order:
    return SpecialOrder(id=1, total=2, note="VIP")  # its note is not in Order


def any_model() -> BaseModel:
    return Order(id=5, total=2)  # BaseModel itself has no fields to build


@pytest.mark.parametrize("fn", [as_float, coerced, subclass, any_model])
def test_what_the_model_is_shown_is_the_plain_agents_when_the_annotation_would_change_it(
    tmp_path: Path, fn: Callable[[], Any]
) -> None:
    """A result the return annotation would not give back as it was is kept as its JSON,
    so the model sees what the plain agent shows it, live and replayed."""
    make = _returning(fn)
    plain = asyncio.run(make().run("go")).output
    durable = DurableAgent(make())

    async def body(ctx: ds.Context) -> str:
        return (await durable.run("go", ctx=ctx)).output

    assert retried(tmp_path, body) == [plain, plain]


def stream_scene() -> tuple[Agent[None, str], DurableAgent, dict[str, int]]:
    """An agent whose model streams a tool call, then its answer in three pieces."""
    calls = {"model": 0}

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
        calls["model"] += 1
        if len(messages) == 1:
            yield {0: DeltaToolCall(name="lookup", tool_call_id="c1")}
            yield {0: DeltaToolCall(json_args='{"order": ')}
            yield {0: DeltaToolCall(json_args="42}")}
            return
        for piece in ("the total ", "is ", "20"):
            yield piece

    agent: Agent[None, str] = Agent(FunctionModel(stream_function=stream))

    @agent.tool_plain
    def lookup(order: int) -> dict[str, int]:
        return {"order": order, "total": 20}

    return agent, DurableAgent(agent), calls


def test_an_event_stream_handler_sees_start_deltas_and_end_as_plainly(tmp_path: Path) -> None:
    """The handler gets the plain agent's events (starts, deltas, ends, tool events),
    live and replayed, not one start event per part."""
    got: list[Any] = []

    async def handler(run_ctx: RunContext[None], events: AsyncIterator[Any]) -> None:
        got.extend([e async for e in events])

    agent, durable, calls = stream_scene()
    asyncio.run(agent.run("go", event_stream_handler=handler))
    plain, _ = norm_events(got), got.clear()
    assert "PartDeltaEvent" in [e[0] for e in plain]

    async def body(ctx: ds.Context) -> Any:
        got.clear()
        await durable.run("go", ctx=ctx, event_stream_handler=handler)
        return norm_events(got)

    assert retried(tmp_path, body) == [plain, plain]
    assert calls["model"] == 4  # two plain, two durable: the replay asked nothing


def test_run_stream_streams_a_recorded_response_back(tmp_path: Path) -> None:
    """run_stream() works in a step: the text deltas and the output are the plain ones."""
    agent, durable, calls = stream_scene()

    async def plain_run() -> Any:
        async with agent.run_stream("go") as result:
            return [t async for t in result.stream_text(delta=True)], result.usage

    plain_pieces, plain_usage = asyncio.run(plain_run())

    async def body(ctx: ds.Context) -> Any:
        state: dict[str, Any] = {}
        async with durable.run_stream("go", ctx=ctx, state=state) as result:
            pieces = [t async for t in result.stream_text(delta=True)]
        assert len(state["messages"]) == 4  # kept once the stream was read to its end
        return pieces, result.usage

    for pieces, usage in retried(tmp_path, body):
        assert pieces == plain_pieces
        assert usage == plain_usage
    assert calls["model"] == 4


async def walk(run: Any) -> tuple[list[str], int]:
    """The nodes of an agent run, each model request streamed: (node names, deltas)."""
    nodes, deltas = [], 0
    async for node in run:
        nodes.append(type(node).__name__)
        if Agent.is_model_request_node(node):
            async with node.stream(run.ctx) as stream:
                deltas += sum([type(e).__name__ == "PartDeltaEvent" async for e in stream])
    return nodes, deltas


def test_run_stream_events_and_iter_work_inside_a_step(tmp_path: Path) -> None:
    """run_stream_events() yields the plain events and result; iter() walks the same
    nodes (streaming a node's response back), live and replayed."""
    agent, durable, calls = stream_scene()

    async def plain_events() -> list[Any]:
        async with agent.run_stream_events("go") as events:
            return norm_events([e async for e in events])

    async def plain_nodes() -> tuple[list[str], int]:
        async with agent.iter("go") as run:
            return await walk(run)

    want_events, want_nodes = asyncio.run(plain_events()), asyncio.run(plain_nodes())
    assert want_events[-1][0] == "AgentRunResultEvent"

    async def body(ctx: ds.Context) -> Any:
        async with durable.run_stream_events("go", ctx=ctx) as stream_events:
            events = [e async for e in stream_events]
        state: dict[str, Any] = {}
        async with durable.iter("go", ctx=ctx, state=state) as run:
            walked = await walk(run)
        assert len(state["messages"]) == 4  # kept once the run reached its end
        assert run.result is not None
        assert run.result.output == "the total is 20"
        return norm_events(events), walked

    for events, walked in retried(tmp_path, body):
        assert events == want_events
        assert walked == want_nodes
        assert walked[1] == 4  # two deltas for the tool call's arguments, two for the text
    assert calls["model"] == 2 + 2 + 4  # plain twice; durable's two runs, once each


def test_override_model_around_a_run_is_honoured_and_recorded(tmp_path: Path) -> None:
    """agent.override(model=...) around a durable run: that model answers, and replays."""
    called: list[str] = []

    def own(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        called.append("own")
        return ModelResponse(parts=[TextPart("from the agent's model")])

    def other(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        called.append("override")
        return ModelResponse(parts=[TextPart("from the override")])

    agent = Agent(FunctionModel(own))
    durable = DurableAgent(agent)

    async def body(ctx: ds.Context) -> Any:
        with agent.override(model=FunctionModel(other)):
            return (await durable.run("hi", ctx=ctx)).output

    assert retried(tmp_path, body) == ["from the override"] * 2
    assert called == ["override"]


def test_an_effect_is_titled_by_its_tool_and_arguments(tmp_path: Path) -> None:
    """An effect in doubt is named by its tool and arguments (StepInDoubt, show,
    events), and its journal name stays the tool call id."""
    events: list[ds.Event] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            args = {"order": "4411", "cents": 500}
            return ModelResponse(parts=[ToolCallPart("refund", args, tool_call_id="e124")])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model))

    class Killed(BaseException):
        pass

    @agent.tool
    def refund(run_ctx: RunContext[None], order: str, cents: int) -> str:
        idempotency_key(run_ctx)
        raise Killed

    durable = DurableAgent(agent, effects={"refund"})
    wf = ds.Workflow("titles", store=ds.LocalStore(tmp_path), on_event=[events.append])

    @wf.step(in_doubt="raise")
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        durable.run_sync("refund it", ctx=ctx)

    with pytest.raises(Killed):
        wf.run("r", {})
    with pytest.raises(ds.StepInDoubt, match=r"refund\(order='4411', cents=500\)") as info:
        wf.run("r", {})
    assert info.value.effect == "tool:e124"
    shown = subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", str(tmp_path), "show", "titles/r"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "effect refund(order='4411', cents=500)" in shown
    titles = {e.call: e.title for e in events if e.kind == "call_started"}
    assert titles["tool:e124"] == "refund(order='4411', cents=500)"
    assert titles["model:1"] == "model request 1 (function:model:)"


def test_live_and_effects_are_checked_when_the_agent_is_wrapped() -> None:
    """live= names tools too: misspelt, a single string, or also an effect is refused."""
    agent = Agent(TestModel())

    @agent.tool_plain
    def pick(mode: str) -> str:
        return mode

    with pytest.raises(ds.DefinitionError, match="no tool named 'pik'"):
        DurableAgent(agent, live={"pik"})
    with pytest.raises(ds.DefinitionError, match="not one string"):
        DurableAgent(agent, live="pick")
    with pytest.raises(ds.DefinitionError, match="both effects= and live="):
        DurableAgent(agent, effects={"pick"}, live={"pick"})


def test_the_history_is_appended_to_and_parsed_once(tmp_path: Path) -> None:
    """state= keeps one list across turns: the old items stay the very same objects
    (format 2 writes only the new ones), and the run's history holds the messages
    parsed for the turn before (not parsed again)."""
    histories: list[list[ModelMessage]] = []

    def model_history(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        histories.append(messages)
        return ModelResponse(parts=[TextPart(f"reply {len(messages)}")])

    durable = DurableAgent(Agent(FunctionModel(model_history)))
    wf = ds.Workflow("chat", store=ds.LocalStore(tmp_path), until=lambda s: s["turn"] == 3)
    lists: list[tuple[int, int, int]] = []

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        durable.run_sync(f"q{state['turn']}", ctx=ctx, state=state)
        kept = state["messages"]
        lists.append((id(kept), id(kept[0]), len(kept)))
        state["turn"] += 1

    final = wf.run("r", {"turn": 0})
    assert [n for _, _, n in lists] == [2, 4, 6]
    assert lists[1][:2] == lists[2][:2]  # the same list, the same first message
    assert histories[2][0] is histories[1][0]  # the parsed message, kept
    assert json.loads(json.dumps(final["messages"])) == final["messages"]


def test_a_tool_that_failed_is_told_as_failed_on_replay_and_not_run_again(
    tmp_path: Path,
) -> None:
    """A ToolFailed is what the model was told and answered: it is recorded, so the
    replay tells it again instead of running the tool (which would now succeed)."""
    from pydantic_ai.exceptions import ToolFailed

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("balance", {}, tool_call_id="c1")])
        told = messages[-1].parts[0]
        return ModelResponse(parts=[TextPart(f"told: {getattr(told, 'content', '')}")])

    def make(calls: list[int]) -> Agent[None, str]:
        agent = Agent(FunctionModel(model))

        @agent.tool_plain
        def balance() -> str:
            calls.append(1)
            if len(calls) == 1:
                raise ToolFailed("upstream 503")
            return "100"

        return agent

    async def run(agent: Agent[None, str] | DurableAgent, **kwargs: Any) -> Any:
        result = await agent.run("balance?", **kwargs)
        return [result.output, norm_messages(result.all_messages()), usage_of(result)]

    plain_calls: list[int] = []
    plain = asyncio.run(run(make(plain_calls)))
    durable_calls: list[int] = []
    durable = DurableAgent(make(durable_calls))
    assert retried(tmp_path, lambda ctx: run(durable, ctx=ctx)) == [plain, plain]
    assert plain[0] == "told: upstream 503"
    assert len(plain_calls) == len(durable_calls) == 1
