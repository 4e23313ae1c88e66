"""Reading a run's whole history for the timeline: one LIST, the chunks in parallel, cached.

A run's history (:mod:`durable_steps._record.history`) is its head's
``log`` and the immutable chunks under ``history/``. Chunks never change
once written (a chunk's name is its digest), so the page keeps the ones it
read (a bounded cache, by key *and* the version the LIST gives: an object
rewritten in place is read again, so a chunk edited after the page first
saw it is found out) and a later look at the same run reads only the
chunks written since. Only the page of the timeline shown is decoded.

Where the chain of chunks breaks, :attr:`History.broken` says why: a chunk
that is gone (the entries before it are not kept) is not one whose bytes no
longer match its name (changed after it was written: tampered, or damaged),
and the page says which.

A step that ran again after a failure, or after a person resolved what was
in doubt, is marked on its row (:func:`rerun`): the history records those
runs as entries of the same step and pass just before it. A crash records
nothing (the attempt died with its process), so nothing is said of one.
"""

from __future__ import annotations

import itertools
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


def _fetch(store: Store, listed: list[tuple[str, str]]) -> dict[str, bytes]:
    """The bytes of each listed ``(key, version)``: cached, or a GET (in parallel)."""
    found: dict[str, bytes] = {}
    with _lock:
        for key, version in listed:
            if f"{key}\0{version}" in _cache:
                found[key] = _cache[f"{key}\0{version}"]
    missing = [k for k, _ in listed if k not in found]

    def get(key: str) -> tuple[str, tuple[bytes, str] | None]:
        return key, store.get(key)

    if missing:
        with ThreadPoolExecutor(max_workers=min(16, len(missing))) as pool:
            for key, got in pool.map(get, missing):
                if got is not None:
                    found[key] = got[0]
                    _remember(f"{key}\0{got[1]}", got[0])
    return found


@dataclass(frozen=True)
class History:
    """A run's history, its entries decoded on demand (a page at a time)."""

    segments: list[history.Segment]
    created: float
    broken: tuple[str, str] | None = None
    """Where the chain of chunks ended early: ``(reason, words)``, the reason
    :attr:`history.Followed.reason` (None: it is whole)."""

    @property
    def first(self) -> int:
        """The index of the first entry kept (more than 0: a chunk was lost)."""
        return self.segments[0].first if self.segments else 0

    @property
    def total(self) -> int:
        """How many entries are kept."""
        return sum(s.count for s in self.segments)

    def entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries ``[lo, hi)`` of those kept, as timeline entries, each run
        again after a failure or a resolution marked so (:func:`rerun`).
        """
        decoded: dict[int, list[history.Commit]] = {}
        commits = self._commits(lo, hi, decoded)
        before: list[history.Commit] = []  # the earlier runs of the first entry's step,
        at = lo  # newest first: they may lie on earlier pages, even in earlier chunks
        while commits and at > 0:
            block = self._commits(max(0, at - _BACK), at, decoded)
            ours = list(itertools.takewhile(lambda e: _again(e, commits[0]), block[::-1]))
            before += ours
            if not block or len(ours) < len(block):
                break
            at -= len(block)
        before.reverse()
        out: list[Entry] = []
        for c in commits:
            prior = before if before and _same(before[-1], c) else []
            out.append(_entry(c, rerun(prior, c)))
            before = [*prior, c] if c.kind in _RUNS_BEFORE else []
        return out

    def _commits(
        self, lo: int, hi: int, decoded: dict[int, list[history.Commit]]
    ) -> list[history.Commit]:
        """Entries ``[lo, hi)``, decoding each segment once (``decoded``, by segment)."""
        out: list[history.Commit] = []
        at = 0
        for n, segment in enumerate(self.segments):
            if at + segment.count > lo and at < hi:
                if n not in decoded:
                    decoded[n] = history.decode(segment, self.created)
                out += decoded[n][max(0, lo - at) : hi - at]
            at += segment.count
        return out


_BACK = 256
"""Entries read back at a time, looking for a step's earlier runs before a page."""
_RUNS_BEFORE = ("failed", "resolution")
"""Entries after which the same step of the same pass runs again."""


def _same(a: history.Commit, b: history.Commit) -> bool:
    return (a.step, a.iteration) == (b.step, b.iteration)


def _again(earlier: history.Commit, entry: history.Commit) -> bool:
    """Whether ``earlier`` is a run of ``entry``'s step that ``entry`` ran again after."""
    return earlier.kind in _RUNS_BEFORE and _same(earlier, entry)


def rerun(prior: list[history.Commit], c: history.Commit) -> str:
    """What the history says of ``c``'s earlier runs (``prior``: the failures and
    resolutions of its step and pass just before it), in words; empty when it
    ran once. Only what the entries record: each failure's attempts, each
    resolution's verdict. An attempt that died in a crash left no entry and is
    not counted (see the module docstring).
    """
    if c.kind not in ("committed", "failed") or not prior:
        return ""
    failures = [p for p in prior if p.kind == "failed"]
    said = [p for p in prior if p.kind == "resolution"]
    words = []
    if failures:
        n = len(failures)
        after = "a failure" if n == 1 else f"{n} failures"
        attempts = sum(p.attempts for p in failures) + c.attempts
        words.append(
            f"ran again after {after}: run {n + 1} of this step in pass {c.iteration}, "
            f"{attempts} attempts in all"
        )
    if said:
        verdict = "did not fire" if not said[-1].attempts else "fired"
        words.append(f"ran again after a person resolved it ({verdict})")
    return "; ".join(words)


def _entry(c: history.Commit, again: str = "") -> Entry:
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
            rerun=again,
        )
    outcome = "committed" if c.attempts == 1 else f"committed after {c.attempts} attempts"
    return Entry(
        c.start,
        "step",
        c.step,
        c.iteration,
        c.attempts,
        c.duration,
        outcome,
        detail=journal,
        rerun=again,
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
        found = _fetch(store, [(info.key, info.version) for info in store.list(prefix)])
    followed = history.follow(header, found)
    if followed is None:
        return None
    return History(followed.segments, header.created_at, _broken(followed))


def _broken(followed: history.Followed) -> tuple[str, str] | None:
    """Why the chain of chunks ended early, for the page (None: it did not)."""
    key, reason = followed.broken, followed.reason
    if key is None or reason is None:
        return None
    if reason == "missing":
        return reason, f"history chunk {key!r} is missing: the entries before it are not kept"
    if reason == "tampered":
        return reason, (
            f"history chunk {key!r} does not match its digest: it was changed after it "
            "was written (chunks never change: tampered with, or damaged). It and the "
            "entries before it are not shown"
        )
    return reason, (
        f"history chunk {key!r} is not a chunk of this run (another run's, or not a "
        "history chunk): it and the entries before it are not shown"
    )
