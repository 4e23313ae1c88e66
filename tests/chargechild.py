"""A child process that makes three Stripe charges as three effects of one step.

Run it by path (it needs only the installed ``durable_steps`` and ``stripe``)::

    python tests/chargechild.py --store URL --run RUN_ID [--crash-after-charge N]

Stripe is wherever ``STRIPE_API_BASE`` says (``tests.stripeserver.stripe_env``
sets it, with ``STRIPE_API_KEY`` and ``STRIPE_ACCOUNT``); the store URL's
credentials come from the environment, as for ``crashchild.py``.

The workflow ``three-charges`` has one step, ``pay``, which makes charges 1, 2
and 3 with ``ctx.effect(f"charge:{i}", charge, i)``; ``charge`` calls
``stripe.Charge.create(..., idempotency_key=...)`` and prints
``charge I CHARGE_ID key KEY replayed|new`` as soon as Stripe answered.
``--crash-after-charge N`` then SIGKILLs the process right after charge N
returned, before its result is recorded. On success the child prints the
final state (charge ids by number) as JSON on its last line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import stripe

import durable_steps as ds

AMOUNTS = {1: 1100, 2: 2200, 3: 3300}  # cents; different, so a mixed-up key would be refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--crash-after-charge", type=int, default=None, metavar="N")
    args = parser.parse_args()
    stripe.api_key = os.environ["STRIPE_API_KEY"]
    stripe.api_base = os.environ["STRIPE_API_BASE"]
    account = os.environ["STRIPE_ACCOUNT"]
    wf = ds.Workflow("three-charges", store=args.store)

    def charge(number: int, *, idempotency_key: str) -> str:
        made = stripe.Charge.create(
            amount=AMOUNTS[number],
            currency="usd",
            source="tok_visa",
            stripe_account=account,
            idempotency_key=idempotency_key,
        )
        response = made.last_response
        replayed = response is not None and response.headers.get("idempotent-replayed") == "true"
        how = "replayed" if replayed else "new"
        print(f"charge {number} {made.id} key {idempotency_key} {how}", flush=True)
        if number == args.crash_after_charge:
            os.kill(os.getpid(), signal.SIGKILL)
        return str(made.id)

    @wf.step()
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        for number in AMOUNTS:
            state[str(number)] = ctx.effect(f"charge:{number}", charge, number)

    print(json.dumps(wf.run(args.run, {})), flush=True)


if __name__ == "__main__":
    main()
