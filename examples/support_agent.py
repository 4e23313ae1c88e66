"""A support agent on the real ``openai`` and ``stripe`` SDKs whose refunds survive ``kill -9``.

    python examples/support_agent.py --crash-after-refund 1   # dies right after the 1st refund
    python examples/support_agent.py                          # resumes: no refund is made twice

A customer writes that two orders arrived broken. The agent is a chat model
with two tools, ``lookup_order`` and ``refund``, in a loop with one step per
turn: the model answers the transcript, each tool call it asks for runs and
its result joins the transcript, and the loop ends when the model answers in
text. Inside a turn,

- ``ctx.call("model", ...)`` records the model's answer (the completion's
  ``model_dump()``) before it returns: a crash later in the turn does not ask
  the model again, and the rerun sees the *same* tool calls, ids included;
- ``ctx.call(f"tool:{id}", lookup_order, ...)`` records a read;
- ``ctx.effect(f"tool:{id}", refund, ...)`` records an idempotency key before
  the refund is sent and the refund after; ``stripe.Refund.create`` gets it as
  ``idempotency_key=``. After a crash, recorded refunds are replayed, and one
  that may have gone through is sent again with the *same* key: Stripe answers
  with the first refund (``Idempotent-Replayed: true``) instead of a second.

The orders are charged first, once, by a one-step workflow of their own
(``support-shop``, each charge an effect too), so that there is something to
refund on a fresh Stripe account.

Offline (no account, no network)::

    python3 -m pip install -e . openai stripe
    npm ci --prefix tests/emulators          # stripe-stateful-mock, a Stripe API in memory
    node -e "require('./tests/emulators/node_modules/stripe-stateful-mock')\\
      .createExpressApp().listen(12111, '127.0.0.1')" &
    STRIPE_API_BASE=http://127.0.0.1:12111 python examples/support_agent.py

With neither ``OPENAI_API_KEY`` nor ``OPENAI_BASE_URL`` set, the agent starts
``fake_openai.py`` (a scripted model) in its own process. With
``STRIPE_API_BASE`` set and no ``STRIPE_API_KEY``, it uses the key
``sk_test_offline`` (the mock takes any ``sk_test_`` key). The mock keeps
nothing on disk: after restarting it, start over with a new ``--run`` (or
delete ``runs/``), since the recorded charges no longer exist there.

Against the real services, set the usual variables: ``OPENAI_API_KEY`` (and
``OPENAI_MODEL``, default ``gpt-4o-mini``) and ``STRIPE_API_KEY``, a
*test-mode* key (``sk_test_...``: the example charges Stripe's test card
``tok_visa``, so live keys are refused). ``STRIPE_ACCOUNT`` makes every
request on behalf of that connected account.

``durable-steps --store runs show support-agent/ticket-1001`` (run from this
directory: the store is ``./runs``) shows the journal of a turn cut short.
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

import openai
import stripe

import durable_steps as ds

HERE = Path(__file__).resolve().parent
ORDERS = {"1001": 2500, "1002": 4200, "1003": 990}  # the shop's orders: number -> cents
CURRENCY = "usd"
MAX_TURNS = 8  # a model that keeps asking for tools is stopped, not paid forever
OFFLINE_STRIPE_KEY = "sk_test_offline"
SYSTEM = (
    "You are the support agent of a small web shop. Look an order up with lookup_order "
    "before you refund it, refund only the orders the customer asks about, then tell the "
    "customer what you did and quote the refund ids."
)
MESSAGE = "Orders #1001 and #1002 both arrived broken. Please refund them."
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": ["order_id"],
            },
        },
    }
    for name, description, properties in (
        (
            "lookup_order",
            "Look an order up by its number: amount, whether it was paid and refunded.",
            {"order_id": {"type": "string"}},
        ),
        (
            "refund",
            "Refund an order in full.",
            {"order_id": {"type": "string"}, "reason": {"type": "string"}},
        ),
    )
]


def say(text: str) -> None:
    print(text, flush=True)  # flush: SIGKILL throws away whatever is still buffered


def money(cents: int, currency: str) -> str:
    return f"{cents / 100:.2f} {currency.upper()}"


def configure_stripe() -> dict[str, Any]:
    """Point the module-level SDK at Stripe or the mock; the options every request gets.

    Exits with a message saying what to set when there is no Stripe to talk to.
    """
    base = os.environ.get("STRIPE_API_BASE")
    key = os.environ.get("STRIPE_API_KEY") or (OFFLINE_STRIPE_KEY if base else None)
    if key is None:
        sys.exit(
            "support_agent.py needs a Stripe API to refund on; set one of:\n"
            "  STRIPE_API_KEY=sk_test_...   a test-mode key of your Stripe account, or\n"
            "  STRIPE_API_BASE=http://127.0.0.1:12111   stripe-stateful-mock, offline:\n"
            "    npm ci --prefix tests/emulators\n"
            "    node -e \"require('./tests/emulators/node_modules/stripe-stateful-mock')"
            ".createExpressApp().listen(12111, '127.0.0.1')\" &"
        )
    if not key.startswith(("sk_test_", "rk_test_")):
        sys.exit(
            "support_agent.py charges Stripe's test card: STRIPE_API_KEY must be a test-mode "
            "key (sk_test_... or rk_test_...), not a live one"
        )
    stripe.api_key = key
    if base:
        stripe.api_base = base
    account = os.environ.get("STRIPE_ACCOUNT")
    return {"stripe_account": account} if account else {}


def openai_client() -> openai.OpenAI:
    """The SDK's client from the usual variables, or one on a fake model started here."""
    if os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL"):
        return openai.OpenAI()  # reads OPENAI_API_KEY and OPENAI_BASE_URL itself
    sys.path.insert(0, str(HERE))
    from fake_openai import make_server

    server = make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"(no OPENAI_API_KEY: using the scripted model of fake_openai.py at {server.url})")
    return openai.OpenAI(base_url=server.url, api_key="sk-fake")


