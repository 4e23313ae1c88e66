"""pydantic-ai scenarios run plainly and through DurableAgent, and a child that crashes them.

``build(scene)`` makes a fresh agent on a scripted ``FunctionModel``, its
``DurableAgent`` and a dict counting the model's calls (and the live tool's):

``tools``       a read tool, then the answer.
``multimodal``  three tools in one response, returning a pydantic model, a
                ``BinaryImage`` and a ``DocumentUrl``; then the answer.
``subagent``    a tool that delegates to another agent with ``usage=run_ctx.usage``
                (two requests of its own: four in the run).
``live``        a live tool that changes ``deps``, which picks the toolset of the
                next response's tool (a dynamic toolset).
``stream``      a streamed tool call, then the answer in three pieces, with an
                ``event_stream_handler`` (its events are part of the outcome).
``self``        a tool that runs the same agent plainly (``agent.run`` on another
                prompt, which answers at once): three requests in the run.
``tags``        a tool returning a pydantic model with a ``set`` field (dumped in
                hash order, which differs between processes).
``overload``    ``tools``, but the run's very first model request is refused
                (``ModelOverloadedError``, once: a marker file) and retried by a
                capability (pydantic-ai's ``RetryModelRequest`` pattern).
``answered``    ``tools``, but the run's very first model request fails (a 503, once: a
                marker file) and an ``on_model_request_error`` hook answers it with a
                lookup of its own (order 7; the model itself would ask for order 42).

Run as a script, it is the child of ``tests/test_pydantic_ai_crash.py``::

    python tests/pydaiscenes.py --store DIR --run ID --scene S [--crash]

With ``--crash`` it SIGKILLs itself right after the first tool call was
recorded; without, it prints the outcome (``outcome()``) as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import (
    BinaryImage,
    DocumentUrl,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.toolsets import FunctionToolset
from pydantic_core import to_jsonable_python

import durable_steps as ds
from durable_steps.integrations.pydantic_ai import DurableAgent
from tests.volatile import normalized

SCENES = (
    "tools",
    "multimodal",
    "subagent",
    "live",
    "stream",
    "self",
    "overload",
    "tags",
    "answered",
)


class Order(BaseModel):
    """A tool's typed result."""

    id: int
    total: int


class Tagged(BaseModel):
    """A typed result whose JSON order is the process's (a set)."""

    tags: set[str]


def _returns(messages: list[ModelMessage]) -> list[Any]:
    return [
        p.content
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]


try:  # a request retried by a hook: pydantic-ai 2.6x (not in 2.54, which 3.10 gets)
    from pydantic_ai import RetryModelRequest
    from pydantic_ai.exceptions import ModelOverloadedError
except ImportError:
    RETRIES = False
else:
    RETRIES = True


class RetryOnOverload(AbstractCapability[Any]):
    """Retry a request the provider refused as overloaded (pydantic-ai's documented way)."""

    async def on_model_request_error(
        self, ctx: Any, *, request_context: Any, error: Exception
    ) -> Any:
        if isinstance(error, ModelOverloadedError):
            raise RetryModelRequest()
        raise error


class AnswerOn503(AbstractCapability[Any]):
    """Answer a request the provider failed (a 503) with a response of its own."""

    async def on_model_request_error(
        self, ctx: Any, *, request_context: Any, error: Exception
    ) -> Any:
        if isinstance(error, ModelHTTPError) and error.status_code == 503:
            return ModelResponse(parts=[ToolCallPart("lookup", {"order": 7}, tool_call_id="h1")])
        raise error


