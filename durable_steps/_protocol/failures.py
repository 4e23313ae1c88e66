"""Recording a step's failure: the checkpoint says what failed, the caller gets StepFailed."""

from __future__ import annotations

import time
from typing import Any

from .._drivers import Protocol
from .._execution.context import Context
from .._execution.run_state import RunState
from .._record import history
from .._step import Step
from ..errors import StepFailed

__all__ = ["give_up", "record_failure", "sentence"]


def give_up(
    run: RunState, step: Step[..., Any], ctx: Context, exc: Exception, what: str = ""
) -> Protocol[None]:
    """Record the failure in the checkpoint, then raise StepFailed."""
    yield from record_failure(run, step, ctx, exc)
    used_up = step.retry is not None and ctx.attempt >= step.retry.attempts > 1
    tries = f"all {ctx.attempt} attempts" if used_up else f"attempt {ctx.attempt}"
    raise StepFailed(
        f"run {run.name}: step {step.name!r} (iteration {ctx.iteration}) failed on "
        f"{tries}{f' ({what})' if what else ''}: {type(exc).__name__}: {sentence(exc)} The run is "
        "saved before this step; fix the cause and run it again to resume here.",
        run=run.name,
        step=step.name,
        attempts=ctx.attempt,
    ) from exc


def record_failure(
    run: RunState, step: Step[..., Any], ctx: Context, exc: BaseException
) -> Protocol[None]:
    """Write status "failed" and the error with the last commit's payload:
    what the failed attempt changed never reaches storage.
    """
    at = round(time.time(), 3)
    error = {
        "step": step.name,
        "iteration": ctx.iteration,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc)[:2000],
        "attempts": ctx.attempt,
        "at": at,
    }
    run.event(
        "step_failed", step=step.name, iteration=ctx.iteration, attempt=ctx.attempt, error=exc
    )
    header = run.header
    log = history.add(header, history.FAILED, step.name, ctx.attempt, 0.0, at)
    yield from run.write(header.evolve(status="failed", error=error, log=log), step.name)


def sentence(exc: BaseException) -> str:
    """``exc``'s message as a sentence of ours: one final period, never two."""
    return f"{str(exc).rstrip('. ')}."
