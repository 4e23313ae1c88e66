"""Everything durable_steps raises.

::

    DurableStepsError                  base of all of them
    ├── CheckpointConflict             another writer changed the checkpoint
    ├── StepInDoubt                    a non-idempotent step may have fired
    ├── StepFailed                     a step's retries are used up
    ├── WorkflowChanged                the stored run came from other code
    ├── RunLocked                      another live process owns the run
    ├── RunNotFound                    wf.resume of a run that does not exist
    │                                  (also a ``LookupError``)
    ├── CorruptCheckpoint              unreadable, truncated, tampered, newer
    ├── SerializationError             the state cannot be encoded
    ├── StoreError                     the storage service failed
    │   └── ConditionalWritesUnsupported
    ├── SignalRefused                  a payload the waiting run does not accept
    │                                  (also a ``ValueError``)
    └── DefinitionError                a step or workflow is defined wrongly
        (also a ``ValueError``, so ``except ValueError`` code keeps working)

Every message names the run (``workflow/run_id``), the step when there is one,
and what to do next. The structured fields (``run``, ``step``, ...) are kept as
attributes, and every exception survives pickling (``__reduce__``) so it can
cross a process pool unchanged.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointConflict",
    "ConditionalWritesUnsupported",
    "CorruptCheckpoint",
    "DefinitionError",
    "DurableStepsError",
    "RunLocked",
    "RunNotFound",
    "RunSuspended",
    "SerializationError",
    "SignalRefused",
    "SignalTimeout",
    "StepFailed",
    "StepInDoubt",
    "StoreError",
    "WorkflowChanged",
]


class DurableStepsError(Exception):
    """Base class of every error durable_steps raises.

    ``run`` is ``"workflow/run_id"`` (or ``None`` when no run is involved) and
    ``step`` the step's name (or ``None``).
    """

    def __init__(self, message: str, *, run: str | None = None, step: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.run = run
        self.step = step

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step}

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through the keyword constructor so subclasses with extra
        # fields round-trip through pickle (multiprocessing, concurrent.futures).
        return (_rebuild, (type(self), self.message, self._fields()))

    def __str__(self) -> str:
        return self.message


def _rebuild(
    cls: type[DurableStepsError], message: str, fields: dict[str, Any]
) -> DurableStepsError:
    return cls(message, **fields)


class CheckpointConflict(DurableStepsError):
    """Another writer changed the checkpoint since this process read it.

    The conditional write was refused, so nothing was overwritten. This
    process must stop: another process (a newer attempt of the same run) owns
    it now.
    """


class StepInDoubt(DurableStepsError):
    """A non-idempotent step may have fired, and its policy says stop.

    Raised on resume when a step declared ``in_doubt="raise"`` has an intent
    but no commit, or one of its effects (``ctx.effect``) has an intent but
    no result (``effect`` names it). Find out whether the effect happened (``key`` is the
    idempotency key it was sent with), then tell the run with
    ``Workflow.resolve(run_id, fired=...)`` or ``durable-steps resolve``.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: str | None = None,
        key: str | None = None,
        iteration: int | None = None,
        effect: str | None = None,
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.key = key
        self.iteration = iteration
        self.effect = effect
        """The effect in doubt (``ctx.effect``'s name), or None for the step itself."""

    def _fields(self) -> dict[str, Any]:
        return {
            **super()._fields(),
            "key": self.key,
            "iteration": self.iteration,
            "effect": self.effect,
        }


class StepFailed(DurableStepsError):
    """A step raised and its retries are used up.

    The last error is ``__cause__``. The failure is recorded in the
    checkpoint; rerunning the workflow resumes at this step.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: str | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.attempts = attempts

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "attempts": self.attempts}


class WorkflowChanged(DurableStepsError):
    """The stored run was made by a different step sequence (or serializer)."""


class RunLocked(DurableStepsError):
    """Another live process owns the run and its lease has not ended."""


class RunNotFound(DurableStepsError, LookupError):
    """``wf.resume`` (or ``aresume``) of a run id the store has no run for.

    Nothing was written: a mistyped id never starts a new run (which would
    fire its effects again under new keys). ``store`` names where it looked.
    """

    def __init__(
        self, message: str, *, run: str | None = None, step: str | None = None, store: str = ""
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.store = store

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "store": self.store}


class CorruptCheckpoint(DurableStepsError):
    """A checkpoint cannot be read: corrupt, truncated, tampered, or newer.

    The checkpoint is left exactly as found; nothing overwrites it.
    """


class SerializationError(DurableStepsError):
    """The state (or a value inside it) cannot be serialized.

    ``path`` says where, e.g. ``state['tools'][2]``. The last good checkpoint
    is kept.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.path = path

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "path": self.path}


class StoreError(DurableStepsError):
    """The storage service failed after bounded retries (or refused access)."""


class ConditionalWritesUnsupported(StoreError):
    """The storage service does not honour ``If-None-Match`` / ``If-Match``.

    Without them two processes can overwrite each other's checkpoints. Use a
    service that honours them, or opt out explicitly with
    ``S3Store(..., unsafe_unconditional_writes=True)``.
    """


class DefinitionError(DurableStepsError, ValueError):
    """A step or workflow is defined wrongly (raised at definition time)."""


class RunSuspended(DurableStepsError):
    """The run waits: for a time (``until``, epoch seconds), a signal (``signal``), or both.

    Raised by ``wf.run``/``wf.arun`` when a step called ``ctx.sleep``,
    ``ctx.sleep_until`` or ``ctx.wait_for`` and the time is not due or the
    signal has not arrived. Nothing is lost and no process holds the run:
    its checkpoint says ``waiting``, its lease is released. Run it again
    after the time, or once ``wf.signal(run_id, name)`` was sent (a worker
    does this by itself), or pass ``wait=True`` to block until then.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: str | None = None,
        until: float | None = None,
        signal: str | None = None,
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.until = until
        self.signal = signal

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "until": self.until, "signal": self.signal}


class SignalRefused(DurableStepsError, ValueError):
    """A signal was not sent: the run waits for it as an approval and its payload is
    not one (``wf.signal``, ``durable-steps signal``, the web page). Nothing was
    written; the run still waits. ``signal`` is the signal's name; the message
    names the payloads the wait accepts.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: str | None = None,
        signal: str | None = None,
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.signal = signal

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "signal": self.signal}


class SignalTimeout(DurableStepsError):
    """Raised inside a step by ``ctx.wait_for(name, timeout=...)`` once the
    timeout has passed without the signal. Catch it to go on without it; left
    uncaught it fails the step like any error.
    """

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: str | None = None,
        signal: str | None = None,
    ) -> None:
        super().__init__(message, run=run, step=step)
        self.signal = signal

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "signal": self.signal}
