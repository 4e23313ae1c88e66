r"""Checkpoint format 2: every commit writes what changed, not the whole state.

Objects of run ``<workflow>/<run_id>/``:

``checkpoint`` — the *head*
    The format-1 record (:mod:`durable_steps._record.checkpoint`) with ``"format": 2``,
    ``parts`` and ``sha256``; its payload is the *tail*: the changes committed
    since the last flush, as records. It is the only object of the run that is
    ever replaced, and only by compare-and-swap (created create-only), so
    fencing, leases and ``CheckpointConflict`` are exactly format 1's.
``parts/<seq>-<16 hex>`` — immutable *parts*
    A JSON line ``{"format":2,"workflow","run_id","run_nonce","kind","seq"}``
    then the payload: for ``kind`` ``base`` the whole state as the serializer
    encodes it, for ``changes`` records. Written create-only, before the head
    that lists it.

A *record* is one commit's change: an 8-byte big-endian length, then
``serializer.dumps(ops)`` where ``ops`` are :mod:`durable_steps._record.delta` ops
(for pickle states, with each value as its own pickle: see
:class:`~durable_steps._record.finders.PickleFinder`). Records concatenate,
so merging changes parts is concatenating bytes, for any serializer. A run's
state is: ``None``; each
part in the head's order (a base replaces the state, changes are replayed);
then the tail. A new run's first record sets the root to the initial state.

Why a crash at any instant leaves a readable run
    A part is complete before any head lists it (create-only, then the head).
    A crash between the two leaves a part nobody lists, and the old head,
    which lists only complete parts. The head itself is replaced atomically.
    Parts a new head dropped are deleted only after that head landed.
Why a straggler can never make the head point at its parts
    Its head write is a compare-and-swap on the version it last saw, which the
    winner's write has changed: refused, so its parts stay unlisted (garbage).
    The winner lists only parts it wrote (64 random bits in each name: nobody
    else writes that key) or found in a head it read.
Integrity and signing (guarantee 10)
    The head lists each part's size and SHA-256, and carries the tail's: every
    byte of the run is bound to the head line, which the signing key signs (and
    which names the run). A part swapped, edited or taken from another run is
    refused before it is decoded; its own header must also name this run.
Garbage
    Unlisted parts (a crashed writer's, a fenced straggler's) are removed by
    ``rm``, ``prune`` and the tombstone of ``on_complete="delete"``, which
    delete everything under ``parts/``; never while a head lists them.

When to flush (design decision; the lead's FORMAT2.md, tuned): a commit adds
its record to the tail; once the tail reaches ``T = clamp(11 x mean record,
16 KB, 8 MB)`` it is flushed into ONE part (2 PUTs instead of 1): a new base
when there is none or the changes parts and tail outweigh it, else the tail
appended as a changes part, the last two merged when the newer outgrows the
older. The head lists at most 3 parts (a resume: 1 + 3 GETs, the parts in
parallel), and every rewrite is geometric, so the bytes written stay
proportional to what the run produced. The threshold's floor is 16 KB, not
the design's 32 KB, and 11 mean records, not 12: a 400-step run of 2 KB
messages wrote 5.7% of a full-rewrite loop's bytes at 32 KB (target 5%),
5.3% at 16 KB and 12 records (1.085 PUTs/step), 4.95% at 11 (1.09 PUTs/step;
10 would cross 1.1). A commit whose change is the whole state (a new run, a
replaced root) and outgrows the threshold is written as a base at once,
encoded into the part's own buffer, never also as a record in the tail.
A step's journaled calls write the head too, and flush its tail when it is
long, usually before the commit would: those flushes merge geometrically
but never write a base (the step is changing the state, and its journal's
records may sit in the parts a base replaces), so the commit after them
writes the base once their parts outweigh it.

Small states are written whole (design decision, measured): a state whose
last whole encoding was at most ``WHOLE_UP_TO`` (8 KB) is encoded whole at
every commit, as one record that replaces the tail and every part, the
change finder idle (it keeps that record, not a shadow). At that size
encoding the state costs less than finding its change, and a tail of
changes would make every head write carry up to the 16 KB threshold: a
2 KB state's head was 4.9 KB on average instead of format 1's 2.7 KB, and
its local step cost 1.15x format 1's (the two side by side in one process);
written whole, 1.02x. A bigger state changed in place (a replaced reply, a
counter) is *collapsed* the same way once its tail has grown by a quarter
of its size (512 bytes at least) past its last whole encoding and the whole
is an eighth smaller than the tail; a state that only grows never is (its
whole is its tail), so the encodes a collapse costs stay proportional to
the change. A state that shrank below ``WHOLE_UP_TO`` (a transcript the
agent compacted) is written whole again at once: the finders report the
encoded size of what each change replaced, deleted or cut off, so the
state's size is known, roughly, without encoding it. After a resume only a
bound is known (the parts' size), so the first commit that takes anything
out encodes the state once (see :meth:`Parts.bound`).

Intent writes, failures and releases rewrite the head with the unchanged
tail (no re-encode). A renewal of a long step first flushes a tail over 2 KB
into a changes part, so the renewals after it write only the header. Change
parts' bytes (less than the base's by the flush rule) are kept in memory so
that merging costs no read.

Format-1 runs (``"format": 1``) continue in format 1; so do runs with a
custom serializer, whose encoding of a part of the state is unknown.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._drivers import GetMany, Protocol, Put
from ..errors import CheckpointConflict, CorruptCheckpoint
from ..serializers import _COMPACT_JSON, JSONSerializer, check_json
from . import checkpoint as ckpt
from .finders import JOURNAL, JSONFinder, PickleFinder, inner
from .ops import apply

if TYPE_CHECKING:
    from ..serializers import Serializer

__all__ = ["Parts", "load_state", "parts_prefix", "supports"]

_LENGTH = struct.Struct(">Q")
_MIN_FLUSH, _MAX_FLUSH, _FLUSH_RECORDS = 16 * 1024, 8 * 1024 * 1024, 11
RENEWAL_TAIL = 2048
"""A renewal flushes a tail longer than this, so the next ones write only the header."""
_MAX_PARTS = 3
WHOLE_UP_TO = 8 * 1024
"""A state whose last whole encoding was at most this is written whole at every commit."""
_SLACK, _MIN_SLACK = 0.25, 512
"""A state smaller than the threshold is rewritten whole into the tail once the
changes behind its last whole encoding reach this fraction of it (or 512 bytes)."""
_LINE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


def supports(serializer: Serializer) -> bool:
    """Whether new runs with this serializer are written in format 2."""
    return inner(serializer).name in ("json", "pickle")


def parts_prefix(workflow: str, run_id: str) -> str:
    """Where a run's parts live (``rm``, ``prune`` and tombstones clear it)."""
    return f"{workflow}/{run_id}/parts/"


