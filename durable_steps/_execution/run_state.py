"""One execution of a run: what it holds, and the one writer of its checkpoint.

:class:`RunState` owns the committed payload, its version (ETag), the header
last written, and the live state object, and it is the only place that
writes the checkpoint — through :meth:`RunState.write` (yielding a ``Put``
effect) or its heartbeat — so every write is conditional on the version
this execution last saw and stamped with its ownership lease.
"""

from __future__ import annotations

import contextlib
import threading
import time
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from .._drivers import Blocking, Delete, Get, ListKeys, Protocol, Put, Sweep, drive_sync
from .._events import Event, EventKind, emit, logger
from .._fleet import index as _index
from .._fleet import pacing as _pacing
from .._fleet.clearing import clear_objects
from .._fleet.leases import Heartbeat, Owner, describe, store_skew
from .._fleet.pacing import Pace, write_interval
from .._fleet.signals import signals_prefix
from .._record import checkpoint as ckpt
from .._record import format2 as f2
from ..errors import CheckpointConflict, CorruptCheckpoint, SerializationError, StoreError
from ..serializers import SignedSerializer
from .plan import Plan

__all__ = ["Keeping", "Released", "RunState"]


class Keeping(typing.Protocol):
    """The names a run's head keeps for renamed steps (``_deploys.positions.Held``)."""

    @property
    def names(self) -> Mapping[str, str]:
        """``{current name: name the run was stored with}``."""

    def stored(self, header: ckpt.Checkpoint) -> ckpt.Checkpoint:
        """``header`` as it is written: renamed steps under their stored names."""


class Released(Exception):
    """The run stopped after a commit because ``Plan.stop`` was set, and its
    lease was released so another process can resume it at once.
    """


