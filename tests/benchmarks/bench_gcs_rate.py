"""Journaled calls per second on GCS's write rate limit (one write a second per object).

Starts the GCS emulator (fake-gcs-server) with a fault proxy in front that
answers 429 to a second write of one object name within a second (the
emulator does not enforce the limit), then runs one step making N quick
sequential ``ctx.call``s (N = 20, 100), three ways (and N = 100 calls of
50 ms each, a sustained 20 a second, paced):

* ``paced``: ``GCSStore``'s default ``min_write_interval=1.0`` (the quick
  calls deferred into the next write, see ``durable_steps._fleet.pacing``);
* ``unpaced``: ``min_write_interval=0`` (what a run did before), GCSStore's
  default retries;
* ``emulator``: no limit at all, unpaced: what the calls cost without one.

Prints, per shape, the calls recorded per second of step time (the run's
wall time, create and commit included, over N), the head writes, the 429s
the proxy answered, and whether the run completed. Run with
``PYTHONPATH=. python tests/benchmarks/bench_gcs_rate.py``.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import durable_steps as ds
from tests.cloudservers import start_fake_gcs
from tests.faultproxy import FaultProxy


def reply(i: int, pause: float) -> dict[str, int]:
    """A quick call (``pause`` seconds)."""
    time.sleep(pause)
    return {"i": i}


def one_run(
    server: Any, bucket: str, calls: int, *, interval: float, limit: bool, pause: float = 0.0
) -> str:
    proxy = FaultProxy(server.endpoint_url).start()
    proxy.rate_limit(1.0 if limit else 0.0)
    prefix = f"b-{uuid.uuid4().hex[:10]}"
    store = server.open(
        bucket, prefix, endpoint_url=proxy.endpoint_url, min_write_interval=interval
    )
    wf = ds.Workflow("bench-gcs", store=store)

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = [ctx.call(f"q:{i}", reply, i, pause) for i in range(calls)]
        ctx.finish()

    started = time.monotonic()
    outcome = "completed"
    try:
        wf.run("r1", {})
    except ds.DurableStepsError as exc:  # StepFailed from the StoreError of a call's write
        outcome = type(exc).__name__ + " (429s)"
    seconds = time.monotonic() - started
    heads = sum(1 for _, name in proxy.writes if name.endswith("bench-gcs/r1/checkpoint"))
    limited = proxy.limited
    store.close()
    proxy.stop()
    rate = f"{calls / seconds:6.1f}" if outcome == "completed" else "     -"
    return (
        f"{rate} calls/s  {seconds:5.2f} s  {heads:3d} head writes  {limited:3d} x 429  {outcome}"
    )


SHAPES = (  # (calls, label, min_write_interval, the proxy's limit, seconds per call)
    (20, "paced (1 s)", 1.0, True, 0.0),
    (20, "unpaced", 0.0, True, 0.0),
    (20, "emulator, no limit", 0.0, False, 0.0),
    (100, "paced (1 s)", 1.0, True, 0.0),
    (100, "emulator, no limit", 0.0, False, 0.0),
    (100, "paced, 50 ms a call", 1.0, True, 0.05),
)


def main() -> None:
    logging.getLogger("durable_steps").setLevel(logging.CRITICAL)  # the 429s' retry lines
    with tempfile.TemporaryDirectory() as tmp:
        server = start_fake_gcs(Path(tmp))
        try:
            bucket = server.make_bucket()
            for calls, label, interval, limit, pause in SHAPES:
                line = one_run(server, bucket, calls, interval=interval, limit=limit, pause=pause)
                print(f"{calls:3d} quick ctx.calls in one step, {label:20s} {line}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
