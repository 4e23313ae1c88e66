"""``reindex``: build the index of runs for a store written before it existed.

Runs made by this version keep their entries in the index themselves (see
``durable_steps._fleet.index``). A store written by an earlier version has runs
without entries: until it is reindexed, workers, ``ls``, ``prune`` and the
web page find them only by listing every run, and say so. ``reindex`` lists
every run once, reads each head, writes the entry each calls for (a live
marker, or a finished run's done entry), and marks the workflow (without
``--workflow``: the whole store) as indexed. It is safe to run while runs
are running — entries are created, never overwritten — and to run again.

It also moves a store out of the earlier layout of the index (a folder per
run under ``_index/live/``, see ``durable_steps._fleet.index``): a workflow that
layout indexed whole has only its live runs read and their entries moved
(what is live, not what ever ran); any other has every run read as above.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .._drivers import drive_sync
from .._fleet import index as _index
from .._record import checkpoint as ckpt
from ..errors import CorruptCheckpoint
from ..stores import Store
from ._base import EXIT_OK, workflow_name
from ._format import Style, echo
from ._runs import _listing

__all__ = ["register"]


def _cmd_reindex(args: argparse.Namespace, store: Store, style: Style) -> int:
    states = drive_sync(_index.registry(), store)
    # Without --workflow, the registered ones too: a workflow registered partial
    # whose runs are all gone has nothing to list, and must not stay partial.
    named = {args.workflow} if args.workflow else set(states)
    moving = {w for w in named if states.get(w) == {"indexed"}}
    counts: defaultdict[str, int] = defaultdict(int)
    for workflow in sorted(moving):
        _move(store, workflow, counts)
    keys: list[tuple[str, str, str]] = []
    signals: dict[tuple[str, str], set[str]] = {}
    if not _registered_whole(store, args.workflow, states, moving):
        keys, signals = _listing(store, args.workflow)
        keys = [k for k in keys if k[0] not in moving]
    workflows = sorted({w for w, _, _ in keys} | named)
    existing: set[str] = set()
    for workflow in sorted(set(workflows) - moving):
        existing |= {info.key for info in store.list(_index.live_prefix(workflow))}
        existing |= {info.key for info in store.list(_index.done_prefix(workflow))}
    for workflow, run_id, key in keys:
        header = _head(store, workflow, run_id, key, counts)
        if header is None:
            continue
        counts["live" if _index.marker_of(header) else "finished"] += 1
        if _index.entry_of(header) not in existing:
            drive_sync(_index.moved(None, header), store)
            counts["written"] += 1
        sent = (header.wait or {}).get("signal") if header.status == "waiting" else None
        if sent in signals.get((workflow, run_id), ()):  # sent before there were nudges
            nudge = _index.nudged(workflow, run_id, header.run_nonce, str(sent))
            drive_sync(nudge, store)
    for workflow in sorted(set(workflows) - moving):  # what the earlier layout left
        for info in store.list(_index.old_live_prefix(workflow)):
            store.delete(info.key)
    for workflow in workflows:
        drive_sync(_index.mark_indexed(workflow), store)
    if args.workflow is None:
        drive_sync(_index.mark_indexed(None), store)
    where = f"workflow {args.workflow}" if args.workflow else f"{len(workflows)} workflow(s)"
    skipped = f", {counts['skipped']} unreadable skipped" if counts["skipped"] else ""
    moved = f", {counts['moved']} moved from the earlier layout" if counts["moved"] else ""
    echo(
        f"indexed {where}: {counts['live']} live and {counts['finished']} finished run(s), "
        f"{counts['written']} entr{'y' if counts['written'] == 1 else 'ies'} written"
        f"{moved}{skipped}; scans now read only the live runs"
    )
    return EXIT_OK


def _registered_whole(
    store: Store, workflow: str | None, states: dict[str, set[str]], moving: set[str]
) -> bool:
    """Whether no run needs a listing: every workflow to index is complete in the
    earlier layout (moved by :func:`_move`), and, for the whole store, the registry
    names them all. One this layout registered is listed whole, as ever: runs a
    process of an earlier release wrote there (a rolling deploy) have no entries here.
    """
    if workflow is not None:
        return workflow in moving
    named_all = any(store.list(_index.COMPLETE)) or any(store.list(_index.OLD_COMPLETE))
    return named_all and set(states) <= moving


def _move(store: Store, workflow: str, counts: defaultdict[str, int]) -> None:
    """A workflow complete in the earlier layout (a folder per run under
    ``_index/live/``): its live entries moved to this one. Only the runs with an
    entry there are read — what was live, not what ever ran: finished runs' done
    entries are the same in both layouts, and runs this version made have their
    entries here already. The run's nudges (of its nonce) move with it.
    """
    runs: defaultdict[str, list[_index.Entry]] = defaultdict(list)
    for info in store.list(_index.old_live_prefix(workflow)):
        entry = _index.parse(info)
        if entry is not None:
            runs[entry.run_id].append(entry)
    for run_id, entries in sorted(runs.items()):
        key = ckpt.checkpoint_key(workflow, run_id)
        header = _head(store, workflow, run_id, key, counts)
        if header is not None:
            counts["live" if _index.marker_of(header) else "finished"] += 1
            drive_sync(_index.moved(None, header), store)
            counts["written"] += 1
            nonce = header.run_nonce[: _index.NONCE_CHARS]
            for nudge in entries:
                if _index.marker_of(header) and nudge.kind == "signal" and nudge.nonce == nonce:
                    signal = str(nudge.signal)
                    drive_sync(_index.nudged(workflow, run_id, header.run_nonce, signal), store)
        for entry in entries:
            store.delete(entry.key)
        counts["moved"] += 1


def _head(
    store: Store, workflow: str, run_id: str, key: str, counts: defaultdict[str, int]
) -> ckpt.Checkpoint | None:
    """The run's head, or None: gone, corrupt (said, and counted skipped), or another's."""
    found = store.get(key)
    if found is None:
        return None
    try:
        header, _ = ckpt.decode(found[0], where=f"run {workflow}/{run_id}: checkpoint {key!r}")
    except CorruptCheckpoint as exc:
        echo(f"skipped {workflow}/{run_id}: {exc}")
        counts["skipped"] += 1
        return None
    if (header.workflow, header.run_id) != (workflow, run_id):
        counts["skipped"] += 1
        return None
    return header


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