def frame(record: bytes) -> tuple[bytes, bytes]:
    """One record as it sits in a tail or a changes part (to be joined, not copied)."""
    return _LENGTH.pack(len(record)), record


def records(data: bytes) -> list[bytes]:
    """The records of a tail or changes part; ValueError if the framing is broken."""
    out, at = [], 0
    while at < len(data):
        if at + 8 > len(data):
            raise ValueError("a record's length is cut short")
        (size,) = _LENGTH.unpack_from(data, at)
        if at + 8 + size > len(data):
            raise ValueError("a record is cut short")
        out.append(data[at + 8 : at + 8 + size])
        at += 8 + size
    return out


# --- the run's parts ------------------------------------------------------------


class Parts:
    """A format-2 run's bookkeeping: its finder, the cached changes parts'
    bytes, and how a commit or renewal turns into part and head writes.
    """

    def __init__(self, serializer: Serializer, workflow: str, run_id: str, committed: Any) -> None:
        self.serializer = serializer
        self.workflow, self.run_id = workflow, run_id
        finder = JSONFinder if inner(serializer).name == "json" else PickleFinder
        self.finder: JSONFinder | PickleFinder = finder(serializer, committed)
        self.cached: dict[str, bytes | memoryview] = {}  # changes parts' payloads, by name
        self.journal: list[tuple[list[Any], bytes]] = []
        """The journal records of the step in progress found by a load, in
        order: ``(meta, record)``, the record kept to be decoded afresh on replay."""
        self._mean = 0.0
        self._count = 0
        self._recheck = 0
        """The tail length at which :meth:`collapse` encodes the state whole again."""
        self._whole = WHOLE_UP_TO + 1
        """The size of the state's last whole encoding (or a bound on it); unknown: big."""
        self._grown = self._shrunk = 0
        """Bytes of the records since then, and of what they took out (``removed``)."""
        self._bounded = False
        """Whether ``_whole`` is only a bound (after a load: see :meth:`bound`)."""

    def key(self, name: str) -> str:
        """The store key of part ``name``."""
        return parts_prefix(self.workflow, self.run_id) + name

    def threshold(self) -> int:
        """The tail length that triggers a flush (see the module docstring)."""
        return int(min(max(_FLUSH_RECORDS * self._mean, _MIN_FLUSH), _MAX_FLUSH))

    def whole(self, size: int) -> None:
        """The state was just encoded whole, in ``size`` bytes (a base, a root
        record): :meth:`collapse` looks again once the tail has grown past it
        by the slack, so its encodes cost, per step, a fixed multiple of the change.
        """
        self._whole, self._grown, self._shrunk, self._bounded = size, 0, 0, False
        self._recheck = size + max(int(size * _SLACK), _MIN_SLACK)

    def bound(self, size: int) -> None:
        """A loaded run's state encodes in at most ``size`` bytes (its head and
        parts): the first commit that takes anything out learns the real size.

        The bound can be far above the state: the parts also hold records that
        later ones overwrote, and the journaled calls of steps whose journal
        writes flushed the tail. A run killed just before compacting its
        transcript (50 KB to 4.4 KB) then compacted on resume, with 58 KB of
        parts: taking 50 KB out of a bound of 58 KB did not reach a small
        state, so it went on writing changes behind the old parts until a
        flush, ending 12 times the size of the same run uncrashed. One encode
        per resume, and only for a run that removes something, avoids that
        (:meth:`collapse`); a run that only appends never pays it.
        """
        self.whole(size)
        self._bounded = True

    def changed(self, record: bytes) -> None:
        """A commit's record of changes (its ``removed`` is the finder's)."""
        self._grown += len(record)
        self._shrunk += self.finder.removed

    def whole_record(self, state: Any) -> bytes:
        """The finder's record of the whole ``state``, counted as its last
        whole encoding (see :meth:`whole`).
        """
        record = self.finder.whole_record(state)
        self.whole(len(record))
        return record

    def small(self) -> bool:
        """Whether the next commit writes the state whole (see the module docstring)."""
        return self._whole <= WHOLE_UP_TO

    def collapse(self, tail: bytes, state: Any) -> bytes | None:
        """The record that replaces ``tail`` and every part, setting the whole
        ``state``, if that is due and smaller (else None).

        A state above ``WHOLE_UP_TO`` changed in place (a counter, a note, a
        replaced reply) would otherwise fill the tail with records that
        overwrite each other, and the head every write carries would grow up
        to the threshold. Rewritten whole, the head stays within the state
        plus the slack, while most commits still encode only their change. A
        state that shrank below ``WHOLE_UP_TO`` is written whole from now on.
        """
        due = self._recheck <= len(tail) and self._recheck < self.threshold()
        # A state that shrank to a small one (a transcript compacted), by the
        # sizes of its records and of what they took out: no encode to tell.
        # After a load, the size is a bound: the first removal encodes to know it.
        shrank = self._shrunk and (
            self._bounded or self._whole + self._grown - self._shrunk <= WHOLE_UP_TO
        )
        if not (due or shrank):
            return None
        record = self.whole_record(state)
        if len(record) <= WHOLE_UP_TO:
            return record  # small: written whole from now on
        if len(record) + 8 > (1 - _SLACK / 2) * min(len(tail), self.threshold()):
            return None  # the changes mostly added to the state: keep them
        return record

    def note(self, record: bytes) -> None:
        """Count a record in the running mean of record sizes."""
        self._count += 1
        self._mean += (len(record) + 8 - self._mean) / self._count

    def plan(
        self,
        header: ckpt.Checkpoint,
        tail: bytes,
        state: Any | None,
        *,
        rebase: bool,
        balance: bool,
    ) -> tuple[str, bytes, list[dict[str, Any]]]:
        """The part a flush writes: ``(kind, payload, parts it replaces)``.

        ``rebase`` allows a new base (the whole ``state``, encoded): only from
        a commit, never while a step runs (it changes the live state, and its
        journal's records may sit in the parts a base would replace).
        ``balance`` merges the last two changes parts once the newer outgrows
        the older, keeping their sizes geometric: a commit balances, and so does
        a journal write, after which the commit rebases when due
        (:meth:`rebase_due`), or a run whose calls flush its tail would grow
        its last part forever (each flush rewriting it whole). A renewal does
        not: it runs on the heartbeat's thread, and writes small.
        """
        parts = list(header.parts)
        base = parts[0] if parts and parts[0]["kind"] == "base" else None
        changes = parts[1:] if base else parts
        if rebase and self.rebase_due(header, len(tail)):
            return "base", self.base(header, state), parts
        if len(parts) < _MAX_PARTS:
            merge = []  # the tail becomes a part of its own
        elif balance and changes[-1]["size"] + len(tail) > changes[-2]["size"]:
            merge = changes[-2:]  # the newer outgrew the older: merge both (geometric)
        else:
            merge = changes[-1:]
        line = self.line(header, "changes")
        return "changes", b"".join([line, *(self.cached[p["name"]] for p in merge), tail]), merge

    @staticmethod
    def rebase_due(header: ckpt.Checkpoint, tail: int) -> bool:
        """Whether a flush with ``tail`` bytes of tail writes a new base: there
        is no base, or the changes parts and the tail outweigh it. With
        ``tail=0`` on a head that has parts: whether a journal write's flushes
        left the changes parts outweighing the base (a commit's never do).
        """
        parts = header.parts
        base = parts[0] if parts and parts[0]["kind"] == "base" else None
        weight = sum(p["size"] for p in parts if p is not base) + tail
        return base is None or weight >= base["size"]

    def line(self, header: ckpt.Checkpoint, kind: str) -> bytes:
        """The header line of a part, with its newline."""
        fields = {"format": 2, "workflow": self.workflow, "run_id": self.run_id}
        fields.update(run_nonce=header.run_nonce, kind=kind, seq=header.committed)
        return _LINE.encode(fields).encode() + b"\n"

    def base(self, header: ckpt.Checkpoint, state: Any) -> bytes:
        """A base part holding ``state``. For JSON it is encoded into the part's
        own buffer a value at a time, so one encoded copy of the state is held,
        not three (the encoder's pieces, its str, the bytes; then the part):
        ``BytesIO.getvalue()`` hands over its buffer, it does not copy it.
        """
        line = self.line(header, "base")
        if type(self.serializer) is not JSONSerializer:  # pickle, signed: their own bytes
            data = b"".join((line, self.serializer.dumps(state)))
        else:
            check_json(state)
            out = io.BytesIO(line)
            out.seek(len(line))
            try:
                _json_into(out.write, state, 2)
                data = out.getvalue()
            except (TypeError, ValueError, RecursionError):  # let the serializer name it
                data = b"".join((line, self.serializer.dumps(state)))
        self.whole(len(data))
        return data

    def write_part(
        self, header: ckpt.Checkpoint, kind: str, data: bytes
    ) -> Protocol[dict[str, Any]]:
        """Write one part (``data``, made by :meth:`plan` or :meth:`base`)
        create-only; its record for the head's ``parts``.
        """
        name = f"{header.committed}-{secrets.token_hex(8)}"
        try:
            yield Put(self.key(name), data, None)
        except CheckpointConflict:
            # Nobody else writes this name: our own write, its answer lost
            # (a store's retry found it there). Keep it only if it is ours.
            found = yield from _get(self.key(name))
            if found is None or found[0] != data:
                raise
        if kind == "changes":  # its payload, for a merge: a view, not a copy
            self.cached[name] = memoryview(data)[data.index(b"\n") + 1 :]
        return {"name": name, "kind": kind, "size": len(data), "sha256": _digest(data)}


