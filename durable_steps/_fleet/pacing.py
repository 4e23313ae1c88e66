r"""Paced head writes, for stores that allow one write per object name per interval.

The problem
    Google Cloud Storage accepts about one write per second to one object
    name; faster writes of it are answered ``429 Too Many Requests``. The
    run's head is one object, and while a step runs every ``ctx.call`` and
    every ``ctx.effect`` rewrites it (see :mod:`durable_steps._execution.journal`). A
    step making quick sequential calls (an agent's cheap tool calls, a cache
    hit) met 429s, exhausted its retries and failed with ``StoreError``.

The options weighed
    *Journal records as objects of their own* (a new name per record, so no
    per-object limit; the head would list or find them, the commit fold them
    in and delete them). It adds a write per call and a LIST to every load
    of a step in progress, deletes to every commit — and it loses what makes
    the journal safe: every journal write is today a compare-and-swap on the
    head, stamped with the lease, so a process that lost the run records
    nothing and *fires no effect*. A record written under its own name is
    refused by nobody; an effect's intent would be fenced only by the clock.

    *Pacing and coalescing the head's writes* keeps every write a
    compare-and-swap of the head, and so every guarantee. A store declares
    the limit (``min_write_interval``, seconds; :class:`~durable_steps.GCSStore`
    says 1.0), and the run's writer never sends a head sooner than that
    after its previous one (:class:`Pace`: a ``Put`` carries the moment it may
    be sent, which the driver waits for, in a worker thread under asyncio).
    Pacing alone would make every call wait for its slot (one call a second).
    What is written in a slot is therefore everything that came since the
    last one: *coalescing*.

What may wait for the next slot, and what may not
    An effect's intent must be durable before its function starts — that
    write is never deferred (it waits for its slot, and carries everything
    queued). Its result is written before ``ctx.effect`` returns, as
    before: a lost effect result makes the effect *in doubt*, which a step
    with ``in_doubt="raise"`` answers by stopping the run. A wake time, a
    deadline or a received signal is written before the run suspends.

    A ``ctx.call`` result is different: losing it merely runs the call again
    on resume (a model call paid twice, never a wrong result — the journal's
    contract for a crash before a record lands). So a call that returns
    while the head's slot is not due yet is *deferred*: ``ctx.call`` returns
    at once, its result is kept in memory (a retry in this process replays
    it), and it rides on the next head write — an effect's intent, a wait,
    or a timer that fires when the slot is due. A call made when the slot is
    due is written at once, before it returns, as on every other store:
    calls slower than the interval (most model calls) lose nothing.

    What a crash can lose: the calls of the last interval (at most a second
    on GCS) that no write carried yet; they run again on resume. The commit
    needs no flush: it drops the step's journal anyway, and the deferred
    results are obsolete once the state they produced is committed, so
    nothing is written for them then — a quick step costs its commit only.
    A step that fails (its retries given up) loses the deferred results with
    the process; a resume runs those calls again.

    A wait is different again: the step runs again from its start when the
    run wakes, so its finished calls must be durable by then. A wait that
    records something (a wake time, a deadline — in a sync step itself, in
    an async step by the runner, off the loop) writes it through the
    journal's queue, and that write carries the deferred results; a wait
    that records nothing (``wait_for`` without a timeout, a wait recorded
    already) has the runner write the deferred results just before the
    suspension (:meth:`~durable_steps._execution.log.Log.flush`). Then the journal is
    closed — its timer cancelled, any write in flight finished — and only
    then does the runner write the suspension.

One writer
    Every head write of a run while a step runs goes through one path, in
    turn: the journal's group commit (``Log._durable``), under ``run.lock``.
    The step's calls and effects, the timer, and the runner's own records
    (``Log.record``: a wake time, a received signal, what ``reconcile``
    said) all queue there, so each write carries everything queued, and
    two writes never share a slot. The heartbeat's renewal takes
    ``run.lock`` too, so it never races them; it rewrites the head as last
    written and does not carry the deferred results (the timer, due by
    then, does). Writes outside a step (claim, intent, commit,
    suspension) are made by the runner when no journal is open. Two
    writers of ours would race for one slot (a 429 on GCS) and the loser,
    finding our own token in the head, used to re-send its data over the
    winner's, silently dropping what that one carried. Now a refused write
    adopts the head only if it *is* ours: the very bytes just sent (the
    answer was lost) or those of our last failed write (which this one
    supersedes); any other head with our token is a real conflict.

The lease
    Every head write stamps the run's lease (``owner.until``). The stamp is
    made after the write's wait for its slot and after the index writes
    before it, right before the PUT is sent: stamped earlier, a write that
    waited a whole interval for its slot would store a lease already an
    interval short. The time a write takes to land still counts against
    it: between two writes the stored lease must outlast about the interval
    plus two writes' latency, so the smallest lease allowed (3 x interval)
    holds while each write lands within about 0.9 x the interval (measured:
    writes taking 0.9 s on a 1 s interval left 0.2 s of the lease). A slower
    link needs a longer lease (the error for a too-short one says so).

What other stores pay
    Nothing: a store without ``min_write_interval`` (local, S3, Azure,
    memory) has an interval of 0, every call is written before it returns,
    and a committed step is one conditional PUT, as before.

Crash safety
    The writes are the journal's writes, only fewer: each is the same
    compare-and-swap of the head with the journal as the process knows it
    durable so far plus what it carries. A SIGKILL before a coalesced write
    lands loses only deferred call results (they run again); after it, they
    replay. No effect's intent is ever deferred, so an effect that may have
    fired is always known, under the one key its intent holds.
"""

