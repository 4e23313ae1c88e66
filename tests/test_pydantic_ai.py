"""durable_steps.integrations.pydantic_ai: a pydantic-ai agent run inside a step.

The crash tests run ``tests/pydaichild.py`` (a two-turn support agent on
pydantic-ai's own ``FunctionModel``: a read tool, two effect tools called
together) killed with a real SIGKILL at one point, then rerun to completion,
and compare what really happened (the child's model, tool and ledger logs)
with an uncrashed run. Each child is a fresh fork of a server that imported
the script once (``tests/forkserver.py``): a real process, killed for real,
without paying pydantic-ai's import twice per case. The other tests run agents in-process, with
``FunctionModel`` and ``TestModel``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturn,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel

import durable_steps as ds
from durable_steps._record import delta as _delta
from durable_steps.integrations.pydantic_ai import DurableAgent, idempotency_key
from tests.forkserver import ForkServer
from tests.pydaichild import read_lines
from tests.volatile import normalized

pytestmark = pytest.mark.pydantic_ai

CHILD = Path(__file__).with_name("pydaichild.py")
KILLED = -signal.SIGKILL


_forks = ForkServer(CHILD)


def child(tmp: Path, mode: str, crash: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python tests/pydaichild.py`` on run r1 in ``tmp``, as a fresh fork of the server."""
    args = ["--store", str(tmp / "store"), "--run", "r1", "--log", str(tmp / "log")]
    args += ["--mode", mode]
    if crash:
        args += ["--crash", crash]
    (tmp / "log").mkdir(parents=True, exist_ok=True)
    return _forks.run(args, cwd=tmp, out=tmp / "child")


def transcript(state: dict[str, Any]) -> Any:
    """The conversation without what differs between any two runs (``tests.volatile``)."""
    return normalized(state["messages"])


_reference: dict[str, dict[str, Any]] = {}


def reference(tmp_path_factory: pytest.TempPathFactory, mode: str) -> dict[str, Any]:
    """The final state of an uncrashed run (one per mode per session)."""
    if mode not in _reference:
        done = child(tmp_path_factory.mktemp(f"reference-{mode}"), mode)
        assert done.returncode == 0, done.stderr
        _reference[mode] = json.loads(done.stdout)
    return _reference[mode]


CRASHES = {
    "between-model-requests": "model:2:0",
    "inside-a-read-tool": "tool:lookup:0",
    "inside-an-effect-tool": "tool:refund:0",
    "after-an-effect-returned": "recorded:tool:c2:0",
    "request-after-the-effects": "model:3:0",
    "second-turn": "recorded:model:1:1",
}
FAST = {
    ("sync", "between-model-requests"),
    ("sync", "inside-an-effect-tool"),
    ("sync", "second-turn"),
    ("async", "after-an-effect-returned"),
}
"""The crashes the extra Pythons run too (each case starts two child processes)."""


@pytest.mark.parametrize(
    ("mode", "crash"),
    [
        pytest.param(
            mode, cue, id=f"{mode}-{name}", marks=() if (mode, name) in FAST else pytest.mark.slow
        )
        for mode in ("sync", "async")
        for name, cue in CRASHES.items()
    ],
)
def test_a_killed_agent_run_replays_its_requests_and_fires_each_effect_under_one_key(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, crash: str, mode: str
) -> None:
    """SIGKILL anywhere in an agent run: the rerun makes each model request once (but
    the one in flight), fires each effect under one key, and ends as an uncrashed run.
    """
    killed = child(tmp_path, mode, crash)
    assert killed.returncode == KILLED, killed.stderr
    done = child(tmp_path, mode)
    assert done.returncode == 0, done.stderr
    final, expected = json.loads(done.stdout), reference(tmp_path_factory, mode)
    assert final["answers"] == expected["answers"]
    assert transcript(final) == transcript(expected)

    log = tmp_path / "log"
    where, turn = crash.rsplit(":", 1)
    in_flight = f"{turn}:{where.split(':')[1]}" if where.startswith("model:") else None
    models = Counter(read_lines(log / "models"))
    assert set(models) == {"0:1", "0:2", "0:3", "1:1"}
    assert {r: n for r, n in models.items() if n != 1} == ({in_flight: 2} if in_flight else {})
    assert len(read_lines(log / "lookup")) == (2 if where == "tool:lookup" else 1)

    ledger = [line.split(":", 1) for line in read_lines(log / "ledger")]
    for tool in ("refund", "notify"):
        keys = [key for name, key in ledger if name == tool]
        assert len(set(keys)) == 1, f"{tool} fired under keys {keys}"
        assert 0 < len(keys[0]) <= 64
        assert keys[0].isascii()
    assert len([k for name, k in ledger if name == "refund"]) == (
        2 if where == "tool:refund" else 1
    )


