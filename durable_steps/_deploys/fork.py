"""``wf.fork``: a new run from another run's last committed state and position.

The source is only read. The new run gets its own nonce, so its idempotency
keys differ from the source's: a step the source may have fired fires again
under a new key, which the log says (a service cannot match the two).
"""

from __future__ import annotations

from .._drivers import Get, Protocol
from .._events import logger
from .._execution.plan import Plan
from .._execution.run_state import RunState
from .._record import checkpoint as ckpt
from .._record import format2 as f2
from ..errors import CheckpointConflict, CorruptCheckpoint, DefinitionError, DurableStepsError
from .positions import check_serializer

__all__ = ["ForkRefused", "fork"]


class ForkRefused(DurableStepsError):
    """The fork was refused and nothing was written (the command line exits 4)."""


def fork(
    plan: Plan, source: str, target: str, *, expect_nonce: str | None = None
) -> Protocol[None]:
    """Create run ``target`` from run ``source``'s last committed state and
    position, with a new nonce (so new idempotency keys); ``source`` is only read.
    ``expect_nonce``: fork only the run with that nonce (the web page's
    confirmation), checked on the read the fork copies from.
    """
    if source == target:
        raise DefinitionError(f"fork: run {plan.workflow}/{source} cannot be forked onto itself")
    src, new = RunState(plan, source), RunState(plan, target)
    header = yield from _read_source(src, expect_nonce)
    if (yield Get(new.key)) is not None:
        raise ForkRefused(
            f"run {new.name} already exists, so {src.name} was not forked onto it (nothing "
            f"was written): choose another id, or remove it first (`durable-steps rm "
            f"{new.name}`).",
            run=new.name,
        )
    intent = header.intent
    if intent is not None and intent.get("resolution") != "not_fired":
        logger.warning(
            "run %s: step %r may have fired (key %s) and was not resolved; the fork %s "
            "fires it with a new key, which the service cannot match to that one",
            src.name,
            intent.get("step"),
            intent.get("key"),
            new.name,
        )
    journal = header.journal
    if journal is not None and (journal["calls"] or journal["open"]):
        logger.warning(
            "run %s: step %r was in progress with %d journaled call(s) recorded and %d "
            "effect(s) in doubt; the fork %s runs that step again from its start, so its "
            "calls run again and its effects fire again under new idempotency keys. Let "
            "the source finish the step first if that matters.",
            src.name,
            journal["step"],
            journal["calls"],
            len(journal["open"]),
            new.name,
        )
    new.state = src.state
    fresh = ckpt.Checkpoint(
        workflow=plan.workflow,
        run_id=target,
        steps=header.steps,
        serializer=header.serializer,
        iteration=header.iteration,
        next_step=header.next_step,
        history=header.history,
        committed=header.committed,
        format=ckpt.FORMAT if f2.supports(plan.serializer) else 1,
        version=header.version,
        code=header.code,
    )
    try:
        yield from new.save(fresh, None, release=True)
    except CheckpointConflict as exc:
        raise ForkRefused(
            f"run {new.name} was created by another process while {src.name} was being "
            "forked onto it; it is theirs and was left as it is. Choose another id.",
            run=new.name,
        ) from exc
    logger.info(
        "run %s forked from %s at step %r (iteration %d)",
        new.name,
        src.name,
        header.steps[header.next_step],
        header.iteration,
    )


_READS = 3


def _read_source(src: RunState, expect_nonce: str | None) -> Protocol[ckpt.Checkpoint]:
    """Decode the run to fork and rebuild its committed state into ``src.state``
    (refused when it is not the run with ``expect_nonce``, if given).
    """
    for _ in range(_READS):  # a format-2 part gone: the head was replaced; read it again
        found = yield Get(src.key)
        if found is None:
            raise DurableStepsError(
                f"run {src.name} does not exist (no checkpoint at {src.key!r}); nothing to fork",
                run=src.name,
            )
        where = f"run {src.name}: checkpoint {src.key!r}"
        header, payload = ckpt.decode(found[0], where=where, run=src.name, signer=src.signer)
        if (header.workflow, header.run_id) != (src.plan.workflow, src.run_id):
            raise CorruptCheckpoint(
                f"{where} belongs to run {header.run}; it was left untouched.", run=src.name
            )
        if expect_nonce is not None and header.run_nonce != expect_nonce:
            raise ForkRefused(
                f"run {src.name} changed since you confirmed (it was deleted and created "
                "again: another run under that id); nothing was forked: reload the run's "
                "page and decide again",
                run=src.name,
            )
        if header.status in ("completed", "deleted"):
            raise ForkRefused(
                f"run {src.name} is {header.status}: it has no steps left to run, so there "
                "is nothing to fork (start a new run instead).",
                run=src.name,
            )
        check_serializer(src.name, header.serializer, src.plan.serializer.name)
        if (yield from src.load_state(header, payload)):
            return header
    raise CorruptCheckpoint(
        f"run {src.name}: a part its checkpoint lists is missing (read {_READS} times); "
        "nothing was forked.",
        run=src.name,
    )
