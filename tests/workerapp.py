"""A workflow for the worker and lease tests, configured by environment.

``workflow`` (``fleet``) loops two passes of ``fetch`` → ``charge`` →
``finish``. ``charge`` is non-idempotent: it appends ``run iteration key`` to
the ledger file (``WORKERAPP_LEDGER``), which stands for a payment API that
counts keys. Every step appends ``step run iteration pid`` to
``WORKERAPP_LOG`` when it starts. ``WORKERAPP_STEP_SECONDS`` makes ``fetch``
take that long; ``WORKERAPP_LEASE`` sets the lease. The store comes from
``$DURABLE_STEPS_STORE``.

Run as ``python -m tests.workerapp RUN_ID`` it runs (or resumes) one run and
exits 0, or 3 on CheckpointConflict, 4 on RunLocked.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import durable_steps as ds

PASSES = 2


def _append(var: str, line: str) -> None:
    path = os.environ.get(var)
    if path:
        # O_APPEND: concurrent workers' lines never interleave within a line.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line}\n".encode())
        finally:
            os.close(fd)


def _started(ctx: ds.Context) -> None:
    _append("WORKERAPP_LOG", f"{ctx.step} {ctx.run_id} {ctx.iteration} {os.getpid()}")


def fetch(state: dict[str, Any], ctx: ds.Context) -> None:
    _started(ctx)
    time.sleep(float(os.environ.get("WORKERAPP_STEP_SECONDS", "0")))
    state["fetched"] += 1


def charge(state: dict[str, Any], ctx: ds.Context) -> None:
    _started(ctx)
    _append("WORKERAPP_LEDGER", f"{ctx.run_id} {ctx.iteration} {ctx.idempotency_key}")
    state["charged"] += 1


def finish(state: dict[str, Any], ctx: ds.Context) -> None:
    _started(ctx)
    state["passes"] += 1


def initial_state() -> dict[str, Any]:
    return {"fetched": 0, "charged": 0, "passes": 0}


workflow = ds.Workflow(
    "fleet",
    steps=[fetch, ds.step(charge, idempotent=False), finish],
    until=lambda s: s["passes"] >= PASSES,
    lease=float(os.environ.get("WORKERAPP_LEASE", "60")),
)


def main(run_id: str) -> int:
    try:
        workflow.run(run_id, initial_state())
    except ds.CheckpointConflict as exc:
        print(f"conflict: {exc}", file=sys.stderr)
        return 3
    except ds.RunLocked as exc:
        print(f"locked: {exc}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
