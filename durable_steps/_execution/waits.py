"""Waiting inside a step: ``ctx.sleep``, ``ctx.sleep_until``, ``ctx.wait_for``.

Each wait is journaled (the wake time, the deadline, the received payload),
so a re-run of the step takes the same branch. A wait that cannot return
yet raises :class:`Suspend`; the runner's side (:mod:`durable_steps._protocol.suspending`)
turns that into a suspended run.

No store I/O on an event loop
    The waits are plain calls, also in an ``async def`` step, which runs on
    the event loop: a GET or a PUT there would stall every other task for a
    round trip. So on a running loop a wait never touches the store itself.
    What it would write (a new wake time or deadline) travels in the
    :class:`Suspend` it raises as ``pending``, and a signal it cannot look
    for is marked ``check``; the runner, whose I/O runs off the loop, writes
    the records, looks for the signal, and either suspends the run or — the
    signal was there, or the deadline passed — runs the step again from its
    start, which then finds everything recorded and returns at once. A run
    woken for its signal has the payload recorded by the runner before the
    step runs (:func:`durable_steps._protocol.suspending.wake`), so the common path
    costs no extra run of the step. Outside a loop (a sync run) the waits
    read and write the store directly, as a sync step's other calls do.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

from .._drivers import Get, Protocol, Put, drive_sync
from .._events import logger
from .._fleet.approval import APPROVAL, accepted, refusal
from .._fleet.signals import consumed, decode, signal_key
from .._record import checkpoint as ckpt
from ..errors import DefinitionError, DurableStepsError, SignalTimeout
from .journal import MISS, Journal
from .log import Kind, Writer

__all__ = ["Suspend", "receive", "sleep_until", "wait_for"]

Pending = tuple[tuple[str, Kind, Any], ...]
"""Journal records a wait made on an event loop, for the runner to write."""


class Suspend(BaseException):
    """Raised inside a step to suspend the run (``ctx.sleep``, ``ctx.wait_for``).

    A BaseException, so that a step's ``except Exception`` cannot swallow
    it; the runner turns it into status ``waiting`` and ``RunSuspended``.
    ``pending`` and ``check``: what the wait left to the runner, on an event
    loop (see the module docstring). ``accepts``: the payloads the wait takes
    (``"approval"``, see :mod:`durable_steps._fleet.approval`; None: any).
    """

    def __init__(
        self,
        until: float | None,
        signal: str | None,
        *,
        pending: Pending = (),
        check: bool = False,
        accepts: str | None = None,
    ) -> None:
        super().__init__(until, signal)
        self.until = until
        self.signal = signal
        self.pending = pending
        self.check = check
        self.accepts = accepts


# --- inside the step: the waits, journaled ---------------------------------------------


def _may_wait(journal: Journal, what: str) -> None:
    """Refuse a wait in a non-idempotent step.

    A waiting step runs again from its start when woken, so whatever a
    non-idempotent step did before its wait would happen again — and its
    intent, written before it fired, would make the wake look like a crash
    (in doubt). Its side effects belong in ``ctx.effect``, which the re-run
    replays: then the step itself is idempotent.
    """
    if not journal.idempotent:
        run = journal.run
        raise DefinitionError(
            f"run {run.name}: step {journal.step!r} is idempotent=False and calls {what}: a "
            "step that waits runs again from its start when it wakes, so a non-idempotent "
            "step may not wait. Make the step idempotent and put its side effects in "
            "ctx.effect(...) (replayed, never fired twice), or wait in a step of its own.",
            run=run.name,
            step=journal.step,
        )


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop now (an async step's code)."""
    asyncio = sys.modules.get("asyncio")  # not imported: no loop, and no 13 ms import
    if asyncio is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _remembered(journal: Journal, name: str, make: Callable[[], float]) -> tuple[float, Pending]:
    """A recorded time (a wake time, a deadline), or a new one: ``(time, pending)``.

    On an event loop a new time is not written here but left ``pending``
    for the runner; elsewhere it is recorded at once.
    """
    hit = journal.begin(name, "sleep")
    if hit is not MISS:
        return float(hit), ()
    value = float(make())
    if _on_event_loop():
        return value, ((name, "sleep", value),)
    journal.finish(name, "sleep", None, value)
    return value, ()


def sleep_until(journal: Journal, wake: Callable[[], float]) -> None:
    """``ctx.sleep``/``sleep_until``: suspend until the recorded wake time."""
    _may_wait(journal, "ctx.sleep")
    with journal._cond:
        journal.sleeps += 1
        name = f"sleep#{journal.sleeps}"
    until, pending = _remembered(journal, name, wake)
    if pending or time.time() < until:
        raise Suspend(until, None, pending=pending)


