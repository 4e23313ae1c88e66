"""``ls``: what runs there are, the newest first, through the index of runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from ..stores import Store
from ._base import EXIT_OK, PROG, arg, cmd, workflow_name
from ._format import Style, echo, human_age, human_size, status_label, table
from ._indexed import covered, finished, live, recent
from ._runs import FINISHED, RunInfo, find_runs, next_step
from ._waiting import waiting_for

__all__ = ["LS_LIMIT", "ls_row", "register", "summary"]

# What `ls --status` filters by, with "corrupt" (ls only).
_LIVE = ("running", "queued", "stopped", "waiting", "failed", "in-doubt")
_LS_STATUSES = (*_LIVE, "completed", "deleted")
LS_LIMIT = 50
"""How many runs ``ls`` shows without ``--limit`` or ``--all``: the newest."""


def ls_row(run: RunInfo, now: float) -> list[str]:
    """The cells of ``run`` in ``ls``: workflow, run, status, step, iteration, age, size,
    and what it waits for.
    """
    h = run.header or {}
    step, updated = next_step(h), h.get("updated_at")
    if run.problem is not None:
        where = "?"
    elif run.status in FINISHED:
        where = "done"
    else:
        where = f"{step} ({h['next_step'] + 1}/{len(h['steps'])})" if step else "?"
    return [
        run.workflow,
        run.run_id,
        status_label(run.status),
        where,
        str(h.get("iteration", "?")),
        human_age(now - float(updated)) if updated is not None else "?",
        human_size(run.size),
        waiting_for(run.header, run.signals, now),
    ]


def summary(run: RunInfo, now: float) -> dict[str, Any]:
    """``run`` as one object of ``ls --json``."""
    h = run.header or {}
    return {
        "run": run.name,
        "workflow": run.workflow,
        "run_id": run.run_id,
        "key": run.key,
        "status": run.status,
        "owner": h.get("owner"),
        "next_step": next_step(h) if run.problem is None else None,
        "iteration": h.get("iteration"),
        "committed": h.get("committed"),
        "updated_at": h.get("updated_at"),
        "age_seconds": round(now - h["updated_at"], 3) if "updated_at" in h else None,
        "size": run.size,
        "intent": h.get("intent"),
        "error": h.get("error"),
        "wait": h.get("wait"),
        "waiting_for": waiting_for(h, run.signals, now) or None,
        "problem": run.problem,
    }


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise ValueError(f"expected a count of at least 1, not {text!r}")
    return number


def _listed(args: argparse.Namespace, store: Store) -> tuple[list[RunInfo], bool]:
    """The runs ``ls`` shows, newest first, and whether more were left out.

    Through the index of runs where it covers the workflow: a live status
    reads only the live runs, a finished one the newest done entries, no
    status the live runs and then the recently finished. ``--all``, or a
    store the index does not cover, reads every run.
    """
    status = args.status.replace("-", "_") if args.status else None
    limit = None if args.all else (args.limit or LS_LIMIT)
    indexed = not args.all and covered(store, args.workflow)
    if not indexed:
        runs = find_runs(store, args.workflow)
        if not args.all and runs:
            echo(
                f"{PROG}: this store's index of runs is incomplete (runs written by an earlier "
                f"version), so every run was read; `{cmd()} reindex` builds it once",
                stream=sys.stderr,
            )
        runs.sort(key=lambda r: -float((r.header or {}).get("updated_at") or 0))
    elif status is None:
        runs = recent(store, args.workflow, None if limit is None else limit + 1)
    elif status in ("completed", "deleted"):
        runs = finished(store, args.workflow, status, None if limit is None else limit + 1)
    else:
        runs = live(store, args.workflow)
    if status is not None:
        runs = [r for r in runs if r.status == status]
    more = limit is not None and len(runs) > limit
    return runs[:limit] if limit is not None else runs, more


def _cmd_ls(args: argparse.Namespace, store: Store, style: Style) -> int:
    runs, more = _listed(args, store)
    if more:
        echo(
            f"{PROG}: the newest {len(runs)} shown; --limit N or --all for more",
            stream=sys.stderr,
        )
    now = time.time()
    if args.json:
        print(json.dumps([summary(r, now) for r in runs], indent=2))
        return EXIT_OK
    if not runs:
        echo(f"{PROG}: no matching runs in {args.store_url}", stream=sys.stderr)
        return EXIT_OK
    rows = [ls_row(r, now) for r in runs]

    def paint(row: int, column: int, text: str) -> str:
        return style.status(runs[row].status, text) if column == 2 else text

    headers = ["WORKFLOW", "RUN", "STATUS", "STEP", "ITER", "AGE", "SIZE", "WAITING FOR"]
    print("\n".join(table(headers, rows, style=style, color=paint, right=(4, 6))))
    return EXIT_OK


def register(command: Callable[..., Any]) -> None:
    """Add the ``ls`` subcommand through build_parser's ``command`` factory."""
    ls = command(
        "ls",
        _cmd_ls,
        "list runs: status, step reached, age, size",
        "List runs, one per line: workflow, run id, status, the next step to run (or "
        "'done'), iteration, time since the last checkpoint, size, and what a waiting run "
        f"waits for; the newest first: live runs, then recently finished ones, {LS_LIMIT} "
        "unless --limit or --all. Statuses: running (a live process owns it), queued "
        "(submitted, not started yet), stopped (nobody runs it: crashed, killed or "
        "released), waiting (a step waits for a time or a signal), failed, "
        "in-doubt (a non-idempotent step may have fired: its policy stopped the run, or the "
        "run crashed with the step's intent pending), completed, deleted (completed with "
        "on_complete='delete': only a tombstone is left); 'corrupt' for a checkpoint that "
        "cannot be read.",
    )
    ls.add_argument("--workflow", "-w", type=workflow_name, help="only runs of this workflow")
    ls.add_argument(
        "--status",
        "-s",
        type=lambda s: s.replace("_", "-"),
        choices=(*_LS_STATUSES, "corrupt"),
        help="only runs with this status",
    )
    ls.add_argument("--json", action="store_true", help="a JSON array, for machines")
    ls.add_argument(
        "--limit",
        "-n",
        type=arg(_positive),
        help=f"show at most N runs, the newest first (default {LS_LIMIT})",
    )
    ls.add_argument(
        "--all",
        action="store_true",
        help="every run, however many (this reads every run in the store)",
    )
