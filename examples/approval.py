"""An agent that asks a person before it pays: the run waits, holding no process.

    python examples/approval.py                  # drafts a refund, then waits for a person
    durable-steps ls --status waiting            # what it waits for
    durable-steps signal approval-agent/ticket-7 approval --data '{"approved": true}'
    python examples/approval.py                  # goes on: issues the refund, replies

The agent drafts a refund for a support ticket (``ctx.call`` of a "model", a
scripted stand-in so it runs offline), then ``ctx.wait_for("approval")``: the
run is *suspended* -- its checkpoint says ``waiting``, its lease is released,
and this process exits. Nothing runs until the signal exists: a person sends
it with ``durable-steps signal`` (or your web app with ``wf.signal``), a
create-only object beside the checkpoint. The next run (or a ``durable-steps
worker``) finds it, and the step goes on: approved, the refund is issued as a
``ctx.effect`` (a payments ledger that deduplicates by idempotency key, like
Stripe's); rejected, the rejection is recorded. Then the agent writes the
customer a reply. ``--wait`` blocks here instead until the answer comes
(``wf.run(..., wait=True)`` polls the signal's key). Without an answer within
``--timeout`` seconds, ``ctx.wait_for`` raises ``SignalTimeout`` and the agent
escalates the ticket.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import durable_steps as ds

TICKET = {"id": "ticket-7", "order": "A-2", "amount": 3400, "text": "My parcel never came."}


def say(text: str) -> None:
    print(text, flush=True)


class Payments:
    """A payments API that deduplicates on an idempotency key, with a JSON file as its database."""

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


def model(task: str, facts: dict[str, Any], log: Path) -> dict[str, Any]:
    """A scripted stand-in for a chat model (its answer depends only on its input)."""
    with log.open("a") as out:
        out.write(f"{task}\n")
    if task == "draft":
        return {
            "order": facts["order"],
            "amount": facts["amount"],
            "reason": f"customer reports: {facts['text']}",
        }
    if facts["outcome"] == "refunded":
        return {"reply": f"We refunded {facts['amount']} cents ({facts['refund']})."}
    if facts["outcome"] == "rejected":
        return {"reply": f"We cannot refund this order: {facts['note']}"}
    return {"reply": "A colleague will look at your request shortly."}


def build(store: str | None, payments: Payments, model_log: Path, timeout: float) -> ds.Workflow:
    wf = ds.Workflow("approval-agent", store=store)

    @wf.step()
    def draft(state: dict[str, Any], ctx: ds.Context) -> None:
        state["draft"] = ctx.call("model", model, "draft", state["ticket"], model_log)

    @wf.step()
    def approval(state: dict[str, Any], ctx: ds.Context) -> None:
        plan = state["draft"]
        say(f"draft: refund {plan['amount']} cents for order {plan['order']} ({plan['reason']})")
        try:
            # accepts="approval": {"approved": true}, {"approved": false, "message": "why"}
            # or bare true / false; another payload is refused when it is sent.
            decision = ctx.wait_for("approval", timeout=timeout, accepts="approval")
        except ds.SignalTimeout:
            state.update(outcome="escalated", note=f"no answer within {timeout:g}s")
            return
        state["decision"] = decision
        if not (decision is True or (isinstance(decision, dict) and decision["approved"])):
            note = decision.get("message") if isinstance(decision, dict) else None
            state.update(outcome="rejected", note=note or "rejected by a person")
            return
        done = ctx.effect("refund", payments.refund, plan["order"], plan["amount"])
        state.update(outcome="refunded", refund=done["id"])

    @wf.step()
    def reply(state: dict[str, Any], ctx: ds.Context) -> None:
        facts = {**state["draft"], **state}
        facts.pop("ticket", None)
        state["reply"] = ctx.call("model", model, "reply", facts, model_log)["reply"]

    return wf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--store", help="store URL or path (default: $DURABLE_STEPS_STORE, else ./.durable_steps)"
    )
    parser.add_argument("--run", default=TICKET["id"], help="run id (default: %(default)s)")
    parser.add_argument("--wait", action="store_true", help="block until the answer comes")
    parser.add_argument(
        "--timeout",
        type=float,
        default=24 * 3600.0,
        metavar="SECONDS",
        help="how long to wait for the answer (default: a day)",
    )
    parser.add_argument(
        "--ledger",
        type=Path,
        default=Path("approval-payments.json"),
        help="the fake payments ledger, a JSON file (default: %(default)s; the model's calls "
        "are logged beside it, in approval-model.log)",
    )
    args = parser.parse_args()
    payments = Payments(args.ledger)
    wf = build(args.store, payments, args.ledger.with_name("approval-model.log"), args.timeout)
    name = f"{wf.name}/{args.run}"
    try:
        state = wf.run(args.run, {"ticket": TICKET})
    except ds.RunSuspended as waiting:
        store = f" --store {shlex.quote(args.store)}" if args.store else ""
        say(f"{name} waits for signal {waiting.signal!r}: a person must approve the refund.")
        say(f"  see it:     durable-steps{store} show {name}")
        approve = shlex.quote(json.dumps({"approved": True}))
        reject = shlex.quote(json.dumps({"approved": False, "message": "order was delivered"}))
        say(f"  approve:    durable-steps{store} signal {name} approval --data {approve}")
        say(f"  or reject:  durable-steps{store} signal {name} approval --data {reject}")
        if not args.wait:
            say("then run this again (or with --wait, which blocks until the answer comes).")
            return 0
        say("--wait: blocking until the answer comes (the signal's key is polled)...")
        state = wf.run(args.run, wait=True)
    book = payments.load()
    say(f"{name}: {state['outcome']}; reply: {state['reply']}")
    say(f"ledger: {len(book['refunds'])} refund(s), {book['calls']} request(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
