r"""A step's journal as the run stores it: what is open, what is recorded, and
the writes that make each change durable.

:class:`Log` is the state and the write side of a
:class:`~durable_steps._execution.journal.Journal` (which adds the calls themselves).
It loads what the run's head holds for its step, and makes every change —
an effect's intent, a call's result — durable through the run's
:class:`Writer` (the runner's ``RunState``, handed in), one head write per
group of changes; see :mod:`durable_steps._execution.journal` for the protocol and
why a crash at any instant is safe.

Group commit
    ``asyncio.gather`` over ``acall``/``aeffect``, or threads in a sync step,
    record concurrently: changes queue, and whichever caller finds no write
    in flight writes everything queued in one PUT while the others wait for
    it. Nobody returns before their own change is durable. A change applies
    to the in-memory journal only once its write landed, so a refused or
    failed write leaves the journal as the store has it.

Deferred call results
    On a store that limits writes per object name (GCS; see
    :mod:`durable_steps._fleet.pacing` for the design), a ``ctx.call`` result that
    arrives while the head's next write slot is not due is *deferred*: it
    joins the queue without a waiter, ``ctx.call`` returns, and a timer
    writes the queue when the slot is due (unless another write — an
    effect's intent, a wait — carried it first). Until then it is kept in
    :attr:`Log.deferred`, where a replay in this process finds it. Nothing
    else is ever deferred, and on other stores nothing is. The runner's own
    records (:meth:`Log.record`) go through the same queue, and before a
    suspension it writes what is still deferred (:meth:`Log.flush`): one
    writer of the head, in turn, so no two writes ever share a slot.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._drivers import Blocking, drive_sync
from .._drivers import Protocol as DriverProtocol
from .._record import checkpoint as ckpt
from .._record import format2 as f2
from ..errors import CheckpointConflict, CorruptCheckpoint, DefinitionError, SerializationError
from ..serializers import plain_json

if TYPE_CHECKING:
    from .._events import EventKind
    from .._fleet.leases import Owner
    from .._fleet.pacing import Pace
    from .._record.checkpoint import Signer
    from .plan import Plan

__all__ = ["Change", "Kind", "Log", "Result", "Writer"]

logger = logging.getLogger("durable_steps")


class Writer(typing.Protocol):
    """What a journal needs of the run it records in.

    :class:`~durable_steps._execution.run_state.RunState` is the one writer of a run's
    checkpoint; it is handed to the journal (and the journal's waits) as
    this, so the journal writes through it without knowing the runner.
    """

    plan: Plan
    name: str
    run_id: str
    pace: Pace
    header: ckpt.Checkpoint
    payload: bytes
    parts: f2.Parts | None
    lock: threading.Lock
    owner: Owner
    warned_store: bool

    @property
    def signer(self) -> Signer | None:
        """The signing serializer, whose key signs what the run writes."""

    def stored_step(self, step: str) -> str:
        """The name the run's head keeps for ``step`` (a renamed step's earlier one)."""

    def event(self, kind: EventKind, **fields: Any) -> None:
        """Tell the run's subscribers."""

    def conflict(self, step: str | None, *, created: bool = False) -> CheckpointConflict:
        """The error for a write another process refused."""

    def rewrite(
        self,
        header: ckpt.Checkpoint,
        tail: bytes,
        step: str | None,
        *,
        flush_over: int | None = None,
        balance: bool = False,
    ) -> DriverProtocol[None]:
        """Write the head while a step runs (see ``RunState.rewrite``)."""


Kind = Literal["call", "effect", "sleep", "signal", "timeout"]
"""``sleep``: a wake time or a signal's deadline; ``signal``: a received payload."""


@dataclass(frozen=True)
class Result:
    """A recorded result: the bytes it is kept as (a format-2 record, or the
    serializer's bytes in format 1), decoded afresh on every replay.
    """

    kind: Kind
    key: str | None
    blob: bytes


@dataclass(frozen=True)
class Change:
    """One thing to make durable: an effect's intent, or a result."""

    name: str
    intent: dict[str, Any] | None = None
    result: Result | None = None


