r"""The index of runs: finding work costs what is live, not what ever ran.

A store holds a few hundred live runs among hundreds of thousands that
finished. Everything that looks for work (a worker's scan, ``ls --status``
of a live status, the web page) reads this index instead of every run's
head. It lives in key *names*, under the reserved top-level prefix
``_index/`` (no workflow name starts with ``_``), so that one LIST with a
prefix answers the question and an entry's name carries what a reader
needs — no GET of a finished run, none at all when nothing changed::

    _index/live2/<workflow>/<run_id>~<class>-<nonce16>[-<until_ms>-<signal>]
    _index/live2/<workflow>/<run_id>~signal-<nonce16>-<name>
    _index/done/<workflow>/<inv_hour>/<inv_ms>-<nonce16>-<status>-<run_id>
    _index/workflows/<workflow>/flat
    _index/flat-complete

Live markers
    A live run (not completed, not deleted) has a *marker* naming its class
    — ``queued`` (submitted, never started), ``running`` (an owner holds it,
    or held it and crashed), ``stopped`` (released by its owner), ``waiting``
    (with its wake time and signal), ``failed``, ``in_doubt`` — and the first
    16 hex digits of its nonce. A marker is empty; its name is derived from
    the run's head alone (:func:`marker_of`), so anyone who reads a head
    knows which marker it calls for. Markers change only when a run changes
    class: a committed step is still one PUT.
Signals
    ``wf.signal`` creates a *nudge* beside the markers before the signal
    object itself, so the scan that lists a waiting run's marker also sees
    that its signal came; a due timer is in the marker's name. A waiting run
    is ready without a GET. A sender killed between the two leaves a nudge
    with no signal: the worker whose resume of the run finds none deletes it
    (then looks again, and puts it back if the signal landed meanwhile), and
    the sender writes its nudge once more after the signal, so no order of
    the two loses a wake (see ``_fleet.finding.Finder._orphaned``).
Finished runs
    A completed (or tombstoned) run has a *done entry* instead, named by its
    completion time inverted, so a LIST of ``done/<workflow>/`` yields the
    newest first and ``ls --limit N`` reads N entries at any size; the hour
    bucket keeps each directory of the local store bounded. ``prune``
    reads the completion time from the name.
Flat: no directory per run
    The live entries are named *beside* each other under the workflow's
    prefix — ``<run_id>~<name>``, ``~`` being in no run id — not in a folder
    per run. A store that keeps a directory per key prefix (SeaweedFS's filer;
    the local store, which removes its empty ones) would otherwise keep one
    empty directory for every run that ever lived once its markers are
    deleted, and a LIST of the live runs walks them all: on SeaweedFS a
    warm scan beside 20 live runs grew 12x from 400 to 4,000 finished runs
    (``tests/benchmarks/bench_flat.py``; docs/performance.md). Flat, what a
    scan lists is what is live. The file name must still fit in 255 bytes on
    the local store: a run id over :data:`LONG_RUN_ID` characters keeps a
    folder (``<run_id>/<name>``, rare, and left empty when it ends), and a
    signal name over :data:`SIGNAL_CHARS` characters appears in a marker or a
    nudge as ``_`` and 12 hex digits of its SHA-256 (:func:`signal_token`:
    no signal name starts with ``_``; readers compare tokens). The earlier
    layout, ``_index/live/<workflow>/<run_id>/<name>``, is read only by
    ``reindex``, which moves a store out of it (see the registry).
The registry
    ``workflows/<workflow>/<state>`` names the workflows, for a bare run id
    and for ``ls`` of every workflow. The state ``flat`` says that every run
    of the workflow has its entries in this layout (the first run of an
    empty workflow says so, or ``durable-steps reindex`` built or moved
    them); ``partial`` (runs written by a version before the index may lack
    entries) and ``indexed`` (complete, but in the earlier per-run-folder
    layout) make readers list every run, as before, and say what to run.
    ``flat-complete`` says every workflow of the store is registered. Both
    are names a release of the earlier layout does not know (its
    ``_index/complete`` is no prefix of them): a reader of that release never
    trusts an index it cannot read, it lists every run of a store this
    layout made.

The protocol (why a crash at any instant loses no run)
    A run is *findable* while its head is live and at least one marker of
    its nonce exists. Creating a run writes its marker *before* its head
    (create-only both), so a live head always has one. Every later class
    change writes the head first, then the new marker, then deletes the old
    one: a crash between leaves the old marker, a *stale hint* — still a
    marker of the run, so still findable (a run leaving ``failed`` or
    ``in_doubt``, classes workers skip, gets its new marker before its head
    too, so that no such hint can hide it). Readers never trust a hint that
    could hide work: a ``running`` hint makes them read the head once the
    owner's remembered lease runs out, and the other hints are only ever
    stale in the safe direction (a ``waiting`` marker left by a run woken
    since was due or nudged when it woke, and stays so; a ``queued`` or
    ``stopped`` one makes a reader try a claim, which reads the head). A
    reader that read a head creates the marker it calls for when missing
    (create-only: adding a marker never loses a run) and removes what
    outlived its run: every entry of a run whose head is terminal (markers
    of that nonce, after its done entry exists), and entries whose head is
    gone or belongs to another nonce once they are older than
    :data:`GRACE` — a creation in progress writes its marker first, and
    gives up (writes no head) if its head is not sent within a third of it.
    A marker of a live head's own nonce that the head does not call for is
    deleted only after :data:`GRACE` too, and then the head is read again and
    the marker it calls for now created: marker keys are reused (class and
    nonce), so the run may have moved back into that very key since the GET
    (see :func:`~durable_steps._fleet.listing.repair`). A run leaving a hiding
    class writes its new marker again after its head, for the same reason.
    The run's nudges stay until it finishes.
Leftovers of a deleted run
    What an interrupted ``rm`` leaves — entries and parts with no head — is
    removed by the reader that finds no head once every entry is older than
    :data:`GRACE`; its parts only if all of them are that old too (a run
    created under the id right after the reader's GET writes fresh parts
    before its head; then nothing is deleted, and a later reader sees the new
    head). ``prune`` keeps ``LEFTOVER_AGE`` for parts likewise. A worker that
    judges a run by its marker's name alone (waiting, in doubt) reads its head
    once when no entry of it changed in :data:`GRACE`, so a deleted run's
    marker is not judged by its name forever: one GET per run and class
    change, not per scan.
Finished runs a crash left half-indexed
    A crash between a run's last head and its done entry leaves only its
    ``running`` marker; one in a tombstone or an ``rm`` leaves a done entry
    its head no longer calls for. Readers of done entries (``ls``) check each
    against its head, show a run once, and read further to fill ``--limit``;
    ``ls --status completed`` and ``prune`` read the heads of runs with a
    ``running`` marker too (what is live, at most).
Mixed versions (the upgrade rule)
    A process of a release before this index writes runs and signals with no
    entries. A store this layout made is registered indexed, so a worker
    never looks for those. Upgrade by stopping every process of the older
    release first; or, in a rolling deploy, run ``durable-steps reindex``
    once the last old process stopped (it writes every entry they left out
    and is safe while runs run). Finding them without that would cost a
    listing of every run, which the index exists to avoid.

This module names the entries and writes them as runs change class;
:mod:`durable_steps._fleet.listing` lists them and repairs what it finds stale;
:mod:`durable_steps._fleet.registry` keeps the registry.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._drivers import Delete, ListObjects, Protocol
from .._events import logger
from ..errors import StoreError
from .registry import (
    _REGISTERED,
    COMPLETE,
    OLD_COMPLETE,
    ROOT,
    complete,
    create_entry,
    mark_indexed,
    registered,
    registry,
    registry_key,
    workflows,
)

if TYPE_CHECKING:
    from .._record.checkpoint import Checkpoint
    from ..stores import ObjectInfo

__all__ = [
    "COMPLETE",
    "GRACE",
    "LIVE",
    "LIVE_CLASSES",
    "OLD_COMPLETE",
    "OLD_LIVE",
    "ROOT",
    "_REGISTERED",
    "Entry",
    "class_of",
    "complete",
    "create_entry",
    "done_key",
    "done_prefix",
    "live_prefix",
    "mark_indexed",
    "marker_of",
    "nudge_key",
    "old_live_prefix",
    "parse",
    "registered",
    "registry",
    "registry_key",
    "signal_token",
    "workflows",
]

LIVE = f"{ROOT}live2/"
"""Where the live entries are, flat (see the module docstring)."""
OLD_LIVE = f"{ROOT}live/"
"""Where the earlier layout put them, a folder per run (read by ``reindex`` only)."""
LONG_RUN_ID = 128
"""Run ids longer than this keep a folder of their entries: the longest flat name,
``<run_id>~waiting-<nonce16>-<until13>-<signal32>``, is then 200 characters, and the
local store's data file (``.v-<name>-<32 hex>``) stays within 255 bytes."""
SIGNAL_CHARS = 32
"""Signal names longer than this are named by :func:`signal_token` in entry names."""
GRACE = 900.0
"""Seconds an entry whose head is missing (or another nonce's) is kept: a
creation in progress has written its marker and not yet its head."""
CREATE_WITHIN = GRACE / 3
"""A creation whose head would be sent later than this after its marker gives up."""
LIVE_CLASSES = ("queued", "running", "stopped", "waiting", "failed", "in_doubt")
NONCE_CHARS = 16
"""Hex digits of a run's nonce an entry carries (enough to tell runs of one id apart)."""
_INV = 9_999_999_999_999  # inverted epoch milliseconds sort the newest first
_HOUR_MS = 3_600_000