# --- in-process ---------------------------------------------------------------------


def scripted(calls: list[int]) -> FunctionModel:
    """A model asking for ``charge`` once, then answering with what it returned."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls.append(len(messages))
        returns = [
            p.content
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        ]
        if not returns:
            return ModelResponse(parts=[ToolCallPart("charge", {"amount": 5}, tool_call_id="k1")])
        return ModelResponse(parts=[TextPart(f"ok {returns}")])

    return FunctionModel(model)


def test_a_step_retry_replays_model_requests_and_tool_calls(tmp_path: Path) -> None:
    """A step that fails after its agent run and retries replays every recorded call."""
    calls: list[int] = []
    fired: list[str] = []
    agent = Agent(scripted(calls))

    @agent.tool
    def charge(run_ctx: RunContext[None], amount: int) -> str:
        fired.append(idempotency_key(run_ctx))
        return f"charged {amount}"

    durable = DurableAgent(agent, effects={"charge"})
    wf = ds.Workflow("retry", store=ds.LocalStore(tmp_path))
    outputs: list[str] = []

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        outputs.append(durable.run_sync("charge me", ctx=ctx).output)
        if ctx.attempt == 1:
            raise RuntimeError("after the agent run")

    wf.run("r", {})
    assert len(calls) == 2  # two model requests, each made once
    assert len(fired) == 1
    assert outputs[0] == outputs[1] == "ok ['charged 5']"


def test_idempotency_key_is_refused_to_a_tool_that_is_not_an_effect(tmp_path: Path) -> None:
    """A tool not named in effects= gets a clear error from idempotency_key()."""
    agent = Agent(scripted([]))

    @agent.tool
    def charge(run_ctx: RunContext[None], amount: int) -> str:
        return idempotency_key(run_ctx)

    durable = DurableAgent(agent)
    wf = ds.Workflow("no-effect", store=ds.LocalStore(tmp_path))

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        durable.run_sync("charge me", ctx=ctx)

    with pytest.raises(ds.StepFailed) as failed:
        wf.run("r", {})
    assert "'charge', which is not running as an effect" in str(failed.value.__cause__)


def test_a_misspelt_effect_is_refused_when_the_agent_is_wrapped() -> None:
    """effects= naming no tool of the agent is a DefinitionError at construction."""
    agent = Agent(scripted([]))

    @agent.tool_plain
    def charge(amount: int) -> str:
        return "x"

    with pytest.raises(ds.DefinitionError, match="no tool named 'chrage'"):
        DurableAgent(agent, effects={"chrage"})
    with pytest.raises(ds.DefinitionError, match="not one string"):
        DurableAgent(agent, effects="charge")


def test_history_in_the_state_carries_the_conversation_across_turns(tmp_path: Path) -> None:
    """With state=, each turn's step sees the earlier turns' messages, stored as JSON."""
    seen: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(len(messages))
        return ModelResponse(parts=[TextPart(f"reply {len(messages)}")])

    durable = DurableAgent(Agent(FunctionModel(model)))
    wf = ds.Workflow("chat", store=ds.LocalStore(tmp_path), until=lambda s: s["turn"] == 3)

    snapshots: list[Any] = []

    @wf.step()
    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        result = await durable.run(f"question {state['turn']}", ctx=ctx, state=state)
        state["replies"].append(result.output)
        state["turn"] += 1
        snapshots.append(_delta.snapshot(state))

    final = asyncio.run(wf.arun("r", {"turn": 0, "replies": []}))
    assert final["replies"] == ["reply 1", "reply 3", "reply 5"]
    assert seen == [1, 3, 5]
    assert json.loads(json.dumps(final["messages"])) == final["messages"]
    assert len(final["messages"]) == 6
    # The stored history re-dumps to the same JSON: each turn is an append (format 2
    # writes the new messages only, not the whole conversation again).
    ops = _delta.diff(snapshots[1], snapshots[2])
    assert [op[0] for op in ops if op[1] == ["messages"]] == ["ext"]


def test_state_and_message_history_together_are_refused(tmp_path: Path) -> None:
    """state= and message_history= both given is ambiguous: a DefinitionError naming the step."""
    durable = DurableAgent(Agent(scripted([])))
    wf = ds.Workflow("both", store=ds.LocalStore(tmp_path))

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        durable.run_sync("hi", ctx=ctx, state=state, message_history=[])

    with pytest.raises(ds.StepFailed) as failed:
        wf.run("r", {})
    assert "pass state= or message_history=, not both" in str(failed.value.__cause__)


def test_test_model_tools_repeat_ids_and_two_agent_runs_in_one_step(tmp_path: Path) -> None:
    """TestModel (which reuses tool call ids) and a second agent run in the same step
    get names of their own; a retry replays both runs without calling the tools again.
    """
    fired: list[str] = []
    agent = Agent(TestModel(call_tools=["charge"]))

    @agent.tool
    def charge(run_ctx: RunContext[None], amount: int) -> str:
        fired.append(idempotency_key(run_ctx))
        return "charged"

    durable = DurableAgent(agent, effects={"charge"})
    names: list[str | None] = []
    wf = ds.Workflow(
        "two-runs",
        store=ds.LocalStore(tmp_path),
        on_event=[lambda e: names.append(e.call) if e.kind == "call_recorded" else None],
    )

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["a"] = durable.run_sync("one", ctx=ctx).output
        state["b"] = durable.run_sync("two", ctx=ctx).output
        if ctx.attempt == 1:
            raise RuntimeError("retry")

    final = wf.run("r", {})
    assert final["a"] == final["b"]
    assert len(fired) == 2
    assert len(set(fired)) == 2
    assert names == [
        "model:1",
        "tool:pyd_ai_tool_call_id__charge",
        "model:2",
        "agent2:model:1",
        "agent2:tool:pyd_ai_tool_call_id__charge",
        "agent2:model:2",
    ]


def test_a_model_retry_from_a_tool_is_recorded_and_replayed(tmp_path: Path) -> None:
    """A tool's ModelRetry is recorded: a retried step tells the model again, without the tool."""
    tries: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        n = sum(isinstance(m, ModelResponse) for m in messages)
        if n < 2:
            return ModelResponse(parts=[ToolCallPart("find", {"q": "x"}, tool_call_id=f"f{n}")])
        return ModelResponse(parts=[TextPart("found")])

    agent = Agent(FunctionModel(model))

    @agent.tool_plain
    def find(q: str) -> str:
        tries.append(1)
        if len(tries) == 1:
            raise ModelRetry("try again")
        return "it"

    durable = DurableAgent(agent)
    wf = ds.Workflow("model-retry", store=ds.LocalStore(tmp_path))

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = durable.run_sync("find x", ctx=ctx).output
        if ctx.attempt == 1:
            raise RuntimeError("retry")

    assert wf.run("r", {})["out"] == "found"
    assert len(tries) == 2