class RunState:
    """The mutable state of one execution: the committed payload, its
    version, the header, and the live state object.
    """

    def __init__(self, plan: Plan, run_id: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.name = f"{plan.workflow}/{run_id}"
        self.key = ckpt.checkpoint_key(plan.workflow, run_id)
        self.version: str | None = None
        self.header: ckpt.Checkpoint
        self.payload: bytes = b""
        self.state: Any = None
        self.owner = Owner(plan.lease, lambda: store_skew(plan.store))
        self.signer = plan.serializer if isinstance(plan.serializer, SignedSerializer) else None
        self.gone = False
        self.unanswered: bytes | None = None
        """The last head we sent whose answer was an error (it may have landed)."""
        """The checkpoint vanished under a write (deleted while the run ran)."""
        self.rival: dict[str, Any] | None = None
        """The owner record found by the last refused write, if any."""
        self.parts: f2.Parts | None = None
        """A format-2 run's parts and change finder; ``payload`` is then its tail."""
        self.warned_store = False
        """The default-store warning was given for this run (see ``_create``)."""
        self.lock = threading.Lock()
        """Held by every write made while a step runs (its journal, the heartbeat)."""
        self.woken: dict[str, Any] | None = None
        """The wait of a run just woken, until its step's journal settles it."""
        self.resumed = False
        """The run existed before this execution (a crash may have left garbage)."""
        self.leaked = False
        """A part this execution dropped could not be deleted."""
        self.entry: str | None = None
        """The index entry (``_fleet.index``) of the head last written or read."""
        self.mark: int | None = None
        """Format 2, while a step runs: the length of the committed tail, which
        the step's journal records follow (its commit drops them)."""
        self.pace = Pace(write_interval(plan.store))
        """When the head may next be written, on a store that limits writes
        per object name (GCS); always at once elsewhere (see ``_fleet.pacing``)."""
        self.held: Keeping | None = None
        """Renamed steps' stored names, which the head keeps (``_deploys.positions.Held``);
        None: the run's names are the code's."""

    def stored_step(self, step: str) -> str:
        """The name the run's head keeps for ``step`` (a renamed step's earlier one)."""
        return step if self.held is None else self.held.names.get(step, step)

    def event(self, kind: EventKind, **fields: Any) -> None:
        if self.plan.subscribers:
            header = getattr(self, "header", None)  # None until the run is read or made
            event = Event(
                kind,
                self.plan.workflow,
                self.run_id,
                execution=self.owner.token,
                run_nonce=header.run_nonce if header is not None else None,
                **fields,
            )
            emit(self.plan.subscribers, event)

    @contextlib.contextmanager
    def reporting_stops(self) -> Iterator[None]:
        """Emit ``run_stopped`` if the block (the execution) ends with any exception."""
        try:
            yield
        except BaseException as exc:  # a failure, a wait, a lost lease, a simulated crash...
            self.event("run_stopped", error=exc)
            raise

    def encode_state(self, step: str | None) -> bytes:
        """The state's bytes; ``step`` is the step just run, None for the
        initial state of a new run.
        """
        try:
            return self.plan.serializer.dumps(self.state)
        except SerializationError as exc:
            raise self.unsaveable(exc, step) from exc

    def unsaveable(self, exc: SerializationError, step: str | None) -> SerializationError:
        """``exc`` with the run, the step and what happens next."""
        if step is None:
            outcome = (
                "Nothing was written: the run was not created. Change that value in "
                "the initial state and start the run again."
            )
        else:
            outcome = (
                f"The last good checkpoint is kept; step {step!r} will run again on "
                "resume, so change what it puts in the state first."
            )
        where = f"after step {step!r}" if step else "(the initial state)"
        return SerializationError(
            f"run {self.name}: cannot save the state {where}: {exc.message} {outcome}",
            run=self.name,
            step=step,
            path=exc.path,
        )

    def save(
        self, header: ckpt.Checkpoint, step: str | None, *, release: bool = False
    ) -> Protocol[None]:
        """Commit the live state with ``header``: the whole state in format 1,
        the change since the last commit in format 2 (see ``_record.format2``).
        """
        if header.format == 1:
            self.payload = self.encode_state(step)
            yield from self.write(header, step, release=release)
            return
        if self.parts is None:
            self.parts = f2.Parts(self.plan.serializer, self.plan.workflow, self.run_id, None)
        parts = self.parts
        try:
            header, tail, whole, ops, dropped = yield from self._changes(header, step)
        except SerializationError as exc:
            raise self.unsaveable(exc, step) from exc
        yield from self.write(header, step, release=release, payload=tail)
        self.payload, self.mark = tail, None
        if whole is not None:
            parts.finder.set_whole(whole, self.state, track=not parts.small())
        else:
            parts.finder.commit(ops)
        yield from self._collect(dropped)

    def _changes(
        self, header: ckpt.Checkpoint, step: str | None
    ) -> Protocol[
        tuple[ckpt.Checkpoint, bytes, bytes | None, list[list[Any]], list[dict[str, Any]]]
    ]:
        """A format-2 commit's writes before the head: ``(header, tail, the
        record of the whole state or None, the ops, the parts it drops)``.

        A small state, a new root or a collapse is one record of the whole
        state, replacing the tail and every part; anything else is its change
        appended to the tail, flushed into a part once the tail is long (see
        ``_record.format2``).
        """
        parts = self.parts
        assert parts is not None
        # The journal of the step just run ends here: its records go.
        tail = self.payload if self.mark is None else self.payload[: self.mark]
        # A save while a step's journal is pending (a migration before the
        # step resumes) must keep its records: the tail is only appended to.
        pending = header.journal is not None
        whole, base, ops = None, None, []
        if parts.small() and not pending:
            whole = parts.whole_record(self.state)
        else:
            ops = parts.finder.changes(self.state)
            if not pending and len(ops) == 1 and ops[0][:2] == ["set", []]:  # a new root
                # The change is the whole state: a big one goes straight into a
                # base (one encoded copy in memory), a small one is its record.
                base = parts.base(header, self.state)
                if len(base) < parts.threshold():
                    base, whole = None, parts.whole_record(self.state)
            elif ops:  # one copy of the record, then it is let go
                record = parts.finder.encode(ops, self.state)
                parts.note(record)
                parts.changed(record)
                tail = b"".join((tail, *f2.frame(record)))
                del record
                if not pending:
                    whole = parts.collapse(tail, self.state)
        dropped: list[dict[str, Any]] = []
        if whole is not None:  # the tail and every part, replaced by the state
            tail, dropped = b"".join(f2.frame(whole)), list(header.parts)
            header = header.replace(parts=())
        rebase = not pending and whole is None
        # The journal writes of the step just run may have flushed the tail
        # (they never write a base): rebase now if their parts outweigh the base.
        due = rebase and bool(header.parts) and f2.Parts.rebase_due(header, 0)
        if base is not None or len(tail) >= parts.threshold() or due:
            # A whole record this long becomes a changes part as it is: no re-encode.
            header, tail, merged = yield from self._flush(
                header, tail, step, rebase=rebase, balance=rebase, base=base
            )
            dropped += merged
        return header, tail, whole, ops, dropped

    def _flush(
        self,
        header: ckpt.Checkpoint,
        tail: bytes,
        step: str | None,
        *,
        rebase: bool,
        balance: bool,
        base: bytes | None = None,
    ) -> Protocol[tuple[ckpt.Checkpoint, bytes, list[dict[str, Any]]]]:
        """Write the part a flush of ``tail`` calls for (``base``, a base part
        already encoded, when given); the head to write next (listing it, with
        an empty tail) and the parts that head drops.
        """
        assert self.parts is not None
        if base is None:
            kind, data, merged = self.parts.plan(
                header, tail, self.state, rebase=rebase, balance=balance
            )
        else:  # a base holds the whole state: it replaces every part and the tail
            kind, data, merged = "base", base, list(header.parts)
        del base
        try:
            part = yield from self.parts.write_part(header, kind, data)
        except CheckpointConflict as exc:
            raise self.conflict(step) from exc
        except StoreError as exc:
            raise self.store_error(exc, step) from exc
        kept = () if kind == "base" else tuple(p for p in header.parts if p not in merged)
        return header.replace(parts=(*kept, part)), b"", merged

    def _collect(self, dropped: list[dict[str, Any]]) -> Protocol[None]:
        """Delete parts the head just written no longer lists (best effort:
        one left behind is garbage that ``rm``/``prune`` remove).
        """
        assert self.parts is not None
        for part in dropped:
            self.parts.cached.pop(part["name"], None)
            try:
                yield Delete(self.parts.key(part["name"]), None)
            except StoreError as exc:
                self.leaked = True
                logger.info("run %s: could not delete an old part (%s)", self.name, exc)

    def tidy(self) -> Protocol[None]:
        """Once the run completed: remove what crashed writers of it left behind.

        A writer killed between a part and the head that would list it, or
        between a head that dropped parts and their deletion, leaves parts
        no head lists; a killed local write leaves a file no key names. Now
        that the final head is written nothing will list them: parts it does
        not list go, and the local store sweeps the run's directories. Only a
        run resumed here, or whose own cleanup failed, can have any, so only
        such a run, or one with parts (a crashed creation may have written some
        before its head), pays the LIST. Best effort (a failure is logged; ``rm`` and
        ``prune`` remove the rest).
        """
        if not (self.resumed or self.leaked or self.header.parts):
            return  # a small run made and finished here: nothing can be left behind
        workflow, run_id = self.plan.workflow, self.run_id
        parts = f2.parts_prefix(workflow, run_id)
        try:
            if self.header.format == 2:
                listed = {parts + part["name"] for part in self.header.parts}
                for key in (yield ListKeys(parts)):
                    if key not in listed:
                        yield Delete(key, None)
            for prefix in (parts, signals_prefix(workflow, run_id), f"{workflow}/{run_id}/"):
                yield Sweep(prefix)
        except StoreError as exc:
            logger.info("run %s: could not remove what crashes left (%s)", self.name, exc)

    def clear_parts(self) -> Protocol[None]:
        """Delete everything under the run's ``parts/`` and ``signals/`` (after its tombstone)."""
        try:
            yield from clear_objects(self.plan.workflow, self.run_id)
        except StoreError as exc:
            logger.warning(
                "run %s: could not delete its parts (%s); rm removes them", self.name, exc
            )

    def load_state(self, header: ckpt.Checkpoint, payload: bytes) -> Protocol[bool]:
        """Rebuild the committed state; False if a part vanished (read the head again)."""
        if header.format == 1:
            self.state = self.decode_state(payload)
            return True
        where = f"run {self.name}: checkpoint {self.key!r}"
        loaded = yield from f2.load_state(
            header, payload, self.plan.serializer, where, self.plan.renamed()
        )
        if loaded is None:
            return False
        self.state, self.parts = loaded
        return True

    def restore(self) -> Any:
        """The committed state again, for an attempt that starts over."""
        if self.parts is None:
            return self.decode_state(self.payload)
        return self.parts.finder.committed()

    def decode_state(self, payload: bytes) -> Any:
        try:
            return self.plan.serializer.loads(payload)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"run {self.name}: the checkpoint at {self.key!r} cannot be decoded: "
                f"{exc.message} It was left untouched.",
                run=self.name,
            ) from exc

    def stamp(self, header: ckpt.Checkpoint, *, release: bool = False) -> ckpt.Checkpoint:
        """``header`` with this process as owner (lease renewed), or with no
        owner once the run is over, stopped, or released.
        """
        keep = header.status == "running" and not release
        return header.replace(owner=self.owner.record() if keep else None)

    def write(
        self,
        header: ckpt.Checkpoint,
        step: str | None,
        *,
        release: bool = False,
        payload: bytes | None = None,
    ) -> Protocol[None]:
        """Conditionally write ``header`` + the current payload (or ``payload``).

        A refusal is checked before it is believed: if the object carries
        this execution's own owner token, it is our own write whose answer
        was lost (a renewal that landed and then reported an error), so it is
        adopted and the write repeated on top of it. Anything else is a real
        :class:`CheckpointConflict`, and nothing was overwritten.
        """
        header = self.stamp(header, release=release)
        creating = self.version is None
        try:
            if creating:  # its index entry first, so the new run is findable (see _fleet.index)
                yield from self._mark(header)
            else:
                yield from _index.leaving(self.entry, header)
            slot = self.pace.slot()
            if slot > time.monotonic():
                yield Blocking(_pacing.wait_until, (slot,))
            # Only now the lease: stamped before the index writes and the wait
            # for the slot, it would run out that much sooner after the head
            # lands (see ``_fleet.pacing``, "The lease").
            header = self.stamp(header, release=release)
            sent = header if self.held is None else self.held.stored(header)  # (rollbacks)
            data = ckpt.encode(sent, self.payload if payload is None else payload, self.signer)
            previous, self.unanswered = self.unanswered, data
            try:
                self.version = yield Put(self.key, data, self.version, self.pace.slot())
            except CheckpointConflict:
                found = yield Get(self.key)
                if not self._adopt(found, (data, previous)):
                    raise
                assert found is not None
                if found[0] != data:  # our previous write, which failed: this one supersedes it
                    self.version = yield Put(self.key, data, self.version, self.pace.slot())
            finally:  # answered, landed or not: the next write keeps its distance
                self.pace.wrote()
            self.unanswered = None
        except CheckpointConflict as exc:
            if creating:  # another process made the run: our marker is nobody's
                yield from _index.abandoned(header)
            raise self.conflict(step, created=creating) from exc
        except StoreError as exc:
            raise self.store_error(exc, step) from exc
        self.header = header
        self.entry = yield from _index.moved(self.entry, header)

    def _mark(self, header: ckpt.Checkpoint) -> Protocol[None]:
        """Before a new run's head: the registry, then the run's marker; and the
        head is not sent if the marker landed too long ago (see ``_fleet.index``).
        """
        store = self.plan.store
        yield from _index.registered(
            getattr(store, "url", None) or repr(store), header.workflow, header.run_id
        )
        marked = yield from _index.creating(header)
        self.entry = _index.entry_of(header)
        if _index.too_late(marked):
            yield from _index.abandoned(header)
            raise StoreError(
                f"the store took more than {_index.CREATE_WITHIN:.0f}s between the run's index "
                "entry and its head, so the head was not written (nothing was created)"
            )

    def _adopt(self, found: tuple[bytes, str] | None, ours: tuple[bytes | None, ...]) -> bool:
        """Take ``found`` as our own write if it is one of ``ours``: the write
        just refused (it landed and its answer was lost, or a retry of it was
        refused), or our last write that failed (it landed all the same; the
        one refused is newer and supersedes it). Anything else, even with our
        owner token, is refused: all of a run's head writes are made by one
        writer, in turn (under ``lock`` while a step runs), so an unknown
        write of ours would be a second writer, and overwriting it could lose
        what it carried.
        """
        if found is None:
            self.gone = True
            return False
        try:
            header, _ = ckpt.decode(found[0], where=self.key, run=self.name, signer=self.signer)
        except CorruptCheckpoint:
            return False
        self.rival = header.owner
        if (header.owner or {}).get("token") != self.owner.token:
            return False
        if found[0] not in ours:
            logger.error(
                "run %s: the head holds a write of this execution that its writer did not "
                "send last; it is left as it is and the run stops (please report it)",
                self.name,
            )
            return False
        logger.info("run %s: an earlier write of ours landed unreported; continuing", self.name)
        self.version = found[1]
        return True

    def conflict(self, step: str | None, *, created: bool = False) -> CheckpointConflict:
        """The error for a refused write, worded for what refused it."""
        at = f" at step {step!r}" if step else ""
        if created:
            why = (
                f"another process created run {self.name} at the same moment and runs it "
                "now, so this one stopped before running anything. Rerun later to resume "
                "it (RunLocked while the other process runs it)."
            )
        elif self.gone:
            why = (
                f"run {self.name}: its checkpoint was deleted while it ran{at} "
                "(durable-steps rm or prune, or another process's cleanup), so this process "
                "stopped without writing it back. Nothing further ran here."
            )
        else:
            by = f" by {describe(self.rival)}" if self.rival else ""
            why = (
                f"run {self.name}: another process changed its checkpoint{at}{by}, so this "
                "process stopped without overwriting it (its lease had run out and the run "
                "was taken over, or it ran twice). Nothing further ran here; let the other "
                "process finish."
            )
        return CheckpointConflict(why, run=self.name, step=step)

    def store_error(self, exc: StoreError, step: str | None) -> StoreError:
        """``exc`` with the run and step named, and what a rerun will do."""
        at = f" at step {step!r}" if step else ""
        return StoreError(
            f"run {self.name}: the store failed{at}: {exc.message} The last checkpoint "
            "that was written is kept; rerun to resume from it.",
            run=self.name,
            step=step,
        )

    def rewrite(
        self,
        header: ckpt.Checkpoint,
        tail: bytes,
        step: str | None,
        *,
        flush_over: int | None = None,
        balance: bool = False,
    ) -> Protocol[None]:
        """Write the head while a step runs (a renewal, a journal record):
        ``tail`` is flushed into a part first once it is longer than
        ``flush_over`` (by default the commit's threshold), so the writes
        after it carry only the header and what came since. ``balance``
        (journal writes): merge parts geometrically (see ``Parts.plan``).
        """
        dropped: list[dict[str, Any]] = []
        flushed = False
        if self.parts is not None:
            limit = self.parts.threshold() if flush_over is None else flush_over
            if len(tail) > limit:
                header, tail, dropped = yield from self._flush(
                    header, tail, step, rebase=False, balance=balance
                )
                flushed = True
        yield from self.write(header, step, payload=tail)
        self.payload = tail
        if flushed and self.mark is not None:
            # Only now: the head that lists the part holding the committed tail
            # landed. Had the write failed, the tail would still be ours to keep.
            self.mark = 0
        if dropped:
            yield from self._collect(dropped)

    def heartbeat(self) -> Heartbeat:
        """Renew the lease from a thread until stopped (see ``_fleet.leases``)."""

        def renew() -> None:
            # A resumed run claims with its first write: this one, if the
            # step outlasts a third of the lease. So it says "running" too.
            with self.lock:
                header = self.header.evolve(status="running")
                renewal = self.rewrite(header, self.payload, None, flush_over=f2.RENEWAL_TAIL)
                drive_sync(renewal, self.plan.store)

        interval = self.plan.lease / 3
        return Heartbeat(interval, renew, self.name, first=self.owner.stamped + interval)
