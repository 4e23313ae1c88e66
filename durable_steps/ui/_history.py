"""Reading a run's whole history for the timeline: one LIST, the chunks in parallel, cached.

A run's history (:mod:`durable_steps._record.history`) is its head's
``log`` and the immutable chunks under ``history/``. Chunks never change
once written (a chunk's name is its digest), so the page keeps the ones it
read (a bounded cache, by key) and a later look at the same run reads only
the chunks written since. Only the page of the timeline shown is decoded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .._record import checkpoint as ckpt
from .._record import history
from ..stores import Store
from ._timeline import Entry

__all__ = ["History", "read"]

_CACHE_BYTES = 32 * 1024 * 1024
_cache: OrderedDict[str, bytes] = OrderedDict()
_cached = [0]
_lock = threading.Lock()


def _remember(key: str, data: bytes) -> None:
    with _lock:
        if key in _cache:
            return
        _cache[key] = data
        _cached[0] += len(data)
        while _cached[0] > _CACHE_BYTES and _cache:
            _, old = _cache.popitem(last=False)
            _cached[0] -= len(old)


def _fetch(store: Store, keys: list[str]) -> dict[str, bytes]:
    with _lock:
        found = {k: _cache[k] for k in keys if k in _cache}
    missing = [k for k in keys if k not in found]

    def get(key: str) -> tuple[str, bytes | None]:
        got = store.get(key)
        return key, None if got is None else got[0]

    if missing:
        with ThreadPoolExecutor(max_workers=min(16, len(missing))) as pool:
            for key, data in pool.map(get, missing):
                if data is not None:
                    found[key] = data
                    _remember(key, data)
    return found


@dataclass(frozen=True)
class History:
    """A run's history, its entries decoded on demand (a page at a time)."""

    segments: list[history.Segment]
    created: float

    @property
    def first(self) -> int:
        """The index of the first entry kept (more than 0: a chunk was lost)."""
        return self.segments[0].first if self.segments else 0

    @property
    def total(self) -> int:
        """How many entries are kept."""
        return sum(s.count for s in self.segments)

    def entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries ``[lo, hi)`` of those kept, as timeline entries."""
        out: list[Entry] = []
        at = 0
        for segment in self.segments:
            if at + segment.count > lo and at < hi:
                made = history.decode(segment, self.created)
                out += [_entry(c) for c in made[max(0, lo - at) : hi - at]]
            at += segment.count
        return out


def _entry(c: history.Commit) -> Entry:
    # The log keeps each count in 6 bits (history.py): 63 means "63 or more".
    journal = ", ".join(
        f"{'63+' if n >= 63 else n} {what}{'s' * (n != 1)}"
        for n, what in ((c.calls, "call"), (c.effects, "effect"), (c.waits, "wait"))
        if n
    )
    if c.kind == "resolved":
        return Entry(
            c.start,
            "resolved",
            c.step,
            c.iteration,
            0,
            None,
            "resolved as fired: counted as done, not run",
        )
    if c.kind == "resolution":
        what = f"{c.effects} effect{'s' * (c.effects != 1)}" if c.effects else "the step"
        verdict = "fired" if c.attempts else "did not fire"
        return Entry(
            c.start,
            "resolution",
            c.step,
            c.iteration,
            None,
            None,
            f"resolved by a person: {verdict}",
            detail=f"{what} in doubt",
        )
    if c.kind == "failed":
        return Entry(
            c.start,
            "failure",
            c.step,
            c.iteration,
            c.attempts,
            None,
            f"failed after {c.attempts} attempt{'s' * (c.attempts != 1)}",
        )
    outcome = "committed" if c.attempts == 1 else f"committed after {c.attempts} attempts"
    return Entry(
        c.start, "step", c.step, c.iteration, c.attempts, c.duration, outcome, detail=journal
    )


def read(store: Store, header: ckpt.Checkpoint) -> History | None:
    """The run's history (None: written before runs kept one): a LIST of its
    chunks and a GET of each one not cached yet, when it has any.
    """
    if header.log is None:
        return None
    found: dict[str, bytes] = {}
    if header.log.get("last"):
        prefix = history.history_prefix(header.workflow, header.run_id)
        found = _fetch(store, [info.key for info in store.list(prefix)])
    return History(history.chain(header, found) or [], header.created_at)