from __future__ import annotations

import math
import time
from typing import Any

__all__ = ["RECENT", "Pace", "wait_until", "write_interval"]

MAX_INTERVAL = 60.0
"""A larger declared interval is taken for a mistake and capped (a step would
wait this long between writes)."""


RECENT = 10.0
"""Seconds after its stamp within which a head read may have been written just
now (its write waited for its slot, took its time, was retried)."""


def write_interval(store: Any) -> float:
    """The seconds ``store`` needs between two writes of one object name: its
    optional ``min_write_interval`` attribute, 0 when it has none (or not a
    finite non-negative number: a wrapper's odd attribute must not stall runs).
    """
    try:
        value = getattr(store, "min_write_interval", 0.0)
    except Exception:  # a forwarding wrapper's __getattr__ may raise anything
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    if not math.isfinite(value) or value <= 0:
        return 0.0
    return min(float(value), MAX_INTERVAL)


def wait_until(moment: float) -> None:
    """Sleep until ``moment`` (``time.monotonic()``): a write slot. Pacing is
    the store's limit, not a retry, so ``testing.no_wait()`` does not skip it.
    """
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class Pace:
    """When the run's head may next be written (monotonic seconds).

    Only the run's one writer (``RunState``) uses it, under the run's lock
    or before the step starts; no lock of its own.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -math.inf

    def slot(self) -> float:
        """The earliest moment (``time.monotonic()``) the next head write may be sent."""
        return self._last + self.interval if self.interval else 0.0

    def due(self) -> bool:
        """Whether a head write sent now keeps to the interval."""
        return self.slot() <= time.monotonic()

    def wrote(self) -> None:
        """A head write landed (or was answered) just now."""
        if self.interval:
            self._last = time.monotonic()

    def seen(self, updated_at: float) -> None:
        """The head just read was stamped at ``updated_at`` (epoch seconds, by its
        writer's clock). The stamp is made before the write waits for its slot
        and is sent, so it says only roughly when the write landed: a head
        stamped less than :data:`RECENT` seconds ago may have landed just now,
        and the next write waits a whole interval from this read. An older one
        costs nothing.
        """
        if self.interval and time.time() - updated_at < self.interval + RECENT:
            self._last = max(self._last, time.monotonic())