def wait_for(journal: Journal, name: str, timeout: float | None, accepts: str | None = None) -> Any:
    """``ctx.wait_for``: the signal's payload, recorded; or suspend until it comes.

    With ``accepts`` a payload of another shape is not received (see ``receive``).
    """
    _may_wait(journal, f"ctx.wait_for({name!r})")
    run = journal.run
    try:
        ckpt.validate_name(name, "signal name")
    except DefinitionError:
        raise DefinitionError(
            f"run {run.name}: step {journal.step!r}: ctx.wait_for({name!r}): a signal name "
            "is 1-200 characters from letters, digits and '._@=+:-', starting with a "
            "letter or digit",
            run=run.name,
            step=journal.step,
        ) from None
    if accepts not in (None, APPROVAL):
        raise DefinitionError(
            f"run {run.name}: step {journal.step!r}: ctx.wait_for({name!r}, accepts="
            f"{accepts!r}): accepts is None (any payload) or 'approval'",
            run=run.name,
            step=journal.step,
        )
    entry = f"signal:{name}"
    hit = journal.begin(entry, "signal")
    if hit is not MISS and accepted(accepts, hit):
        return hit
    # A payload recorded that the wait does not take (an earlier version recorded
    # it unchecked) is not received: the run waits again, and one of the right
    # shape replaces it (``_fleet.signals.send``), recorded over it.
    if journal.begin(f"timeout:{name}", "timeout") is not MISS:
        # Recorded: a re-run takes the same branch, even if the signal came since.
        raise timed_out(run, journal.step, name, timeout)
    deadline: float | None = None
    pending: Pending = ()
    if timeout is not None:
        deadline, pending = _remembered(journal, f"deadline:{name}", lambda: time.time() + timeout)
    if _on_event_loop():  # the runner looks for the signal, off the loop
        raise Suspend(deadline, name, pending=pending, check=True, accepts=accepts)
    received = receive(run, journal.step, journal.iteration, name, accepts)
    payload = drive_sync(received, run.plan.store)
    if payload is not MISS:
        journal.event("signal_received", entry)
        return journal.finish(entry, "signal", None, payload)
    if deadline is not None and time.time() >= deadline:
        journal.finish(f"timeout:{name}", "timeout", None, True)
        raise timed_out(run, journal.step, name, timeout)
    raise Suspend(deadline, name, accepts=accepts)


def timed_out(run: Writer, step: str, name: str, timeout: float | None) -> SignalTimeout:
    """The SignalTimeout a wait for signal ``name`` raises (``timeout`` if known)."""
    return SignalTimeout(
        f"run {run.name}: step {step!r}: signal {name!r} did not come within {timeout:g}s"
        if timeout is not None
        else f"run {run.name}: signal {name!r} timed out",
        run=run.name,
        step=step,
        signal=name,
    )


def receive(
    run: Writer, step: str, iteration: int, name: str, accepts: str | None = None
) -> Protocol[Any]:
    """Signal ``name``'s payload if it was sent to this run, else ``MISS``.

    A signal is received once per run: one that another step or pass received
    already is refused (put the pass in the name), and it is marked received
    here (best effort: the journal records the payload either way). One whose
    payload the wait does not accept (``accepts``; sent before the run waited,
    so not checked when sent, or received by an earlier version, which did not
    check) is not received: it decides nothing, the run waits on, and a signal
    of the right shape may replace it.
    """
    workflow, run_id = run.plan.workflow, run.run_id
    key = signal_key(workflow, run_id, name)
    found = yield Get(key)
    if found is None:
        return MISS
    record = decode(found[0], workflow, run_id, name, run.signer)
    if record.get("run_nonce") != run.header.run_nonce:
        return MISS  # sent to an earlier run under this id, deleted since
    here = [step, iteration]
    received = record.get("consumed")
    if received is not None:  # by this step under an older name (renamed_from) is this step
        received = [run.plan.renamed().get(received[0], received[0]), *received[1:]]
    if received is not None and received != here:
        raise DefinitionError(
            f"run {run.name}: step {step!r} (pass {iteration}) waits for signal {name!r}, "
            f"which step {received[0]!r} (pass {received[1]}) received already. A signal "
            "name is delivered once per run: waits in a loop put the pass in the name, "
            f'e.g. ctx.wait_for(f"{name}:{{ctx.iteration}}").',
            run=run.name,
            step=step,
        )
    if not accepted(accepts, record.get("payload")):
        logger.warning(
            "%s; it was %s, so it decides nothing: the run waits on, and a signal of that "
            "shape replaces it",
            refusal(run.name, name, record.get("payload"), step),
            "sent before the run waited" if received is None else "recorded unchecked",
        )
        return MISS
    if received is None:
        # Marked under the name the run's head keeps: the code a rename replaced, if it
        # is redeployed, must find the signal received by its own step (_deploys.positions.Held).
        mark = [run.stored_step(step), iteration]
        with contextlib.suppress(DurableStepsError):  # changed, unreachable: fine
            yield Put(key, consumed(record, mark, run.signer), found[1])
    return record.get("payload")
