"""A child process that runs a waiting workflow (or sends its signal) and SIGKILLs itself on cue.

Run it by path, like ``crashchild.py`` (whose helpers it imports)::

    python tests/waitchild.py run  --store URL --run RUN --log LOG --ledger LEDGER [--crash B]
                                   [--worker]
    python tests/waitchild.py send --store URL --run RUN --data JSON [--crash after-signal]

The workflow ``wait-crash`` has three steps: ``draft`` (asks a "model" through
``ctx.call``), ``approve`` (``ctx.wait_for("approval")``, then pays the
approved amount as ``ctx.effect("refund", ...)``) and ``notify``. Each step
appends to the executions *log* when it starts (``approve`` also logs
``got:<payload>`` once the wait returns, and the model logs ``model``); the
refund appends ``<idempotency key> <amount>`` to the *ledger*, fsynced, as a
payments API that deduplicates by key would record it.

``--crash`` (run) picks where the process dies:

``before-wait`` / ``after-wait``
    around the write that records the run as waiting;
``after-record``
    after the first checkpoint write once the signal was found: the record of
    its payload (under ``--worker``, the worker's claim of the woken run);
``inside-after-wait``
    in ``approve`` once ``wait_for`` returned, before the refund;
``inside-effect``
    in the refund, after the ledger has it, before its result is recorded;
``before-commit`` / ``after-commit``
    around the write that commits ``approve``.

``send --crash after-signal`` dies right after the signal object was written.

Exit status: 0 with the final state as JSON on stdout (run), or sent (send);
4 the run waits (RunSuspended); 5 the signal was already sent.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt

try:  # imported by the tests
    from tests.crashchild import append_line, die
except ImportError:  # run by path: tests/ is on sys.path
    from crashchild import append_line, die

WORKFLOW = "wait-crash"
EXIT_WAITING, EXIT_ALREADY_SENT = 4, 5
CRASHES = (
    "before-wait",
    "after-wait",
    "after-record",
    "inside-after-wait",
    "inside-effect",
    "before-commit",
    "after-commit",
)


class KillingStore:
    """Wrap a store; SIGKILL the process around the write ``crash`` names."""

    def __init__(self, inner: ds.Store, crash: str | None) -> None:
        self.inner = inner
        self.crash = crash
        self.committed = -1
        self.found_signal = False  # a signal was read: the next write is the wake's first

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Pass through, noting a signal found."""
        found = self.inner.get(key)
        if found is not None and "/signals/" in key:
            self.found_signal = True
        if found is not None and key.endswith("/checkpoint") and self.committed < 0:
            self.committed = ckpt.decode(found[0], where=key)[0].committed
        return found

    def _kind(self, key: str, data: bytes) -> str:
        if "/signals/" in key:
            return "signal"
        if not key.endswith("/checkpoint"):
            return "part"
        header = ckpt.decode(data, where=key)[0]
        committed, self.committed = self.committed, header.committed
        if header.status == "waiting":
            return "wait"
        if header.committed > committed >= 0 and header.history[-1][0] == "approve":
            return "commit"
        if self.found_signal:
            self.found_signal = False
            return "record"
        return "other"

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write through; die before or after the chosen write."""
        kind = self._kind(key, data)
        if self.crash == f"before-{kind}":
            die()
        version = self.inner.put(key, data, match=match)
        if self.crash == f"after-{kind}":
            die()
        return version

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Pass through."""
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ds.ObjectInfo]:
        """Pass through."""
        return self.inner.list(prefix)

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()


def build_workflow(store: ds.Store, log: Path, ledger: Path, crash: str | None) -> ds.Workflow:
    """The test workflow on ``store`` (wrapped in a :class:`KillingStore`)."""
    wf = ds.Workflow(WORKFLOW, store=KillingStore(store, crash))  # type: ignore[arg-type]

    def model(ticket: str) -> dict[str, Any]:
        append_line(log, "model")
        return {"ticket": ticket, "amount": 3400}

    @wf.step()
    def draft(state: dict[str, Any], ctx: ds.Context) -> None:
        append_line(log, "draft")
        state["draft"] = ctx.call("model", model, "t-7")

    def refund(amount: int, *, idempotency_key: str) -> dict[str, Any]:
        append_line(ledger, f"{idempotency_key} {amount}")
        if crash == "inside-effect":
            die()
        return {"refunded": amount}

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        append_line(log, "approve")
        payload = ctx.wait_for("approval")
        append_line(log, f"got:{json.dumps(payload, sort_keys=True)}")
        if crash == "inside-after-wait":
            die()
        state["payload"] = payload
        state["refund"] = ctx.effect("refund", refund, payload["amount"])

    @wf.step()
    def notify(state: dict[str, Any]) -> None:
        append_line(log, "notify")
        state["notified"] = True

    return wf


def main(argv: list[str] | None = None) -> int:
    """Run the workflow, or send its signal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("run", "send"))
    parser.add_argument("--store", required=True, help="store URL")
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--log", type=Path, default=Path("executions.log"))
    parser.add_argument("--ledger", type=Path, default=Path("ledger.log"))
    parser.add_argument("--crash", choices=(*CRASHES, "after-signal"))
    parser.add_argument("--data", default="null", help="the signal's payload (send)")
    parser.add_argument("--worker", action="store_true", help="run it under a Worker")
    args = parser.parse_args(argv)
    wf = build_workflow(ds.open_store(args.store), args.log, args.ledger, args.crash)
    try:
        if args.mode == "send":
            sent = wf.signal(args.run, "approval", json.loads(args.data))
            return 0 if sent else EXIT_ALREADY_SENT
        if args.worker:
            report = ds.Worker(wf, concurrency=1).run(until_idle=True)
            if args.run not in report.completed:  # not due (or waits again)
                print(f"worker: {report}", file=sys.stderr)
                return EXIT_WAITING
            final = wf.run(args.run)  # the final state, from the terminal marker
        else:
            final = wf.run(args.run)
    except ds.RunSuspended as exc:
        print(f"RunSuspended: {exc}", file=sys.stderr)
        return EXIT_WAITING
    finally:
        wf.store.close()
    print(json.dumps(final, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
