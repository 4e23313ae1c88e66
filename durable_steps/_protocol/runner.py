"""The run protocol: load → resume → intent → fire → commit → terminal marker.

One generator, :func:`execute`, holds the whole protocol. It never does I/O
itself: it *yields* effects (:class:`Get`, :class:`Put`, :class:`Delete`,
:class:`Call`, :class:`Sleep`, in ``_drivers``) and is sent their results (or
has their exceptions thrown in). ``drive_sync`` and ``drive_async`` perform
the effects — directly, or with ``await`` and ``asyncio.to_thread`` — so
``run`` and ``arun`` share every line of the protocol and cannot drift apart.
:class:`~durable_steps._execution.run_state.RunState` makes every write.

The write protocol of one step, where ``V`` is the version (ETag) this
process last read or wrote::

    non-idempotent only:
      PUT header{intent: key} + unchanged payload   If-Match: V   → V'
    fire the step (retries start over from the committed payload)
    PUT header{cursor+1, intent: null} + new payload If-Match: V' → V''
        (the last step's commit also carries status "completed")

The first write of a run is create-only (``If-None-Match: *``). A resume
claims the run (records this process as its owner, fencing off any earlier
one) with its first write; workers and ``takeover=True`` write that claim
before the first step. A refused condition means another process took
the run: :class:`CheckpointConflict`, and nothing further runs. While one step
runs longer than a third of the lease, a heartbeat renews the lease with the
same compare-and-swap writes. A crash anywhere leaves either the previous commit
(the step runs again) or the intent (the step *may* have fired: re-fire with
the same key, reconcile, or stop, per the step's ``in_doubt`` policy).
"""

from __future__ import annotations

import time
from typing import Any

import tenacity

from .._deploys import positions
from .._drivers import Await, AwaitableInSyncRun, Call, Get, Protocol, Sleep
from .._events import logger
from .._execution.context import Context
from .._execution.journal import Journal
from .._execution.plan import Plan
from .._execution.run_state import Released, RunState
from .._execution.waits import Suspend
from .._fleet.leases import Heartbeat
from .._record import checkpoint as ckpt
from .._record import format2 as f2
from .._record import history
from .._step import Step
from ..errors import (
    CheckpointConflict,
    DefinitionError,
    DurableStepsError,
    SerializationError,
    StoreError,
)
from ..stores import DEFAULT_STORE, STORE_ENV
from .doubt import settle_doubt, settle_effects
from .failures import give_up, record_failure, sentence
from .opening import RunGone, load
from .suspending import settle_wait, suspend, wake

__all__ = ["RunGone", "execute", "submit"]


# --- the protocol -------------------------------------------------------------


def execute(plan: Plan, run_id: str, initial: Any, *, create: bool = True) -> Protocol[Any]:
    """The whole run protocol; returns the final state.

    ``create=False`` (the worker) only resumes: a run that vanished since it
    was seen raises :class:`RunGone` instead of starting afresh with new
    idempotency keys.
    """
    run = RunState(plan, run_id)
    with run.owner.active(), run.reporting_stops():
        found = yield Get(run.key)
        if found is None and not create:
            raise RunGone(f"run {run.name} no longer exists", run=run.name)
        if found is None:
            yield from _create(run, initial)
        else:
            claim = yield from load(run, *found)
            if run.header.status == "deleted":
                logger.info("run %s completed and its state was deleted; nothing to do", run.name)
                return None
            if run.header.status == "completed":
                logger.info("run %s is already complete; nothing to do", run.name)
                if plan.on_complete == "delete":  # a crash came between commit and tombstone
                    yield from _tombstone(run)
                return run.state
            if run.header.status == "waiting":
                yield from wake(run)  # RunSuspended if not due: nothing written
                # Two processes may wake a run at once (a worker, a wait=True
                # loop): claim it before its step, so only one goes on.
                claim = True
                yield from positions.migrate(run)
            if claim:
                # An explicit claim before any step (or reconcile) runs: from
                # here on a process that held the run is fenced off by the
                # compare-and-swap of every write it tries, and others see us
                # as the owner. Workers, takeovers and resumes from an owner
                # that may still be alive (its lease ran out on another host)
                # pay this PUT; a plain rerun whose previous owner is provably
                # gone (or stopped cleanly) claims with its first write instead
                # — the intent, the first commit, or the heartbeat of a long
                # first step — so that resuming costs one GET.
                yield from run.write(run.header.evolve(status="running"), None)
        while run.header.status != "completed":
            if plan.stop is not None and plan.stop.is_set():
                yield from run.write(run.header, None, release=True)
                raise Released(f"run {run.name} released")
            index = run.header.next_step
            yield from _advance(run, plan.steps[index], index)
        return (yield from _finish(run))


