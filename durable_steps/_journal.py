r"""Journaled calls: the model and tool calls inside one step, recorded one by one.

``ctx.call(name, fn, ...)`` and ``ctx.effect(name, fn, ...)`` make a step's
calls durable on their own, so a re-run of the step before it commits (a
retry, a resume after a crash) replays the finished ones instead of paying
for them again — and an effect re-fired after a crash carries the key it
was first sent with, even when the model asked for a different mix of tools.

The write protocol (every write is the run's head, compare-and-swap on the
version this process last wrote, stamped with its lease — so a process
that lost the run can record nothing, and fire no effect)::

    ctx.call:    fn() → PUT head{journal.calls+1} + tail ++ record(name, result)
    ctx.effect:  PUT head{journal.open += {name, key}}          ← before fn starts
                 fn(idempotency_key=key)
                 PUT head{journal.open -= name, calls+1} + tail ++ record(name, result)
    commit:      PUT head{journal: null} + the step's state change

Where a journal lives
    The header's ``journal`` field names the step in progress (step name and
    pass: a deploy that moves the step keeps its journal), counts its
    recorded results and lists its *open* effects: intent written, result
    not. The results themselves are records of the format-2 tail
    (``["jrn", [step, iteration, name, kind, key], value]``, encoded like
    any change), so each write carries the new result and the tail's short
    backlog, not every earlier result: the tail is flushed into a part when
    it grows past the flush threshold, exactly as a commit's changes are. A
    load keeps the records of the step the header names and skips the rest
    (a committed step's, which a flush may have carried into a part). A
    format-1 run (a custom serializer, or a run made before format 2) keeps
    the results in the header (``inline``, base64), rewritten with every
    call: fine for a handful of calls per step.
Why a crash at any instant is safe
    Before a call's record lands, the call did not happen as far as the run
    knows: it runs again (a model call paid twice, never a lost result).
    After, it replays. An effect's intent lands before ``fn`` starts, so an
    effect that may have fired is always known: on resume it is *in doubt*
    and the step's policy decides (re-fire with the same key; ``raise``;
    ``reconcile``). The commit clears the journal in the same write that
    saves the state the calls produced.
Concurrency
    ``asyncio.gather`` over ``acall``/``aeffect``, or threads in a sync step,
    record concurrently: records queue, and whichever caller finds no write
    in flight writes everything queued in one PUT (group commit) while the
    others wait for it. Nobody returns before their own record is durable,
    and an effect's ``fn`` starts only after its intent is.
"""

from __future__ import annotations

import base64
import inspect
import logging
import threading
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._drivers import Protocol as DriverProtocol
from ._drivers import drive_sync
from ._record import checkpoint as ckpt
from ._record import format2 as f2
from .errors import (
    CheckpointConflict,
    CorruptCheckpoint,
    DefinitionError,
    SerializationError,
)
from .serializers import plain_json
from .stores import DEFAULT_STORE

if TYPE_CHECKING:
    from ._events import EventKind
    from ._lease import Owner
    from ._plan import Plan
    from ._record.checkpoint import Signer

__all__ = ["MISS", "Journal", "Writer"]


class Writer(typing.Protocol):
    """What a journal needs of the run it records in.

    :class:`~durable_steps._run.RunState` is the one writer of a run's
    checkpoint; it is handed to the journal (and the journal's waits) as
    this, so the journal writes through it without knowing the runner.
    """

    plan: Plan
    name: str
    run_id: str
    header: ckpt.Checkpoint
    payload: bytes
    parts: f2.Parts | None
    lock: threading.Lock
    owner: Owner
    warned_store: bool

    @property
    def signer(self) -> Signer | None:
        """The signing serializer, whose key signs what the run writes."""

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


logger = logging.getLogger("durable_steps")
Kind = Literal["call", "effect", "sleep", "signal", "timeout"]
"""``sleep``: a wake time or a signal's deadline; ``signal``: a received payload."""
MAX_NAME = 200
MAX_TITLE = 200
"""A title longer than this is cut (with an ellipsis) where it is kept."""


@dataclass(frozen=True)
class _Result:
    """A recorded result: the bytes it is kept as (a format-2 record, or the
    serializer's bytes in format 1), decoded afresh on every replay.
    """

    kind: Kind
    key: str | None
    blob: bytes


@dataclass(frozen=True)
class _Change:
    """One thing to make durable: an effect's intent, or a result."""

    name: str
    intent: dict[str, Any] | None = None
    result: _Result | None = None


MISS = object()
"""What :meth:`Journal.begin` returns for a name not recorded yet."""