class Log:
    """The open effects and recorded results of one step of one pass, and the
    writes that keep the run's head in step with them (see the module docstring).
    """

    def __init__(self, run: Writer, step: str, iteration: int) -> None:
        self.run = run
        self.step = step
        self.iteration = iteration
        self.results: dict[str, Result] = {}
        self.open: dict[str, dict[str, Any]] = {}
        """Effects whose intent is durable and whose result is not, by name."""
        self.was: list[str] = []
        """Earlier names of the step its records may carry (see ``_load``)."""
        self.closed = False
        self.lost = False
        self._cond = threading.Condition()
        self._queue: list[Change] = []
        self._asked = self._done = 0
        self._writing = False
        self._errors: dict[int, BaseException] = {}
        self.deferred: dict[str, Result] = {}
        """Call results returned but not written yet (queued for the next write)."""
        self._timer: threading.Timer | None = None
        self._load()

    def _load(self) -> None:
        """Take the journal the loaded checkpoint holds for this step, if any."""
        run = self.run
        field = run.header.journal
        if field is None or (field["step"], field["iteration"]) != (self.step, self.iteration):
            return
        self.open = {entry["name"]: dict(entry) for entry in field["open"]}
        # The names the step's records may carry: the step was renamed since they
        # were written (``was``, kept by _deploys.positions.adopt), perhaps again now (renamed).
        self.was = list(field.get("was", ()))
        names = {self.step, *self.was}
        if run.header.format == 1:
            for name, kind, key, data in field["inline"]:
                self.results[name] = Result(kind, key, base64.b64decode(data))
        elif run.parts is not None:
            renamed = run.plan.renamed()  # records made before a rename name the old step
            for meta, record in run.parts.journal:
                step, iteration, name, kind, key = meta
                if iteration == self.iteration and (step in names or renamed.get(step) in names):
                    self.results[name] = Result(kind, key, record)
            run.parts.journal = []  # taken: a later step's journal starts empty
        if len(self.results) != field["calls"]:
            raise CorruptCheckpoint(
                f"run {run.name}: the journal of step {self.step!r} lists {field['calls']} "
                f"results but {len(self.results)} were found; it was left untouched. "
                "Restore the checkpoint, or delete the run to start over.",
                run=run.name,
            )

    def _encode(self, name: str, kind: Kind, key: str | None, value: Any) -> Result:
        """``value`` as it will be stored; a clear error if it cannot be."""
        run = self.run
        path = f"ctx.{kind}({name!r})"
        try:
            if run.parts is not None:
                meta = [self.step, self.iteration, name, kind, key]
                blob = run.parts.finder.journal_record(meta, value, path)
            else:
                if run.plan.serializer.name.startswith("json"):
                    value = plain_json(value, path)
                blob = run.plan.serializer.dumps(value)
        except SerializationError as exc:
            if kind == "effect":
                then = (
                    f"The effect happened; its intent stays recorded, so when the step runs "
                    f"again it fires again with the same idempotency key {key}."
                )
            else:
                then = "Nothing was recorded: the call runs again when the step does."
            raise SerializationError(
                f"run {run.name}: step {self.step!r}: the result of {path} cannot be saved: "
                f"{exc.message} {then} Return a value the serializer stores (convert an SDK "
                "object with .model_dump() or to_dict(), for instance).",
                run=run.name,
                step=self.step,
                path=exc.path,
            ) from exc
        return Result(kind, key, blob)

    def value(self, result: Result) -> Any:
        """A recorded result's value, decoded (what a replay of it returns)."""
        return self._value(result)

    def _value(self, result: Result) -> Any:
        run = self.run
        if run.parts is not None:
            return run.parts.finder.journal_value(result.blob)
        return run.plan.serializer.loads(result.blob)

    # --- making it durable -----------------------------------------------------

    def _durable(self, change: Change | None) -> None:
        """Return once ``change`` is written (group commit; see the module
        docstring), or at once when it is a call result that may wait for the
        next write slot (deferred). ``None``: write what was deferred (the timer).
        """
        with self._cond:
            if not self._enqueued(change):
                return
            self._asked += 1
            ticket = self._asked
            while self._done < ticket:
                if self._writing:
                    self._cond.wait()
                else:
                    self._write_queue()
            failure = self._errors.pop(ticket, None)
        if failure is not None:
            raise failure

    def _enqueued(self, change: Change | None) -> bool:
        """Queue ``change`` (``_cond`` held); whether its caller waits for the write."""
        if change is None:  # the timer: a write only if something is still deferred
            return not self.closed and bool(self.deferred)
        self._queue.append(change)
        if not self._deferrable(change) or (not self._writing and self.run.pace.due()):
            return True  # (a call when the slot is due: written before it returns, as elsewhere)
        assert change.result is not None
        self.deferred[change.name] = change.result
        self._schedule()
        return False

    def _write_queue(self) -> None:
        """Write everything queued, as the one writer (``_cond`` held, released
        while the write is under way); settle the tickets it covers.
        """
        batch, self._queue = self._queue, []
        last, self._writing = self._asked, True
        error: BaseException | None = None
        self._cond.release()
        try:
            if batch:  # (empty: a flush whose results a write carried already)
                self._write(batch)
        except BaseException as exc:
            error = exc
        finally:
            self._cond.acquire()
            self._writing = False
        if error is not None:
            self._errors.update(dict.fromkeys(range(self._done + 1, last + 1), error))
            # Deferred results stay queued: the next write carries them.
            self._queue[:0] = [c for c in batch if self._is_deferred(c)]
        else:
            for c in batch:
                if self._is_deferred(c):
                    del self.deferred[c.name]
        self._done = last
        self._cond.notify_all()

    def _deferrable(self, change: Change) -> bool:
        """A call's result, on a store that paces writes (see the module docstring)."""
        result = change.result
        return (
            bool(self.run.pace.interval)
            and change.intent is None
            and result is not None
            and result.kind == "call"
        )

    def _is_deferred(self, change: Change) -> bool:
        return change.result is not None and self.deferred.get(change.name) is change.result

    def _schedule(self) -> None:
        """Have the deferred results written when the slot is due (``_cond`` held)."""
        if self._timer is not None or self.closed:
            return
        delay = max(0.0, self.run.pace.slot() - time.monotonic())
        self._timer = threading.Timer(delay, self._flush_deferred)
        self._timer.daemon = True
        self._timer.start()

    def _flush_deferred(self) -> None:
        """The timer: one head write carrying the deferred results. A failure
        leaves them queued for the next write (a lost run: nothing more is).
        """
        with self._cond:
            self._timer = None
        try:
            self._durable(None)
        except Exception as exc:  # the step's next write says it, or its commit drops them
            logger.info(
                "run %s: step %r: writing %d deferred call result(s) failed (%s); the "
                "next write carries them",
                self.run.name,
                self.step,
                len(self.deferred),
                exc,
            )

    def _write(self, batch: list[Change]) -> None:
        """One head write carrying ``batch``; the journal changes only once it landed."""
        run = self.run
        opened, results, field, records = self._applied(batch)
        with run.lock:
            if self.closed:  # the step returned, so it may have committed: this head is not ours
                raise DefinitionError(
                    f"run {run.name}: step {self.step!r} returned while "
                    f"{', '.join(repr(c.name) for c in batch)} was still under way (in a thread "
                    "or task the step left running); it was not recorded. Wait for every call "
                    "before the step returns.",
                    run=run.name,
                    step=self.step,
                )
            if self.lost:
                raise run.conflict(self.step)
            header, tail = self._head(field, records)
            self._rewrite(header, tail)
        self.open, self.results = opened, results

    def record(self, name: str, kind: Kind, key: str | None, value: Any) -> DriverProtocol[Any]:
        """Record ``value`` as ``name``'s result for the runner (what ``reconcile``
        said an effect returned, what a wait left pending): one head write, made
        by the runner's driver, so never on an event loop. Returns the value decoded.
        """
        result = self._encode(name, kind, key, value)
        # Through the journal's one write path, in a worker thread under asyncio:
        # under the run's lock, serialized with the timer's and the heartbeat's
        # writes, and carrying the deferred call results (never a second writer).
        yield Blocking(self._durable, (Change(name, result=result),))
        return self._value(result)

    def flush(self) -> DriverProtocol[None]:
        """Write the deferred call results now, if any (before the run suspends:
        the wait's own write is the runner's, after :meth:`close`). Off any loop.
        """
        if self.deferred:
            yield Blocking(self._durable, (None,))

    def _applied(
        self, batch: list[Change]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Result], dict[str, Any], list[bytes]]:
        """The open effects and results with ``batch`` applied, the header's
        ``journal`` field for them, and the format-2 records ``batch`` adds.
        """
        opened, results = dict(self.open), dict(self.results)
        records = []
        for change in batch:
            if change.intent is not None:
                opened[change.name] = change.intent
            if change.result is not None:
                opened.pop(change.name, None)
                results[change.name] = change.result
                if self.run.parts is not None:
                    records.append(change.result.blob)
        field: dict[str, Any] = {
            "step": self.step,
            "iteration": self.iteration,
            "calls": len(results),
            "open": list(opened.values()),
        }
        if self.was:
            field["was"] = self.was
        if self.run.parts is None:
            field["inline"] = [
                [n, r.kind, r.key, base64.b64encode(r.blob).decode()] for n, r in results.items()
            ]
        return opened, results, field, records

    def _head(self, field: dict[str, Any], records: list[bytes]) -> tuple[ckpt.Checkpoint, bytes]:
        """The head to write for ``field``, and the tail with ``records`` appended."""
        run = self.run
        tail = run.payload
        if run.parts is not None and records:
            tail = b"".join((tail, *(b for r in records for b in f2.frame(r))))
            for record in records:
                run.parts.note(record)
        return run.header.evolve(status="running", journal=field), tail

    def _rewrite(self, header: ckpt.Checkpoint, tail: bytes) -> None:
        """Write the head (``run.lock`` held); a refusal means the run is lost."""
        run = self.run
        try:
            drive_sync(run.rewrite(header, tail, self.step, balance=True), run.plan.store)
        except CheckpointConflict:
            self.lost = True
            raise

    def _renew_if_short(self) -> None:
        """Renew the lease before an effect fires if the intent write left little
        of it (the same care the runner takes before a non-idempotent step).
        """
        run = self.run
        if self.closed or run.owner.remaining() >= run.plan.lease / 3:
            return  # (closed: the effect's result will be refused, see _write)
        with run.lock:
            self._rewrite(run.header.evolve(status="running"), run.payload)

    def close(self) -> None:
        """The step returned: refuse further calls, wait for a write in flight."""
        with self._cond:
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            # Deferred results go unwritten: the commit drops the journal, and a
            # step that failed runs those calls again when it is resumed.
            self._queue = [c for c in self._queue if not self._is_deferred(c)]
            self.deferred.clear()
            while self._writing:
                self._cond.wait()
