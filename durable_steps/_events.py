"""What a run reports while it goes: log lines and events for subscribers.

Every committed step is logged at INFO on the ``durable_steps`` logger.
Subscribers (``Workflow(..., on_event=[fn])``) receive an :class:`Event` for
each of the kinds below — enough to feed OpenTelemetry spans or metrics
without durable_steps depending on either. A subscriber that raises is logged
and ignored: observability never breaks a run.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

__all__ = ["Event", "EventKind", "Progress", "emit", "logger"]

logger = logging.getLogger("durable_steps")

EventKind = Literal[
    "run_started",  # a new run was created
    "run_resumed",  # an unfinished run was loaded
    "step_started",  # an attempt of a step is about to run
    "step_retrying",  # an attempt failed and another follows after `wait`
    "step_committed",  # the step's checkpoint was written
    "step_failed",  # retries used up; the run stops, resumable
    "step_in_doubt",  # an intent without a commit was found
    "call_started",  # a journaled call (ctx.call/ctx.effect) is about to run its function
    "call_recorded",  # its result was written to the checkpoint
    "call_replayed",  # its recorded result was returned without calling the function
    "effect_in_doubt",  # an effect's intent without a result was found
    "run_suspended",  # a step waits (ctx.sleep, ctx.wait_for): status waiting, lease released
    "signal_received",  # ctx.wait_for found its signal and recorded the payload
    "run_woken",  # a waiting run's time came or its signal arrived, and it goes on
    "run_completed",  # the terminal marker was written
    "run_stopped",  # this execution ended without completing the run; `error` says why
    # (None: Workflow.submit created the run, and left it to a worker)
    "code_changed",  # the run was made by other code; `detail` says what the resume does
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
    call: str | None = None
    """The journaled call's name (``call_*`` and ``effect_in_doubt`` events)."""
    execution: str | None = None
    """This execution's owner token (as in the checkpoint's lease): tells apart
    two executions of one run, even in one process."""
    detail: str | None = None
    """``code_changed``: what differs from the code that made the run, and what is done."""
    run_nonce: str | None = None
    """The run's nonce (chosen when it was created): tells this run apart from
    one deleted and created again under the same id."""
    title: str | None = None
    """For ``call_*`` and ``effect_in_doubt`` events: what the code that made the
    call gave to show for it (an integration's tool and its arguments), when
    it gave anything; ``call`` stays its journal name."""


Subscriber = Callable[[Event], object]


def emit(subscribers: Sequence[Subscriber], event: Event) -> None:
    """Deliver ``event`` to every subscriber, isolating their failures."""
    for subscriber in subscribers:
        try:
            subscriber(event)
        except Exception:
            logger.exception("event subscriber %r failed on %s; ignored", subscriber, event.kind)


_LOGGED = (
    "step_committed",
    "run_resumed",
    "step_in_doubt",
    "effect_in_doubt",
    "run_suspended",
    "run_woken",
    "code_changed",
)
"""What Progress prints a line for when it is not on a terminal."""


class Progress:
    """An opt-in progress display: ``Workflow(..., on_event=[ds.Progress()])``.

    On a terminal it keeps one status line up to date (run, pass, step,
    commits so far, elapsed time, retries); elsewhere (a pipe, a log file) it
    prints one line per committed step instead, so logs stay readable.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._started = time.monotonic()
        self._commits = 0
        self._width = 0

    def __call__(self, event: Event) -> None:
        """Render ``event``."""
        if event.kind == "run_stopped":  # the failure or the wait was shown already
            return
        run = f"{event.workflow}/{event.run_id}"
        if event.kind in ("run_started", "run_resumed"):
            self._started, self._commits = time.monotonic(), 0
        if event.kind == "step_committed":
            self._commits += 1
        elapsed = time.monotonic() - self._started
        where = f"pass {event.iteration} · {event.step}" if event.step else ""
        text = {
            "run_started": f"{run}: started",
            "run_resumed": f"{run}: resumed at {where}",
            "step_started": f"{run}: {where} (attempt {event.attempt})",
            "step_retrying": f"{run}: {where} failed, retrying in {event.duration or 0:.1f}s",
            "step_committed": f"{run}: {where} done in {event.duration or 0:.2f}s",
            "step_failed": f"{run}: {where} FAILED: {event.error!r}",
            "step_in_doubt": f"{run}: {where} may have fired before a crash",
            "call_started": f"{run}: {where} · {event.call}",
            "call_recorded": f"{run}: {where} · {event.call} recorded",
            "call_replayed": f"{run}: {where} · {event.call} replayed",
            "effect_in_doubt": f"{run}: {where} · {event.call} may have fired before a crash",
            "run_suspended": f"{run}: {where} waiting",
            "signal_received": f"{run}: {where} · {event.call} received",
            "run_woken": f"{run}: woken at {where}",
            "run_completed": f"{run}: completed",
            "code_changed": f"{run}: {event.detail}",
        }[event.kind]
        line = f"{text} · {self._commits} steps · {elapsed:.1f}s"
        final = event.kind in ("run_completed", "step_failed", "run_suspended")
        if self.tty:
            pad = " " * max(self._width - len(line), 0)
            self._width = 0 if final else len(line)
            self.stream.write(f"\r{line}{pad}" + ("\n" if final else ""))
        elif event.kind in _LOGGED or final:
            self.stream.write(line + "\n")
        self.stream.flush()
