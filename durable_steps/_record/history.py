r"""A run's whole history, a few bytes per step: what the web page's timeline draws.

The header's ``history`` keeps the last ten commits (``show``'s "recent
steps"). The timeline needs every one — each step's pass, attempts, start,
duration and outcome, and what its journal held — for runs of 10,000 steps,
without a write more per step and without a head that grows with the run.

The record (design decision)
    Each commit (and each failure that stops a run) appends one *entry* to
    the header's ``log`` field: six unsigned LEB128 varints — ``attempts * 4
    + kind`` (kind 0 a commit, 1 a step resolved as fired, so not run, 2 a
    failure, 3 a person's resolution of what was in doubt, written by
    ``resolve`` with the head it rewrites anyway: its "attempts" is 1 for
    fired, 0 for not fired, its journal the effects resolved), ``name`` (an
    index into ``log.names``), the pass and the start as *differences* from
    the entry before (the start from that entry's end, in milliseconds,
    zigzag-coded: a clock may step back), the duration (ms), and the
    journal (``calls + 64 * effects + 4096 * waits``). A typical entry is 6
    or 7 bytes. A *segment* (the head's entries, or a chunk's) starts from
    pass 0 at the run's ``created_at``, so each decodes alone.
Where the entries live
    The head holds the entries since the last *chunk* (base64, ``log.recent``).
    Once they are :func:`due` (at least :data:`SPILL_AT`, and an eighth of
    the run's stored bytes or :data:`SPILL_MAX`), the commit first writes
    them to an immutable chunk object, create-only, then its head without
    them: a small PUT per 32 commits or (for a state of kilobytes) far fewer,
    never one per step, so format 2's 1.1 PUTs per step holds.
    ``<workflow>/<run_id>/history/<first:08d>-<32 hex>``, the hex being the
    chunk's SHA-256 (so its name is its digest): a JSON line ``{"format": 2,
    "workflow", "run_id", "run_nonce", "kind": "history", "first", "names",
    "prev"}`` then the packed entries. The head names the last chunk
    (``log.last``) and each chunk the one before it: a hash chain that the
    head, signed with a signing key, authenticates whole.
Why a crash loses nothing
    A chunk is complete before a head names it; a crash between the two
    leaves a chunk nobody names (garbage that ``rm``, ``prune`` and the
    tombstone of ``on_complete="delete"`` remove, with everything under the
    run's ``history/``) and the old head, which still holds its entries.
    History is display only: a chunk the store refuses leaves the entries in
    the head for the next commit, and never fails a run.
Reading
    A reader LISTs the run's ``history/`` once and GETs the chunks (in
    parallel); :func:`chain` follows them from the head back, checking each
    digest, and returns the segments: their entries are decoded only for the
    page shown (:func:`decode`), so the timeline of a 10,000-step run costs
    one LIST and a GET per chunk, each immutable (a reader may cache it).
    Runs written before this record have no ``log``: readers fall back on
    the header's recent commits.
Old readers
    ``log`` is a new header field: durable_steps versions before it refuse a
    head that has one (they refuse unknown fields), so upgrade every reader
    of a store (workers, the CLI) before its writers. A head without a
    commit yet (a new or forked run) is written without it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._drivers import Protocol, Put
from ..errors import CheckpointConflict, StoreError

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = [
    "SPILL_AT",
    "Commit",
    "Followed",
    "Segment",
    "add",
    "chain",
    "decode",
    "due",
    "follow",
    "history_prefix",
    "spill",
]

SPILL_AT = 32
"""Entries the head holds at least before a commit moves them to a chunk."""
SPILL_SHARE = 8
"""...and until they are an eighth of the run's stored bytes (its tail and parts)."""
SPILL_MAX = 256
"""...but never more than this many (about 2 KB of base64)."""
COMMIT, RESOLVED, FAILED, RESOLUTION = 0, 1, 2, 3
_KINDS = {COMMIT: "committed", RESOLVED: "resolved", FAILED: "failed", RESOLUTION: "resolution"}
_FIELDS = 6
_LINE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


def history_prefix(workflow: str, run_id: str) -> str:
    """Where a run's history chunks live (``rm``, ``prune`` and tombstones clear it)."""
    return f"{workflow}/{run_id}/history/"


@dataclass(frozen=True)
class Commit:
    """One entry of a run's history, decoded."""

    kind: str
    """``committed``, ``resolved`` (counted as done without running), ``failed``, or
    ``resolution`` (what was in doubt resolved by a person: ``attempts`` 1 fired, 0 not)."""
    step: str
    iteration: int
    attempts: int
    start: float
    """Epoch seconds."""
    duration: float
    calls: int
    effects: int
    waits: int


