"""Model requests an agent framework retries or moves to another model, then a re-run.

Retried requests.

The failed try records nothing; its retry is recorded as ``model:N.2``. A
re-run of the step (here: the step's own retry, which replays the journal as
a resume does; ``tests/test_pydantic_ai_crash.py`` kills real processes) must
replay the try that succeeded. It used to ask for response N anew: a fresh
answer, the run going on from it, and the refund the recorded answer had
asked for fired again under another key.

Other models. pydantic-ai's ``ModelFallback`` and ``SelectModel`` capabilities
pick the model of each request, which DurableAgent (whose model is the one
it records) cannot record: they are refused, saying what to use instead;
a ``FallbackModel`` as the agent's model is recorded whole.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")
pytest.importorskip("agents")

import pydantic_ai.capabilities as pydantic_ai_capabilities
from agents import Agent as SDKAgent
from agents import ModelResponse as SDKResponse
from agents import ModelSettings, RunContextWrapper, function_tool, set_tracing_disabled
from agents.models.interface import Model as SDKModel
from agents.retry import ModelRetrySettings
from pydantic_ai import Agent, ModelResponse, ModelRetry, RunContext
from pydantic_ai.capabilities import AbstractCapability, SelectModel
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, TextPart, ToolCallPart
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.function import AgentInfo, FunctionModel

import durable_steps as ds
from durable_steps.integrations import openai_agents, pydantic_ai
from durable_steps.integrations._names import response_name
from tests.pydaiscenes import RETRIES, RetryOnOverload
from tests.sdkscript import message, response, told, tool_call
from tests.test_pydantic_ai_parity import retried

pytestmark = [pytest.mark.pydantic_ai, pytest.mark.openai_agents]
NEEDS_RETRIES = pytest.mark.skipif(not RETRIES, reason="a pydantic-ai without RetryModelRequest")
if RETRIES:
    from pydantic_ai.exceptions import ModelOverloadedError
set_tracing_disabled(True)  # no trace export to OpenAI from a test


def test_the_first_try_of_a_response_takes_the_name_of_the_try_recorded() -> None:
    recorded = {"model:1", "agent2:model:3.4"}.__contains__
    assert response_name("", 1, 0, recorded) == "model:1"
    assert response_name("", 2, 0, recorded) == "model:2"  # none recorded: asked anew
    assert response_name("", 2, 1, recorded) == "model:2.2"  # a retry in this attempt
    assert response_name("agent2:", 3, 0, recorded) == "agent2:model:3.4"  # replayed


def refunding(agent: Agent[None, str]) -> tuple[pydantic_ai.DurableAgent, list[str]]:
    """``agent`` with an effect tool ``refund``, wrapped; the keys it fired under."""
    keys: list[str] = []

    @agent.tool
    def refund(run_ctx: RunContext[None], cents: int = 0) -> str:
        keys.append(pydantic_ai.idempotency_key(run_ctx))
        return "ok"

    return pydantic_ai.DurableAgent(agent, effects={"refund"}), keys


@NEEDS_RETRIES
def test_pydantic_ai_a_retried_request_replays_and_fires_its_effect_once(
    tmp_path: Any,
) -> None:
    requests: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests.append(len(messages))
        if len(requests) == 1:
            raise ModelOverloadedError("function", "overloaded, try again")
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("refund", {"cents": 500}, tool_call_id="c1")])
        return ModelResponse(parts=[TextPart("refunded")])

    agent = Agent(FunctionModel(model), capabilities=[RetryOnOverload()])
    durable, keys = refunding(agent)

    async def run(ctx: ds.Context) -> tuple[str, int, int, int]:
        result = await durable.run("refund order 1", ctx=ctx)
        usage = result.usage
        return (result.output, usage.requests, usage.tool_calls, len(result.all_messages()))

    seen = retried(tmp_path, run)
    plain = ("refunded", 2, 1, 4)  # what the plain agent gives (the failed try counts nothing)
    assert seen == [plain, plain]
    assert len(requests) == 3  # the failed try, its retry, the answer: none asked again
    assert len(keys) == 1  # the refund fired once


def test_openai_agents_an_sdk_retried_response_replays_and_fires_its_effect_once(
    tmp_path: Any,
) -> None:
    class Flaky(SDKModel):
        """Fails its first response once, then asks for a refund, then answers."""

        calls = 0

        async def get_response(
            self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
        ) -> SDKResponse:
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise ConnectionError("connection reset by the provider")
            if not told(input):  # a fresh answer would carry a new call id
                return response([tool_call("refund", {"cents": 500}, f"call_{Flaky.calls}")])
            return response([message("refunded")])

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    keys: list[str] = []

    @function_tool
    def refund(tool_ctx: RunContextWrapper[Any], cents: int) -> str:
        keys.append(openai_agents.idempotency_key(tool_ctx))
        return "ok"

    settings = ModelSettings(retry=ModelRetrySettings(max_retries=2, policy=lambda _: True))
    agent = SDKAgent(name="desk", model=Flaky(), tools=[refund], model_settings=settings)
    runner = openai_agents.DurableRunner(effects={"refund"})

    async def run(ctx: ds.Context) -> str:
        return str((await runner.run(agent, "refund order 1", ctx=ctx)).final_output)

    assert retried(tmp_path, run) == ["refunded", "refunded"]
    assert Flaky.calls == 3  # the failed try, its retry, the answer: none asked again
    assert len(keys) == 1


def test_pydantic_ai_capabilities_that_pick_the_model_are_refused(tmp_path: Any) -> None:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart("hi")])

    backup = FunctionModel(answer)
    fallback = getattr(pydantic_ai_capabilities, "ModelFallback", None)  # not in 2.54
    choosers = [SelectModel(lambda _: backup), *([fallback(backup)] if fallback else [])]
    for capability in choosers:
        agent = Agent(FunctionModel(answer), capabilities=[capability])
        with pytest.raises(ds.DefinitionError, match=type(capability).__name__) as refused:
            pydantic_ai.DurableAgent(agent)
        assert "FallbackModel" in str(refused.value)
    durable = pydantic_ai.DurableAgent(Agent(FunctionModel(answer)))
    wf = ds.Workflow("chooser", store=ds.LocalStore(tmp_path))

    @wf.step()
    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        await durable.run("hi", ctx=ctx, capabilities=[SelectModel(lambda _: backup)])

    with pytest.raises(ds.StepFailed) as failed:
        asyncio.run(wf.arun("r1", {}))
    assert "SelectModel" in str(failed.value.__cause__)
    assert "chooser/r1" in str(failed.value.__cause__)


def test_pydantic_ai_a_fallback_model_is_recorded_whole(tmp_path: Any) -> None:
    """The primary refuses, the backup answers a tool call with a fresh id each time:
    replayed, the backup is not asked again and the refund fires once."""
    asked: list[str] = []

    def primary(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append("primary")
        raise ModelHTTPError(503, "primary", "overloaded")

    def backup(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append("backup")
        if len(messages) == 1:
            call = ToolCallPart("refund", {"cents": 5}, tool_call_id=f"call_{len(asked)}")
            return ModelResponse(parts=[call])
        return ModelResponse(parts=[TextPart("refunded")])

    agent = Agent(FallbackModel(FunctionModel(primary), FunctionModel(backup)))
    durable, keys = refunding(agent)

    async def run(ctx: ds.Context) -> str:
        return (await durable.run("refund", ctx=ctx)).output

    assert retried(tmp_path, run) == ["refunded", "refunded"]
    assert asked.count("backup") == 2  # the two requests, once each
    assert len(keys) == 1


class Recover(AbstractCapability[None]):
    """Answers a refused request itself (``answer``) or asks the model again (``retry``):
    no new try of that request, so the next request is a new one."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def on_model_request_error(
        self, ctx: Any, *, request_context: Any, error: Exception
    ) -> Any:
        if not isinstance(error, ModelHTTPError):
            raise error
        if self.how == "answer":
            return ModelResponse(parts=[ToolCallPart("lookup", {}, tool_call_id="c0")])
        raise ModelRetry("shorter, please")