def test_a_streamed_request_is_recorded_and_its_events_replay(tmp_path: Path) -> None:
    """With an event_stream_handler the request streams; the handler sees the same
    events when the step is retried, and the model is not asked again.
    """
    calls: list[int] = []

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> Any:
        calls.append(1)
        yield "hello "
        yield "world"

    agent = Agent(FunctionModel(stream_function=stream))
    durable = DurableAgent(agent)
    events: list[list[str]] = []

    async def handler(run_ctx: RunContext[None], stream_events: Any) -> None:
        events[-1].extend([type(e).__name__ async for e in stream_events])

    wf = ds.Workflow("stream", store=ds.LocalStore(tmp_path))

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        events.append([])
        result = await durable.run("hi", ctx=ctx, event_stream_handler=handler)
        state["out"] = result.output
        if ctx.attempt == 1:
            raise RuntimeError("retry")

    assert asyncio.run(wf.arun("r", {}))["out"] == "hello world"
    assert len(calls) == 1
    assert events[0] == events[1]
    assert "PartStartEvent" in events[0]


def test_outside_a_step_the_agent_runs_as_it_always_did() -> None:
    """The agent itself is untouched: run directly it calls its model and tools as usual."""
    calls: list[int] = []
    agent = Agent(scripted(calls))

    @agent.tool_plain
    def charge(amount: int) -> str:
        return "charged"

    DurableAgent(agent, effects={"charge"})
    assert agent.run_sync("charge me").output == "ok ['charged']"
    assert len(calls) == 2


