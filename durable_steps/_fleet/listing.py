"""The index of runs, read: what is live, and repairs by whoever finds a stale entry.

:mod:`durable_steps._fleet.index` names the entries and writes them as runs change
class; this module lists them (one LIST for the live runs of a workflow, one
for its newest finished runs) and, for a reader that went on to read a
run's head, brings the run's entries in line with it (:func:`repair`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._drivers import Delete, Get, ListObjects, Protocol
from .._events import logger
from ..errors import DurableStepsError, StoreError
from . import index as _index
from .index import (
    NONCE_CHARS,
    Entry,
    create_entry,
    done_prefix,
    entry_of,
    live_prefix,
    marker_of,
    parse,
    signal_token,
)

if TYPE_CHECKING:
    from .._record.checkpoint import Checkpoint

__all__ = ["Live", "done_runs", "live_runs", "repair"]


@dataclass(frozen=True)
class Live:
    """What the index says of one live run: its markers, and the signals sent to it."""

    workflow: str
    run_id: str
    markers: tuple[Entry, ...]
    nudges: tuple[Entry, ...]

    @property
    def hint(self) -> Entry | None:
        """The run's one marker; None when it has several (or none): read the head."""
        return self.markers[0] if len(self.markers) == 1 else None

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The markers and the nudges."""
        return (*self.markers, *self.nudges)

    @property
    def keys(self) -> frozenset[str]:
        """Every entry's key: what changed since a scan is told by this."""
        return frozenset(e.key for e in (*self.markers, *self.nudges))

    @property
    def since(self) -> float:
        """When the run last changed class, as far as the index tells (store clock)."""
        return max((e.modified for e in (*self.markers, *self.nudges)), default=0.0)

    def signalled(self, nonce: str, signal: str) -> bool:
        """Whether signal ``signal`` was sent to the run with ``nonce``."""
        token = signal_token(signal)
        return any(n.signal == token and n.nonce == nonce[:NONCE_CHARS] for n in self.nudges)


def live_runs(workflow: str | None = None) -> Protocol[list[Live]]:
    """The live runs of ``workflow`` (of every workflow with None): one LIST."""
    grouped: dict[tuple[str, str], tuple[list[Entry], list[Entry]]] = {}
    for info in (yield ListObjects(live_prefix(workflow))):
        entry = parse(info)
        if entry is None:
            continue
        markers, nudges = grouped.setdefault((entry.workflow, entry.run_id), ([], []))
        (nudges if entry.kind == "signal" else markers).append(entry)
    return [Live(w, r, tuple(m), tuple(n)) for (w, r), (m, n) in grouped.items()]


def done_runs(workflow: str, limit: int | None = None) -> Protocol[list[Entry]]:
    """The finished runs of ``workflow``, newest first (at most ``limit``)."""
    infos = yield ListObjects(done_prefix(workflow), limit)
    return [e for e in map(parse, infos) if e is not None]


def repair(live: Live, header: Checkpoint | None, now: float) -> Protocol[None]:
    """Bring ``live``'s entries in line with the head just read (None: no head).

    Called by whoever read the head of a run the index lists (a worker's
    scan): the marker the head calls for is created if missing; what
    outlived its run is removed — every entry of a finished head's nonce
    (once its done entry exists), and after :data:`~durable_steps._fleet.index.GRACE` the entries
    of no head or of another nonce, and markers of this nonce that the head does
    not call for. ``now`` is on the store's clock. Best effort.

    Why deleting is safe. An entry of no head or of another nonce older than
    :data:`~durable_steps._fleet.index.GRACE` is no creation in progress (a creation sends its head
    within
    :data:`~durable_steps._fleet.index.CREATE_WITHIN` of its marker, or gives up), and a nonce never
    comes back. A marker of the head's *own* nonce is another matter: marker
    keys are reused (class and nonce), a writer that finds its new marker
    there already keeps it as it is (old), and the head may change class
    between our GET and our delete — the owner releasing the run moves back
    into exactly the stale ``stopped`` marker we are about to delete. So after
    deleting one, the head is read again and the marker *it* calls for is
    created (create-only): any class change whose marker write came before
    our delete had its head written before it too, so this second read sees
    it (or a later one, whose writer writes its own marker after it). One
    more GET, only when a crash left a stale marker of a live run.
    """
    try:
        if header is None:
            for entry in live.entries:
                if now - entry.modified > _index.GRACE:
                    yield Delete(entry.key, None)
            return
        wanted = entry_of(header)
        if wanted not in live.keys:
            yield from create_entry(wanted)
        nonce = header.run_nonce[:NONCE_CHARS]
        finished = marker_of(header) is None
        deleted_mine = False
        for entry in live.entries:
            mine = entry.nonce == nonce
            old = now - entry.modified > _index.GRACE
            stale = entry.kind != "signal" and entry.key != wanted
            if (finished and mine) or (old and (not mine or stale)):
                yield Delete(entry.key, None)
                deleted_mine = deleted_mine or (mine and not finished)
        if deleted_mine:
            yield from _reread(header)
    except StoreError as exc:
        logger.info("run %s/%s: index repair failed (%s)", live.workflow, live.run_id, exc)


def _reread(header: Checkpoint) -> Protocol[None]:
    """After deleting a stale marker of a live head: the head again, and the entry
    it calls for now created (see :func:`repair`).
    """
    from .._record import checkpoint as ckpt

    key = ckpt.checkpoint_key(header.workflow, header.run_id)
    got = yield Get(key)
    if got is None:
        return
    try:
        now, _ = ckpt.decode(got[0], where=f"checkpoint {key!r}")
    except DurableStepsError:  # corrupt: the next reader that reads it says so
        return
    yield from create_entry(entry_of(now))
