"""The context a step gets: where it runs, and its journaled calls and waits.

:class:`Context` is what ``fn(state, ctx)`` receives. Its journaled calls
(``call``, ``effect`` and their async twins) and waits (``sleep``,
``wait_for``) go through the step's :class:`~durable_steps._execution.journal.Journal`;
a Context made by hand (a unit test of a step) has none, and then runs
calls directly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .._fleet.approval import Accepts
from .._record.checkpoint import effect_key
from ..errors import DefinitionError
from .waits import sleep_until, wait_for

if TYPE_CHECKING:
    from .journal import Journal

__all__ = ["Context"]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(eq=False)
class Context:
    """What a step knows about where it runs. Read-only for steps.

    ``idempotency_key`` is the same on every retry and every resume of this
    step in this pass, and differs for every other step, pass and run. For a
    step declared ``idempotent=False`` it is written to the checkpoint before
    the step fires: pass it to the API the step calls, so that a re-fire is
    deduplicated there.
    """

    run_id: str
    workflow: str
    step: str
    iteration: int
    """The pass number, from 0."""
    attempt: int
    """The try number within this process, from 1."""
    idempotency_key: str
    in_doubt: bool = False
    """True when an earlier process may already have fired this step."""
    effect_in_doubt: str | None = None
    """In ``reconcile``: the name of the effect in doubt it is asked about
    (``idempotency_key`` is then that effect's key); None for the step itself."""
    _finish: bool = field(default=False, repr=False)
    _journal: Journal | None = field(default=None, repr=False)

    def finish(self) -> None:
        """Complete the run when this step commits: no further steps or passes run."""
        self._finish = True

    def call(self, name: str, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call ``fn(*args, **kwargs)`` once for this step of this pass, recorded.

        The result is serialized with the workflow's serializer and written
        to the checkpoint before ``call`` returns. A later ``call`` with the
        same ``name`` before the step commits — in a retry, or after a crash —
        returns the recorded result without calling ``fn``. Either way the
        value returned is the *decoded* record, a copy, so it does not matter
        which happened. Under JSON a result is stored as JSON gives it back
        (a tuple becomes a list; an SDK object — a pydantic model, a Stripe
        object — its plain data); what JSON cannot encode raises
        SerializationError.
        Each name may be used once per attempt: put an index or id in it.

        On a store that allows one write of an object per interval (GCS: a
        second; ``min_write_interval``), a call that returns before the run's
        next write is due returns at once and is written with that write (at
        most an interval later): a crash before it runs the call again, as a
        crash before any record lands does. See ``docs/stores/gcs.md``.
        """
        if self._journal is None:  # a step called by hand (a unit test): no run to record in
            return fn(*args, **kwargs)
        return self._journal.call(name, fn, args, kwargs)  # type: ignore[no-any-return]

    def effect(self, name: str, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """Call ``fn(*args, idempotency_key=key, **kwargs)`` as a side effect.

        The effect's intent, holding ``key`` (at most 64 printable ASCII
        characters, the same on every retry and resume of this effect), is
        written before ``fn`` starts; its result is recorded like
        :meth:`call`'s. If the run stopped between the two, the effect is *in
        doubt* on resume: by default it fires again with the same key (the API
        deduplicates); ``in_doubt="raise"`` on the step stops the run with
        :class:`~durable_steps.StepInDoubt` naming the effect instead, and
        ``reconcile`` is asked first (with ``ctx.effect_in_doubt`` set to its name).
        """
        if self._journal is None:
            key = effect_key(self.idempotency_key, self.iteration, self.step, name)
            return fn(*args, idempotency_key=key, **kwargs)
        return self._journal.effect(name, fn, args, kwargs)  # type: ignore[no-any-return]

    def sleep(self, seconds: float) -> None:
        """Suspend the run for ``seconds``, durably: no process waits meanwhile.

        The wake time is recorded in the step's journal the first time; until
        it is due the run is *waiting* (``wf.run`` raises
        :class:`~durable_steps.RunSuspended`, its lease is released). After
        it, the step runs again from its start, its finished calls replay,
        and this ``sleep`` returns at once.
        """
        _seconds(seconds, "ctx.sleep")
        self._sleep_until(lambda: time.time() + seconds)

    def sleep_until(self, when: datetime | float) -> None:
        """Suspend the run until ``when`` (a ``datetime``, naive meaning local
        time, or epoch seconds); see :meth:`sleep`.
        """
        at = when.timestamp() if isinstance(when, datetime) else when
        _seconds(at, "ctx.sleep_until")
        self._sleep_until(lambda: float(at))

    def _sleep_until(self, wake: Callable[[], float]) -> None:
        # The wake time is ``wake()`` as it was when first asked (recorded).
        if self._journal is None:  # a step called by hand: nothing to suspend
            return
        sleep_until(self._journal, wake)

    def wait_for(
        self, name: str, timeout: float | None = None, *, accepts: Accepts | None = None
    ) -> Any:
        """Suspend the run until signal ``name`` arrives; return its payload (JSON).

        Send it with ``wf.signal(run_id, name, payload)`` or ``durable-steps
        signal``; one sent before the run waits is kept and used at once. The
        payload is recorded in the step's journal, so a re-run of the step
        gets the same one. With ``timeout`` (seconds, counted from the first
        wait) :class:`~durable_steps.SignalTimeout` is raised here once it
        passed without the signal. A name is delivered once per run: waits in
        a loop put the pass in it (``f"approval:{ctx.iteration}"``).

        ``accepts="approval"``: the payload is an approval, ``{"approved":
        true}``, ``{"approved": false, "message": "why"}``, ``true`` or
        ``false``, and nothing else — a signal of another shape is refused
        when it is sent (:class:`~durable_steps.SignalRefused`), and ``show``
        and the web page say what the run accepts.
        """
        if timeout is not None:
            _seconds(timeout, "ctx.wait_for(timeout=)")
        if self._journal is None:
            raise DefinitionError(
                f"ctx.wait_for({name!r}) needs a running workflow: a hand-made Context has "
                "no run to wait in. Unit-test the step's logic around the wait instead."
            )
        return wait_for(self._journal, name, timeout, accepts)

    # For integrations: a journaled call with a title (what show, resolve,
    # events and traces display), its name staying what replays it. Same
    # semantics as the public methods above and below.

    def _recorded(self, name: str) -> bool:
        return self._journal is not None and self._journal.recorded(name)

    def _call(
        self, name: str, fn: Callable[..., R], args: Any, kwargs: Any, *, title: str | None
    ) -> R:
        if self._journal is None:
            return fn(*args, **kwargs)
        return self._journal.call(name, fn, args, kwargs, title)  # type: ignore[no-any-return]

    def _effect(
        self, name: str, fn: Callable[..., R], args: Any, kwargs: Any, *, title: str | None
    ) -> R:
        if self._journal is None:
            key = effect_key(self.idempotency_key, self.iteration, self.step, name)
            return fn(*args, idempotency_key=key, **kwargs)
        return self._journal.effect(name, fn, args, kwargs, title)  # type: ignore[no-any-return]

    async def _acall(
        self,
        name: str,
        fn: Callable[..., Awaitable[R]],
        args: Any,
        kwargs: Any,
        *,
        title: str | None,
    ) -> R:
        if self._journal is None:
            return await fn(*args, **kwargs)
        return await self._journal.acall(name, fn, args, kwargs, title)  # type: ignore[no-any-return]

    def _release(self, name: str) -> None:
        """A failed journaled call's name, free again in this attempt (``Journal.release``)."""
        if self._journal is not None:
            self._journal.release(name)

    async def _aeffect(
        self,
        name: str,
        fn: Callable[..., Awaitable[R]],
        args: Any,
        kwargs: Any,
        *,
        title: str | None,
    ) -> R:
        if self._journal is None:
            key = effect_key(self.idempotency_key, self.iteration, self.step, name)
            return await fn(*args, idempotency_key=key, **kwargs)
        return await self._journal.aeffect(name, fn, args, kwargs, title)  # type: ignore[no-any-return]

    async def acall(
        self, name: str, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        r""":meth:`call` for a coroutine function, in an async step; concurrent
        ``acall``\ s (``asyncio.gather``) are each recorded, sharing writes.
        """
        if self._journal is None:
            return await fn(*args, **kwargs)
        return await self._journal.acall(name, fn, args, kwargs)  # type: ignore[no-any-return]

    async def aeffect(
        self, name: str, fn: Callable[..., Awaitable[R]], /, *args: Any, **kwargs: Any
    ) -> R:
        """:meth:`effect` for a coroutine function, in an async step."""
        if self._journal is None:
            key = effect_key(self.idempotency_key, self.iteration, self.step, name)
            return await fn(*args, idempotency_key=key, **kwargs)
        return await self._journal.aeffect(name, fn, args, kwargs)  # type: ignore[no-any-return]


def _seconds(value: object, what: str) -> None:
    """Refuse a time that is not a finite number (a string, NaN, None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DefinitionError(f"{what}: expected a finite number of seconds, not {value!r}")