@pytest.mark.parametrize("how", ["answer", "retry"])
def test_pydantic_ai_a_failure_a_hook_answered_is_no_retry_and_replays_as_it_ran(
    tmp_path: Any, how: str
) -> None:
    """The first request always fails and a hook answers it: the request after is a new
    request (model:2), not a retry of the failed one, and the replay gives what the
    attempt that ran gave: the same messages, the refund once."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1 and len(messages[0].parts) == 1:  # (told to retry: two)
            raise ModelHTTPError(400, "function", "the prompt is too long")
        asked = [p for m in messages for p in m.parts if isinstance(p, ToolCallPart)]
        if not any(p.tool_name == "refund" for p in asked):
            return ModelResponse(parts=[ToolCallPart("refund", {}, tool_call_id="r1")])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), capabilities=[Recover(how)])

    @agent.tool_plain
    def lookup() -> str:
        return "found"

    durable, keys = refunding(agent)

    async def run(ctx: ds.Context) -> list[str]:
        result = await durable.run("go", ctx=ctx)
        return [p.part_kind for m in result.all_messages() for p in m.parts]

    seen = retried(tmp_path, run)
    assert seen[0] == seen[1]
    # told to retry (pydantic-ai 2.6x: a retry-feedback part; 2.54: a retry-prompt), or
    # answered by the hook with a lookup
    shape = ["user-prompt", "retry"] if how == "retry" else ["user-prompt", "tool-call"]
    assert [
        kind.split("-")[0] if kind.startswith("retry") else kind for kind in seen[0][:2]
    ] == shape
    assert len(keys) == 1
