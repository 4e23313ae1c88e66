"""Tool calls whose ids are longer than a journal name may be.

Providers choose tool call ids, and some make them hundreds of characters
long. Both agent integrations record a tool call under its id; a long id is
shortened to its head and a digest (``durable_steps.integrations._names``).
These tests give each integration ids of 500 characters that differ only at
their very end, and check that each call is recorded apart, replayed on a
step's retry, and fired once as an effect under one key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")
pytest.importorskip("agents")

from agents import Agent as SDKAgent
from agents import ModelResponse as SDKResponse
from agents import RunContextWrapper, function_tool, set_tracing_disabled
from agents.models.interface import Model as SDKModel
from pydantic_ai import Agent, RunContext
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
from durable_steps._execution.journal import MAX_NAME
from durable_steps.integrations import openai_agents, pydantic_ai
from durable_steps.integrations._names import tool_call_name
from tests.sdkscript import message, response, told, tool_call
from tests.storetools import rewrite_header
from tests.test_pydantic_ai_parity import retried

HEAD = "call_" + "x" * 495
"""Two ids sharing their first 500 characters: only a digest of the whole tells them apart."""
IDS = (HEAD + "A", HEAD + "B")
pytestmark = [pytest.mark.pydantic_ai, pytest.mark.openai_agents]
RETRY = ds.Retry(attempts=2, wait=0, on=RuntimeError)
set_tracing_disabled(True)  # no trace export to OpenAI from a test


def test_a_long_id_is_shortened_the_same_way_every_time_and_kept_apart() -> None:
    short = "call_abc"
    assert tool_call_name("", short) == "tool:call_abc"  # unchanged, as earlier versions named it
    names = [tool_call_name("agent2:", i) for i in IDS]
    assert names == [tool_call_name("agent2:", i) for i in IDS]  # stable across calls
    assert names[0] != names[1]
    assert all(n.startswith("agent2:tool:call_xxx") and len(n) < MAX_NAME - 16 for n in names)
    # The longest name that fits is kept whole (an earlier version recorded it so: a
    # run in progress must find its records), and one more character is shortened.
    kept = "c" * (MAX_NAME - len("tool:"))
    assert tool_call_name("", kept) == f"tool:{kept}"
    longer = tool_call_name("", kept + "c")
    assert len(longer) < MAX_NAME
    assert longer.startswith("tool:cccc")
    # A suffix for a reused id stays at the end, and the whole still fits.
    again = tool_call_name("", kept, "@2")
    assert again.endswith("@2")
    assert len(again) <= MAX_NAME
    assert again != tool_call_name("", kept + "c", "@2")


def test_pydantic_ai_long_tool_call_ids_are_recorded_replayed_and_fired_once(
    tmp_path: Path,
) -> None:
    requests: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests.append(len(messages))
        returns = sorted(
            str(p.content)
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        )
        if not returns:
            calls = [
                ToolCallPart("refund", {"order": n}, tool_call_id=i) for n, i in enumerate(IDS)
            ]
            return ModelResponse(parts=calls)
        return ModelResponse(parts=[TextPart(" / ".join(returns))])

    agent = Agent(FunctionModel(model))
    fired: list[tuple[int, str]] = []

    @agent.tool
    def refund(run_ctx: RunContext[None], order: int) -> str:
        fired.append((order, pydantic_ai.idempotency_key(run_ctx)))
        return f"refunded {order}"

    durable = pydantic_ai.DurableAgent(agent, effects={"refund"})
    wf = ds.Workflow("long-ids", store=ds.LocalStore(tmp_path))
    outputs: list[str] = []

    @wf.step(retry=RETRY)
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        outputs.append(durable.run_sync("refund both", ctx=ctx).output)
        if ctx.attempt == 1:
            raise RuntimeError("after the agent run: the retry replays it")

    wf.run("r1", {})
    assert outputs == ["refunded 0 / refunded 1"] * 2
    assert len(requests) == 2  # each request made once, replayed on the retry
    assert sorted(order for order, _ in fired) == [0, 1]  # each effect once
    assert fired[0][1] != fired[1][1]  # under keys of their own


def test_openai_agents_long_call_ids_are_recorded_replayed_and_fired_once(
    tmp_path: Path,
) -> None:

    class TwoRefunds(SDKModel):
        """Asks for two refunds under long call ids, then answers with their results."""

        calls = 0

        async def get_response(
            self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
        ) -> SDKResponse:
            TwoRefunds.calls += 1
            results = told(input)
            if not results:
                calls = [tool_call("refund", {"order": n}, i, n) for n, i in enumerate(IDS)]
                return response(calls)
            return response([message(" / ".join(results))])

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    fired: list[tuple[int, str]] = []

    @function_tool
    def refund(tool_ctx: RunContextWrapper[Any], order: int) -> str:
        fired.append((order, openai_agents.idempotency_key(tool_ctx)))
        return f"refunded {order}"

    agent = SDKAgent(name="desk", model=TwoRefunds(), tools=[refund])
    runner = openai_agents.DurableRunner(effects={"refund"})

    async def run(ctx: ds.Context) -> str:
        return str((await runner.run(agent, "refund both", ctx=ctx)).final_output)

    assert retried(tmp_path, run) == ["refunded 0 / refunded 1"] * 2
    assert TwoRefunds.calls == 2  # each response made once, replayed on the retry
    assert sorted(order for order, _ in fired) == [0, 1]
    assert fired[0][1] != fired[1][1]


class AskTwoApprovals(SDKModel):
    """Asks for two refunds (tools that need approval) under long call ids, then
    answers with what came back."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> SDKResponse:
        results = told(input)
        if not results:
            return response([tool_call("refund", {"order": n}, i, n) for n, i in enumerate(IDS)])
        return response([message(" / ".join(results))])

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def approvals(store: ds.Store) -> tuple[ds.Workflow, list[int]]:
    """A workflow whose one step runs an agent that asks for two approved refunds."""
    fired: list[int] = []

    @function_tool(needs_approval=True)
    def refund(order: int) -> str:
        fired.append(order)
        return f"refunded {order}"

    agent = SDKAgent(name="desk", model=AskTwoApprovals(), tools=[refund])
    runner = openai_agents.DurableRunner(effects={"refund"})
    wf = ds.Workflow("long-approvals", store=store)

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["output"] = str(runner.run_sync(agent, "refund both", ctx=ctx).final_output)

    return wf, fired