def test_import_durable_steps_does_not_import_pydantic_ai() -> None:
    """The core never imports the extra: `import durable_steps` (its worker and CLI too)
    leaves pydantic_ai and pydantic unloaded.
    """
    code = (
        "import sys, durable_steps, durable_steps.worker, durable_steps.cli\n"
        "durable_steps.cli.build_parser()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pydantic_ai', 'pydantic')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Crash(BaseException):
    """Ends a tool like a kill: not an Exception, so nothing catches it."""


def test_an_effect_tool_in_doubt_raises_and_resolve_gives_the_model_its_result(
    tmp_path: Path,
) -> None:
    """in_doubt='raise' names the effect tool in doubt; resolve(fired=True, result=...)
    hands the model that result as the tool's return, without firing it again.
    """
    fired: list[str] = []
    agent = Agent(scripted([]))

    @agent.tool
    def charge(run_ctx: RunContext[None], amount: int) -> str:
        fired.append(idempotency_key(run_ctx))
        raise Crash

    durable = DurableAgent(agent, effects={"charge"})
    wf = ds.Workflow("doubt", store=ds.LocalStore(tmp_path))

    @wf.step(in_doubt="raise")
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = durable.run_sync("charge me", ctx=ctx).output

    with pytest.raises(Crash):
        wf.run("r", {})
    with pytest.raises(ds.StepInDoubt) as info:
        wf.run("r", {})
    assert info.value.effect == "tool:k1"
    assert info.value.key == fired[0]
    wf.resolve("r", fired=True, result="charged 5 (by hand)")
    assert wf.run("r")["out"] == "ok ['charged 5 (by hand)']"
    assert len(fired) == 1


def test_a_reused_tool_call_id_and_a_tool_return_are_recorded_apart_and_rebuilt(
    tmp_path: Path,
) -> None:
    """A model reusing a tool call id in a later response gets a second record, and a
    ToolReturn comes back a ToolReturn on replay; a retried step calls no tool again.
    """
    tools: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        n = sum(isinstance(m, ModelResponse) for m in messages)
        if n < 2:
            return ModelResponse(parts=[ToolCallPart("look", {"q": str(n)}, tool_call_id="same")])
        return ModelResponse(parts=[TextPart("seen")])

    agent = Agent(FunctionModel(model))

    @agent.tool_plain
    def look(q: str) -> ToolReturn:
        tools.append(q)
        return ToolReturn(return_value=f"looked {q}", metadata={"q": q})

    durable = DurableAgent(agent)
    names: list[str | None] = []
    wf = ds.Workflow(
        "reused",
        store=ds.LocalStore(tmp_path),
        on_event=[lambda e: names.append(e.call) if e.kind == "call_recorded" else None],
    )
    returns: list[list[Any]] = []

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        result = durable.run_sync("look twice", ctx=ctx)
        returns.append(
            [
                (p.content, p.metadata)
                for m in result.all_messages()
                if isinstance(m, ModelRequest)
                for p in m.parts
                if isinstance(p, ToolReturnPart)
            ]
        )
        if ctx.attempt == 1:
            raise RuntimeError("retry")

    wf.run("r", {})
    assert tools == ["0", "1"]
    assert names == ["model:1", "tool:same", "model:2", "tool:same@2", "model:3"]
    assert returns[0] == returns[1] == [("looked 0", {"q": "0"}), ("looked 1", {"q": "1"})]


def test_a_step_called_by_hand_runs_the_agent_with_keys_for_its_effects() -> None:
    """With a hand-made Context (a unit test of the step), the agent just runs; effect
    tools still get a key, and state= still keeps the history.
    """
    keys: list[str] = []
    agent = Agent(scripted([]))

    @agent.tool
    def charge(run_ctx: RunContext[None], amount: int) -> str:
        keys.append(idempotency_key(run_ctx))
        return "charged"

    state: dict[str, Any] = {}
    result = DurableAgent(agent, effects={"charge"}).run_sync(
        "charge me", ctx=ds.Context("r", "wf", "turn", 0, 1, "ds-key"), state=state
    )
    assert result.output == "ok ['charged']"
    assert keys[0].startswith("ds-")
    assert len(state["messages"]) == 4


def test_a_tool_result_that_is_not_json_names_the_tool_step_and_run(tmp_path: Path) -> None:
    """A tool returning an object JSON cannot hold fails the step with a SerializationError
    naming the tool, the step and the run, and saying the effect will re-fire under its key.
    """
    agent = Agent(scripted([]))

    @agent.tool_plain
    def charge(amount: int) -> object:
        return object()

    durable = DurableAgent(agent, effects={"charge"})
    wf = ds.Workflow("not-json", store=ds.LocalStore(tmp_path))

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        durable.run_sync("charge me", ctx=ctx)

    with pytest.raises(ds.StepFailed) as failed:
        wf.run("r", {})
    cause = failed.value.__cause__
    assert isinstance(cause, ds.SerializationError)
    assert "run not-json/r: step 'turn': the result of tool 'charge'" in str(cause)
    assert "same idempotency key" in str(cause)
