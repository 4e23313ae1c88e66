"""The ``scale`` section of ``bench.py``: finding work beside many finished runs.

Beside 20 live runs (8 submitted, 6 waiting for a signal, 6 sleeping) a
store holds N finished runs, at two sizes per store (locally 2,000 and
20,000; on SeaweedFS 400 and 4,000; ``--huge`` adds 100,000 locally). The
finished runs are written as this version leaves them — a completed head
and its done entry — straight through the store, in parallel, because
creating them as runs would only make the benchmark slow. Measured, with
requests counted at the store (``bench.CountingStore``) and wall time the
median of rounds:

- a new worker's first scan (``Worker.claimable``) and a later one with
  nothing changed (requests and time), through the index and, for
  comparison, the way every scan went before it (one LIST of everything, a
  GET per head: the store with its index marked incomplete);
- ``durable-steps ls --status waiting`` and ``ls --limit 5`` (in process);
- that a signal sent, a timer come due and a run submitted are each found
  by the next scan.

The verdicts: the first scan reads at most one object per live run (plus a
constant), a later one none; the larger size's scan and ``ls --status
waiting`` take at most 1.5x the smaller's, and ``ls --limit 5`` the same.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import index as _index
from durable_steps._record import checkpoint as ckpt

LIVE = {"queued": 8, "signal": 6, "sleep": 6}
SIZES = {"local": (2_000, 20_000), "seaweedfs": (400, 4_000)}
FLAT = 1.5  # the larger size over the smaller, at most


def _workflow(store: Any) -> ds.Workflow:
    wf = ds.Workflow("desk", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        if state.get("signal"):
            ctx.wait_for("approval")
        if state.get("sleep"):
            ctx.sleep_until(state["sleep"])

    return wf


def _finished(store: ds.Store, count: int) -> None:
    """``count`` completed runs, each its head and its done entry, written in parallel."""
    now = time.time()

    def one(i: int) -> None:
        header = ckpt.Checkpoint(
            "desk",
            f"done-{i:06d}",
            ("ask",),
            "json",
            status="completed",
            next_step=1,
            committed=1,
            created_at=now - 86400 - i,
            updated_at=now - 86400 + i,
        )
        store.put(ckpt.checkpoint_key("desk", header.run_id), ckpt.encode(header, b"{}"))
        drive_sync(_index.moved(None, header), store)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(count)))


def _live(wf: ds.Workflow, wake: float) -> None:
    for i in range(LIVE["queued"]):
        wf.submit(f"queued-{i}", {})
    for kind in ("signal", "sleep"):
        for i in range(LIVE[kind]):
            try:
                wf.run(f"{kind}-{i}", {kind: wake if kind == "sleep" else True})
            except ds.RunSuspended:
                pass


class _Open:
    """The store as the CLI would open it, left open when the CLI closes it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        pass


def _cli(store: Any, *args: str) -> float:
    """Seconds ``durable-steps ARGS`` takes on ``store``, in this process."""
    from durable_steps.cli import _main

    saved = _main.open_store
    _main.open_store = lambda _url: _Open(store)  # type: ignore[assignment]
    try:
        began = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert _main.main(["--store", "x", *args]) == 0
        return time.perf_counter() - began
    finally:
        _main.open_store = saved