def submit(plan: Plan, run_id: str, initial: Any) -> Protocol[bool]:
    """Create a run without running it (for workers); False if it exists."""
    run = RunState(plan, run_id)
    try:
        yield from _create(run, initial, release=True)
    except CheckpointConflict:
        return False
    run.event("run_stopped")  # the end of this "execution": it only created the run
    return True


def _create(run: RunState, initial: Any, *, release: bool = False) -> Protocol[None]:
    plan = run.plan
    run.state = {} if initial is None else initial
    if not f2.supports(plan.serializer):
        run.payload = run.encode_state(None)  # refuse a bad state before until() sees it
    done = plan.until is not None and _until(run, None)
    header = ckpt.Checkpoint(
        workflow=plan.workflow,
        run_id=run.run_id,
        steps=tuple(s.name for s in plan.steps),
        serializer=plan.serializer.name,
        status="completed" if done else "running",
        format=ckpt.FORMAT if f2.supports(plan.serializer) else 1,
        version=plan.version,
        code=plan.code,
    )
    yield from run.save(header, None, release=release)
    logger.info("run %s %s", run.name, "submitted" if release else "started")
    if plan.implicit_store and not all(s.idempotent for s in plan.steps):
        logger.warning(
            "run %s was created in the default local store %s because no store= was given "
            "and $%s is not set. A rerun from another directory or machine will not find "
            "it and will start the run over, firing its non-idempotent steps again under "
            "new idempotency keys. Pass store= (or set $%s) to the store you will resume from.",
            run.name,
            DEFAULT_STORE,
            STORE_ENV,
            STORE_ENV,
        )
        run.warned_store = True
    run.event("run_started")


