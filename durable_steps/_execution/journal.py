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
    record concurrently, sharing writes (group commit, in :mod:`~durable_steps._execution.log`).
    Nobody returns before their own record is durable, and an effect's
    ``fn`` starts only after its intent is. One effect never fires twice at
    once in a process, and the runner waits for what an attempt left
    running before it goes on (see :mod:`~durable_steps._execution.firing`).
Where the code is
    :class:`Journal` (here) is the calls: names, replays, keys, titles,
    events. Its base :class:`~durable_steps._execution.log.Log` is the state and the writes.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from .._record import checkpoint as ckpt
from ..errors import DefinitionError
from ..stores import DEFAULT_STORE
from .firing import Firing, Outcome, claim
from .log import Change, Kind, Log, Result, Writer

__all__ = ["MISS", "Journal"]


logger = logging.getLogger("durable_steps")
MAX_NAME = 200
MAX_TITLE = 200
"""A title longer than this is cut (with an ellipsis) where it is kept."""


MISS = object()
"""What :meth:`Journal.begin` returns for a name not recorded yet."""


class Journal(Log):
    """The journal of one step of one pass, shared by every attempt of it
    in this process (see the module docstring).
    """

    def __init__(
        self, run: Writer, step: str, iteration: int, policy: str, *, idempotent: bool = True
    ) -> None:
        super().__init__(run, step, iteration)
        self.idempotent = idempotent
        """False for a non-idempotent step, which may not wait (see ``_execution.waits``)."""
        self.policy = policy
        """The step's in-doubt policy, recorded with each intent for the tools."""
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
        self._firings: set[Firing] = set()
        """The effect starts of this journal still running (see ``_execution.firing``)."""

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
        while True:  # an earlier start of it still firing here is waited for
            firing, earlier = self._claim(name)
            if firing is not None:
                break
            hit = self._after(name, earlier.result())
            if hit is not MISS:
                return hit
        outcome: Outcome = (False, None)
        try:
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
            outcome = (True, result)
            try:
                return self.finish(name, "effect", key, result)
            except BaseException:
                self.unrecorded[name] = (key, result)  # a retry records it, never fires it
                raise
        finally:
            self._settle(firing, outcome)

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
        await asyncio.to_thread(self._durable, Change(name, result=record))
        return self._recorded(name, record)

    async def aeffect(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any, title: str | None = None
    ) -> Any:
        """``ctx.aeffect``: :meth:`effect` for a coroutine function."""
        import asyncio

        hit = self.begin(name, "effect", title)
        if hit is not MISS:
            return hit
        while True:  # an earlier start of it still firing here is awaited
            firing, earlier = self._claim(name)
            if firing is not None:
                break
            hit = self._after(name, await asyncio.wrap_future(earlier))
            if hit is not MISS:
                return hit
        outcome: Outcome = (False, None)
        try:
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
            outcome = (True, result)
            try:
                record = self._encode(name, "effect", key, result)
                await asyncio.to_thread(self._durable, Change(name, result=record))
            except BaseException:
                self.unrecorded[name] = (key, result)  # a retry records it, never fires it
                raise
            return self._recorded(name, record)
        finally:
            self._settle(firing, outcome)

    def _key(self, name: str) -> str:
        """Effect ``name``'s idempotency key: the persisted one, else derived."""
        opened = self.open.get(name)
        if opened is not None:
            return str(opened["key"])
        return ckpt.effect_key(self.run.header.run_nonce, self.iteration, self.step, name)

    def _after(self, name: str, outcome: Outcome) -> Any:
        """Take over what an earlier start of effect ``name`` did (see ``_execution.firing``):
        its recorded result, replayed; else ``MISS``, with its returned result
        left to record, or its failure to fire again after.
        """
        with self._cond:
            found = self.results.get(name)
        if found is not None:
            self.event("call_replayed", name, key=found.key)
            return self._value(found)
        returned, result = outcome
        if returned:
            self.unrecorded.setdefault(name, (self._key(name), result))
        else:
            self.failed.add(name)
        return MISS

    def _claim(self, name: str) -> tuple[Firing | None, Future[Outcome]]:
        """Claim effect ``name``'s key for this start (see ``_execution.firing``): the claim,
        or else the future of the earlier start to wait for first.
        """
        firing, earlier = claim(self._key(name))
        if firing is None:
            assert earlier is not None
            return None, earlier
        with self._cond:
            self._firings.add(firing)
        return firing, firing.future

    def _settle(self, firing: Firing, outcome: Outcome) -> None:
        """Release ``firing`` with ``outcome``, and forget it as this journal's."""
        with self._cond:
            self._firings.discard(firing)
        firing.done(outcome)

    def firings(self) -> tuple[Future[Outcome], ...]:
        """The effects this journal's attempts started and that are still running."""
        with self._cond:
            return tuple(f.future for f in self._firings)

    def _before_firing(
        self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> tuple[str, Change]:
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
            found = self.results.get(name) or self.deferred.get(name)
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

    def _intent(self, name: str) -> tuple[str, Change]:
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
        return key, Change(name, intent=intent)

    def finish(self, name: str, kind: Kind, key: str | None, result: Any) -> Any:
        record = self._encode(name, kind, key, result)
        self._durable(Change(name, result=record))
        return self._recorded(name, record)

    def _recorded(self, name: str, record: Result) -> Any:
        self.event("call_recorded", name, key=record.key)
        return self._value(record)

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

    def release(self, name: str) -> None:
        """Let a call named ``name`` be made again in this attempt, if it recorded
        nothing (it failed): an integration records under it what answered it.
        """
        with self._cond:
            if name not in self.results and name not in self.deferred:
                self.used.discard(name)

    def recorded(self, name: str) -> bool:
        """Whether ``name`` has a recorded result (a call of it now replays it)."""
        with self._cond:
            return name in self.results or name in self.deferred

    def title(self, name: str) -> str | None:
        """What to show for call ``name``: the title its caller gave, now or
        when its intent was written; None when there is none.
        """
        found = self.titles.get(name)
        if found is None:
            title = self.open.get(name, {}).get("title")
            found = title if isinstance(title, str) else None
        return found


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
