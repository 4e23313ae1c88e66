"""Is a worker's scan flat in the number of finished runs? Ratios, not a timed test.

    PYTHONPATH=. .venv/bin/python tests/benchmarks/bench_flat.py [--moto] [--sizes 400,4000]

Beside 20 live runs (``bench_scale``'s: 8 submitted, 6 waiting for a signal, 6
sleeping) a store holds N finished runs, and a warm ``Worker.claimable()`` (the
second and later scans, nothing changed) is timed, median of rounds, at each N, on
the local store and on a real SeaweedFS (``weed mini`` on loopback, as the s3 tests
start it; ``--moto`` adds moto). Printed: requests per scan and milliseconds, and
the larger N's time over the smaller's (the target: at most 2x).

Unlike ``bench_scale``, each finished run is written as a real run leaves the index:
its live marker created, then its completed head and done entry, then its marker
deleted. That is what matters on SeaweedFS, whose filer keeps a directory per key
prefix: a layout with a directory per run under ``_index/live*/`` leaves one empty
directory per finished run behind, and a LIST walks them all. To see the earlier
layout's figures, run this script on a checkout from before ``live2`` (it writes the
markers where that checkout's ``_index.marker_of`` names them).

CPU contention on a shared machine shows as noise in milliseconds: use ``--rounds``
(31 for the figures in docs/performance.md); the sizes' scans are interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import durable_steps as ds
from durable_steps._fleet import index as _index
from durable_steps._record import checkpoint as ckpt
from tests.benchmarks.bench_scale import LIVE, _live, _workflow
from tests.s3servers import start_moto, start_seaweedfs

TARGET = 2.0


class Counting:
    """Counts the store's requests (a scan should be one LIST and no GET)."""

    def __init__(self, inner: ds.Store) -> None:
        self.inner, self.calls = inner, {"get": 0, "list": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: str) -> Any:
        self.calls["get"] += 1
        return self.inner.get(key)

    def list(self, prefix: str) -> Any:
        self.calls["list"] += 1
        return self.inner.list(prefix)


def finished(store: ds.Store, start: int, count: int) -> None:
    """``count`` finished runs, each as a run leaves the index (see the module docstring)."""
    now = time.time()

    def one(i: int) -> None:
        run_id = f"done-{i:06d}"
        queued = ckpt.Checkpoint("desk", run_id, ("ask",), "json", created_at=now - 86400)
        marker = _index.marker_of(queued)
        assert marker is not None
        store.put(marker, b"", match=None)
        header = ckpt.Checkpoint(
            "desk",
            run_id,
            ("ask",),
            "json",
            run_nonce=queued.run_nonce,
            status="completed",
            next_step=1,
            committed=1,
            created_at=now - 86400,
            updated_at=now - 86400 + i,
        )
        store.put(ckpt.checkpoint_key("desk", run_id), ckpt.encode(header, b"{}"))
        store.put(_index.done_key(header), b"", match=None)
        store.delete(marker)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(start, start + count)))


def measure(
    name: str, open_store: Callable[[], ds.Store], sizes: list[int], rounds: int
) -> list[str]:
    """The warm scan at each size, each in a store of its own, and the ratio.

    The scans of the sizes are interleaved, one of each per round, so that what
    else runs on the machine slows them alike; each size's time is the median.
    """
    workers, counters, lines = [], [], []
    for size in sizes:
        store = Counting(open_store())
        _live(_workflow(store.inner), time.time() + 3600)
        began = time.perf_counter()
        finished(store.inner, 0, size)
        lines.append(f"{name:10} {size:>6} finished written in {time.perf_counter() - began:.0f} s")
        worker = ds.Worker(_workflow(store))
        assert len(worker.claimable()) == LIVE["queued"]  # cold: reads what it must
        worker.claimable()
        store.calls = {"get": 0, "list": 0}
        workers.append(worker)
        counters.append(store)
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(rounds):
        for worker, spent in zip(workers, times, strict=True):
            began = time.perf_counter()
            worker.claimable()
            spent.append(time.perf_counter() - began)
    medians = [statistics.median(t) for t in times]
    for size, seconds, store in zip(sizes, medians, counters, strict=True):
        calls = {k: v // rounds for k, v in store.calls.items()}
        lines.append(
            f"{name:10} {size:>6} finished  warm scan {seconds * 1000:7.1f} ms  "
            f"{calls['get']} GET {calls['list']} LIST per scan"
        )
    ratio = medians[-1] / medians[0]
    verdict = "PASS" if ratio <= TARGET else "MISS"
    lines.append(
        f"{name:10} ratio {sizes[-1]}/{sizes[0]}: {ratio:.2f}x  (target <= {TARGET}x) {verdict}"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="400,4000")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--moto", action="store_true", help="moto server too")
    parser.add_argument("--no-local", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-flat-"))
    out: list[str] = []
    if not args.no_local:
        local = lambda: ds.LocalStore(tmp / uuid.uuid4().hex[:6])  # noqa: E731
        out += measure("local", local, sizes, args.rounds)
    starts = [start_seaweedfs] + ([start_moto] if args.moto else [])
    for start in starts:
        server = start(tmp / start.__name__)
        try:
            bucket, client = server.make_bucket(), server.client()

            def remote(bucket: str = bucket, client: Any = client) -> ds.Store:
                return ds.S3Store(bucket, f"flat-{uuid.uuid4().hex[:6]}", client=client)

            out += measure(server.name, remote, sizes, args.rounds)
        finally:
            server.stop()
    print("\n".join(out))


if __name__ == "__main__":
    main()