def live_prefix(workflow: str | None = None, run_id: str | None = None) -> str:
    """Where live entries are: all, one workflow's, or one run's (a key prefix, a
    folder only for a run id over :data:`LONG_RUN_ID` characters).
    """
    if workflow is None:
        return LIVE
    if run_id is None:
        return f"{LIVE}{workflow}/"
    return f"{LIVE}{workflow}/{run_id}" + ("/" if len(run_id) > LONG_RUN_ID else "~")


def old_live_prefix(workflow: str | None = None, run_id: str | None = None) -> str:
    """:func:`live_prefix` in the earlier layout (a folder per run)."""
    if workflow is None:
        return OLD_LIVE
    return f"{OLD_LIVE}{workflow}/" + (f"{run_id}/" if run_id is not None else "")


def signal_token(name: str) -> str:
    """How signal ``name`` appears in an entry's name: itself, or ``_`` and 12 hex
    digits of its SHA-256 when longer than :data:`SIGNAL_CHARS` (a token given
    again is returned as it is: no signal name starts with ``_``).
    """
    if len(name) <= SIGNAL_CHARS or name.startswith("_"):
        return name
    return "_" + hashlib.sha256(name.encode()).hexdigest()[:12]


def done_prefix(workflow: str) -> str:
    """Where a workflow's done entries are, newest first."""
    return f"{ROOT}done/{workflow}/"