def _json_into(write: Callable[[bytes], Any], value: Any, levels: int) -> None:
    """Write ``value`` as JSONSerializer encodes it (compact, byte for byte):
    the top ``levels`` of containers item by item, so that no more than one
    item's encoding is held at a time.
    """
    kind = type(value)
    if levels and kind is dict and value:
        for i, (key, item) in enumerate(value.items()):
            write(b"%s%s:" % (b"," if i else b"{", _COMPACT_JSON.encode(key).encode()))
            _json_into(write, item, levels - 1)
        write(b"}")
    elif levels and kind is list and value:
        for i, item in enumerate(value):
            write(b"," if i else b"[")
            _json_into(write, item, levels - 1)
        write(b"]")
    else:
        write(_COMPACT_JSON.encode(value).encode())


def _get(key: str) -> Protocol[tuple[bytes, str] | None]:
    got = yield GetMany((key,))
    return got[0]  # type: ignore[no-any-return]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_state(
    header: ckpt.Checkpoint,
    tail: bytes,
    serializer: Serializer,
    where: str,
    renamed: dict[str, str] | None = None,
) -> Protocol[tuple[Any, Parts] | None]:
    """Read a format-2 head's parts (in parallel) and rebuild the state.

    The journal records kept are those of the step the header's journal names
    (``renamed``: old step names as the header now calls them, for records
    written before a step was renamed).

    Returns None when a part is missing (compaction deleted it after a newer
    head replaced this one: the caller reads the head again). Every part is
    checked against the head's size and digest, and its header against the
    run, before anything in it is decoded.
    """
    parts = Parts(serializer, header.workflow, header.run_id, None)
    found = yield GetMany(tuple(parts.key(p["name"]) for p in header.parts))
    state: Any = None
    journal = header.journal
    # The names the step's records may carry: its own, those it had when they were
    # written (``was``), and the stored names the current code renamed.
    names = {journal["step"], *journal.get("was", ())} if journal else set()

    def replay(record: bytes) -> None:
        nonlocal state
        ops = parts.finder.ops(record)
        if ops and ops[0][0] == JOURNAL:  # a call's record: the step in progress's only
            step, iteration = ops[0][1][:2]
            if (
                journal
                and iteration == journal["iteration"]
                and (step in names or (renamed or {}).get(step) in names)
            ):
                parts.journal.append((ops[0][1], record))
        else:
            state = apply(state, ops)

    what = "its head"  # the object being decoded, for an error
    try:
        for part, got in zip(header.parts, found, strict=True):
            if got is None:
                return None
            payload = _check_part(got[0], part, header, where)
            what = f"its {part['kind']} part {part['name']!r}"
            if part["kind"] == "base":
                state = serializer.loads(payload)
            else:
                parts.cached[part["name"]] = payload
                for i, record in enumerate(records(payload)):
                    what = f"record {i} of its changes part {part['name']!r}"
                    replay(record)
        for i, record in enumerate(records(tail)):
            what = f"record {i} of the tail in its head"
            parts.note(record)
            replay(record)
    except CorruptCheckpoint as exc:
        if exc.run is not None:  # a part refused unread (_check_part): named already
            raise
        raise _undecodable(where, what, exc.message, header.run) from exc
    except Exception as exc:
        # Any failure to decode what the head vouches for (a damaged record, a
        # class a deploy moved: AttributeError, ModuleNotFoundError, or whatever
        # a pickle's own code raises) is this run's, named with the object.
        raise _undecodable(where, what, f"{exc!r}", header.run) from exc
    parts.finder = type(parts.finder)(serializer, state)
    parts.bound(len(tail) + sum(p["size"] for p in header.parts))  # at most: no encode
    return state, parts


def _undecodable(where: str, what: str, detail: str, run: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{where}: {what} cannot be decoded: {detail.rstrip('.')}. The run was left untouched.",
        run=run,
    )


def _check_part(data: bytes, part: dict[str, Any], header: ckpt.Checkpoint, where: str) -> bytes:
    """The payload of a part, once it is proven to be the one the head lists."""
    if len(data) != part["size"] or _digest(data) != part["sha256"]:
        raise CorruptCheckpoint(
            f"{where}: its part {part['name']!r} is not the one its head lists (changed, "
            "damaged, or swapped for another run's); refused unread and left untouched.",
            run=header.run,
        )
    line, _, payload = data.partition(b"\n")
    try:
        meta = json.loads(line)
    except ValueError:
        meta = None
    expected = (2, header.workflow, header.run_id, header.run_nonce, part["kind"])
    fields = ("format", "workflow", "run_id", "run_nonce", "kind")
    if not isinstance(meta, dict) or tuple(meta.get(f) for f in fields) != expected:
        raise CorruptCheckpoint(
            f"{where}: its part {part['name']!r} belongs to another run; refused unread.",
            run=header.run,
        )
    return payload