def _advance(run: RunState, step: Step[..., Any], index: int) -> Protocol[None]:
    """Run one step and commit it: everything between a step's start and its
    checkpoint happens here.
    """
    header = run.header
    key = ckpt.idempotency_key(header.run_nonce, header.iteration, index, step.name)
    intent = header.intent
    in_doubt = bool(
        intent and intent.get("index") == index and intent.get("iteration") == header.iteration
    )
    if in_doubt:
        key = intent["key"]  # type: ignore[index]  # the persisted key wins over a re-derived one
    ctx = Context(run.run_id, run.plan.workflow, step.name, header.iteration, 1, key, in_doubt)
    policy = "reconcile" if step.reconcile is not None else step.in_doubt
    journal = Journal(run, step.name, header.iteration, policy, idempotent=step.idempotent)
    ctx._journal = journal
    run.mark = len(run.payload) if run.parts is not None else None

    if in_doubt:
        assert intent is not None
        already_done = yield from settle_doubt(run, step, ctx, intent)
        if already_done:
            yield from _commit(run, step, ctx, attempts=0, seconds=0.0)
            return
    if not step.idempotent:
        # Also before a re-fire: the fresh intent claims the run (of two plain
        # reruns, only one gets past this compare-and-swap), and a person's
        # resolution answers one crash only, so a crash during the re-fire
        # asks again.
        intent = {
            "step": step.name,
            "index": index,
            "iteration": header.iteration,
            "key": key,
            "at": round(time.time(), 3),
            "policy": policy,
        }
        yield from run.write(header.evolve(intent=intent, status="running"), step.name)
        if run.owner.remaining() < run.plan.lease / 3:
            # The intent was slow to land, and the lease it carried is mostly
            # (or all) spent: renew it before the step fires, so that nobody
            # can take the run over while its side effect is under way. (An
            # idempotent step needs no such care: a takeover fences it off at
            # its commit, and running it twice is harmless.)
            yield from run.write(run.header.evolve(status="running"), step.name)

    woken = run.woken
    if woken is not None and (woken["step"], woken["iteration"]) == (step.name, header.iteration):
        run.woken = None  # woken for its signal (or deadline): record what came, off any loop
        wait = Suspend(woken["until"], woken["signal"], accepts=woken.get("accepts"))
        settled = yield from _settle_wait(run, journal, wait, ())
        if isinstance(settled, Exception):
            yield from give_up(run, step, ctx, settled)
    doubtful = journal.in_doubt()
    if doubtful:
        yield from settle_effects(run, step, ctx, doubtful)

    started = time.monotonic()
    attempts, failure = yield from _attempts(run, step, ctx, journal)
    if isinstance(failure, AwaitableInSyncRun):  # it never ran: withdraw our intent
        if not step.idempotent:  # back to the header before it (an earlier crash's intent stays)
            yield from run.write(header, step.name, release=True)
        raise DefinitionError(
            f"run {run.name}: step {step.name!r} is async (it returned an awaitable) and "
            "did not run; nothing was recorded. Run the workflow with `await wf.arun(...)`.",
            run=run.name,
            step=step.name,
        ) from failure
    if failure is not None:
        yield from give_up(run, step, ctx, failure)
    yield from _commit(run, step, ctx, attempts, time.monotonic() - started)


def _attempts(
    run: RunState, step: Step[..., Any], ctx: Context, journal: Journal
) -> Protocol[tuple[int, Exception | None]]:
    """Fire the step (retries included) under a heartbeat; see :func:`_fire`.

    A step that waits (``ctx.sleep``, ``ctx.wait_for``) stops at the wait
    with ``Suspend``: the run is recorded as waiting and RunSuspended raised.
    """
    heartbeat = run.heartbeat()
    suspended: Suspend | None = None
    try:
        while True:
            try:
                attempts, failure = yield from _fire(run, step, ctx, heartbeat)
                break
            except Suspend as wait:
                yield from _settled(run, journal)
                if wait.pending or wait.check:  # a wait on an event loop left its I/O to us
                    ready = yield from _settle_wait(run, journal, wait, wait.pending)
                    if isinstance(ready, Exception):
                        attempts, failure = ctx.attempt, ready
                        break
                    if ready:  # it can return now: the step runs again and finds it recorded
                        ctx.attempt += 1
                        run.state = run.restore()
                        continue
                # The deferred call results first: after the wake the step runs
                # again, and its finished calls must replay, not run again.
                yield from journal.flush()
                suspended = wait
                break
    finally:
        heartbeat.stop()
        journal.close()
    if heartbeat.lost or journal.lost:  # taken over while the step ran: say so first
        raise run.conflict(step.name)
    if suspended is not None:
        yield from suspend(run, step, ctx, suspended)
    return attempts, failure


