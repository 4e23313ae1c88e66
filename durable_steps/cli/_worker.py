"""``durable-steps worker``: resume a workflow's runs from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from .._apps import load_app
from ..errors import DefinitionError
from ..stores import Store, extra_hint
from ..worker import Worker, install_signal_handlers

__all__ = ["register"]

DESCRIPTION = (
    "Resume the unfinished runs of one workflow: find runs nobody is running (never "
    "claimed, released, or whose owner's lease ended or whose process on this host is "
    "gone), claim each with a conditional write, run it to the end, repeat. Start as "
    "many workers on as many machines as you like on one store. SIGTERM (or Ctrl-C) "
    "finishes the current steps and releases their runs; a second one exits at once. "
    "Enqueue runs from Python with wf.submit(run_id, state). Exit status 0, or 1 if a "
    "run raised an unexpected error."
)


def _log_progress() -> None:
    """The library's INFO log on stderr. Only the ``durable_steps`` logger: a
    root handler would let botocore's and urllib3's request logs flood it.
    An app that configured logging itself keeps its own handlers.
    """
    log = logging.getLogger("durable_steps")
    log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)


def _cmd_worker(args: argparse.Namespace, store: Store, _style: object) -> int:
    workflow = load_app(args.app)
    if args.store:  # an explicit --store wins over the one the app configured
        workflow.store = store
    if not args.debug:
        _log_progress()
    if args.ray is not None:
        try:  # the `ray` extra, imported only when asked for
            from ..integrations.ray import RayDriver
        except ImportError as exc:
            raise DefinitionError(f"--ray needs Ray ({exc}): {extra_hint('ray')}") from exc
        driver = RayDriver(
            args.app,
            address=None if args.ray == "auto" else args.ray,
            store=args.store,
            max_in_flight=args.concurrency,
            poll=args.poll,
            retry_failed=args.retry_failed,
        )
        worker, run = driver.worker, driver.run
    else:
        worker = Worker(
            workflow,
            concurrency=args.concurrency or 4,
            poll=args.poll,
            retry_failed=args.retry_failed,
        )
        run = worker.run
    install_signal_handlers(worker, lambda text: print(f"worker: {text}", file=sys.stderr))
    report = run(until_idle=args.until_idle)
    counts = ", ".join(f"{len(v)} {k.replace('_', '-')}" for k, v in vars(report).items())
    print(f"worker {workflow.name}: {counts}")
    return 1 if report.errors else 0


def register(command: Callable[..., Any]) -> None:
    """Add the ``worker`` subcommand through cli.build_parser's ``command`` factory."""
    sub = command("worker", _cmd_worker, "resume a workflow's unfinished runs", DESCRIPTION)
    sub.add_argument(
        "--app",
        required=True,
        metavar="MODULE:WORKFLOW",
        help="where the Workflow object is, e.g. myagent:workflow (imported from the "
        "current directory too)",
    )
    sub.add_argument(
        "--concurrency", "-c", type=int, help="runs at once (4; with --ray: the cluster's CPUs)"
    )
    sub.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="run each run as a task on the Ray cluster at ADDRESS (default: the one "
        "ray.init finds); needs the `ray` extra",
    )
    sub.add_argument("--poll", type=float, default=2.0, help="seconds between scans when idle (2)")
    sub.add_argument(
        "--until-idle",
        action="store_true",
        help="exit once no run can be claimed, instead of waiting for more",
    )
    sub.add_argument(
        "--retry-failed", action="store_true", help="also resume runs whose step failed"
    )