def replayed(obj: stripe.StripeObject) -> bool:
    """Whether Stripe answered from its idempotency cache (the key was seen before)."""
    response = obj.last_response
    return response is not None and response.headers.get("idempotent-replayed") == "true"


def build(
    store: str, client: openai.OpenAI, options: dict[str, Any], crash_after: int | None
) -> tuple[ds.Workflow, ds.Workflow]:
    """The shop's checkout (charges the orders once) and the support agent."""
    model = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
    shop = ds.Workflow("support-shop", store=store)
    agent = ds.Workflow("support-agent", store=store, until=lambda s: s["done"])
    refunds_made = {"n": 0}

    def pay(order: str, *, idempotency_key: str) -> str:
        charge = stripe.Charge.create(
            amount=ORDERS[order],
            currency=CURRENCY,
            source="tok_visa",
            description=f"order {order}",
            metadata={"order": order},
            idempotency_key=idempotency_key,
            **options,
        )
        say(f"  charged {charge.id} for order {order}, {money(charge.amount, charge.currency)}")
        return str(charge.id)

    @shop.step()
    def checkout(state: dict[str, Any], ctx: ds.Context) -> None:
        for order in ORDERS:
            state[order] = ctx.effect(f"charge:{order}", pay, order)

    def ask_model(messages: list[Any]) -> dict[str, Any]:
        completion = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        return completion.model_dump(mode="json")  # JSON, so the journal can store it

    def lookup_order(orders: dict[str, str], order_id: str) -> dict[str, Any]:
        if order_id not in orders:
            return {"order": order_id, "error": "no such order"}
        try:
            charge = stripe.Charge.retrieve(orders[order_id], **options)
        except stripe.InvalidRequestError as exc:  # e.g. a mock restarted since the checkout
            return {"order": order_id, "error": exc.user_message or str(exc)}
        return {
            "order": order_id,
            "amount": money(charge.amount, charge.currency),
            "paid": charge.paid,
            "refunded": charge.refunded,
        }

    def refund(
        orders: dict[str, str], order_id: str, reason: str, *, idempotency_key: str
    ) -> dict[str, Any]:
        if order_id not in orders:
            return {"order": order_id, "error": "no such order: nothing refunded"}
        try:
            made = stripe.Refund.create(
                charge=orders[order_id],
                reason="requested_by_customer",
                metadata={"order": order_id, "note": reason[:500]},
                idempotency_key=idempotency_key,
                **options,
            )
        except stripe.InvalidRequestError as exc:  # e.g. already refunded: the model is told
            return {"order": order_id, "error": exc.user_message or str(exc)}
        how = "replayed by Stripe" if replayed(made) else "new"
        say(f"  refund {made.id} for order {order_id} (key {idempotency_key}, {how})")
        refunds_made["n"] += 1
        if refunds_made["n"] == crash_after:
            say("  -- SIGKILL, right after the refund went through --")
            os.kill(os.getpid(), signal.SIGKILL)
        return {"order": order_id, "refund": made.id, "amount": money(made.amount, made.currency)}

    def run_tool(ctx: ds.Context, orders: dict[str, str], call: dict[str, Any]) -> Any:
        name, name_of_call = call["function"]["name"], f"tool:{call['id']}"
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
            order_id = str(arguments["order_id"])
        except (ValueError, TypeError, KeyError) as exc:
            return {"error": f"bad arguments for {name}: {exc}"}
        if name == "lookup_order":
            return ctx.call(name_of_call, lookup_order, orders, order_id)
        if name == "refund":
            reason = str(arguments.get("reason") or "")
            return ctx.effect(name_of_call, refund, orders, order_id, reason)
        return {"error": f"no tool named {name!r}"}

    @agent.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        completion = ctx.call("model", ask_model, state["messages"])
        message = completion["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if calls:
            reply["tool_calls"] = calls
        state["messages"].append(reply)
        for call in calls:
            result = run_tool(ctx, state["orders"], call)
            state["messages"].append(
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
            )
        state["turns"] += 1
        state["done"] = not calls or state["turns"] >= MAX_TURNS
        if not calls:
            say(f"agent: {message.get('content')}")

    return shop, agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default=str(HERE / "runs"), help="store URL or path")
    parser.add_argument("--run", default="ticket-1001", help="the ticket's run id")
    parser.add_argument("--message", default=MESSAGE, help="what the customer writes")
    parser.add_argument(
        "--crash-after-refund", type=int, default=None, metavar="N", help="SIGKILL after refund N"
    )
    args = parser.parse_args()
    options = configure_stripe()
    shop, agent = build(args.store, openai_client(), options, args.crash_after_refund)
    orders = shop.run(args.run, {})
    start = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": args.message},
        ],
        "orders": orders,
        "turns": 0,
        "done": False,
    }
    state = agent.run(args.run, start)
    say(f"done: {state['turns']} turns, {len(state['messages'])} messages")


if __name__ == "__main__":
    main()
