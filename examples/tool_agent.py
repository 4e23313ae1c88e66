"""A tool-calling agent whose every model and tool call survives ``kill -9``.

    python examples/tool_agent.py --crash-after-refund 2   # dies right after the 2nd refund
    python examples/tool_agent.py                          # resumes: no refund is paid twice

One step per turn of the loop. In a turn the model (a scripted stand-in here,
so it runs offline; see ``support_agent.py`` for the real ``openai`` SDK)
answers the transcript with a message that may ask for tool calls; each tool
call runs and its result joins the transcript; the loop ends when the model
answers without tools. A turn may ask for any number of tools, so they cannot
be steps of their own: they are *journaled calls* inside the turn's step.

- ``ctx.call("model", ...)`` records the model's answer before it returns, so
  a crash later in the turn does not pay for the model call again;
- ``ctx.effect(f"tool:{id}", ...)`` records each side-effecting tool call's
  idempotency key before it runs, and its result after: after a crash, the
  refunds already recorded are replayed, and one that may have gone through
  is sent again with the *same* key, which the payments API deduplicates.

``durable-steps --store runs show tool-agent/ticket-4411`` (run from this
directory: the store is ``./runs``) shows the journal of a turn cut short.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import durable_steps as ds

HERE = Path(__file__).resolve().parent
ORDERS = {"A-1": 1200, "A-2": 3400, "A-3": 560}  # order id -> amount in cents


def say(text: str) -> None:
    print(text, flush=True)  # flush: SIGKILL throws away whatever is still buffered


class Payments:
    """A payments API that, like Stripe's, deduplicates on an idempotency key.

    Its ledger is a JSON file, so that, like a provider's database, it outlives
    our process; ``calls`` counts every request, duplicates included.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Any]:
        if self.path.exists():
            return json.loads(self.path.read_text())  # type: ignore[no-any-return]
        return {"refunds": {}, "calls": 0}

    def refund(self, order: str, amount: int, *, idempotency_key: str) -> dict[str, Any]:
        book = self.load()
        book["calls"] += 1
        new = {"id": f"re_{len(book['refunds']) + 1}", "order": order, "amount": amount}
        refund = book["refunds"].setdefault(idempotency_key, new)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(book))
        os.replace(tmp, self.path)
        return dict(refund)


def model(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A scripted stand-in for a chat model: asks for refunds, then sums up.

    Its answer depends only on the transcript, like a model called at
    temperature 0; it appends to ``MODEL_LOG`` so the example can count calls.
    """
    with open(os.environ["MODEL_LOG"], "a") as log:
        log.write(f"{len(messages)}\n")
    tool_results = [m for m in messages if m["role"] == "tool"]
    if not tool_results:
        calls = [
            {"id": f"call_{i}", "name": "refund", "arguments": {"order": order}}
            for i, order in enumerate(sorted(ORDERS), 1)
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    total = sum(json.loads(m["content"])["amount"] for m in tool_results)
    return {"role": "assistant", "content": f"Refunded {len(tool_results)} orders, {total} cents."}


def build(store: str, payments: Payments, crash_after: int | None) -> ds.Workflow:
    wf = ds.Workflow("tool-agent", store=store, until=lambda s: s["done"])
    refunds_made = {"n": 0}

    def refund(order: str, *, idempotency_key: str) -> dict[str, Any]:
        result = payments.refund(order, ORDERS[order], idempotency_key=idempotency_key)
        say(f"  refund {result['id']} for {order} (key {idempotency_key})")
        refunds_made["n"] += 1
        if refunds_made["n"] == crash_after:
            say("  -- SIGKILL, right after the refund went through --")
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        reply = ctx.call("model", model, state["messages"])
        state["messages"].append(reply)
        for call in reply.get("tool_calls") or []:
            result = ctx.effect(f"tool:{call['id']}", refund, **call["arguments"])
            state["messages"].append(
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
            )
        state["done"] = not reply.get("tool_calls")
        if state["done"]:
            say(f"agent: {reply['content']}")

    return wf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default=str(HERE / "runs"), help="store URL or path")
    parser.add_argument("--run", default="ticket-4411")
    parser.add_argument("--crash-after-refund", type=int, default=None, metavar="N")
    args = parser.parse_args()
    payments = Payments(Path(os.environ.get("PAYMENTS_LEDGER", HERE / "runs" / "payments.json")))
    payments.path.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MODEL_LOG", str(payments.path.with_name("model-calls.log")))
    wf = build(args.store, payments, args.crash_after_refund)
    start = {"messages": [{"role": "user", "content": "Refund all my orders."}], "done": False}
    state = wf.run(args.run, start)
    book = payments.load()
    say(
        f"done: {len(state['messages'])} messages; {len(book['refunds'])} refunds in the ledger "
        f"({book['calls']} requests)"
    )


if __name__ == "__main__":
    main()
