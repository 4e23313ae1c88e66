"""``reindex``: build the index of runs for a store written before it existed.

Runs made by this version keep their entries in the index themselves (see
``durable_steps._index``). A store written by an earlier version has runs
without entries: until it is reindexed, workers, ``ls``, ``prune`` and the
web page find them only by listing every run, and say so. ``reindex`` lists
every run once, reads each head, writes the entry each calls for (a live
marker, or a finished run's done entry), and marks the workflow (without
``--workflow``: the whole store) as indexed. It is safe to run while runs
are running — entries are created, never overwritten — and to run again.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .. import _index
from .._drivers import drive_sync
from .._record import checkpoint as ckpt
from ..errors import CorruptCheckpoint
from ..stores import Store
from ._base import EXIT_OK, workflow_name
from ._format import Style, echo
from ._runs import _listing

__all__ = ["register"]


def _cmd_reindex(args: argparse.Namespace, store: Store, style: Style) -> int:
    keys, _ = _listing(store, args.workflow)
    existing = {info.key for info in store.list(_index.live_prefix(args.workflow))}
    # Without --workflow, the registered ones too: a workflow registered partial
    # whose runs are all gone has nothing to list, and must not stay partial.
    named = {args.workflow} if args.workflow else set(drive_sync(_index.workflows(), store))
    workflows = sorted({w for w, _, _ in keys} | named)
    for workflow in workflows:
        existing |= {info.key for info in store.list(_index.done_prefix(workflow))}
    counts: defaultdict[str, int] = defaultdict(int)
    for workflow, run_id, key in keys:
        found = store.get(key)
        if found is None:
            continue
        try:
            header, _ = ckpt.decode(found[0], where=f"run {workflow}/{run_id}: checkpoint {key!r}")
        except CorruptCheckpoint as exc:
            echo(f"skipped {workflow}/{run_id}: {exc}")
            counts["skipped"] += 1
            continue
        if (header.workflow, header.run_id) != (workflow, run_id):
            counts["skipped"] += 1
            continue
        entry = _index.entry_of(header)
        counts["live" if _index.marker_of(header) else "finished"] += 1
        if entry not in existing:
            drive_sync(_index.moved(None, header), store)
            counts["written"] += 1
    for workflow in workflows:
        drive_sync(_index.mark_indexed(workflow), store)
    if args.workflow is None:
        drive_sync(_index.mark_indexed(None), store)
    where = f"workflow {args.workflow}" if args.workflow else f"{len(workflows)} workflow(s)"
    skipped = f", {counts['skipped']} unreadable skipped" if counts["skipped"] else ""
    echo(
        f"indexed {where}: {counts['live']} live and {counts['finished']} finished run(s), "
        f"{counts['written']} entr{'y' if counts['written'] == 1 else 'ies'} written"
        f"{skipped}; scans now read only the live runs"
    )
    return EXIT_OK


def register(command: Callable[..., Any]) -> None:
    """Add the ``reindex`` subcommand through build_parser's ``command`` factory."""
    reindex = command(
        "reindex",
        _cmd_reindex,
        "build the index of runs of a store written by an earlier version",
        "List every run once, read each, and write the index entry it needs (live runs a "
        "marker, finished ones a done entry), then mark the workflow (without --workflow, "
        "the whole store) as indexed, so that workers, ls and prune read only the live "
        "runs. Runs made by this version index themselves; run this once on a store an "
        "earlier version wrote (a worker or ls says when). Safe while runs run, and to "
        "repeat.",
    )
    reindex.add_argument(
        "--workflow", "-w", type=workflow_name, help="only the runs of this workflow"
    )