# --- packing -------------------------------------------------------------------


def _varint(value: int, out: bytearray) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _zigzag(value: int) -> int:
    return value * 2 if value >= 0 else -value * 2 - 1


def _unzigzag(value: int) -> int:
    return value // 2 if not value & 1 else -(value + 1) // 2


def _varints(data: bytes) -> list[int]:
    """The varints of ``data``; ValueError when it is cut short."""
    out, value, shift = [], 0, 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(value)
            value, shift = 0, 0
        elif shift > 63:
            raise ValueError("a varint is too long")
    if shift or len(out) % _FIELDS:
        raise ValueError("the entries are cut short")
    return out


@dataclass(frozen=True)
class _Tail:
    """Where a segment ends: its entry count, last pass and last end (ms)."""

    count: int = 0
    iteration: int = 0
    end: int = 0


def _walk(numbers: list[int]) -> list[tuple[int, int, int, int, int, int]]:
    """The entries of a segment's varints, with pass and start made absolute."""
    out = []
    iteration = end = 0
    for at in range(0, len(numbers), _FIELDS):
        head, name, dpass, gap, duration, journal = numbers[at : at + _FIELDS]
        iteration += dpass
        start = end + _unzigzag(gap)
        end = start + duration
        out.append((head, name, iteration, start, duration, journal))
    return out


_TAILS: OrderedDict[str, _Tail] = OrderedDict()
"""The tail of the ``recent`` strings this process wrote: appending an entry
costs no decode of the ones before (a resumed run decodes once)."""


def _tail(recent: str) -> _Tail:
    found = _TAILS.get(recent)
    if found is not None:
        return found
    walked = _walk(_varints(_b64(recent)))
    if not walked:
        return _Tail()
    _, _, iteration, start, duration, _ = walked[-1]
    return _Tail(len(walked), iteration, start + duration)


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def add(  # noqa: PLR0917 - one entry's fields
    header: Checkpoint,
    kind: int,
    step: str,
    attempts: int,
    seconds: float,
    now: float,
    journal: tuple[int, int, int] = (0, 0, 0),
) -> dict[str, Any]:
    """``header``'s ``log`` with one more entry (``journal``: its calls, effects, waits)."""
    log = dict(header.log or {"names": [], "recent": "", "n": 0})
    names = log["names"]
    if step not in names:
        names = log["names"] = [*names, step]
    try:
        tail = _tail(log["recent"])
    except ValueError:  # a damaged log (decode checks its base64): start it again
        tail, log["recent"] = _Tail(), ""
    duration = max(0, round(seconds * 1000))
    start = round((now - header.created_at) * 1000) - duration
    calls, effects, waits = (min(n, 63) for n in journal)
    out = bytearray()
    for value in (
        attempts * 4 + kind,
        names.index(step),
        max(0, header.iteration - tail.iteration),
        _zigzag(start - tail.end),
        duration,
        calls + 64 * effects + 4096 * waits,
    ):
        _varint(value, out)
    recent = base64.b64encode(_b64(log["recent"]) + out).decode()
    _TAILS[recent] = _Tail(tail.count + 1, max(header.iteration, tail.iteration), start + duration)
    while len(_TAILS) > 256:
        _TAILS.popitem(last=False)
    log["recent"] = recent
    return log


def due(log: dict[str, Any] | None, stored: int) -> bool:
    """Whether the log's entries go to a chunk now: at least :data:`SPILL_AT`
    of them, and as many bytes as an eighth of the ``stored`` bytes of the run
    (its tail and parts), or :data:`SPILL_MAX` entries. The log stays a small
    share of what the run keeps, and a run whose state is kilobytes chunks
    rarely (a 2 KB-a-step transcript: once per 256 commits); a tiny state
    chunks every 32 commits.
    """
    if not log:
        return False
    try:
        count = _tail(log["recent"]).count
    except ValueError:
        return False
    if count < SPILL_AT:
        return False
    return count >= SPILL_MAX or len(log["recent"]) * SPILL_SHARE >= stored


