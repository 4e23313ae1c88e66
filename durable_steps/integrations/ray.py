"""Runs as Ray tasks: Ray schedules them, the bucket keeps each run single-writer.

Ray decides where and when a run executes — CPUs, GPUs, custom resources,
placement, autoscaling, retries when a node dies. durable_steps keeps what
makes a run safe to execute anywhere: each task claims its run with a
compare-and-swap write, renews its lease, and is fenced off if another
takes the run over, exactly as ``durable-steps worker`` does. Two names:

:func:`submit_run`
    One run as one Ray task; returns the task's ``ObjectRef``, whose value
    is what happened to the run (a :class:`~durable_steps.WorkerReport`
    field name: ``"completed"``, ``"failed"``, ``"in_doubt"``, ``"lost"``,
    ``"errors"``).
:class:`RayDriver`
    Keeps a cluster busy: the worker's scan of the prefix (one LIST, a GET
    only for runs that changed), each claimable run submitted as a task, at
    most ``max_in_flight`` at once, their outcomes gathered in a
    :class:`~durable_steps.WorkerReport`. ``durable-steps worker --ray
    [ADDRESS] --app module:workflow`` is its command line.

The workflow travels as ``"module:workflow"`` and the store as its URL: each
task imports the module (as ``durable-steps worker --app`` does), so nothing
unpicklable — store clients, locks, threads — is shipped; the module must be
importable on the workers (installed, or shipped with Ray's ``runtime_env``).

**A retried task waits for the lease.** When a node dies, Ray retries its
tasks elsewhere. The dead task's lease was written from another host, so
nothing can prove that owner gone: the retry sees a live owner until the
lease runs out. Instead of failing with ``RunLocked`` it waits — re-reading
the checkpoint with backoff — and resumes the run once the lease has ended.
The wait is bounded by ``wait`` (default: the workflow's lease plus a
quarter): an owner that is really alive keeps renewing its lease past it,
and is never taken over; the task then reports the run ``"lost"``.

Set ``$DURABLE_STEPS_HOST`` to tell apart Ray nodes that share one machine
(or one hostname); on separate machines the hostname does it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ray

from .._apps import load_app
from .._events import logger
from .._fleet.leases import judge, lease_end, store_skew
from ..errors import DefinitionError
from ..stores import open_store
from ..worker import Worker, WorkerReport

if TYPE_CHECKING:
    from .._workflow import Workflow
    from ..stores import Store

__all__ = ["RayDriver", "submit_run"]

_MAX_PAUSE = 5.0  # seconds between looks at a lease: a renewal is noticed soon


_stores: dict[str, Store] = {}  # per process: a Ray worker runs many tasks


def _workflow(app: str, store: str | None) -> Workflow:
    workflow = load_app(app)
    if store is not None:  # an explicit store wins over the one the app configured
        if store not in _stores:
            _stores[store] = open_store(store)
        workflow.store = _stores[store]
    return workflow


def _lease_left(worker: Worker, run_id: str) -> float | None:
    """Seconds until the run's owner's lease ends (0 if it has no live owner),
    or None if the run is no longer one to resume.
    """
    wf = worker.workflow
    seen = worker._finder.head(run_id)
    if seen is None or seen.status not in worker.statuses:
        return None
    skew = store_skew(wf.store)
    if judge(seen.owner, skew=skew, since=seen.updated_at) != "live":
        return 0.0
    return lease_end(seen.owner, since=seen.updated_at) - (time.time() - (skew or 0.0))


def _run_task(app: str, store: str | None, run_id: str, wait: float | None, retry: bool) -> str:
    """Resume one run in this Ray worker; its WorkerReport field name."""
    worker = Worker(_workflow(app, store), concurrency=1, retry_failed=retry)
    lease = worker.workflow.lease
    deadline = time.monotonic() + (lease * 1.25 if wait is None else wait)
    backoff = 0.1
    while True:
        outcome = worker._resume(run_id)
        if outcome != "lost":
            return outcome
        # Claimed by another: this task's earlier attempt, on a node that
        # died (its lease must run out), or a live owner.
        left = _lease_left(worker, run_id)
        if left is None or time.monotonic() + max(left, 0.0) > deadline:
            return "lost"
        logger.info("run %s/%s: waiting %.1fs for its owner's lease", app, run_id, left)
        time.sleep(min(max(left, backoff), _MAX_PAUSE))
        backoff = min(backoff * 2, _MAX_PAUSE)


_remote_run = ray.remote(_run_task)


def submit_run(
    app: str,
    run_id: str,
    *,
    store: str | None = None,
    wait: float | None = None,
    retry_failed: bool = False,
    **options: Any,
) -> ray.ObjectRef[str]:
    """Resume (or finish) run ``run_id`` of ``app`` (``"module:workflow"``) as a Ray task.

    The run must exist (``Workflow.submit`` creates it). ``store`` is a store
    URL for the task (default: the one the app configures); ``wait`` bounds
    how long the task waits for another owner's lease to run out (default:
    the lease plus a quarter); ``retry_failed`` also resumes a failed run.
    ``options`` go to Ray's ``.options()``: ``num_cpus``, ``num_gpus``,
    ``resources``, ``memory``, ``max_retries``, ``runtime_env``, a
    ``scheduling_strategy``... Ray must be initialized (``ray.init``).
    """
    task = _remote_run.options(**options) if options else _remote_run
    return task.remote(app, store, run_id, wait, retry_failed)


class RayDriver:
    """Keeps a Ray cluster busy with the unfinished runs of ``app`` (``"module:workflow"``).

    Scans the store as :class:`~durable_steps.Worker` does and submits each
    claimable run with :func:`submit_run` (``store``, ``wait``,
    ``retry_failed`` and ``task_options`` are passed on), at most
    ``max_in_flight`` at once (default: the cluster's CPUs). ``address`` is
    given to ``ray.init`` unless Ray is initialized already. :meth:`run`
    returns a :class:`~durable_steps.WorkerReport`; a task Ray gave up on
    (out of ``max_retries``) counts among its ``errors``.
    """

    def __init__(
        self,
        app: str,
        *,
        address: str | None = None,
        store: str | None = None,
        max_in_flight: int | None = None,
        poll: float = 2.0,
        retry_failed: bool = False,
        wait: float | None = None,
        task_options: Mapping[str, Any] | None = None,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise DefinitionError(f"max_in_flight must be >= 1, not {max_in_flight!r}")
        self.app = app
        self.address = address
        self.store = store
        self.max_in_flight = max_in_flight
        self.wait = wait
        self.retry_failed = retry_failed
        self.task_options = dict(task_options or {})
        self.worker = Worker(_workflow(app, store), poll=poll, retry_failed=retry_failed)
        """The scan, and the loop that keeps tasks in flight."""

    def stop(self) -> None:
        """Submit nothing more; :meth:`run` returns once the tasks in flight end."""
        self.worker.stop()

    def run(self, *, until_idle: bool = False) -> WorkerReport:
        """Work until stopped (or, with ``until_idle``, until no run is claimable)."""
        if not ray.is_initialized():
            ray.init(address=self.address)
        if self.max_in_flight is None:
            cpus = int(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call]
            self.worker.concurrency = max(cpus, 1)
        else:
            self.worker.concurrency = self.max_in_flight

        def start(run_id: str) -> Future[str]:
            ref = submit_run(
                self.app,
                run_id,
                store=self.store,
                wait=self.wait,
                retry_failed=self.retry_failed,
                **self.task_options,
            )
            return ref.future()

        return self.worker._drive(start, until_idle=until_idle)
