"""Suspending a run that waits (``ctx.sleep``, ``ctx.wait_for``) and waking it.

A step that waits raises :class:`~durable_steps._journal.Suspend` (after
journaling the wake time, or finding no signal). The runner then writes the
head once more — status ``waiting``, the header's ``wait`` saying for what,
no owner — and raises :class:`~durable_steps.RunSuspended`: nothing holds
the run, no process, no lease. Loading a waiting run checks whether it can
go on (its time is due, or its signal object exists: one GET) and else
raises RunSuspended again without writing anything. Once it goes on, the
step runs again from its start: its journaled calls replay, the sleep
returns at once, ``wait_for`` finds the signal and records its payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import _checkpoint as ckpt
from ._drivers import Get, Protocol
from ._events import logger
from ._journal import MISS, Journal
from ._run import RunState
from ._signals import consume, decode, for_run, signal_key
from ._step import Context, Step
from .errors import DefinitionError, RunSuspended, SignalTimeout

__all__ = ["Suspend", "sleep_until", "suspend", "suspended", "wait_for", "waits_for", "wake"]


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


# --- the runner's side: suspending and waking ------------------------------------------


def suspend(run: RunState, step: Step[..., Any], ctx: Context, wait: Suspend) -> Protocol[None]:
    """Record that the run waits, release it, and raise RunSuspended."""
    record = {
        "step": step.name,
        "iteration": ctx.iteration,
        "until": wait.until,
        "signal": wait.signal,
        "since": round(time.time(), 3),
    }
    yield from run.write(run.header.evolve(status="waiting", wait=record), step.name, release=True)
    logger.info("run %s: step %r waits %s", run.name, step.name, waits_for(record))
    run.event("run_suspended", step=step.name, iteration=ctx.iteration)
    raise suspended(run, record)


def wake(run: RunState) -> Protocol[None]:
    """A waiting run goes on if its time is due or its signal exists; else RunSuspended."""
    wait = run.header.wait
    assert wait is not None
    due = wait["until"] is not None and time.time() >= wait["until"]
    if not due and wait["signal"] is not None:
        got = yield Get(signal_key(run.plan.workflow, run.run_id, wait["signal"]))
        due = got is not None and for_run(got[0], run.header.run_nonce)
    if not due:
        raise suspended(run, wait)
    # Every write from here on says "running" and carries no wait (the first one
    # claims the run, as any resume's does).
    run.header = run.header.replace(status="running", wait=None)
    logger.info("run %s woken at step %r (%s)", run.name, wait["step"], waits_for(wait))
    run.event("run_woken", step=wait["step"], iteration=wait["iteration"])
    run.event("run_resumed", step=wait["step"], iteration=wait["iteration"])


def waits_for(wait: dict[str, Any]) -> str:
    """``for signal 'approval'``, ``until 2026-12-01 14:05:00``, or both."""
    parts = []
    if wait["signal"] is not None:
        parts.append(f"for signal {wait['signal']!r}")
    if wait["until"] is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wait["until"]))
        parts.append(f"{'or its timeout at' if parts else 'until'} {when}")
    return " ".join(parts)  # "for signal 'approval' or its timeout at ..."


def suspended(run: RunState, wait: dict[str, Any]) -> RunSuspended:
    """The RunSuspended of a run that waits as ``wait`` says, with what unblocks it."""
    signal = wait["signal"]
    how = "Run it again then"
    if signal is not None:
        how = (
            f"Send the signal with wf.signal({run.run_id!r}, {signal!r}, payload) or "
            f"`durable-steps signal {run.name} {signal} --data JSON`, then run it again"
        )
    return RunSuspended(
        f"run {run.name} is waiting at step {wait['step']!r} {waits_for(wait)}. {how} "
        "(or let `durable-steps worker` resume it, or pass wait=True to block until it "
        "can go on).",
        run=run.name,
        step=wait["step"],
        until=wait["until"],
        signal=signal,
    )
