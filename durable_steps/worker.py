"""Resume worker: many runs, many machines, the bucket as the only coordinator.

A :class:`Worker` finds the unfinished runs of one workflow that nobody is
running — never claimed, released by a worker that stopped, or whose owner's
lease ended (or, on this host, whose owner process is gone) — claims each
with a conditional write, resumes it, and repeats. Any number of workers on
any number of machines can share one store prefix:

* **Claiming is a compare-and-swap.** Two workers that pick the same run
  both read it, both try to write their claim against the version they read;
  the store lets exactly one through. The other gets ``CheckpointConflict``
  (or ``RunLocked`` if it read after the claim) and moves on.
* **Fencing stays.** A worker that stalls past its lease (a long GC pause, a
  frozen VM) and wakes after another took its run over fails its next write
  and stops that run; its heartbeat stops too.
* **Scanning is cheap.** Each scan is one LIST of ``<workflow>/``; a run is
  read (GET) only when its version changed since the worker last saw it, so
  10,000 completed runs cost one LIST per scan, not 10,000 GETs. A lease that
  ends is noticed from the remembered header, without reading it again.
* **Graceful stop.** :meth:`Worker.stop` (``SIGTERM`` for the command line)
  lets every run finish the step it is in, commit it, and release its lease,
  so another worker can pick the run up at once.

Enqueue runs with :meth:`Workflow.submit` (creates the run without running
it) and start workers with ``durable-steps worker --app module:workflow``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._drivers import drive_async, drive_sync
from ._events import logger
from ._lease import is_live
from ._record import checkpoint as ckpt
from ._run import Released, store_skew
from ._runner import RunGone, execute
from .errors import (
    CheckpointConflict,
    CorruptCheckpoint,
    DefinitionError,
    DurableStepsError,
    RunLocked,
    RunSuspended,
    StepFailed,
    StepInDoubt,
    StoreError,
)

if TYPE_CHECKING:
    from ._workflow import Workflow
    from .stores import ObjectInfo

__all__ = ["Worker", "WorkerReport"]


@dataclass
class WorkerReport:
    """What a worker did, by run id."""

    completed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """Runs whose step used up its retries (resume them after a fix)."""
    in_doubt: list[str] = field(default_factory=list)
    """Runs waiting for ``durable-steps resolve``."""
    released: list[str] = field(default_factory=list)
    """Runs handed back unfinished because the worker was stopped."""
    waiting: list[str] = field(default_factory=list)
    """Runs that went on until a step waits (``ctx.sleep``, ``ctx.wait_for``):
    a later scan resumes each when its time is due or its signal arrives."""
    lost: list[str] = field(default_factory=list)
    """Runs another worker claimed first (or took over)."""
    errors: list[str] = field(default_factory=list)
    """Runs that raised anything else (logged with a traceback)."""


@dataclass
class _Seen:
    version: str
    status: str
    owner: dict[str, Any] | None
    updated_at: float | None = None
    wait: dict[str, Any] | None = None

    def due(self, now: float, signals: set[str]) -> bool:
        """Whether a waiting run can go on: its time came, or its signal is listed."""
        wait = self.wait or {}
        until, signal = wait.get("until"), wait.get("signal")
        return (until is not None and now >= until) or (signal is not None and signal in signals)


class Worker:
    """Resumes the unfinished, unowned runs of ``workflow``, ``concurrency`` at a time.

    ``poll`` is the pause (seconds) between scans when there is nothing to
    do. ``retry_failed=True`` also resumes runs whose step failed (by default
    they wait for a person: the cause is usually a bug). Runs in doubt are
    never picked up: they wait for ``resolve``.
    """

    def __init__(
        self,
        workflow: Workflow,
        *,
        concurrency: int = 4,
        poll: float = 2.0,
        retry_failed: bool = False,
    ) -> None:
        if concurrency < 1:
            raise DefinitionError(f"concurrency must be >= 1, not {concurrency!r}")
        self.workflow = workflow
        self.concurrency = concurrency
        self.poll = poll
        self.statuses = ("running", "failed") if retry_failed else ("running",)
        self._stopping = threading.Event()
        self._seen: dict[str, _Seen] = {}
        # Runs that raised an unexpected error, with the version they had
        # then (None until the next scan sees it): skipped until someone
        # changes them, so a broken run is not retried in a tight loop.
        self._quarantine: dict[str, str | None] = {}
        self._skipped: set[str] = set()  # keys already reported as no run
        self._prefix = f"{workflow.name}/"
        self._suffix = f"/{ckpt.CHECKPOINT_OBJECT}"

    def stop(self) -> None:
        """Finish the current steps, release their runs, then return from :meth:`run`."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopping.is_set()

    def run(self, *, until_idle: bool = False) -> WorkerReport:
        """Work until stopped (or, with ``until_idle``, until no run is claimable)."""
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="durable-steps") as pool:
            return self._drive(
                lambda run_id: pool.submit(self._resume, run_id), until_idle=until_idle
            )

    def _drive(self, start: Callable[[str], Future[str]], *, until_idle: bool) -> WorkerReport:
        """Scan, ``start`` up to ``concurrency`` runs at once, and collect what they did.

        ``start(run_id)`` resumes one run somewhere (a thread of this worker,
        a Ray task) and returns a future of its :class:`WorkerReport` field
        name, or ``transient`` for a store failure worth another try.
        """
        report = WorkerReport()
        active: dict[Future[str], str] = {}
        while True:
            free = self.concurrency - len(active)
            if free and not self.stopping:
                for run_id in self.claimable(limit=free, exclude=set(active.values())):
                    active[start(run_id)] = run_id
            if not active and (self.stopping or until_idle):
                return report
            if not active:
                self._stopping.wait(self.poll)
                continue
            done, _ = wait(active, timeout=self.poll, return_when=FIRST_COMPLETED)
            for future in done:
                run_id = active.pop(future)
                try:
                    outcome = future.result()
                except Exception:  # where it ran failed (a Ray task out of retries)
                    logger.exception("worker: run %s/%s failed to run", self.workflow.name, run_id)
                    outcome = "errors"
                if outcome == "transient":  # the store failed: try again next scan
                    outcome = "errors"
                elif outcome == "errors":
                    self._quarantine[run_id] = None
                getattr(report, outcome).append(run_id)

    def claimable(
        self, *, limit: int | None = None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> list[str]:
        """Up to ``limit`` run ids that nobody runs now.

        One LIST; a GET only for a run whose version changed since this
        worker last read it, and none once ``limit`` runs are found (the rest
        are read by a later scan). A waiting run is ready when its time is
        due or its signal is among the listed objects: no GET for that either.
        """
        now = time.time()
        skew = store_skew(self.workflow.store)
        lease = self.workflow.lease
        found: list[str] = []
        try:
            # The whole listing first: a run's signals sort after its checkpoint.
            infos, signals = self._listing()
            for info in infos:
                if limit is not None and len(found) >= limit:
                    break
                run_id = self._run_id(info.key)
                if run_id is None or run_id in exclude:
                    continue
                if self._quarantined(run_id, info.version):
                    continue
                seen = self._seen.get(info.key)
                if seen is None or seen.version != info.version:
                    seen = self._read(info.key)
                if seen is None:
                    continue
                if seen.status == "waiting":
                    ready = seen.due(now, signals.get(run_id, set()))
                else:
                    ready = seen.status in self.statuses and not is_live(
                        seen.owner, now=now, skew=skew, since=seen.updated_at, lease=lease
                    )
                if ready:
                    found.append(run_id)
            self._forget({info.key for info in infos})
        except DurableStepsError as exc:  # the store is down: try again at the next poll
            logger.warning("worker %s: scan failed (%s); retrying", self.workflow.name, exc)
        except Exception:  # a bug of ours or a store wrapper's: never the worker's end
            logger.exception("worker %s: scan failed; retrying", self.workflow.name)
        return found

    def _forget(self, listed: set[str]) -> None:
        """Drop what is remembered of runs no longer listed."""
        for key in self._seen.keys() - listed:
            del self._seen[key]
        listed_ids = {k[len(self._prefix) : -len(self._suffix)] for k in listed}
        for run_id in self._quarantine.keys() - listed_ids:
            del self._quarantine[run_id]

    def _listing(self) -> tuple[list[ObjectInfo], dict[str, set[str]]]:
        """One LIST: the checkpoints under the prefix, and the signals sent, by run id."""
        infos: list[ObjectInfo] = []
        signals: dict[str, set[str]] = {}
        for info in self.workflow.store.list(self._prefix):
            if info.key.endswith(self._suffix):
                infos.append(info)
                continue
            run_id, sep, name = info.key[len(self._prefix) :].partition("/signals/")
            if sep and name:
                signals.setdefault(run_id, set()).add(name)
        return infos, signals

    def _run_id(self, key: str) -> str | None:
        """The run id of a checkpoint key, or None for any other object.

        An object whose name is not a valid run id (an operator's copy at
        ``wf/r1 copy/checkpoint``, a name starting with ``_``) is logged once
        and skipped: one bad object must never stop the workers of a prefix.
        """
        if not key.endswith(self._suffix):
            return None
        run_id = key[len(self._prefix) : -len(self._suffix)]
        try:
            return ckpt.validate_name(run_id, "run id")
        except DefinitionError:
            if key not in self._skipped:
                self._skipped.add(key)
                logger.warning(
                    "worker %s: skipping %r: %r is not a valid run id, so it is no run of ours",
                    self.workflow.name,
                    key,
                    run_id,
                )
            return None

    def _quarantined(self, run_id: str, version: str) -> bool:
        if run_id not in self._quarantine:
            return False
        held = self._quarantine[run_id]
        if held is None or held == version:
            self._quarantine[run_id] = version
            return True
        del self._quarantine[run_id]  # changed since it failed: worth another try
        return False

    def _read(self, key: str) -> _Seen | None:
        got = self.workflow.store.get(key)
        if got is None:
            self._seen.pop(key, None)
            return None
        try:
            header, _ = ckpt.decode(got[0], where=f"checkpoint {key!r}")
        except CorruptCheckpoint as exc:
            logger.warning("worker: skipping %s", exc)
            seen = _Seen(got[1], "corrupt", None)
        else:
            seen = _Seen(got[1], header.status, header.owner, header.updated_at, header.wait)
        self._seen[key] = seen
        return seen

    def _resume(self, run_id: str) -> str:
        """Resume one run in this thread; return the WorkerReport field it belongs
        to, or ``transient`` for a store failure worth another try.
        """
        wf = self.workflow
        plan = wf._plan(run_id, asynchronous=True, stop=self._stopping, claim=True)
        protocol = execute(plan, run_id, None, create=False)
        outcomes: list[tuple[type[BaseException], str]] = [
            (Released, "released"),
            (StepFailed, "failed"),
            (StepInDoubt, "in_doubt"),
            (CheckpointConflict, "lost"),
            (RunLocked, "lost"),
            (RunGone, "lost"),
            (RunSuspended, "waiting"),
        ]
        try:
            if any(s.is_async for s in wf.steps):
                import asyncio

                asyncio.run(drive_async(protocol, wf.store))
            else:
                drive_sync(protocol, wf.store)
        except BaseException as exc:  # one run's failure never stops the worker
            for kind, name in outcomes:
                if isinstance(exc, kind):
                    logger.info("worker: run %s/%s %s: %s", wf.name, run_id, name, exc)
                    return name
            if isinstance(exc, StoreError):
                logger.warning("worker: run %s/%s: %s; will retry", wf.name, run_id, exc)
                return "transient"
            logger.exception("worker: run %s/%s raised", wf.name, run_id)
            return "errors"
        return "completed"


def install_signal_handlers(worker: Worker, log: Callable[[str], object]) -> None:
    """SIGTERM/SIGINT: stop gracefully; a second one of either exits at once.

    The second signal gets the default action — the kernel ends the process —
    because anything run in Python would first wait for the steps in flight
    (a KeyboardInterrupt waits in the thread pool's shutdown). Nothing is lost
    by that: every committed step is in the store, and a run whose step was cut
    short resumes at that step.
    """
    import signal

    def graceful(signum: int, _frame: object) -> None:
        log(
            f"{signal.Signals(signum).name}: finishing current steps, then stopping "
            "(send it again to exit at once)"
        )
        worker.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, graceful)
    signal.signal(signal.SIGINT, graceful)
