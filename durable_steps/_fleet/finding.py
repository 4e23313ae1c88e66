"""Finding a workflow's claimable runs: through the index, or by listing every run.

A :class:`Finder` is the memory of a worker (thread pool or Ray driver)
between its scans. On a store whose index is complete (see ``_fleet.index``) a
scan is one LIST of the workflow's live markers. What a marker's name says
decides most runs with no GET at all — a submitted or released run is ready,
a waiting one is ready once its time is due or a nudge says its signal
came, a failed one only for ``retry_failed``, one in doubt never. A run that
is ``running`` (or whose markers disagree) needs its head: it is read once,
and then again only when the owner's remembered lease has run out (an owner
on this host whose process is gone is noticed from memory) or its markers
change. A scan in which nothing changed reads nothing but the listing.

A store whose index is not complete — runs written by an earlier version,
or an index in the earlier layout (a folder per run), before ``durable-steps
reindex`` — is scanned the old way: one LIST of the
whole workflow and a GET of each head whose version changed, with a warning
that says what to run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._drivers import drive_sync
from .._events import logger
from .._record import checkpoint as ckpt
from ..errors import CorruptCheckpoint, DefinitionError, DurableStepsError
from ..stores import command_hint
from . import index as _index
from . import listing
from . import signals as _signals
from .clearing import clear_leftovers
from .leases import is_live, store_skew

if TYPE_CHECKING:
    from ..stores import ObjectInfo, Store

__all__ = ["Finder"]

_RECHECK = 60.0
"""Seconds between two looks at a run that is quarantined or whose head is corrupt."""


@dataclass
class _Seen:
    """What a run's head said when it was last read."""

    version: str
    status: str
    owner: dict[str, Any] | None
    updated_at: float | None = None
    wait: dict[str, Any] | None = None
    nonce: str = ""
    read_at: float = field(default_factory=time.time)

    @classmethod
    def of(cls, data: bytes, version: str, key: str) -> _Seen:
        try:
            header, _ = ckpt.decode(data, where=f"checkpoint {key!r}")
        except CorruptCheckpoint as exc:
            logger.warning("worker: skipping %s", exc)
            return cls(version, "corrupt", None)
        return cls(
            version, header.status, header.owner, header.updated_at, header.wait, header.run_nonce
        )

    def due(self, now: float, signalled: bool) -> bool:
        """Whether a waiting run can go on: its time came, or its signal was sent."""
        wait = self.wait or {}
        until = wait.get("until")
        return (until is not None and now >= until) or (
            wait.get("signal") is not None and signalled
        )


