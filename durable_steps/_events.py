"""What a run reports while it goes: log lines and events for subscribers.

Every committed step is logged at INFO on the ``durable_steps`` logger.
Subscribers (``Workflow(..., on_event=[fn])``) receive an :class:`Event` for
each of the kinds below — enough to feed OpenTelemetry spans or metrics
without durable_steps depending on either. A subscriber that raises is logged
and ignored: observability never breaks a run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Event", "EventKind", "emit", "logger"]

logger = logging.getLogger("durable_steps")

EventKind = Literal[
    "run_started",  # a new run was created
    "run_resumed",  # an unfinished run was loaded
    "step_started",  # an attempt of a step is about to run
    "step_retrying",  # an attempt failed and another follows after `wait`
    "step_committed",  # the step's checkpoint was written
    "step_failed",  # retries used up; the run stops, resumable
    "step_in_doubt",  # an intent without a commit was found
    "run_completed",  # the terminal marker was written
]


@dataclass(frozen=True)
class Event:
    """One thing that happened in a run."""

    kind: EventKind
    workflow: str
    run_id: str
    step: str | None = None
    iteration: int | None = None
    attempt: int | None = None
    duration: float | None = None
    """Seconds the step took (committed, failed) or will wait (retrying)."""
    error: BaseException | None = None
    idempotency_key: str | None = None


Subscriber = Callable[[Event], object]


def emit(subscribers: Sequence[Subscriber], event: Event) -> None:
    """Deliver ``event`` to every subscriber, isolating their failures."""
    for subscriber in subscribers:
        try:
            subscriber(event)
        except Exception:
            logger.exception("event subscriber %r failed on %s; ignored", subscriber, event.kind)
