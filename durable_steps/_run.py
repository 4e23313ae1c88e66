"""One execution of a run: what it needs (:class:`Plan`) and what it holds.

:class:`RunState` owns the committed payload, its version (ETag), the header
last written, and the live state object, and it is the only place that
writes the checkpoint — through :meth:`RunState.write` (yielding a ``Put``
effect) or its heartbeat — so every write is conditional on the version
this execution last saw and stamped with its ownership lease.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _checkpoint as ckpt
from ._drivers import Protocol, Put
from ._events import Event, EventKind, Subscriber, emit
from ._lease import Heartbeat, Owner
from ._step import Step
from .errors import CheckpointConflict, CorruptCheckpoint, SerializationError

if TYPE_CHECKING:
    from .serializers import Serializer
    from .stores import Store

__all__ = ["Plan", "Released", "RunState"]


@dataclass(frozen=True)
class Plan:
    """What a run needs from its workflow (kept apart so the runner never
    reaches back into ``Workflow``).
    """

    workflow: str
    steps: Sequence[Step[..., Any]]
    serializer: Serializer
    until: Callable[[Any], bool] | None
    on_complete: str
    subscribers: Sequence[Subscriber]
    store: Store
    lease: float
    takeover: bool = False
    stop: threading.Event | None = None
    """Set by a worker to stop the run after its current step (see Released)."""
    claim: bool = False
    """Write a claim before the first step of a resumed run (see execute)."""


class Released(Exception):
    """The run stopped after a commit because ``Plan.stop`` was set, and its
    lease was released so another process can resume it at once.
    """


class RunState:
    """The mutable state of one execution: the committed payload, its
    version, the header, and the live state object.
    """

    def __init__(self, plan: Plan, run_id: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.name = f"{plan.workflow}/{run_id}"
        self.key = ckpt.checkpoint_key(plan.workflow, run_id)
        self.version: str | None = None
        self.header: ckpt.Checkpoint
        self.payload: bytes = b""
        self.state: Any = None
        self.owner = Owner(plan.lease)

    def event(self, kind: EventKind, **fields: Any) -> None:
        if self.plan.subscribers:
            emit(self.plan.subscribers, Event(kind, self.plan.workflow, self.run_id, **fields))

    def encode_state(self, step: str | None) -> bytes:
        """The state's bytes; ``step`` is the step just run, None for the
        initial state of a new run.
        """
        try:
            return self.plan.serializer.dumps(self.state)
        except SerializationError as exc:
            if step is None:
                outcome = (
                    "Nothing was written: the run was not created. Change that value in "
                    "the initial state and start the run again."
                )
            else:
                outcome = (
                    f"The last good checkpoint is kept; step {step!r} will run again on "
                    "resume, so change what it puts in the state first."
                )
            where = f"after step {step!r}" if step else "(the initial state)"
            raise SerializationError(
                f"run {self.name}: cannot save the state {where}: {exc.message} {outcome}",
                run=self.name,
                step=step,
                path=exc.path,
            ) from exc

    def decode_state(self, payload: bytes) -> Any:
        try:
            return self.plan.serializer.loads(payload)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(
                f"run {self.name}: the checkpoint at {self.key!r} cannot be decoded: "
                f"{exc.message} It was left untouched.",
                run=self.name,
            ) from exc

    def stamp(self, header: ckpt.Checkpoint, *, release: bool = False) -> ckpt.Checkpoint:
        """``header`` with this process as owner (lease renewed), or with no
        owner once the run is over, stopped, or released.
        """
        keep = header.status == "running" and not release
        return header.replace(owner=self.owner.record() if keep else None)

    def write(
        self, header: ckpt.Checkpoint, step: str | None, *, release: bool = False
    ) -> Protocol[None]:
        """Conditionally write ``header`` + the current payload."""
        header = self.stamp(header, release=release)
        data = ckpt.encode(header, self.payload)
        try:
            self.version = yield Put(self.key, data, self.version)
        except CheckpointConflict as exc:
            raise self.conflict(step) from exc
        self.header = header

    def conflict(self, step: str | None) -> CheckpointConflict:
        at = f" at step {step!r}" if step else ""
        return CheckpointConflict(
            f"run {self.name}: another process changed its checkpoint{at}, so this "
            "process stopped without overwriting it (its lease had run out and the run "
            "was taken over, or it ran twice). Nothing further ran here; let the other "
            "process finish.",
            run=self.name,
            step=step,
        )

    def heartbeat(self) -> Heartbeat:
        """Renew the lease from a thread until stopped (see ``_lease``)."""

        def renew() -> None:
            # A resumed run claims with its first write: this one, if the
            # step outlasts a third of the lease. So it says "running" too.
            header = self.stamp(self.header.replace(status="running"))
            data = ckpt.encode(header, self.payload)
            self.version = self.plan.store.put(self.key, data, match=self.version)
            self.header = header

        return Heartbeat(self.plan.lease / 3, renew, self.name)
