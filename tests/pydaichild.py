"""A child process that runs a pydantic-ai agent in a workflow and SIGKILLs itself on cue.

Run it by path::

    python tests/pydaichild.py --store DIR --run RUN_ID --log DIR [--crash CUE] [--mode sync|async]

The workflow ``support`` has one step, ``turn``, run once per turn (two
turns, ``until``): a :class:`DurableAgent` over pydantic-ai's own
``FunctionModel``, its history kept in ``state["messages"]``. Turn 0 makes
three model requests: the first asks for ``lookup`` (a read), the second
for ``refund`` and ``notify`` together (two effects, run concurrently), the
third answers. Turn 1 makes one request, whose answer quotes the history.

What really happened is appended (and fsynced) to files in ``--log``:
``models`` (``<turn>:<request>`` per call of the model function),
``lookup`` (one line per call), ``ledger`` (``<tool>:<idempotency key>``
per effect fired: the "payment API").

``--crash`` picks where the process dies with SIGKILL (``T`` is the turn):
``model:N:T`` (inside the N-th model request, in flight), ``tool:NAME:T``
(inside tool NAME, after its side effect), ``recorded:CALL:T`` (right after
journaled call CALL was written, e.g. ``recorded:model:1:0``).

On success it prints the final state as JSON on stdout and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import durable_steps as ds
from durable_steps.integrations.pydantic_ai import DurableAgent, idempotency_key

PROMPTS = ("refund order 42", "what did you do?")


def note(path: Path, line: str) -> None:
    """Append ``line`` durably: it must survive the SIGKILL that may follow."""
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> list[str]:
    """The lines of a log file (none if it does not exist)."""
    return path.read_text().splitlines() if path.exists() else []


def tool_returns(messages: list[ModelMessage]) -> dict[str, Any]:
    """The tool results so far, by tool name."""
    return {
        part.tool_name: part.content
        for m in messages
        if isinstance(m, ModelRequest)
        for part in m.parts
        if isinstance(part, ToolReturnPart)
    }


def build(log: Path, crash: str | None) -> tuple[Callable[..., Any], ...]:
    """The step (sync, async) and the event subscriber that kills on cue."""
    where = crash.rsplit(":", 1) if crash else ["", "-1"]
    cue, cue_turn = where[0], int(where[1])
    turn_now = {"turn": -1}

    def kill_if(point: str) -> None:
        if point == cue and turn_now["turn"] == cue_turn:
            os.kill(os.getpid(), signal.SIGKILL)

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        # The request number within this turn: responses since the last user prompt.
        last_prompt = max(
            i
            for i, m in enumerate(messages)
            if isinstance(m, ModelRequest) and any(isinstance(p, UserPromptPart) for p in m.parts)
        )
        n = 1 + sum(isinstance(m, ModelResponse) for m in messages[last_prompt:])
        turn = turn_now["turn"]
        note(log / "models", f"{turn}:{n}")
        kill_if(f"model:{n}")
        if turn == 1:
            earlier = [
                p.content
                for m in messages[:last_prompt]
                if isinstance(m, ModelResponse)
                for p in m.parts
                if isinstance(p, TextPart)
            ]
            return ModelResponse(parts=[TextPart(f"{len(messages)} messages; I said: {earlier}")])
        results = tool_returns(messages)
        if n == 1:
            return ModelResponse(parts=[ToolCallPart("lookup", {"order": 42}, tool_call_id="c1")])
        if n == 2:
            amount = results["lookup"]["total"] // 4
            return ModelResponse(
                parts=[
                    ToolCallPart("refund", {"amount": amount}, tool_call_id="c2"),
                    ToolCallPart("notify", {"text": f"refund of {amount}"}, tool_call_id="c3"),
                ]
            )
        return ModelResponse(parts=[TextPart(f"done: {results['refund']}, {results['notify']}")])

    agent = Agent(FunctionModel(model))

    @agent.tool
    def lookup(run_ctx: RunContext[None], order: int) -> dict[str, int]:
        note(log / "lookup", str(order))
        kill_if("tool:lookup")
        return {"order": order, "total": 20}

    @agent.tool
    def refund(run_ctx: RunContext[None], amount: int) -> str:
        key = idempotency_key(run_ctx)
        note(log / "ledger", f"refund:{key}")
        kill_if("tool:refund")
        return f"refunded {amount}"

    @agent.tool
    async def notify(run_ctx: RunContext[None], text: str) -> str:
        key = idempotency_key(run_ctx)
        note(log / "ledger", f"notify:{key}")
        kill_if("tool:notify")
        return "sent"

    durable = DurableAgent(agent, effects={"refund", "notify"})

    def on_event(event: ds.Event) -> None:
        if event.kind == "call_recorded":
            kill_if(f"recorded:{event.call}")

    def turn_sync(state: dict[str, Any], ctx: ds.Context) -> None:
        turn_now["turn"] = state["turn"]
        result = durable.run_sync(PROMPTS[state["turn"]], ctx=ctx, state=state)
        state["answers"].append(result.output)
        state["turn"] += 1

    async def turn_async(state: dict[str, Any], ctx: ds.Context) -> None:
        turn_now["turn"] = state["turn"]
        result = await durable.run(PROMPTS[state["turn"]], ctx=ctx, state=state)
        state["answers"].append(result.output)
        state["turn"] += 1

    return turn_sync, turn_async, on_event


def main() -> int:
    """Run (or resume) the workflow; print the final state."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--crash")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    args = parser.parse_args()
    turn_sync, turn_async, on_event = build(args.log, args.crash)
    step = ds.step(turn_sync if args.mode == "sync" else turn_async, name="turn")
    wf = ds.Workflow(
        "support",
        steps=[step],
        store=args.store,
        until=lambda s: s["turn"] >= len(PROMPTS),
        on_event=[on_event],
    )
    initial = {"turn": 0, "answers": []}
    if args.mode == "sync":
        final = wf.run(args.run, initial)
    else:
        final = asyncio.run(wf.arun(args.run, initial))
    json.dump(final, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
