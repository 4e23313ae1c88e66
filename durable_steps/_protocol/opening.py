"""Opening a run that exists: decode its head, check it is this workflow's and
free to run here, map it onto the current code, rebuild its state.

:func:`load` is the first thing ``_protocol.runner.execute`` does with a head it found.
Every check raises before anything is written, so a refused resume leaves the
run exactly as it was: the wrong workflow or serializer, a live owner (or an
expired one judged by a clock too far off the store's), or a migration that
fails.
"""

from __future__ import annotations

from .._deploys import positions
from .._drivers import Get, Protocol
from .._events import logger
from .._execution.run_state import RunState
from .._fleet import index as _index
from .._fleet.leases import describe, judge, store_skew
from .._record import checkpoint as ckpt
from ..errors import CorruptCheckpoint, DurableStepsError, RunLocked

__all__ = ["RunGone", "load"]


class RunGone(DurableStepsError):
    """A run to resume (not create) has no checkpoint any more."""


def load(run: RunState, data: bytes, version: str) -> Protocol[bool]:
    """Decode and check a found checkpoint; True if the resume must claim it first.

    A format-2 head whose part is gone was replaced (and compacted) after it
    was read: the head is read again, a few times, before that is corruption.
    """
    for _ in range(_READS):
        claim = _check(run, data, version)
        if run.header.status == "deleted" or (yield from run.load_state(run.header, run.payload)):
            break
        found = yield Get(run.key)
        if found is None:
            raise RunGone(f"run {run.name} no longer exists", run=run.name)
        data, version = found
    else:
        raise CorruptCheckpoint(
            f"run {run.name}: a part its checkpoint {run.key!r} lists is missing (read "
            f"{_READS} times); it was left untouched. Restore the part or delete the run.",
            run=run.name,
        )
    if run.header.status != "waiting":  # a waiting run migrates once it wakes (execute)
        yield from positions.migrate(run)  # before any other write: a failure writes nothing
    header = run.header
    if header.status not in ("completed", "deleted", "waiting"):  # a waiting one: _wake says
        step = run.plan.steps[header.next_step].name
        if header.committed == 0 and header.owner is None:  # submitted, never started
            logger.info("run %s started (it was submitted and queued)", run.name)
        else:
            logger.info(
                "run %s resumed at step %r (iteration %d) after %d committed steps",
                run.name,
                step,
                header.iteration,
                header.committed,
            )
        run.event("run_resumed", step=step, iteration=header.iteration)
    return claim


_READS = 3


def _check(run: RunState, data: bytes, version: str) -> bool:
    """Decode a found head and check it fits this workflow; True if it must be claimed."""
    plan = run.plan
    header, payload = ckpt.decode(
        data, where=f"run {run.name}: checkpoint {run.key!r}", run=run.name, signer=run.signer
    )
    if (header.workflow, header.run_id) != (plan.workflow, run.run_id):
        raise CorruptCheckpoint(
            f"run {run.name}: the checkpoint at {run.key!r} belongs to run "
            f"{header.run}; it was left untouched.",
            run=run.name,
        )
    positions.check_serializer(run.name, header.serializer, plan.serializer.name)
    claim = plan.claim
    if header.status not in ("completed", "deleted"):
        claim = _check_owner(run, header) or claim
        header = positions.adopt(run, header)  # resume by step name
    run.header, run.payload, run.version = header, payload, version
    run.pace.seen(header.updated_at)  # its last writer may have written it a moment ago
    run.entry = _index.entry_of(header)  # as stored: a resume's first write moves it
    run.resumed = True
    return claim and header.status != "deleted"


def _check_owner(run: RunState, header: ckpt.Checkpoint) -> bool:
    """Refuse a run another process may be running; True if it must be claimed."""
    plan = run.plan
    skew = store_skew(plan.store)
    ownership = judge(header.owner, skew=skew, since=header.updated_at, lease=plan.lease)
    if ownership == "live" and not plan.takeover:
        assert header.owner is not None
        raise RunLocked(
            f"run {run.name} is being run by {describe(header.owner, since=header.updated_at)}. "
            "Wait for it, or if you know that process is gone, pass takeover=True "
            "(durable-steps worker does this by itself once the lease ends).",
            run=run.name,
        )
    if ownership == "expired" and skew is not None and abs(skew) > plan.lease / 4:
        raise RunLocked(
            f"run {run.name}: its owner's lease has run out by this host's clock, but this "
            f"clock is {abs(skew):.0f}s {'ahead of' if skew > 0 else 'behind'} the store's "
            f"(more than a quarter of the {plan.lease:.0f}s lease), so that cannot be "
            "trusted and the run was not taken over. Fix this host's clock (NTP), or pass "
            "takeover=True if you know the owner is gone.",
            run=run.name,
        )
    return ownership in ("live", "expired")