def _fire(
    run: RunState, step: Step[..., Any], ctx: Context, heartbeat: Heartbeat
) -> Protocol[tuple[int, Exception | None]]:
    """Call the step until it succeeds or its retry policy gives up.

    Every attempt after the first starts from the committed payload, decoded
    afresh, so changes a failed attempt made in place are gone. Returns the
    number of attempts made and, if the policy gave up, the last error.
    """
    policy = step.retry._policy() if step.retry else None
    tries = None
    if policy is not None:
        policy.begin()  # tenacity's per-call statistics, which iter() updates
        tries = tenacity.RetryCallState(policy, None, (), {})
    while True:
        ctx._finish = False  # a failed attempt's finish() does not carry over
        if ctx._journal is not None:
            ctx._journal.begin_attempt(ctx.attempt)
        run.event(
            "step_started",
            step=step.name,
            iteration=ctx.iteration,
            attempt=ctx.attempt,
            idempotency_key=ctx.idempotency_key,
        )
        args = (run.state, ctx) if step.takes_context else (run.state,)
        try:
            result = yield Call(step.fn, args)
        except AwaitableInSyncRun as exc:
            return ctx.attempt, exc  # not a failure of the step, and never retried
        except Exception as exc:
            yield from _settled(run, ctx._journal)
            lost = heartbeat.lost or (ctx._journal is not None and ctx._journal.lost)
            if lost or isinstance(exc, CheckpointConflict):  # taken over: never retried
                raise run.conflict(step.name) from exc
            wait = _next_wait(policy, tries, exc)
            if wait is None:
                return ctx.attempt, exc
            assert tries is not None
            logger.warning(
                "run %s: step %r attempt %d failed (%s: %s); retrying in %.2fs",
                run.name,
                step.name,
                ctx.attempt,
                type(exc).__name__,
                exc,
                wait,
            )
            run.event(
                "step_retrying",
                step=step.name,
                iteration=ctx.iteration,
                attempt=ctx.attempt,
                duration=wait,
                error=exc,
            )
            if heartbeat.lost:  # taken over: a straggler runs nothing more
                raise run.conflict(step.name) from exc
            yield Sleep(wait)
            if heartbeat.lost:
                raise run.conflict(step.name) from exc
            tries.prepare_for_next_attempt()
            ctx.attempt += 1
            run.state = run.restore()
            continue
        yield from _settled(run, ctx._journal)
        wrong = step.wrong_return(run.state, result)
        if wrong is not None:  # a bug, not bad luck: recorded as the failure, not retried
            return ctx.attempt, wrong
        if result is not None:
            run.state = result
        return ctx.attempt, None


def _settle_wait(
    run: RunState, journal: Journal, wait: Suspend, pending: tuple[Any, ...]
) -> Protocol[bool | Exception]:
    """:func:`settle_wait`, with a bad signal (unsigned, received by another step)
    returned as the step's failure — what it is when a sync wait meets it.
    """
    try:
        return (
            yield from settle_wait(
                run, journal, wait.until, wait.signal, pending, accepts=wait.accepts
            )
        )
    except (CheckpointConflict, StoreError):
        raise
    except DurableStepsError as exc:
        return exc


def _settled(run: RunState, journal: Journal | None) -> Protocol[None]:
    """Wait for the effects an attempt left running (a sibling of ``gather``, a
    thread), so they finish and are recorded before the step is retried,
    suspended or committed — and never fire twice at once (see ``_execution.firing``).
    """
    running = journal.firings() if journal is not None else ()
    if running:
        logger.info(
            "run %s: waiting for %d effect(s) the step left running", run.name, len(running)
        )
        yield Await(running)


def _next_wait(
    policy: tenacity.Retrying | None, tries: tenacity.RetryCallState | None, exc: Exception
) -> float | None:
    """Ask tenacity what follows a failed attempt: seconds to wait, or None
    to give up (attempts used up, or an exception not retried).
    """
    if policy is None or tries is None:
        return None
    tries.set_exception((type(exc), exc, exc.__traceback__))
    try:
        action = policy.iter(tries)
    except Exception as stop:
        if stop is exc:  # tenacity re-raises the step's own error to say "stop"
            return None
        raise
    return float(action) if isinstance(action, tenacity.DoSleep) else None


def _until(run: RunState, step: str | None) -> bool:
    until = run.plan.until
    assert until is not None
    try:
        return bool(until(run.state))
    except Exception as exc:
        if step:
            where, then = f" after step {step!r}", "The step was not committed and will run again"
        else:
            where, then = " before the first pass", "Nothing was written: the run was not created"
        raise DurableStepsError(
            f"run {run.name}: until() raised{where}: {type(exc).__name__}: {sentence(exc)} "
            f"{then}; fix until() and run it again.",
            run=run.name,
            step=step,
        ) from exc


