"""Deciding what happened to a step or an effect that may have fired before a crash.

An intent without its commit (a non-idempotent step), or an effect's intent
without its result (``ctx.effect``), means the side effect may have happened.
The step's policy decides, before the step runs again: a person's
resolution if there is one, else ``reconcile``, else ``in_doubt="raise"``
stops the run with :class:`StepInDoubt`, else (the default) the step or
effect fires again under the same idempotency key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .._drivers import AwaitableInSyncRun, Call, Protocol
from .._events import logger
from .._execution.context import Context
from .._execution.run_state import RunState
from .._step import Fired, Step
from ..errors import CheckpointConflict, DefinitionError, StepInDoubt
from ..stores import command_hint
from .failures import give_up

__all__ = ["call_owned", "settle_doubt", "settle_effects"]


def call_owned(run: RunState, step: Step[..., Any], call: Call) -> Protocol[Any]:
    """Call user code with the lease renewed meanwhile; a run lost while it
    ran raises CheckpointConflict before anything else happens.
    """
    heartbeat = run.heartbeat()
    try:
        result = yield call
    finally:
        heartbeat.stop()
    if heartbeat.lost:
        raise run.conflict(step.name)
    return result


def settle_doubt(
    run: RunState, step: Step[..., Any], ctx: Context, intent: dict[str, Any]
) -> Protocol[bool]:
    """Decide an intent found without a commit. True: the effect happened."""
    run.event(
        "step_in_doubt",
        step=step.name,
        iteration=ctx.iteration,
        idempotency_key=ctx.idempotency_key,
    )
    resolution = intent.get("resolution")
    if resolution is not None:
        logger.info("run %s: step %r was resolved as %s", run.name, step.name, resolution)
        return bool(resolution == "fired")
    if step.reconcile is not None:
        try:
            happened = yield from call_owned(run, step, Call(step.reconcile, (run.state, ctx)))
        except (CheckpointConflict, AwaitableInSyncRun):
            raise
        except Exception as exc:
            yield from give_up(run, step, ctx, exc, what="reconcile()")
        if isinstance(happened, Fired):
            raise DefinitionError(
                f"run {run.name}: reconcile() of step {step.name!r} returned "
                f"ds.Fired(...), which answers for an effect in doubt (ctx.effect_in_doubt "
                "is set then). For the step itself return True (it happened; record what "
                "it did in the state) or False (fire it again with its key). Nothing was "
                "written; the step is still in doubt.",
                run=run.name,
                step=step.name,
            )
        logger.warning(
            "run %s: step %r may have fired (key %s); reconcile says %s",
            run.name,
            step.name,
            ctx.idempotency_key,
            "it did" if happened else "it did not",
        )
        if not happened:  # drop what reconcile changed: the step starts clean
            run.state = run.restore()
            ctx._finish = False
        return bool(happened)
    if step.in_doubt == "raise":
        yield from run.write(run.header.evolve(status="in_doubt"), step.name)
        raise StepInDoubt(
            f"run {run.name}: step {step.name!r} (iteration {ctx.iteration}) may have "
            f"fired before the last crash, with idempotency key {ctx.idempotency_key}. "
            "Check whether its effect happened, then call "
            f"wf.resolve({run.run_id!r}, fired=True|False) or run "
            f"`{command_hint(run.plan.store)} resolve {run.name} --fired|--not-fired`, and "
            "run it again.",
            run=run.name,
            step=step.name,
            key=ctx.idempotency_key,
            iteration=ctx.iteration,
        )
    logger.warning(
        "run %s: step %r may have fired before the run last stopped (a crash, or an "
        "error after it began); firing it again with "
        "the same idempotency key %s",
        run.name,
        step.name,
        ctx.idempotency_key,
    )
    return False


def settle_effects(
    run: RunState, step: Step[..., Any], ctx: Context, doubtful: list[dict[str, Any]]
) -> Protocol[None]:
    """Decide the effects found in doubt before the step runs again.

    ``reconcile`` is asked about each (``True``: it happened, so ``ctx.effect``
    returns None for it without firing; ``False``: it fires again with its
    key); ``in_doubt="raise"`` stops the run; by default each fires again
    with its key when the step reaches it.
    """
    for entry in doubtful:
        run.event(
            "effect_in_doubt",
            step=step.name,
            iteration=ctx.iteration,
            call=entry["name"],
            idempotency_key=entry["key"],
            title=entry.get("title"),
        )
    if step.reconcile is not None:
        for entry in doubtful:
            asked = replace(ctx, effect_in_doubt=entry["name"], idempotency_key=entry["key"])
            try:
                happened = yield from call_owned(
                    run, step, Call(step.reconcile, (run.state, asked))
                )
            except (CheckpointConflict, AwaitableInSyncRun):
                raise
            except Exception as exc:
                yield from give_up(run, step, ctx, exc, what=f"reconcile() of {entry['name']!r}")
            logger.warning(
                "run %s: effect %r of step %r may have fired (key %s); reconcile says %s",
                run.name,
                entry["name"],
                step.name,
                entry["key"],
                "it did" if happened else "it did not",
            )
            run.state = run.restore()  # the step starts from the committed state
            if isinstance(happened, Fired):  # its result, recorded: ctx.effect returns it
                assert ctx._journal is not None
                yield from ctx._journal.record(
                    entry["name"], "effect", entry["key"], happened.result
                )
                continue
            entry["resolution"] = "fired" if happened else "not_fired"
        return
    if step.in_doubt == "raise":
        first = doubtful[0]
        yield from run.write(run.header.evolve(status="in_doubt"), step.name)
        more = f" (and {len(doubtful) - 1} more)" if len(doubtful) > 1 else ""
        named = f"{first['title']} ({first['name']!r})" if "title" in first else repr(first["name"])
        raise StepInDoubt(
            f"run {run.name}: effect {named}{more} of step {step.name!r} (iteration "
            f"{ctx.iteration}) may have fired before the last crash, with idempotency key "
            f"{first['key']}. Check whether it happened, then call "
            f"wf.resolve({run.run_id!r}, fired=True|False) or run "
            f"`{command_hint(run.plan.store)} resolve {run.name} --fired|--not-fired`, and "
            "run it again.",
            run=run.name,
            step=step.name,
            key=first["key"],
            iteration=ctx.iteration,
            effect=first["name"],
        )