class Finder:
    """The runs of ``workflow`` in ``store`` that a worker may claim now."""

    def __init__(
        self, store: Store, workflow: str, lease: float, statuses: tuple[str, ...]
    ) -> None:
        self.store = store
        self.workflow = workflow
        self.lease = lease
        self.statuses = statuses
        self.indexed = False
        """The registry says every run of the workflow is in the index."""
        self._warned = False
        self._seen: dict[str, _Seen] = {}
        self._keys: dict[str, frozenset[str]] = {}
        self.quarantine: dict[str, str | None] = {}
        """Runs that raised an unexpected error, with the version they had then
        (None until a scan sees it): skipped until someone changes them."""
        self._skipped: set[str] = set()
        self._lives: dict[str, listing.Live] = {}
        self._lock = threading.Lock()  # the worker's threads report a gone run (see gone)

    def claimable(self, limit: int | None, exclude: set[str] | frozenset[str]) -> list[str]:
        """Up to ``limit`` run ids nobody runs now (see the module docstring)."""
        with self._lock:
            if not self.indexed:
                found = drive_sync(_index.workflows(), self.store)
                self.indexed = found.get(self.workflow, False)
            if self.indexed:
                return self._indexed(limit, exclude)
            return self._listed(limit, exclude)

    # --- through the index ----------------------------------------------------------

    def _indexed(self, limit: int | None, exclude: set[str] | frozenset[str]) -> list[str]:
        now = time.time()
        skew = store_skew(self.store)
        lives = drive_sync(listing.live_runs(self.workflow), self.store)
        lives.sort(key=lambda live: live.since)  # the longest waiting first
        found: list[str] = []
        for live in lives:
            if limit is not None and len(found) >= limit:
                break
            if live.run_id in exclude or not self._valid(live.run_id, live.markers):
                continue
            if self._keys.get(live.run_id) != live.keys:  # it changed class: forget its head
                self._keys[live.run_id] = live.keys
                self._seen.pop(live.run_id, None)
            if self._ready(live, now, skew):
                found.append(live.run_id)
        listed = {live.run_id for live in lives}
        self._lives = {live.run_id: live for live in lives}
        for table in (self._keys, self._seen, self.quarantine):
            for run_id in table.keys() - listed - set(exclude):
                del table[run_id]
        return found

    def _ready(self, live: listing.Live, now: float, skew: float | None) -> bool:
        """Whether ``live`` can be claimed, from its markers where they suffice."""
        hint = live.hint
        seen = self._seen.get(live.run_id)
        if hint is not None and hint.kind != "running" and seen is None:
            if live.run_id in self.quarantine:
                return self._requarantined(live, now, skew)
            if not self._settled(live, now, skew):
                return self._hinted(live, hint, now)
        if seen is None or self._outdated(seen, live, now, skew):
            seen = self._read(live, now, skew)
            if seen is None:
                return False
        if live.run_id in self.quarantine and not self._released(live.run_id, seen):
            return False
        if seen.status == "waiting":
            signal = (seen.wait or {}).get("signal")
            return seen.due(now, signal is not None and live.signalled(seen.nonce, signal))
        return seen.status in self.statuses and not is_live(
            seen.owner, now=now, skew=skew, since=seen.updated_at, lease=self.lease
        )

    def _settled(self, live: listing.Live, now: float, skew: float | None) -> bool:
        """Whether none of the run's entries changed in :data:`~durable_steps._fleet.index.GRACE`:
        then its head is read once (and remembered while its entries stay as they are).
        A marker judged by its name alone could be all an interrupted ``rm`` left — a
        waiting or in-doubt run's is never claimed, so nothing else would read its
        head and clean it up. One GET per run and class change, not per scan.
        """
        store_now = now - (skew or 0.0)
        return all(store_now - e.modified > _index.GRACE for e in live.entries)

    def _hinted(self, live: listing.Live, hint: _index.Entry, now: float) -> bool:
        """Whether a run is ready by its one marker alone (a class that needs no head)."""
        if hint.kind == "waiting":
            due = hint.until is not None and now >= hint.until
            return due or (hint.signal is not None and live.signalled(hint.nonce, hint.signal))
        return hint.kind in ("queued", "stopped") or (
            hint.kind == "failed" and "failed" in self.statuses
        )

    def recheck(self, run_id: str) -> None:
        """After a run was resumed (or found gone, or already finished): read its
        head once, so that what the index says of it is repaired — an entry a
        crash left stale, or one that outlived its run — and not tried again.
        """
        with self._lock:
            live = self._lives.get(run_id)
            if live is None:
                return
            try:
                seen = self._read(live, time.time(), store_skew(self.store))
                if seen is not None and seen.status == "waiting":
                    self._orphaned(live, seen)
            except DurableStepsError as exc:  # the next scan that reads it repairs it
                logger.info("worker %s: could not recheck run %s (%s)", self.workflow, run_id, exc)

    def _orphaned(self, live: listing.Live, seen: _Seen) -> None:
        """A run resumed and waiting again for a signal whose nudge it has: is the
        signal there, and one its wait takes? If not, the nudge is an orphan — its
        sender died between it and the signal object (see ``_fleet.signals.send``), or it
        sent a payload the wait does not accept (an approval of another shape,
        sent before the run waited), which decides nothing — and trusting it
        would resume the run at every scan, for ever. It is deleted, then the signal looked at
        again: one that landed meanwhile gets its nudge back (the sender writes it
        once more after the signal too, so a wake is never lost whatever the order).
        Only after a resume came back waiting: two GETs, never per scan.
        """
        signal, accepts = (seen.wait or {}).get("signal"), (seen.wait or {}).get("accepts")
        if signal is None or not live.signalled(seen.nonce, signal):
            return
        key = _signals.signal_key(self.workflow, live.run_id, signal)

        def there() -> bool:
            got = self.store.get(key)
            return got is not None and _signals.wakes(got[0], seen.nonce, accepts)

        if there():
            return
        nudge = _index.nudge_key(self.workflow, live.run_id, seen.nonce, signal)
        logger.info(
            "worker %s: run %s was nudged for signal %r, which was never sent (its sender "
            "died in between) or is not of a shape its wait accepts; the nudge is deleted",
            self.workflow,
            live.run_id,
            signal,
        )
        self.store.delete(nudge)
        if there():
            drive_sync(_index.create_entry(nudge), self.store)

    def head(self, run_id: str) -> _Seen | None:
        """The run's head as it is now (read, not remembered), or None if it is gone."""
        key = ckpt.checkpoint_key(self.workflow, run_id)
        got = self.store.get(key)
        return None if got is None else _Seen.of(got[0], got[1], key)

    def _outdated(self, seen: _Seen, live: listing.Live, now: float, skew: float | None) -> bool:
        """Whether a remembered head may have changed in a way that matters: its
        owner's lease ran out by memory (it may have renewed it since), it is
        missing while an entry is young (a creation in progress: its head lands
        in a moment, and the next scan must see it — the marker's name will not
        change to say so), or it is corrupt or missing for good (looked at again
        now and then).
        """
        if seen.status == "missing":
            store_now = now - (skew or 0.0)
            if any(store_now - e.modified <= _index.GRACE for e in live.entries):
                return True
        if seen.status in ("corrupt", "missing"):
            return now - seen.read_at > _RECHECK
        return seen.status == "running" and not is_live(
            seen.owner, now=now, skew=skew, since=seen.updated_at, lease=self.lease
        )

    def _read(self, live: listing.Live, now: float, skew: float | None) -> _Seen | None:
        """GET the run's head, remember it, and repair what the index says of it."""
        key = ckpt.checkpoint_key(self.workflow, live.run_id)
        got = self.store.get(key)
        header = None
        if got is None:  # entries with no head: a creation in progress, or left over
            self._seen[live.run_id] = _Seen("", "missing", None)
        else:
            seen = _Seen.of(got[0], got[1], key)
            self._seen[live.run_id] = seen
            if seen.status != "corrupt":
                header = ckpt.decode(got[0], where=f"checkpoint {key!r}")[0]
        store_now = now - (skew or 0.0)
        if got is None and all(store_now - e.modified > _index.GRACE for e in live.entries):
            # Gone for good (not a creation in progress): what an interrupted rm left
            # — but a new run may be created under the id this very moment, after
            # our GET: only parts older than GRACE go, and none while a younger
            # one is there (its entries wait for a later scan).
            cleared = clear_leftovers(self.workflow, live.run_id, store_now - _index.GRACE)
            if not drive_sync(cleared, self.store):
                return self._seen.get(live.run_id)
        if got is None or header is not None:
            drive_sync(listing.repair(live, header, store_now), self.store)
        return self._seen.get(live.run_id)

    def _requarantined(self, live: listing.Live, now: float, skew: float | None) -> bool:
        """A quarantined run's head, read again once a while: changed, it may go."""
        seen = self._read(live, now, skew)
        return (
            seen is not None and self._released(live.run_id, seen) and self._ready(live, now, skew)
        )

    def _released(self, run_id: str, seen: _Seen) -> bool:
        """Whether a quarantined run changed since it failed (then it leaves quarantine)."""
        held = self.quarantine.get(run_id)
        if held is None or held == seen.version:
            self.quarantine[run_id] = seen.version
            return False
        del self.quarantine[run_id]
        return True

    def _valid(self, run_id: str, where: object) -> bool:
        """Whether ``run_id`` is a run id (an odd key is logged once and skipped)."""
        try:
            ckpt.validate_name(run_id, "run id")
        except DefinitionError:
            if run_id not in self._skipped:
                self._skipped.add(run_id)
                logger.warning(
                    "worker %s: skipping %r: %r is not a valid run id, so it is no run of ours",
                    self.workflow,
                    where,
                    run_id,
                )
            return False
        return True

    # --- by listing every run (a store the index does not cover yet) --------------------

    def _listed(self, limit: int | None, exclude: set[str] | frozenset[str]) -> list[str]:
        """One LIST of the whole workflow; a GET for a run whose version changed."""
        now = time.time()
        skew = store_skew(self.store)
        found: list[str] = []
        infos, signals = self._listing()
        if infos and not self._warned:
            self._warned = True
            logger.warning(
                "worker %s: this store has runs written before the index of runs (or the "
                "index is not complete, or in an earlier layout), so every scan lists and "
                "reads every run. Run "
                "`%s reindex --workflow %s` once to make scans cost only the live runs.",
                self.workflow,
                command_hint(self.store),
                self.workflow,
            )
        for info in infos:
            if limit is not None and len(found) >= limit:
                break
            run_id = info.key[len(self.workflow) + 1 : -len(ckpt.CHECKPOINT_OBJECT) - 1]
            if run_id in exclude or not self._valid(run_id, info.key):
                continue
            if run_id in self.quarantine and not self._unchanged_since(run_id, info.version):
                continue
            seen = self._seen.get(run_id)
            if seen is None or seen.version != info.version:
                got = self.store.get(info.key)
                if got is None:
                    self._seen.pop(run_id, None)
                    continue
                seen = self._seen[run_id] = _Seen.of(got[0], got[1], info.key)
            if seen.status == "waiting":
                ready = seen.due(now, (seen.wait or {}).get("signal") in signals.get(run_id, ()))
            else:
                ready = seen.status in self.statuses and not is_live(
                    seen.owner, now=now, skew=skew, since=seen.updated_at, lease=self.lease
                )
            if ready:
                found.append(run_id)
        listed = {info.key[len(self.workflow) + 1 :].split("/")[0] for info in infos}
        for table in (self._seen, self.quarantine):
            for run_id in table.keys() - listed:
                del table[run_id]
        return found

    def _unchanged_since(self, run_id: str, version: str) -> bool:
        """False while a quarantined run keeps the version it failed with."""
        held = self.quarantine[run_id]
        if held is None or held == version:
            self.quarantine[run_id] = version
            return False
        del self.quarantine[run_id]
        return True

    def _listing(self) -> tuple[list[ObjectInfo], dict[str, set[str]]]:
        """One LIST: the checkpoints of the workflow, and the signals sent, by run id."""
        infos: list[ObjectInfo] = []
        signals: dict[str, set[str]] = {}
        prefix, suffix = f"{self.workflow}/", f"/{ckpt.CHECKPOINT_OBJECT}"
        for info in self.store.list(prefix):
            if info.key.endswith(suffix):
                infos.append(info)
                continue
            run_id, sep, name = info.key[len(prefix) :].partition("/signals/")
            if sep and name:
                signals.setdefault(run_id, set()).add(name)
        return infos, signals
