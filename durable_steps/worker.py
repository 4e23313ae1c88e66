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
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._drivers import drive_async, drive_sync
from ._events import logger
from ._execution.run_state import Released
from ._fleet.finding import Finder
from ._protocol.runner import RunGone, execute
from .errors import (
    CheckpointConflict,
    DefinitionError,
    DurableStepsError,
    RunLocked,
    RunSuspended,
    StepFailed,
    StepInDoubt,
    StoreError,
    WorkflowChanged,
)
from .stores import command_hint

if TYPE_CHECKING:
    from ._workflow import Workflow

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
    stranded: list[str] = field(default_factory=list)
    """Runs this code cannot resume (``WorkflowChanged``: their next step is gone,
    say): each is logged with what to do, and left for a person or other code."""
    errors: list[str] = field(default_factory=list)
    """Runs that raised anything else (logged with a traceback)."""


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
        self._finder = Finder(workflow.store, workflow.name, workflow.lease, self.statuses)

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
                self._finder.recheck(run_id)
                if outcome == "transient":  # the store failed: try again next scan
                    outcome = "errors"
                elif outcome in ("errors", "stranded"):  # not again until someone changes it
                    self._finder.quarantine[run_id] = None
                getattr(report, outcome).append(run_id)

    def claimable(
        self, *, limit: int | None = None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> list[str]:
        """Up to ``limit`` run ids that nobody runs now.

        One LIST of the workflow's live runs in the index of runs; a GET only
        for a run that is (or was) owned and whose owner's lease has run out
        by this worker's memory (see ``_fleet.finding``). On a store written before
        the index, one LIST of every run instead, with a warning that says how
        to build the index.
        """
        found: list[str] = []
        try:
            found = self._finder.claimable(limit, exclude)
        except DurableStepsError as exc:  # the store is down: try again at the next poll
            logger.warning("worker %s: scan failed (%s); retrying", self.workflow.name, exc)
        except Exception:  # a bug of ours or a store wrapper's: never the worker's end
            logger.exception("worker %s: scan failed; retrying", self.workflow.name)
        return found

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
        stranded = (
            "worker: run %s/%s cannot be resumed by this code and is left as it is; the "
            "others go on. %s Check the deploy with `%s plan --all --app MODULE:WORKFLOW` "
            "(the new code's app)."
        )
        try:
            if any(s.is_async for s in wf.steps):
                import asyncio

                asyncio.run(drive_async(protocol, wf.store))
            else:
                drive_sync(protocol, wf.store)
        except BaseException as exc:  # one run's failure never stops the worker
            if isinstance(exc, WorkflowChanged):
                logger.error(stranded, wf.name, run_id, exc, command_hint(wf.store))
                return "stranded"
            for kind, name in outcomes:
                if isinstance(exc, kind):
                    if isinstance(exc, Released):  # its message is just that
                        logger.info("worker: run %s/%s released", wf.name, run_id)
                    else:
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
