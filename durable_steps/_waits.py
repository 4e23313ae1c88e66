"""Waiting inside a step: ``ctx.sleep``, ``ctx.sleep_until``, ``ctx.wait_for``.

Each wait is journaled (the wake time, the deadline, the received payload),
so a re-run of the step takes the same branch. A wait that cannot return
yet raises :class:`Suspend`; the runner's side (:mod:`durable_steps._waiting`)
turns that into a suspended run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ._journal import MISS, Journal
from ._record import checkpoint as ckpt
from ._signals import consume, decode, signal_key
from .errors import DefinitionError, SignalTimeout

__all__ = ["Suspend", "sleep_until", "wait_for"]


class Suspend(BaseException):
    """Raised inside a step to suspend the run (``ctx.sleep``, ``ctx.wait_for``).

    A BaseException, so that a step's ``except Exception`` cannot swallow
    it; the runner turns it into status ``waiting`` and ``RunSuspended``.
    """

    def __init__(self, until: float | None, signal: str | None) -> None:
        super().__init__(until, signal)
        self.until = until
        self.signal = signal


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


def sleep_until(journal: Journal, wake: Callable[[], float]) -> None:
    """``ctx.sleep``/``sleep_until``: suspend until the recorded wake time."""
    _may_wait(journal, "ctx.sleep")
    with journal._cond:
        journal.sleeps += 1
        name = f"sleep#{journal.sleeps}"
    until = float(journal.remember(name, "sleep", wake))
    if time.time() < until:
        raise Suspend(until, None)


def wait_for(journal: Journal, name: str, timeout: float | None) -> Any:
    """``ctx.wait_for``: the signal's payload, recorded; or suspend until it comes."""
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
    entry = f"signal:{name}"
    hit = journal.begin(entry, "signal")
    if hit is not MISS:
        return hit

    def timed_out() -> SignalTimeout:  # made only when raised: most waits end otherwise
        return SignalTimeout(
            f"run {run.name}: step {journal.step!r}: signal {name!r} did not come within "
            f"{timeout:g}s"
            if timeout is not None
            else f"run {run.name}: signal {name!r} timed out",
            run=run.name,
            step=journal.step,
            signal=name,
        )

    if journal.begin(f"timeout:{name}", "timeout") is not MISS:
        raise timed_out()  # recorded: a re-run takes the same branch, even if it came since
    deadline = None
    if timeout is not None:
        deadline = float(
            journal.remember(f"deadline:{name}", "sleep", lambda: time.time() + timeout)
        )
    payload = _received(journal, name)
    if payload is not MISS:
        journal.event("signal_received", entry)
        return journal.finish(entry, "signal", None, payload)
    if deadline is not None and time.time() >= deadline:
        journal.finish(f"timeout:{name}", "timeout", None, True)
        raise timed_out()
    raise Suspend(deadline, name)


def _received(journal: Journal, name: str) -> Any:
    """Signal ``name``'s payload if it was sent to this run, else ``MISS``.

    A signal is received once per run: one that another step or pass received
    already is refused (put the pass in the name), and it is marked received
    here before its payload is recorded.
    """
    run = journal.run
    workflow, run_id = run.plan.workflow, run.run_id
    found = run.plan.store.get(signal_key(workflow, run_id, name))
    if found is None:
        return MISS
    record = decode(found[0], workflow, run_id, name, run.signer)
    if record.get("run_nonce") != run.header.run_nonce:
        return MISS  # sent to an earlier run under this id, deleted since
    here = [journal.step, journal.iteration]
    consumed = record.get("consumed")
    if consumed is not None and consumed != here:
        raise DefinitionError(
            f"run {run.name}: step {journal.step!r} (pass {journal.iteration}) waits for "
            f"signal {name!r}, which step {consumed[0]!r} (pass {consumed[1]}) received "
            "already. A signal name is delivered once per run: waits in a loop put the pass "
            f'in the name, e.g. ctx.wait_for(f"{name}:{{ctx.iteration}}").',
            run=run.name,
            step=journal.step,
        )
    if consumed is None:
        consume(run.plan.store, found, record, here, run.signer)
    return record.get("payload")