def spill(header: Checkpoint, stored: int = 0) -> Protocol[Checkpoint]:
    """Before ``header`` is written: once its log is :func:`due` (``stored``:
    the run's bytes, tail and parts), write its entries to a chunk
    (create-only) and return the header without them. Best effort (see the
    module docstring): history never fails a run.
    """
    log = header.log
    if log is None or not due(log, stored):
        return header
    first = log["n"]
    meta = {
        "format": 2,
        "workflow": header.workflow,
        "run_id": header.run_id,
        "run_nonce": header.run_nonce,
        "kind": "history",
        "first": first,
        "names": log["names"],
        "prev": log.get("last"),
    }
    data = _LINE.encode(meta).encode() + b"\n" + _b64(log["recent"])
    name = f"{first:08d}-{hashlib.sha256(data).hexdigest()[:32]}"
    try:
        yield Put(history_prefix(header.workflow, header.run_id) + name, data, None)
    except CheckpointConflict:
        pass  # its name is its digest: the same bytes are there already (a retry's)
    except StoreError:
        return header  # kept in the head: the next commit tries again
    chunked = {"names": log["names"], "recent": "", "n": first + _tail(log["recent"]).count}
    return header.replace(log={**chunked, "last": name})


# --- reading ---------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A chunk's entries, or the head's, not decoded yet."""

    first: int
    """The index of its first entry in the run's history."""
    count: int
    names: tuple[str, ...]
    data: bytes


def chain(header: Checkpoint, found: dict[str, bytes]) -> list[Segment] | None:
    """The segments of the run's history, oldest first, from the head's ``log``
    and the chunks ``found`` (by key: a LIST of :func:`history_prefix` and its
    GETs); None when the run keeps no log. The chain is followed from the head
    back: a chunk missing, or not the one named (its digest), ends it, and
    what came before it is left out (the first segment then starts past 0).
    :func:`follow` also says why it ended.
    """
    followed = follow(header, found)
    return None if followed is None else followed.segments


@dataclass(frozen=True)
class Followed:
    """What :func:`follow` found: the segments kept, and where the chain broke."""

    segments: list[Segment]
    broken: str | None = None
    """The key of the chunk that ended the chain early (None: it reached the start)."""
    reason: str | None = None
    """Why: ``missing`` (no such object: deleted, or never there), ``tampered``
    (an object whose bytes do not hash to its name), ``foreign`` (its bytes hash
    to its name but it is not a chunk of this run: another run's, or made up)."""


def follow(header: Checkpoint, found: dict[str, bytes]) -> Followed | None:
    """:func:`chain`, and why it ended before the run's first entry.

    The difference matters to a reader: a chunk that is gone means the entries
    before it are not kept; one that is there with other bytes than its name
    (its SHA-256) promises was changed after it was written (chunks are
    immutable), and is never believed.
    """
    log = header.log
    if log is None:
        return None
    prefix = history_prefix(header.workflow, header.run_id)
    out: list[Segment] = []
    try:
        recent = _b64(log["recent"])
        out.append(Segment(log["n"], len(_varints(recent)) // _FIELDS, tuple(log["names"]), recent))
    except ValueError:
        pass
    wanted, end = log.get("last"), log["n"]
    broken = reason = None
    while isinstance(wanted, str):
        key = prefix + wanted
        data = found.get(key)
        if data is None:
            broken, reason = key, "missing"
            break
        if hashlib.sha256(data).hexdigest()[:32] != wanted.partition("-")[2]:
            broken, reason = key, "tampered"
            break
        line, _, body = data.partition(b"\n")
        meta = _meta(line, header)
        if meta is None or not isinstance(meta.get("first"), int) or meta["first"] > end:
            broken, reason = key, "foreign"
            break
        out.append(Segment(meta["first"], end - meta["first"], tuple(meta["names"]), body))
        wanted, end = meta.get("prev"), meta["first"]
    return Followed(out[::-1], broken, reason)


def decode(segment: Segment, created: float) -> list[Commit]:
    """The entries of one segment (``created``: the run's ``created_at``); none
    if it cannot be read (display only: the page says what is missing).
    """
    try:
        walked = _walk(_varints(segment.data))
    except ValueError:
        return []
    names = segment.names
    return [
        Commit(
            _KINDS.get(head % 4, "committed"),
            names[name] if name < len(names) else "?",
            iteration,
            head // 4,
            created + start / 1000,
            duration / 1000,
            journal % 64,
            journal // 64 % 64,
            journal // 4096,
        )
        for head, name, iteration, start, duration, journal in walked
    ]


def _meta(line: bytes, header: Checkpoint) -> dict[str, Any] | None:
    """A chunk's header line, if it is one of this run's."""
    try:
        meta = json.loads(line)
    except ValueError:
        return None
    fields = ("format", "workflow", "run_id", "run_nonce", "kind")
    expected = (2, header.workflow, header.run_id, header.run_nonce, "history")
    if not isinstance(meta, dict) or tuple(meta.get(f) for f in fields) != expected:
        return None
    names = meta.get("names")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return None
    return meta
