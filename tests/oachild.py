"""A child process that runs an OpenAI Agents SDK agent in a workflow and SIGKILLs itself on cue.

Run it by path::

    python tests/oachild.py --store DIR --run RUN_ID --log DIR --base-url URL
        [--crash CUE] [--mode sync|async|plain] [--approval] [--live TOOL] [--message TEXT]

The workflow ``support`` has one step, ``turn``: a :class:`DurableRunner`
runs ``triage``, which hands off (through a ``Handoff`` with an
``on_handoff`` callback) to ``billing``, which has two tools: ``lookup_order``
(a read) and ``refund`` (an effect; with ``--approval`` it needs approval).
Both agents talk to the scripted OpenAI server at ``--base-url`` over the
Responses API: ``triage`` by a model name its provider resolves, ``billing``
by a ``Model`` instance, so both ways the SDK finds a model are journaled.
``--mode plain`` runs the same agents with ``Runner.run``, no workflow.

What really happened is appended (and fsynced) to files in ``--log``:
``lookup`` (one line per call), ``ledger`` (``<order>:<idempotency key>`` per
refund fired: the "payment API"), ``handoffs``.

``--crash`` picks where the process dies with SIGKILL: ``recorded:CALL``
(right after journaled call CALL was written, e.g. ``recorded:model:1``),
``tool:refund`` (inside the refund, after its side effect), ``handoff``
(in the handoff's callback), ``waiting`` (once the run is suspended).

On success it prints a summary of the result as JSON on stdout and exits 0;
a suspended run prints ``{"suspended": SIGNAL}`` and exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    OpenAIProvider,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
    handoff,
    set_tracing_disabled,
)
from agents.usage import serialize_usage
from openai import AsyncOpenAI

import durable_steps as ds
from durable_steps.integrations.openai_agents import DurableRunner, idempotency_key

MESSAGE = "Order #1001 arrived broken. Please refund it."


def note(path: Path, line: str) -> None:
    """Append ``line`` durably: it must survive the SIGKILL that may follow."""
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def summary(result: Any) -> dict[str, Any]:
    """What two runs must agree on: the answer, the usage, the agent and the items."""
    return {
        "output": result.final_output,
        "usage": serialize_usage(result.context_wrapper.usage),
        "last_agent": result.last_agent.name,
        "items": [type(item).__name__ for item in result.new_items],
    }


def build(args: argparse.Namespace) -> tuple[Agent[Any], RunConfig, Any, AsyncOpenAI]:
    """The agents, the run config, the function that kills on cue and the client."""
    log: Path = args.log

    def kill_if(point: str) -> None:
        if point == args.crash:
            os.kill(os.getpid(), signal.SIGKILL)

    @function_tool
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        note(log / "lookup", order_id)
        return {"order": order_id, "cents": 2500, "status": "delivered"}

    @function_tool(needs_approval=args.approval)
    def refund(ctx: RunContextWrapper[Any], order_id: str, reason: str) -> str:
        """Refund an order."""
        key = idempotency_key(ctx) if args.mode != "plain" else "plain"
        note(log / "ledger", f"{order_id}:{key}")
        kill_if("tool:refund")
        return f"refunded order {order_id} ({reason})"

    def on_handoff(ctx: RunContextWrapper[Any]) -> None:
        note(log / "handoffs", "billing")
        kill_if("handoff")

    client = AsyncOpenAI(base_url=args.base_url, api_key="sk-fake", max_retries=0)
    billing = Agent(
        name="billing",
        instructions="Look the order up, then refund it.",
        model=OpenAIResponsesModel(model="gpt-fake", openai_client=client),
        tools=[lookup_order, refund],
    )
    triage = Agent(
        name="triage",
        instructions="Hand billing questions to billing.",
        model="gpt-fake",
        handoffs=[handoff(billing, on_handoff=on_handoff)],
    )
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
    return triage, config, kill_if, client


def main() -> int:
    """Run (or resume) the workflow; print a summary of the agent's result."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--crash")
    parser.add_argument("--mode", choices=("sync", "async", "plain"), default="sync")
    parser.add_argument("--approval", action="store_true")
    parser.add_argument("--live", action="append", default=[])
    parser.add_argument("--message", default=MESSAGE)
    args = parser.parse_args()
    set_tracing_disabled(True)
    args.log.mkdir(parents=True, exist_ok=True)
    triage, config, kill_if, _ = build(args)
    if args.mode == "plain":
        result = Runner.run_sync(triage, args.message, run_config=config)
        json.dump(summary(result), sys.stdout)
        return 0
    runner = DurableRunner(effects={"refund"}, live=args.live)

    def turn_sync(state: dict[str, Any], ctx: ds.Context) -> None:
        state["result"] = summary(runner.run_sync(triage, args.message, ctx=ctx, run_config=config))
        ctx.finish()

    async def turn_async(state: dict[str, Any], ctx: ds.Context) -> None:
        result = await runner.run(triage, args.message, ctx=ctx, run_config=config)
        state["result"] = summary(result)
        ctx.finish()

    def on_event(event: ds.Event) -> None:
        if event.kind == "call_recorded":
            kill_if(f"recorded:{event.call}")
        elif event.kind == "run_suspended":
            kill_if("waiting")

    step = ds.step(turn_sync if args.mode == "sync" else turn_async, name="turn")
    wf = ds.Workflow("support", steps=[step], store=args.store, on_event=[on_event])
    try:
        if args.mode == "sync":
            final = wf.run(args.run, {})
        else:
            final = asyncio.run(wf.arun(args.run, {}))
    except ds.RunSuspended as exc:
        json.dump({"suspended": exc.signal}, sys.stdout)
        return 3
    json.dump(final["result"], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