def build(
    scene: str, overloaded: Path | None = None
) -> tuple[Agent[Any, Any], DurableAgent, dict[str, int]]:
    """A fresh agent for ``scene``, its DurableAgent, and its call counts.
    ``overloaded``: the marker file of scenes ``overload`` and ``answered`` (made by
    their refusal).
    """
    calls = {"model": 0, "live": 0}
    responses = {  # request number -> response, per scene
        "tools": [ToolCallPart("lookup", {"order": 42}, tool_call_id="c1")],
        "overload": [ToolCallPart("lookup", {"order": 42}, tool_call_id="c1")],
        "answered": [ToolCallPart("lookup", {"order": 42}, tool_call_id="c1")],
        "tags": [ToolCallPart("tag", {}, tool_call_id="c1")],
        "multimodal": [
            ToolCallPart("order", {"id": 42}, tool_call_id="c1"),
            ToolCallPart("picture", {}, tool_call_id="c2"),
            ToolCallPart("manual", {}, tool_call_id="c3"),
        ],
        "subagent": [ToolCallPart("delegate", {"task": "count"}, tool_call_id="c1")],
        "live": [ToolCallPart("elevate", {}, tool_call_id="c1")],
        "self": [ToolCallPart("ask_myself", {"task": "inner"}, tool_call_id="c1")],
    }

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        if scene == "overload" and overloaded is not None and not overloaded.exists():
            overloaded.touch()
            raise ModelOverloadedError("function", "overloaded, try again")
        if scene == "answered" and overloaded is not None and not overloaded.exists():
            overloaded.touch()
            raise ModelHTTPError(503, "function", "busy")
        asked = sum(isinstance(m, ModelResponse) for m in messages)
        first = messages[0].parts[-1]
        if scene == "self" and getattr(first, "content", None) == "inner":
            return ModelResponse(parts=[TextPart(f"inner answer after {asked}")])
        if asked == 0:
            return ModelResponse(parts=list(responses[scene]))
        if scene == "live" and asked == 1:
            return ModelResponse(parts=[ToolCallPart("admin_action", {}, tool_call_id="c2")])
        shown = [r if isinstance(r, (str, dict)) else type(r).__name__ for r in _returns(messages)]
        return ModelResponse(parts=[TextPart(f"done: {shown}")])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
        calls["model"] += 1
        if len(messages) == 1:
            yield {0: DeltaToolCall(name="lookup", tool_call_id="c1")}
            yield {0: DeltaToolCall(json_args='{"order": ')}
            yield {0: DeltaToolCall(json_args="42}")}
            return
        for piece in ("the total ", "is ", "20"):
            yield piece

    capabilities: list[AbstractCapability[Any]] = []
    if scene in ("overload", "answered"):
        capabilities.append(RetryOnOverload() if scene == "overload" else AnswerOn503())
    agent: Agent[Any, Any] = Agent(
        FunctionModel(model, stream_function=stream), deps_type=dict, capabilities=capabilities
    )
    live: set[str] = set()

    @agent.tool_plain
    def lookup(order: int) -> dict[str, int]:
        return {"order": order, "total": 20}

    if scene == "multimodal":

        @agent.tool_plain
        def order(id: int) -> Order:
            return Order(id=id, total=20)

        @agent.tool_plain
        def picture() -> Any:  # no annotation: the type is recorded with the result
            return BinaryImage(data=b"\x89PNG\x00\xff", media_type="image/png")

        @agent.tool_plain
        def manual() -> DocumentUrl:
            return DocumentUrl(url="https://example.com/manual.pdf")

    if scene == "tags":

        @agent.tool_plain
        def tag() -> Tagged:
            return Tagged(tags={f"tag{i}" for i in range(12)})

    if scene == "subagent":
        sub = Agent(FunctionModel(_sub_model))

        @sub.tool_plain
        def count() -> int:
            return 3

        @agent.tool
        async def delegate(run_ctx: RunContext[Any], task: str) -> str:
            return (await sub.run(task, usage=run_ctx.usage)).output

    if scene == "self":

        @agent.tool
        async def ask_myself(run_ctx: RunContext[Any], task: str) -> str:
            return (await agent.run(task, deps=run_ctx.deps, usage=run_ctx.usage)).output

    if scene == "live":
        live = {"elevate"}
        admin: FunctionToolset[Any] = FunctionToolset()

        @admin.tool_plain
        def admin_action() -> str:
            return "admin done"

        @agent.tool
        def elevate(run_ctx: RunContext[dict[str, str]]) -> str:
            calls["live"] += 1
            run_ctx.deps["mode"] = "admin"
            return "elevated"

        @agent.toolset
        def by_mode(run_ctx: RunContext[dict[str, str]]) -> FunctionToolset[Any] | None:
            return admin if run_ctx.deps.get("mode") == "admin" else None

    return agent, DurableAgent(agent, live=live), calls


def _sub_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("count", {}, tool_call_id="s1")])
    return ModelResponse(parts=[TextPart(f"counted {_returns(messages)}")])


def norm_messages(messages: list[ModelMessage]) -> Any:
    """The messages as JSON, without what differs between any two runs (``normalized``)."""
    return normalized(ModelMessagesTypeAdapter.dump_python(messages, mode="json"))


def norm_events(events: list[Any]) -> list[Any]:
    """Events as ``[kind, JSON]``, without what differs between any two runs."""
    out: list[Any] = []
    for event in events:
        name = type(event).__name__
        if name == "AgentRunResultEvent":
            out.append([name, event.result.output])
        else:
            out.append([name, normalized(event)])
    return out


def usage_of(result: Any) -> dict[str, Any]:
    """A run's usage as a dict."""
    return dict(to_jsonable_python(result.usage))


async def outcome(
    agent: Agent[Any, Any] | DurableAgent, scene: str, ctx: ds.Context | None = None
) -> dict[str, Any]:
    """Run ``scene`` plainly (``ctx=None``) or durably: output, messages, usage, events."""
    events: list[Any] = []

    async def handler(run_ctx: RunContext[Any], stream: AsyncIterator[Any]) -> None:
        events.extend([e async for e in stream])

    kwargs: dict[str, Any] = {"deps": {"mode": "basic"}}
    if scene == "stream":
        kwargs["event_stream_handler"] = handler
    if ctx is not None:
        assert isinstance(agent, DurableAgent)
        result = await agent.run("go", ctx=ctx, **kwargs)
    else:
        assert isinstance(agent, Agent)
        result = await agent.run("go", **kwargs)
    return {
        "output": result.output,
        "messages": norm_messages(result.all_messages()),
        "usage": usage_of(result),
        "events": norm_events(events),
    }


def main() -> int:
    """Run (or resume) one scene in a workflow; print its outcome."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--scene", choices=SCENES, required=True)
    parser.add_argument("--crash", action="store_true")
    args = parser.parse_args()
    _, durable, calls = build(args.scene, Path(args.store).parent / "overloaded")

    def on_event(event: ds.Event) -> None:
        if args.crash and event.kind == "call_recorded" and "tool:" in (event.call or ""):
            os.kill(os.getpid(), signal.SIGKILL)

    wf = ds.Workflow("scenes", store=args.store, on_event=[on_event])

    @wf.step()
    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["outcome"] = await outcome(durable, args.scene, ctx)
        state["model_calls"] = calls["model"]

    final = asyncio.run(wf.arun(args.run, {}))
    json.dump(final, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