def suspended(wf: ds.Workflow) -> str:
    with pytest.raises(ds.RunSuspended) as waiting:
        wf.run("r1", {})
    assert waiting.value.signal is not None
    return waiting.value.signal


def test_approvals_of_two_long_call_ids_are_asked_and_decided_apart() -> None:
    """Earlier versions cut both ids to one signal name: one signal decided both calls."""
    wf, fired = approvals(ds.MemoryStore())
    first = suspended(wf)
    assert wf.signal("r1", first, {"approved": True})
    second = suspended(wf)  # asked for under a name of its own
    assert second != first
    for name in (first, second):
        assert name.startswith("approve:call_xxx")
        assert len(f"signal:{name}") <= MAX_NAME
    assert wf.signal("r1", second, {"approved": False, "message": "not this one"})
    output = wf.run("r1", {})["output"]
    assert fired == [0]
    assert "refunded 0" in output
    assert "not this one" in output


def test_a_run_waiting_under_an_earlier_versions_name_goes_on_under_it() -> None:
    """A run that an earlier version suspended under the id cut at 180 characters (and
    no ``accepts``) is resumed by a signal under that name; the second call, which
    that name cannot tell apart from the first, is asked for under its own."""
    store = ds.MemoryStore()
    wf, fired = approvals(store)
    new = suspended(wf)
    legacy = f"approve:{IDS[0][:180]}"
    assert new != legacy
    key = "long-approvals/r1/checkpoint"
    found = store.get(key)
    assert found is not None
    wait = json.loads(found[0].partition(b"\n")[0])["wait"]
    assert wait["signal"] == new
    del wait["accepts"]
    rewrite_header(store, key, wait={**wait, "signal": legacy})  # as the earlier version wrote
    assert wf.signal("r1", legacy, True)
    second = suspended(wf)
    assert second not in (new, legacy)
    assert fired == []
    assert wf.signal("r1", second, True)
    assert "refunded 0 / refunded 1" in wf.run("r1", {})["output"]
    assert sorted(fired) == [0, 1]


def test_a_payload_an_earlier_versions_wait_took_is_not_received_and_may_be_corrected() -> None:
    """A wait recorded without ``accepts`` took any payload when sent; one that is not an
    approval reaches the step's wait, which takes an approval: it is not received, so
    the run waits again (it used to fail the step on every retry, suggesting a fork
    that re-runs model calls), and the approval sent then replaces it."""
    store = ds.MemoryStore()
    wf, fired = approvals(store)
    name = suspended(wf)
    key = "long-approvals/r1/checkpoint"
    found = store.get(key)
    assert found is not None
    wait = json.loads(found[0].partition(b"\n")[0])["wait"]
    del wait["accepts"]
    rewrite_header(store, key, wait=wait)  # as the earlier version wrote
    assert wf.signal("r1", name, "approve")  # unchecked: the wait says nothing
    assert suspended(wf) == name  # waits again for the same call, now saying what it takes
    found = store.get(key)
    assert found is not None
    assert json.loads(found[0].partition(b"\n")[0])["wait"]["accepts"] == "approval"
    with pytest.raises(ds.SignalRefused):
        wf.signal("r1", name, "approve")
    assert wf.signal("r1", name, {"approved": True})  # replaces the one that decided nothing
    second = suspended(wf)
    assert second != name
    assert wf.signal("r1", second, False)
    assert "refunded 0" in wf.run("r1", {})["output"]
    assert fired == [0]
