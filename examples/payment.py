"""A payment step that asks a person when a crash leaves it in doubt.

python examples/payment.py order-17 --crash   # charges, then dies before the commit
python examples/payment.py order-17           # StepInDoubt: was the card charged?
durable-steps show pay/order-17               # the idempotency key to look up
durable-steps resolve pay/order-17 --fired    # it was: skip the step
python examples/payment.py order-17           # completes without charging again
"""

import os
import signal
import sys
from typing import Any

import durable_steps as ds

wf = ds.Workflow("pay")


@wf.step()
def quote(state: dict[str, Any]) -> None:
    state["amount"] = 4200


@wf.step(idempotent=False, in_doubt="raise")
def charge(state: dict[str, Any], ctx: ds.Context) -> None:
    # A real step would call the payment API with idempotency_key=ctx.idempotency_key.
    print(f"charging {state['amount']} with key {ctx.idempotency_key}")
    if "--crash" in sys.argv:
        os.kill(os.getpid(), signal.SIGKILL)  # charged, but the commit never happens
    state["charged"] = True


@wf.step()
def receipt(state: dict[str, Any]) -> None:
    state["receipt"] = "sent"


if __name__ == "__main__":
    try:
        print(wf.run(sys.argv[1], {"order": sys.argv[1]}))
    except ds.StepInDoubt as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(3) from None