def _median(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@contextlib.contextmanager
def _unindexed(store: ds.Store) -> Iterator[None]:
    """The store as an earlier version left it: its index marked incomplete."""
    store.delete(_index.registry_key("desk") + "/flat")
    store.put(_index.registry_key("desk") + "/partial", b"")
    try:
        yield
    finally:
        store.delete(_index.registry_key("desk") + "/partial")
        store.put(_index.registry_key("desk") + "/flat", b"")


def _scan_costs(counting: Any, rounds: int) -> dict[str, Any]:
    """A new worker's first scan, then later scans with nothing changed."""
    counting.calls.clear()
    worker = ds.Worker(_workflow(counting))
    began = time.perf_counter()
    first = worker.claimable()
    first_seconds = time.perf_counter() - began
    first_calls = dict(counting.calls)
    worker.claimable()
    counting.calls.clear()
    later = _median(worker.claimable, rounds)
    later_calls = {k: v // rounds for k, v in counting.calls.items()}
    return {
        "found": len(first),
        "first_gets": first_calls.get("get", 0),
        "first_lists": first_calls.get("list", 0),
        "first_s": first_seconds,
        "later_gets": later_calls.get("get", 0),
        "later_lists": later_calls.get("list", 0),
        "later_s": later,
    }


def bench_scale(
    backends: list[Any], mode: str, *, counting: Any, table: Callable[..., str], huge: bool
) -> tuple[list[dict[str, Any]], str]:
    """Run the section on each backend (see the module docstring)."""
    rounds = 3 if mode == "quick" else 7
    rows: list[dict[str, Any]] = []
    for backend in backends:
        sizes = SIZES.get(backend.name)
        if sizes is None:
            continue
        if mode == "quick":
            sizes = tuple(n // 10 for n in sizes)
        if huge and backend.name == "local":
            sizes = (*sizes, 100_000)
        for size in sizes:
            prefix = f"scale-{uuid.uuid4().hex[:8]}"
            if backend.name == "local":
                store: Any = ds.LocalStore(backend.root / prefix)
            else:
                store = ds.S3Store(backend.bucket, prefix, client=backend.client)
            wf = _workflow(store)
            wake = time.time() + 3600
            _live(wf, wake)
            _finished(store, size)
            wrapped = counting(store)
            row: dict[str, Any] = {"store": backend.name, "finished": size}
            row |= {f"index_{k}": v for k, v in _scan_costs(wrapped, rounds).items()}
            row["ls_waiting_s"] = _median(lambda: _cli(store, "ls", "-s", "waiting"), rounds)
            row["ls_limit5_s"] = _median(lambda: _cli(store, "ls", "--limit", "5"), rounds)
            with _unindexed(store):
                row |= {f"listing_{k}": v for k, v in _scan_costs(wrapped, 1).items()}
                row["listing_ls_waiting_s"] = _cli(store, "ls", "-s", "waiting")
            row["next_scan_finds"] = _next_scan_finds(wf, store)
            rows.append(row)
    return rows, _report(rows, table)


def _next_scan_finds(wf: ds.Workflow, store: Any) -> bool:
    """A signal sent, a timer due and a run submitted: all in the next scan."""
    worker = ds.Worker(_workflow(store))
    before = set(worker.claimable())
    wf.signal("signal-0", "approval", "yes")
    wf.submit("queued-new", {})
    found = set(worker.claimable())
    due = time.time() + 3600 + 1
    real = time.time
    time.time = lambda: due  # the sleeping runs' time has come
    try:
        later = set(worker.claimable())
    finally:
        time.time = real
    return {"signal-0", "queued-new"} <= found - before and {
        f"sleep-{i}" for i in range(6)
    } <= later


def _report(rows: list[dict[str, Any]], table: Callable[..., str]) -> str:
    lines = []
    for row in rows:
        live = sum(LIVE.values())
        lines.append(
            [
                row["store"],
                f"{row['finished']:,}",
                f"{row['index_first_gets']} GET, {row['index_first_lists']} LIST, "
                f"{row['index_first_s'] * 1000:.0f} ms",
                f"{row['index_later_gets']} GET, {row['index_later_lists']} LIST, "
                f"{row['index_later_s'] * 1000:.1f} ms",
                f"{row['ls_waiting_s'] * 1000:.0f} ms",
                f"{row['ls_limit5_s'] * 1000:.0f} ms",
                f"{row['listing_first_gets']:,} GET, {row['listing_first_s']:.2f} s; "
                f"later {row['listing_later_s']:.2f} s",
                "yes" if row["next_scan_finds"] else "NO",
                "PASS"
                if row["index_first_gets"] <= live and not row["index_later_gets"]
                else "MISS",
            ]
        )
    text = table(
        "scale: 20 live runs beside N finished ones (index of runs; before it: list everything)",
        [
            "store",
            "finished",
            "first scan",
            "later scan",
            "ls -s waiting",
            "ls --limit 5",
            "before the index (first; later)",
            "next scan finds",
            "reads",
        ],
        lines,
    )
    flat = []
    for name in {r["store"] for r in rows}:
        mine = sorted((r for r in rows if r["store"] == name), key=lambda r: r["finished"])
        small, large = mine[0], mine[-1]
        for key in ("index_later_s", "ls_waiting_s", "ls_limit5_s"):
            ratio = large[key] / small[key] if small[key] else float("inf")
            verdict = "PASS" if ratio <= FLAT else "MISS"
            flat.append(
                [
                    name,
                    key,
                    f"{large['finished']:,} / {small['finished']:,}",
                    f"{ratio:.2f}",
                    verdict,
                ]
            )
    text += "\n" + table(
        f"scale: larger size over smaller (flat: <= {FLAT})",
        ["store", "figure", "sizes", "ratio", "verdict"],
        flat,
    )
    return text