def _commit(
    run: RunState, step: Step[..., Any], ctx: Context, attempts: int, seconds: float
) -> Protocol[None]:
    """Write the checkpoint that says ``step`` happened."""
    header = run.header
    last = header.next_step + 1 == len(run.plan.steps)
    try:
        done = ctx._finish or (last and (run.plan.until is None or _until(run, step.name)))
    except DurableStepsError as exc:  # until() raised
        yield from record_failure(run, step, ctx, exc)
        raise
    # A finished run's cursor points just past its last committed step; an
    # unfinished pass moves to its next step; a finished pass to the next pass.
    if last and not done:
        iteration, next_step = header.iteration + 1, 0
    else:
        iteration, next_step = header.iteration, header.next_step + 1
    committed = header.with_commit(
        step.name, attempts, seconds, iteration=iteration, next_step=next_step, completed=done
    )
    if committed.code is not run.plan.code:  # the code of every commit (see _deploys.fingerprints)
        committed = committed.replace(code=run.plan.code)
    kind = history.COMMIT if attempts else history.RESOLVED
    entry = history.add(header, kind, step.name, attempts, seconds, time.time(), _calls(ctx))
    # A chunk of history per 32 commits or (much) fewer: never a write per step.
    stored = len(run.payload) + sum(p["size"] for p in header.parts)
    committed = yield from history.spill(committed.replace(log=entry), stored)
    try:
        yield from run.save(committed, step.name)
    except SerializationError as exc:  # the state cannot be saved: nothing was written
        yield from record_failure(run, step, ctx, exc)
        raise
    logger.info(
        "run %s: committed step %r (iteration %d, attempt %d) in %.3fs",
        run.name,
        step.name,
        ctx.iteration,
        attempts,
        seconds,
    )
    run.event(
        "step_committed",
        step=step.name,
        iteration=ctx.iteration,
        attempt=attempts,
        duration=seconds,
        idempotency_key=ctx.idempotency_key,
    )


def _calls(ctx: Context) -> tuple[int, int, int]:
    """The journaled calls, effects and waits the step's journal holds (for its history)."""
    kinds = [r.kind for r in ctx._journal.results.values()] if ctx._journal else []
    waits = sum(k in ("sleep", "signal", "timeout") for k in kinds)
    return kinds.count("call"), kinds.count("effect"), waits


def _finish(run: RunState) -> Protocol[Any]:
    if run.plan.on_complete == "delete":
        yield from _tombstone(run)
    else:
        yield from run.tidy()
    logger.info("run %s completed", run.name)
    run.event("run_completed")
    return run.state


def _tombstone(run: RunState) -> Protocol[None]:
    """Replace the completed run's checkpoint by a tombstone: no state, same identity.

    The tombstone (status ``deleted``, empty payload) keeps the run's id taken,
    so a rerun returns ``None`` and redoes nothing — rather than starting a
    new run whose non-idempotent steps would fire again under new keys — and a
    stale create-only write of this run still in flight can never land.
    ``durable-steps rm``/``prune`` remove tombstones. The run completed
    whatever happens here: a failure is logged, the checkpoint still holds
    the terminal marker, and the next rerun tries again.
    """
    kept = run.header.log is not None  # its history goes with the state
    tomb = run.header.evolve(
        status="deleted", owner=None, intent=None, error=None, parts=(), log=None
    )
    try:
        yield from run.write(tomb, None, payload=b"")
        if tomb.format == 2 or kept:
            yield from run.clear_parts()
    except CheckpointConflict:
        # A new run under the same id (or a resolve, a takeover) wrote it after
        # our last write: it is theirs now, and stays.
        logger.warning("run %s changed after it completed; its checkpoint was kept", run.name)
    except DurableStepsError as exc:
        logger.warning(
            "run %s completed, but its state could not be deleted (%s); the checkpoint "
            "keeps the final state, and the next rerun of the run deletes it",
            run.name,
            exc,
        )