class Journal:
    """The journal of one step of one pass, shared by every attempt of it
    in this process (see the module docstring).
    """

    def __init__(
        self, run: Writer, step: str, iteration: int, policy: str, *, idempotent: bool = True
    ) -> None:
        self.run = run
        self.step = step
        self.iteration = iteration
        self.idempotent = idempotent
        """False for a non-idempotent step, which may not wait (see ``_waiting``)."""
        self.policy = policy
        """The step's in-doubt policy, recorded with each intent for the tools."""
        self.results: dict[str, _Result] = {}
        self.open: dict[str, dict[str, Any]] = {}
        """Effects whose intent is durable and whose result is not, by name."""
        self.used: set[str] = set()
        """Names called in the current attempt."""
        self.unrecorded: dict[str, tuple[str, Any]] = {}
        """Effects that returned in this process but whose result could not be
        recorded (a store failure): a retry records it instead of firing again."""
        self.failed: set[str] = set()
        """Effects whose ``fn`` raised in this process: a retry re-fires them
        with the same key without calling that doubt."""
        self.titles: dict[str, str] = {}
        """The titles given for calls (see :meth:`begin`), by name."""
        self.attempt = 1
        self.sleeps = 0
        """``ctx.sleep`` calls so far in this attempt (they are named by order)."""
        self.closed = False
        self.lost = False
        self._cond = threading.Condition()
        self._queue: list[_Change] = []
        self._asked = self._done = 0
        self._writing = False
        self._errors: dict[int, BaseException] = {}
        self._load()

    # --- loading ----------------------------------------------------------------

    def _load(self) -> None:
        """Take the journal the loaded checkpoint holds for this step, if any."""
        run = self.run
        field = run.header.journal
        if field is None or (field["step"], field["iteration"]) != (self.step, self.iteration):
            return
        self.open = {entry["name"]: dict(entry) for entry in field["open"]}
        if run.header.format == 1:
            for name, kind, key, data in field["inline"]:
                self.results[name] = _Result(kind, key, base64.b64decode(data))
        elif run.parts is not None:
            for meta, record in run.parts.journal:
                step, iteration, name, kind, key = meta
                if (step, iteration) == (self.step, self.iteration):
                    self.results[name] = _Result(kind, key, record)
            run.parts.journal = []  # taken: a later step's journal starts empty
        if len(self.results) != field["calls"]:
            raise CorruptCheckpoint(
                f"run {run.name}: the journal of step {self.step!r} lists {field['calls']} "
                f"results but {len(self.results)} were found; it was left untouched. "
                "Restore the checkpoint, or delete the run to start over.",
                run=run.name,
            )

    def in_doubt(self) -> list[dict[str, Any]]:
        """The open effects no process here fired and nobody resolved."""
        return [e for n, e in self.open.items() if n not in self.failed and "resolution" not in e]

    # --- the calls --------------------------------------------------------------

    def begin_attempt(self, attempt: int) -> None:
        """A new attempt of the step: its names start unused again."""
        with self._cond:
            self.used.clear()
            self.attempt = attempt
            self.sleeps = 0

    def remember(self, name: str, kind: Kind, make: Callable[[], Any]) -> Any:
        """``make()`` once, recorded under ``name``: a wake time, a deadline."""
        hit = self.begin(name, kind)
        if hit is not MISS:
            return hit
        return self.finish(name, kind, None, make())

    def call(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any, title: str | None = None
    ) -> Any:
        """``ctx.call``: ``fn(*args, **kwargs)`` once, its result recorded."""
        hit = self.begin(name, "call", title)
        if hit is not MISS:
            return hit
        self.event("call_started", name)
        result = _sync_result(fn(*args, **kwargs), name, "call")
        return self.finish(name, "call", None, result)

    def effect(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any, title: str | None = None
    ) -> Any:
        """``ctx.effect``: the intent durable, then ``fn(..., idempotency_key=key)``."""
        hit = self.begin(name, "effect", title)
        if hit is not MISS:
            return hit
        fired = self.unrecorded.pop(name, None)
        if fired is not None:  # it returned in this process; only its record failed
            key, result = fired
        else:
            key, change = self._before_firing(name, fn, args, kwargs)
            self._durable(change)
            self._renew_if_short()
            try:
                result = _sync_result(fn(*args, idempotency_key=key, **kwargs), name, "effect")
            except BaseException:
                self.failed.add(name)
                raise
        try:
            return self.finish(name, "effect", key, result)
        except BaseException:
            self.unrecorded[name] = (key, result)  # a retry records it without firing again
            raise

    async def acall(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any, title: str | None = None
    ) -> Any:
        """``ctx.acall``: :meth:`call` for a coroutine function, writes off the loop."""
        import asyncio

        hit = self.begin(name, "call", title)
        if hit is not MISS:
            return hit
        self.event("call_started", name)
        result = await _awaited(fn(*args, **kwargs))
        record = self._encode(name, "call", None, result)
        await asyncio.to_thread(self._durable, _Change(name, result=record))
        return self._recorded(name, record)

    async def aeffect(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any, title: str | None = None
    ) -> Any:
        """``ctx.aeffect``: :meth:`effect` for a coroutine function."""
        import asyncio

        hit = self.begin(name, "effect", title)
        if hit is not MISS:
            return hit
        fired = self.unrecorded.pop(name, None)
        if fired is not None:  # it returned in this process; only its record failed
            key, result = fired
        else:
            key, change = self._before_firing(name, fn, args, kwargs)
            await asyncio.to_thread(self._durable, change)
            await asyncio.to_thread(self._renew_if_short)
            try:
                result = await _awaited(fn(*args, idempotency_key=key, **kwargs))
            except BaseException:
                self.failed.add(name)
                raise
        try:
            record = self._encode(name, "effect", key, result)
            await asyncio.to_thread(self._durable, _Change(name, result=record))
        except BaseException:
            self.unrecorded[name] = (key, result)  # a retry records it without firing again
            raise
        return self._recorded(name, record)

    def _before_firing(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> tuple[str, _Change]:
        """Checks before an effect's intent is written; its key and that intent."""
        _takes_key(fn, args, kwargs, name)
        self._warn_implicit_store()
        return self._intent(name)

    def _warn_implicit_store(self) -> None:
        """The default-store warning, for effects (the runner gives it for steps)."""
        run = self.run
        if run.plan.implicit_store and not run.warned_store:
            run.warned_store = True
            logger.warning(
                "run %s makes effects in the default local store %s because no store= was "
                "given and $DURABLE_STEPS_STORE is not set. A rerun from another directory "
                "or machine will not find it and will start the run over, firing its effects "
                "again under new idempotency keys. Pass store= (or set $DURABLE_STEPS_STORE).",
                run.name,
                DEFAULT_STORE,
            )

    def begin(self, name: str, kind: Kind, title: str | None = None) -> Any:
        """Check ``name``; the replayed value if it is recorded, else ``MISS``.

        ``title`` is what a person or a trace is shown for the call (an
        integration's tool and its arguments); ``name`` stays what replays it.
        """
        run = self.run
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise DefinitionError(
                f"run {run.name}: step {self.step!r}: a ctx.{kind} name must be a string of "
                f"1-{MAX_NAME} characters, not {name!r}",
                run=run.name,
                step=self.step,
            )
        with self._cond:
            if self.closed:
                raise DefinitionError(
                    f"run {run.name}: ctx.{kind}({name!r}) was made after step {self.step!r} "
                    "returned (from a thread or task the step left running); nothing was "
                    "recorded. Wait for every call before the step returns.",
                    run=run.name,
                    step=self.step,
                )
            if self.lost:
                raise run.conflict(self.step)
            if name in self.used:
                raise DefinitionError(
                    f"run {run.name}: step {self.step!r} made two calls named {name!r} in one "
                    "attempt. Each journaled call needs its own name: put the loop index or "
                    f"the tool call's id in it (e.g. f'{name}:{{i}}').",
                    run=run.name,
                    step=self.step,
                )
            self.used.add(name)
            if title is not None:
                self.titles[name] = _title(title)
            found = self.results.get(name)
            opened = self.open.get(name)
        if found is not None:
            if found.kind != kind:
                raise DefinitionError(
                    f"run {run.name}: step {self.step!r}: {name!r} was recorded as a "
                    f"ctx.{found.kind}, and is now made as a ctx.{kind}; keep its kind, "
                    "or give it another name.",
                    run=run.name,
                    step=self.step,
                )
            self.event("call_replayed", name, key=found.key)
            return self._value(found)
        if kind == "effect" and opened is not None and opened.get("resolution") == "fired":
            logger.info(
                "run %s: effect %r of step %r was resolved as fired; not firing it again",
                run.name,
                name,
                self.step,
            )
            self.event("call_replayed", name, key=opened["key"])
            return None
        return MISS

    def _intent(self, name: str) -> tuple[str, _Change]:
        """The key of effect ``name`` and the intent to write before it fires."""
        run = self.run
        opened = self.open.get(name)
        if opened is not None:
            key = str(opened["key"])  # the persisted key wins over a re-derived one
            if name not in self.failed and "resolution" not in opened:
                self.event("effect_in_doubt", name, key=key)
                logger.warning(
                    "run %s: effect %r of step %r may have fired before the run last stopped; "
                    "firing it again with the same idempotency key %s",
                    run.name,
                    name,
                    self.step,
                    key,
                )
        else:
            key = ckpt.effect_key(run.header.run_nonce, self.iteration, self.step, name)
        self.event("call_started", name, key=key)
        intent = {"name": name, "key": key, "at": round(time.time(), 3), "policy": self.policy}
        if name in self.titles:
            intent["title"] = self.titles[name]
        return key, _Change(name, intent=intent)

    def finish(self, name: str, kind: Kind, key: str | None, result: Any) -> Any:
        record = self._encode(name, kind, key, result)
        self._durable(_Change(name, result=record))
        return self._recorded(name, record)

    def _recorded(self, name: str, record: _Result) -> Any:
        self.event("call_recorded", name, key=record.key)
        return self._value(record)

    def _encode(self, name: str, kind: Kind, key: str | None, value: Any) -> _Result:
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
        return _Result(kind, key, blob)

    def _value(self, result: _Result) -> Any:
        run = self.run
        if run.parts is not None:
            return run.parts.finder.journal_value(result.blob)
        return run.plan.serializer.loads(result.blob)

    def event(self, kind: Any, name: str, *, key: str | None = None) -> None:
        self.run.event(
            kind,
            step=self.step,
            iteration=self.iteration,
            attempt=self.attempt,
            call=name,
            idempotency_key=key,
            title=self.title(name),
        )

    def title(self, name: str) -> str | None:
        """What to show for call ``name``: the title its caller gave, now or
        when its intent was written; None when there is none.
        """
        found = self.titles.get(name)
        if found is None:
            title = self.open.get(name, {}).get("title")
            found = title if isinstance(title, str) else None
        return found

    # --- making it durable -----------------------------------------------------

    def _durable(self, change: _Change) -> None:
        """Return once ``change`` is written (group commit; see the module docstring)."""
        with self._cond:
            self._queue.append(change)
            self._asked += 1
            ticket = self._asked
            while self._done < ticket:
                if self._writing:
                    self._cond.wait()
                    continue
                batch, self._queue = self._queue, []
                last, self._writing = self._asked, True
                error: BaseException | None = None
                self._cond.release()
                try:
                    self._write(batch)
                except BaseException as exc:
                    error = exc
                finally:
                    self._cond.acquire()
                    self._writing = False
                if error is not None:
                    self._errors.update(dict.fromkeys(range(self._done + 1, last + 1), error))
                self._done = last
                self._cond.notify_all()
            failure = self._errors.pop(ticket, None)
        if failure is not None:
            raise failure

    def _write(self, batch: list[_Change]) -> None:
        """One head write carrying ``batch``; the journal changes only once it landed."""
        run = self.run
        opened, results = dict(self.open), dict(self.results)
        records = []
        for change in batch:
            if change.intent is not None:
                opened[change.name] = change.intent
            if change.result is not None:
                opened.pop(change.name, None)
                results[change.name] = change.result
                if run.parts is not None:
                    records.append(change.result.blob)
        field: dict[str, Any] = {
            "step": self.step,
            "iteration": self.iteration,
            "calls": len(results),
            "open": list(opened.values()),
        }
        if run.parts is None:
            field["inline"] = [
                [n, r.kind, r.key, base64.b64encode(r.blob).decode()] for n, r in results.items()
            ]
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
            tail = run.payload
            if run.parts is not None and records:
                tail = b"".join((tail, *(b for r in records for b in f2.frame(r))))
                for record in records:
                    run.parts.note(record)
            self._rewrite(run.header.evolve(status="running", journal=field), tail)
        self.open, self.results = opened, results

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
            while self._writing:
                self._cond.wait()


def _title(text: object) -> str:
    """A call's title as kept: a string of at most ``MAX_TITLE`` characters."""
    text = str(text)
    return text if len(text) <= MAX_TITLE else text[: MAX_TITLE - 1] + "\u2026"


def _takes_key(fn: Callable[..., Any], args: Any, kwargs: Any, name: str) -> None:
    """Refuse, before its intent is written, an effect whose ``fn`` cannot take
    ``idempotency_key=`` (it would fail with a TypeError and be left in doubt).
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: Python cannot say
        return
    try:
        signature.bind(*args, idempotency_key="", **kwargs)
    except TypeError as exc:
        raise DefinitionError(
            f"ctx.effect({name!r}): {getattr(fn, '__name__', fn)!r} cannot be called with "
            f"these arguments and idempotency_key= ({exc}); nothing was fired. An effect's "
            "function receives its key as the keyword argument idempotency_key: add that "
            "parameter, or wrap the call (lambda idempotency_key: api(..., key=idempotency_key))."
        ) from None


def _sync_result(result: Any, name: str, kind: str) -> Any:
    """``result`` of a sync call; an awaitable means the call was async."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise DefinitionError(
            f"ctx.{kind}({name!r}): the function returned an awaitable, so it is async and "
            f"did not run; use `await ctx.a{kind}(...)` in an async step"
        )
    return result


async def _awaited(result: Awaitable[Any] | Any) -> Any:
    return (await result) if inspect.isawaitable(result) else result
