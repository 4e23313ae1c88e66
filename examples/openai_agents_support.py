"""The support agent of ``support_agent.py``, written with the OpenAI Agents SDK, durable.

    python examples/openai_agents_support.py --crash-after-refund 1   # dies after refund 1
    python examples/openai_agents_support.py                          # resumes: no refund twice

A customer writes that two orders arrived broken. A ``triage`` agent hands
the ticket to a ``refunds`` agent, which has two tools, ``lookup_order`` and
``refund``; the SDK's ``Runner`` loop does the rest. ``DurableRunner`` runs
that loop inside one step of a workflow, so that

- every model response is recorded as it arrives: a crash later in the run
  does not ask the model again, and the rerun sees the same tool calls;
- ``lookup_order`` is a journaled call, ``refund`` an *effect*: its
  idempotency key (``idempotency_key(ctx)``) is recorded before it runs and
  sent to the payments API, which answers a repeated key with the first
  refund instead of making a second one.

With ``--approval`` a refund needs a person's yes (``needs_approval``): the
run suspends, no process waits, and the example says which signal to send::

    python examples/openai_agents_support.py --approval   # suspends: says which signal
    durable-steps --store examples/runs signal support-agents/ticket-1001 \
        approve:call_... --data true                         # (false rejects it)
    python examples/openai_agents_support.py --approval   # goes on: refunds, answers

Offline (no account, no network): with neither ``OPENAI_API_KEY`` nor
``OPENAI_BASE_URL`` set, the example starts ``fake_openai.py`` (a scripted
model, Responses API) in a thread. Online, set ``OPENAI_API_KEY`` (and
``OPENAI_MODEL``, default ``gpt-4o-mini``). The payments API is a ledger
file (``$PAYMENTS_LEDGER``, default ``payments.json`` beside the store)
that keeps one refund per idempotency key, as Stripe does;
``support_agent.py`` does the same against Stripe itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    OpenAIProvider,
    RunConfig,
    RunContextWrapper,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import durable_steps as ds
from durable_steps.integrations.openai_agents import DurableRunner, idempotency_key

HERE = Path(__file__).resolve().parent
ORDERS = {"1001": 2500, "1002": 4200, "1003": 990}  # the shop's orders: number -> cents
MESSAGE = "Orders #1001 and #1002 both arrived broken. Please refund them."


def say(text: str) -> None:
    print(text, flush=True)  # flush: SIGKILL throws away whatever is still buffered


class Payments:
    """A payments API in a file: one refund per idempotency key (a repeat gets the first)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def refunds(self) -> dict[str, Any]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def refund(self, order: str, cents: int, *, idempotency_key: str) -> tuple[str, bool]:
        """The refund's id, and whether it was a repeat of an earlier request."""
        with self.lock:
            made = self.refunds()
            if idempotency_key in made:
                return made[idempotency_key]["id"], True
            refund_id = f"re_{len(made) + 1}"
            made[idempotency_key] = {"id": refund_id, "order": order, "cents": cents}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(made, indent=1))
            return refund_id, False


def run_config() -> RunConfig:
    """The SDK's default provider online; the scripted model of fake_openai.py offline."""
    if os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL"):
        return RunConfig()  # reads OPENAI_API_KEY and OPENAI_BASE_URL itself
    sys.path.insert(0, str(HERE))
    from fake_openai import make_server

    server = make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"(no OPENAI_API_KEY: using the scripted model of fake_openai.py at {server.url})")
    set_tracing_disabled(True)  # no key to export traces with
    client = AsyncOpenAI(base_url=server.url, api_key="sk-fake")
    return RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))


def build(store: str, payments: Payments, crash_after: int | None, approval: bool) -> ds.Workflow:
    """The agents, and the workflow whose one step runs them durably."""
    model = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
    made = {"n": 0}

    @function_tool
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up: its amount and whether it was paid."""
        if order_id not in ORDERS:
            return {"order": order_id, "error": "no such order"}
        return {"order": order_id, "amount_cents": ORDERS[order_id], "paid": True}

    @function_tool(needs_approval=approval)
    def refund(ctx: RunContextWrapper[Any], order_id: str, reason: str) -> dict[str, Any]:
        """Refund an order in full."""
        if order_id not in ORDERS:
            return {"order": order_id, "error": "no such order: nothing refunded"}
        key = idempotency_key(ctx)
        refund_id, repeat = payments.refund(order_id, ORDERS[order_id], idempotency_key=key)
        how = "a repeat: the payments API answered with the first refund" if repeat else "new"
        say(f"  refund {refund_id} for order {order_id} (key {key}, {how})")
        made["n"] += 1
        if made["n"] == crash_after:
            say("  -- SIGKILL, right after the refund went through --")
            os.kill(os.getpid(), signal.SIGKILL)
        return {"order": order_id, "refund": refund_id, "reason": reason}

    refunds = Agent(
        name="refunds",
        instructions=(
            "Look an order up with lookup_order before you refund it, refund only the orders "
            "the customer asks about, then tell the customer what you did and quote the "
            "refund ids."
        ),
        model=model,
        tools=[lookup_order, refund],
    )
    triage = Agent(
        name="triage",
        instructions="You are the front desk of a small web shop. Hand refunds to refunds.",
        model=model,
        handoffs=[refunds],
    )
    runner = DurableRunner(effects={"refund"})
    config = run_config()
    wf = ds.Workflow("support-agents", store=store)

    @wf.step()
    def answer(state: dict[str, Any], ctx: ds.Context) -> None:
        result = runner.run_sync(triage, state["message"], ctx=ctx, run_config=config)
        state["answer"] = result.final_output
        state["agent"] = result.last_agent.name
        state["usage"] = result.context_wrapper.usage.total_tokens
        ctx.finish()

    return wf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default=str(HERE / "runs"), help="store URL or path")
    parser.add_argument("--run", default="ticket-1001", help="the ticket's run id")
    parser.add_argument("--message", default=MESSAGE, help="what the customer writes")
    parser.add_argument("--approval", action="store_true", help="refunds need a person's yes")
    parser.add_argument(
        "--crash-after-refund", type=int, default=None, metavar="N", help="SIGKILL after refund N"
    )
    args = parser.parse_args()
    default_ledger = Path(args.store) / "payments.json"
    payments = Payments(Path(os.environ.get("PAYMENTS_LEDGER") or default_ledger))
    wf = build(args.store, payments, args.crash_after_refund, args.approval)
    try:
        state = wf.run(args.run, {"message": args.message})
    except ds.RunSuspended as waiting:
        say(f"waiting for a person: send signal {waiting.signal!r}, e.g.")
        say(
            f"  durable-steps --store {args.store} signal support-agents/{args.run} "
            f"{waiting.signal} --data true      (false rejects)"
        )
        say("then run this again.")
        return
    say(f"agent ({state['agent']}): {state['answer']}")
    say(f"done: {len(payments.refunds())} refunds in the ledger, {state['usage']} tokens")


if __name__ == "__main__":
    main()