def class_of(header: Checkpoint) -> str | None:
    """The class of a run, as its marker names it; None when it is finished."""
    status = header.status
    if status in ("completed", "deleted"):
        return None
    if status == "running":
        if header.owner is not None:
            return "running"
        return "queued" if header.committed == 0 else "stopped"
    return status


def marker_of(header: Checkpoint) -> str | None:
    """The key of the marker ``header`` calls for (None: a finished run has none)."""
    kind = class_of(header)
    if kind is None:
        return None
    name = f"{kind}-{header.run_nonce[:NONCE_CHARS]}"
    if kind == "waiting" and header.wait is not None:
        until = header.wait.get("until")
        due = "x" if until is None else str(int(until * 1000))
        signal = header.wait.get("signal")
        name += f"-{due}-{signal_token(signal) if signal else ''}"
    return live_prefix(header.workflow, header.run_id) + name


def nudge_key(workflow: str, run_id: str, nonce: str, signal: str) -> str:
    """The nudge ``wf.signal`` leaves for a waiting run's scanners."""
    return live_prefix(workflow, run_id) + f"signal-{nonce[:NONCE_CHARS]}-{signal_token(signal)}"


def nudged(workflow: str, run_id: str, nonce: str, signal: str) -> Protocol[None]:
    """Before a signal object is created: its nudge (create-only; one there is fine)."""
    yield from create_entry(nudge_key(workflow, run_id, nonce, signal))


