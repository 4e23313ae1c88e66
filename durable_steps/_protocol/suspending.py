"""Suspending a run that waits (``ctx.sleep``, ``ctx.wait_for``) and waking it.

A step that waits raises :class:`~durable_steps._execution.waits.Suspend` (after
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
from typing import Any

from .._drivers import Get, Protocol
from .._events import logger
from .._execution.context import Context
from .._execution.journal import MISS, Journal
from .._execution.run_state import RunState
from .._execution.waits import Pending, Suspend, receive
from .._fleet.approval import APPROVAL, SHAPE, accepted
from .._fleet.signals import signal_key, wakes
from .._step import Step
from ..errors import RunSuspended
from ..stores import command_hint

__all__ = ["settle_wait", "suspend", "suspended", "waits_for", "wake"]


def settle_wait(
    run: RunState,
    journal: Journal,
    until: float | None,
    signal: str | None,
    pending: Pending = (),
    *,
    accepts: str | None = None,
) -> Protocol[bool]:
    """Do a wait's store work for the step, off the event loop: write what it left
    ``pending``, look for its signal and record the payload (or, past the deadline,
    the timeout). True if the wait can return now: the step runs (again) and
    finds it all recorded (see ``_execution.waits``).
    """
    for name, kind, value in pending:
        yield from journal.record(name, kind, None, value)
    if signal is not None:
        entry = f"signal:{signal}"
        recorded = journal.results.get(entry)
        if recorded is not None and accepted(accepts, journal.value(recorded)):
            return True  # (one the wait does not take was recorded unchecked: looked for again)
        payload = yield from receive(run, journal.step, journal.iteration, signal, accepts)
        if payload is not MISS:
            journal.event("signal_received", entry)
            yield from journal.record(entry, "signal", None, payload)
            journal.event("call_recorded", entry)
            return True
    if until is not None and time.time() >= until:
        timeout = f"timeout:{signal}"
        if signal is not None and timeout not in journal.results:
            yield from journal.record(timeout, "timeout", None, True)
        return True
    return False


def suspend(run: RunState, step: Step[..., Any], ctx: Context, wait: Suspend) -> Protocol[None]:
    """Record that the run waits, release it, and raise RunSuspended."""
    record = {
        "step": step.name,
        "iteration": ctx.iteration,
        "until": wait.until,
        "signal": wait.signal,
        "since": round(time.time(), 3),
    }
    if wait.accepts is not None:  # only then: a reader before 'accepts' sees what it knew
        record["accepts"] = wait.accepts
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
        due = got is not None and wakes(got[0], run.header.run_nonce, wait.get("accepts"))
    if not due:
        raise suspended(run, wait)
    # Every write from here on says "running" and carries no wait (the first one
    # claims the run, as any resume's does).
    run.header = run.header.replace(status="running", wait=None)
    run.woken = wait  # its step gets the payload recorded before it runs (settle_wait)
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
    cli = command_hint(run.plan.store)
    how = "Run it again then"
    if signal is not None and wait.get("accepts") == APPROVAL:
        how = (
            f"Approve or reject with wf.signal({run.run_id!r}, {signal!r}, "
            f"{{'approved': True}}) or `{cli} signal {run.name} {signal} --data "
            f"'{{\"approved\": true}}'` (it accepts {SHAPE}), then run it again"
        )
    elif signal is not None:
        how = (
            f"Send the signal with wf.signal({run.run_id!r}, {signal!r}, payload) or "
            f"`{cli} signal {run.name} {signal} --data JSON`, then run it again"
        )
    return RunSuspended(
        f"run {run.name} is waiting at step {wait['step']!r} {waits_for(wait)}. {how} "
        f"(or let `{cli} worker --app module:workflow` resume it, or pass wait=True to "
        "block until it can go on).",
        run=run.name,
        step=wait["step"],
        until=wait["until"],
        signal=signal,
    )