def done_key(header: Checkpoint) -> str:
    """The done entry of a finished run, named by its completion (the head's time)."""
    return done_entry(
        header.workflow, header.run_id, header.run_nonce, header.status, header.updated_at
    )


def done_entry(workflow: str, run_id: str, nonce: str, status: str, finished: float) -> str:
    """:func:`done_key` from the fields themselves (a raw header's)."""
    inverted = _INV - int(finished * 1000)
    return (
        f"{done_prefix(workflow)}{inverted // _HOUR_MS:07d}/"
        f"{inverted:013d}-{nonce[:NONCE_CHARS]}-{status}-{run_id}"
    )


@dataclass(frozen=True)
class Entry:
    """One index entry, parsed from its key (and the listing's facts)."""

    key: str
    workflow: str
    run_id: str
    kind: str
    """A live class, ``signal`` (a nudge), or a done status (``completed``, ``deleted``)."""
    nonce: str
    until: float | None = None
    signal: str | None = None
    """The signal a waiting marker waits for, or a nudge's, as :func:`signal_token` has it."""
    finished: float | None = None
    """Done entries: when the run finished (epoch seconds)."""
    modified: float = 0.0


def parse(info: ObjectInfo) -> Entry | None:
    """The entry an index key names; None for anything else found there."""
    parts = info.key.split("/")
    if len(parts) == 5 and parts[:2] == ["_index", "live"]:  # the earlier layout
        return _live_entry(info, parts[2], parts[3], parts[4])
    if len(parts) in (4, 5) and parts[:2] == ["_index", "live2"]:
        if len(parts) == 5:  # a long run id's folder
            return _live_entry(info, parts[2], parts[3], parts[4])
        run_id, flat, name = parts[3].partition("~")
        return _live_entry(info, parts[2], run_id, name) if flat and run_id else None
    if len(parts) == 5 and parts[:2] == ["_index", "done"]:
        inverted, _, rest = parts[4].partition("-")
        nonce, _, rest = rest.partition("-")
        status, _, run_id = rest.partition("-")
        if not (inverted.isdigit() and run_id and status in ("completed", "deleted")):
            return None
        finished = (_INV - int(inverted)) / 1000
        return Entry(info.key, parts[2], run_id, status, nonce, finished=finished)
    return None


def _live_entry(info: ObjectInfo, workflow: str, run_id: str, name: str) -> Entry | None:
    kind, _, rest = name.partition("-")
    nonce, _, rest = rest.partition("-")
    if len(nonce) != NONCE_CHARS:
        return None
    if kind == "signal":
        return Entry(info.key, workflow, run_id, kind, nonce, signal=rest, modified=info.modified)
    if kind not in LIVE_CLASSES:
        return None
    until, signal = None, None
    if kind == "waiting":
        due, _, name = rest.partition("-")
        until = int(due) / 1000 if due.isdigit() else None
        signal = name or None
    return Entry(info.key, workflow, run_id, kind, nonce, until, signal, modified=info.modified)


def entry_of(header: Checkpoint) -> str:
    """The entry ``header`` calls for: its live marker, or its done entry."""
    return marker_of(header) or done_key(header)


# --- writing: the run's writer keeps its entries in step with its head ------------------


def creating(header: Checkpoint) -> Protocol[float]:
    """Before a new run's head is created: its marker (create-only). Returns when
    it landed (monotonic), for :func:`too_late`.
    """
    yield from create_entry(entry_of(header))
    return time.monotonic()


def too_late(written: float) -> bool:
    """Whether a head is sent too long after its marker (see :data:`CREATE_WITHIN`)."""
    return time.monotonic() - written > CREATE_WITHIN


def abandoned(header: Checkpoint) -> Protocol[None]:
    """A creation that wrote its marker and no head (another process created the
    run first, or it gave up): its marker goes.
    """
    yield from _quietly(Delete(entry_of(header), None))


HIDING = ("failed", "in_doubt")
"""Classes a worker does not claim: a run leaving one must never be left with only
that stale marker, so its new marker is written before its head (see below)."""


def leaving(before: str | None, header: Checkpoint) -> Protocol[str | None]:
    """Before ``header`` is written over a head whose entry is ``before``: when the
    run leaves a class workers skip (:data:`HIDING`: ``resolve`` of a run in doubt,
    a failed run resumed), its new entry first. A crash after the head then leaves
    two markers (readers read the head) instead of a hint that hides the run.
    Returns the entry it created, if any (:func:`moved` writes it again all the same).
    """
    if before is None or entry_of(header) == before:
        return None
    kind = before.rpartition("/")[2].rpartition("~")[2].partition("-")[0]
    if not (before.startswith(live_prefix()) and kind in HIDING):
        return None
    yield from create_entry(entry_of(header))
    return entry_of(header)


def moved(before: str | None, header: Checkpoint) -> Protocol[str]:
    """After ``header`` was written over a head whose entry was ``before``: the
    entry ``header`` calls for, created, and the old one deleted. Returns the
    entry now standing. Best effort: a failure leaves a stale hint, which
    readers repair; so are the nudges of a finished run (a reader that finds
    them reads the head once and removes them: a completion costs no LIST).
    """
    after = entry_of(header)
    if after == before:
        return after
    try:
        # Written again even when :func:`leaving` wrote it before the head: a
        # reader's repair may have deleted it in between, while the head did not
        # call for it yet (create-only: one PUT more, only when leaving a hiding
        # class).
        yield from create_entry(after)
        if before is not None:
            yield Delete(before, None)
    except StoreError as exc:
        run = f"{header.workflow}/{header.run_id}"
        logger.info("run %s: the index lags behind its head (%s); readers repair it", run, exc)
    return after


def removed(workflow: str, run_id: str, raw: dict[str, Any] | None) -> Protocol[None]:
    """After a run's head was deleted (``rm``, ``prune``): all its entries (``raw``,
    the deleted head's fields, names its done entry; a corrupt one's is left to
    ``prune``, which finds it by its missing head). Those of the earlier layout
    too: one LIST more, for a run ``reindex`` has not moved yet.
    """
    for prefix in (live_prefix(workflow, run_id), old_live_prefix(workflow, run_id)):
        for info in (yield ListObjects(prefix)):
            yield Delete(info.key, None)
    done = done_key_of(workflow, run_id, raw)
    if done is not None:
        yield Delete(done, None)


def done_key_of(workflow: str, run_id: str, raw: dict[str, Any] | None) -> str | None:
    """:func:`done_key` of a raw header (None: a live one, or fields it lacks)."""
    fields = raw or {}
    nonce, status, when = fields.get("run_nonce"), fields.get("status"), fields.get("updated_at")
    if not (isinstance(nonce, str) and status in ("completed", "deleted")):
        return None
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        return None
    return done_entry(workflow, run_id, nonce, str(status), float(when))


def _quietly(effect: Delete) -> Protocol[None]:
    try:
        yield effect
    except StoreError as exc:
        logger.info("could not delete index entry %s (%s)", effect.key, exc)
