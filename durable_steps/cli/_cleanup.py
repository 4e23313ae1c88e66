"""``rm`` and ``prune``: deleting runs, and never anything that is not one.

A format-2 run is its head (the ``checkpoint`` object) and the parts it
lists, so deleting one takes several requests, and a crash can stop in
between. The head goes first, in one conditional delete, then everything
under the run's ``parts/``:

- Parts first would leave, after a crash, a head listing parts that are
  gone: a run that ``ls`` shows as stopped or completed but that no resume
  can read. Head first, the run is gone at one instant, whole.
- What a crash leaves instead is parts with no head. They are still found:
  ``rm WORKFLOW/RUN`` of a run whose head is gone deletes what is left under
  its ``parts/``, and ``prune`` deletes parts no head is left for once they
  are as old as ``--older-than`` and at least :data:`LEFTOVER_AGE` (a run
  being created writes its first part a moment before its head: a younger
  part may be that).
- The run's entries in the index of runs go last: until then they lead
  ``prune`` (which reads the index, not every run, where the index covers
  the store) to what an interrupted delete left.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .._drivers import drive_sync
from .._fleet import index as _index
from .._fleet.clearing import clear_leftovers, clear_objects
from .._record import checkpoint as ckpt
from ..errors import CheckpointConflict
from ..stores import ObjectInfo, Store
from ._base import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    PROG,
    RUN_HELP,
    CommandError,
    arg,
    cmd,
    run_ref,
    workflow_name,
)
from ._format import (
    Style,
    echo,
    human_age,
    human_size,
    parse_duration,
    run_size,
    status_label,
    table,
)
from ._indexed import aged, covered, locate
from ._runs import (
    RunInfo,
    effect_label,
    find_runs,
    open_effects,
    owner_text,
    peek_header,
    pinned,
    run_status,
)

__all__ = ["LEFTOVER_AGE", "register"]

LEFTOVER_AGE = 600.0
"""Seconds before ``prune`` takes parts with no head for an interrupted delete's leftovers."""


def _cmd_rm(args: argparse.Namespace, store: Store, style: Style) -> int:
    workflow, run_id = locate(store, args.run)
    name, key = f"{workflow}/{run_id}", ckpt.checkpoint_key(workflow, run_id)
    found = store.get(key)
    if found is None:
        pinned(args, name, None)  # the page's run is gone: its parts may be a new one's
        left = _delete_parts(store, workflow, run_id)
        _forget(store, workflow, run_id, None)
        if left:  # an rm or prune that stopped between the head and the parts
            echo(f"deleted {left} part(s) left of run {name}, whose checkpoint was already gone")
            return EXIT_OK
        raise CommandError(f"run {name} not found (no checkpoint at {key!r})", EXIT_NOT_FOUND)
    header = peek_header(found[0], workflow, run_id)
    if header is None and found[0] == b"" and args.force:
        # What is left of a checkpoint whose bytes are gone (a local link whose
        # file was removed by hand): nothing to protect, and no other way out.
        store.delete(key, match=found[1])
        echo(f"deleted {name} (an empty checkpoint object: its data was missing)")
        return EXIT_OK
    if header is None:
        raise CommandError(
            f"{key!r} is not a durable_steps checkpoint of run {name}; refusing to delete it "
            "(remove it with your storage's own tools if it is not needed)",
            EXIT_REFUSED,
        )
    pinned(args, name, header.get("run_nonce"))  # the delete below is conditional on it
    status = run_status(
        str(header.get("status")),
        header.get("owner"),
        header.get("intent"),
        since=header.get("updated_at"),
        journal=header.get("journal"),
        committed=header.get("committed"),
    )
    intent = header.get("intent")
    if not args.force and status == "running":
        who = owner_text(header["owner"], status, since=header.get("updated_at"))
        raise CommandError(
            f"run {name} is being run by {who}: wait for it "
            "(or stop that process); pass --force to delete it anyway",
            EXIT_REFUSED,
        )
    effects = open_effects(header.get("journal"))
    if not args.force and (isinstance(intent, dict) or effects):
        what = (
            f"step {intent.get('step')!r} in doubt (key {intent.get('key')})"
            if isinstance(intent, dict)
            else f"effect {effect_label(effects[0])} in doubt (key {effects[0].get('key')})"
        )
        raise CommandError(
            f"run {name} has {what}: deleting the run forgets the key, so a new run would "
            f"fire it again with a new one. Resolve it (`{cmd()} resolve {name} "
            "--fired|--not-fired`) or pass --force",
            EXIT_REFUSED,
        )
    store.delete(key, match=found[1])  # refused if the run changed since we looked
    _delete_parts(store, workflow, run_id)
    _forget(store, workflow, run_id, header)
    size = human_size(run_size(len(found[0]), header))
    if status == "deleted":
        echo(f"deleted the tombstone of {name} ({size}): the id is free for a new run")
    else:
        echo(f"deleted {name} ({status_label(status)}, {size})")
    return EXIT_OK


def _cmd_prune(args: argparse.Namespace, store: Store, style: Style) -> int:
    # A tombstone is what is left of a completed run (on_complete="delete").
    wanted = {s for s, on in (("completed", args.completed), ("failed", args.failed)) if on}
    if args.completed:
        wanted.add("deleted")
    if not wanted:
        raise CommandError("say what to prune: --completed and/or --failed", EXIT_USAGE)
    now = time.time()
    chosen, kept = _choose(store, args, wanted, now)
    if kept:
        echo(
            f"{PROG}: keeping {kept} run(s) with a step in doubt; see `{cmd()} ls`",
            stream=sys.stderr,
        )
    leftovers = _prune_leftovers(store, args, now)
    if not chosen:
        if not leftovers:
            echo(f"{PROG}: nothing to prune in {args.store_url}", stream=sys.stderr)
        elif not args.yes:
            print(style.dim("dry run: nothing was deleted; add --yes to delete them"))
        return EXIT_OK
    total = human_size(sum(r.size for r, _ in chosen))
    rows = [
        [r.workflow, r.run_id, status_label(r.status), human_age(a), human_size(r.size)]
        for r, a in chosen
    ]
    if not args.yes:
        print(f"would delete {len(chosen)} run{'s' * (len(chosen) != 1)} ({total}):")
        print("\n".join(table(["WORKFLOW", "RUN", "STATUS", "AGE", "SIZE"], rows, style=style)))
        print(style.dim("dry run: nothing was deleted; add --yes to delete them"))
        return EXIT_OK
    deleted = []
    for run, _ in chosen:
        try:
            store.delete(run.key, match=run.version)
        except CheckpointConflict:
            echo(f"{PROG}: kept {run.name}: it changed since it was listed", stream=sys.stderr)
            continue
        _delete_parts(store, run.workflow, run.run_id)
        _forget(store, run.workflow, run.run_id, run.header)
        deleted.append(run)
        echo(f"deleted {run.name} ({status_label(run.status)}, {human_size(run.size)})")
    size = human_size(sum(r.size for r in deleted))
    print(f"deleted {len(deleted)} run{'s' * (len(deleted) != 1)} ({size})")
    return EXIT_OK


def _forget(store: Store, workflow: str, run_id: str, raw: dict[str, Any] | None) -> None:
    """After a run's head and parts are deleted: its index entries, last (so an
    interrupted delete is still found through them, see the module docstring).
    """
    drive_sync(_index.removed(workflow, run_id, raw), store)


def _candidates(
    store: Store, args: argparse.Namespace, wanted: set[str], now: float
) -> list[RunInfo]:
    """The runs ``prune`` looks at: through the index where it covers the
    workflow (finished runs by their done entries' times, failed ones by their
    markers), else every run.
    """
    if not covered(store, args.workflow):
        return find_runs(store, args.workflow)
    before = now - args.older_than if wanted & {"completed", "deleted"} else None
    runs, _ = aged(store, args.workflow, finished_before=before, failed="failed" in wanted)
    return runs


def _choose(
    store: Store, args: argparse.Namespace, wanted: set[str], now: float
) -> tuple[list[tuple[RunInfo, float]], int]:
    """The runs to prune with their ages, and how many are kept for an intent."""
    kept, chosen = 0, []
    for run in _candidates(store, args, wanted, now):
        h = run.header
        if run.problem is not None or h is None or run.status not in wanted:
            continue
        age = now - float(h.get("updated_at", now))
        if age < args.older_than:
            continue
        if h.get("intent") or open_effects(h.get("journal")):  # it would forget the key
            kept += 1
        else:
            chosen.append((run, age))
    return chosen, kept


def _delete_parts(store: Store, workflow: str, run_id: str) -> int:
    """Delete everything under a deleted run's ``parts/`` (format 2: the parts
    its head listed, and any a crashed or fenced-off writer left behind); how many.
    Called once the head is deleted, never before (see the module docstring).
    """
    return drive_sync(clear_objects(workflow, run_id), store)


def _prune_leftovers(store: Store, args: argparse.Namespace, now: float) -> int:
    """List (dry run) or delete the parts interrupted deletes left; how many."""
    if covered(store, args.workflow):  # through the index (parts kept LEFTOVER_AGE all the same)
        return _prune_orphans(store, args, now - args.older_than)
    found = _leftovers(store, args.workflow, now - max(args.older_than, LEFTOVER_AGE))
    parts = [info for infos in found.values() for info in infos]
    if not parts:
        return 0
    what = f"{len(parts)} part(s) left of {len(found)} deleted run(s)"
    if not args.yes:
        print(f"would delete {what}: {', '.join(sorted(found))}")
        return len(parts)
    for info in parts:
        store.delete(info.key)
    print(f"deleted {what} ({human_size(sum(i.size for i in parts))})")
    return len(parts)


def _prune_orphans(store: Store, args: argparse.Namespace, before: float) -> int:
    """:func:`_prune_leftovers` through the index: the runs whose head is gone while
    their entries are left (a delete stopped after the head) — their parts,
    signals and entries; how many runs.
    """
    _, orphans = aged(store, args.workflow, finished_before=before, failed=False)
    gone = [o for o in orphans if o.gone]
    if not args.yes:
        if gone:
            names = ", ".join(sorted(f"{o.workflow}/{o.run_id}" for o in gone))
            print(f"would delete what is left of {len(gone)} deleted run(s): {names}")
        return len(gone)
    # Parts as old as LEFTOVER_AGE only: a run created under the id after our GET
    # writes its parts a moment before its head (then its entries wait too).
    parts_before = min(before, time.time() - LEFTOVER_AGE)
    cleared, young = [], []
    for orphan in orphans:  # the stale ones too: a done entry its head no longer calls for
        name = f"{orphan.workflow}/{orphan.run_id}"
        if orphan.gone:
            if not drive_sync(clear_leftovers(orphan.workflow, orphan.run_id, parts_before), store):
                young.append(name)
                continue
            cleared.append(name)
        for key in orphan.keys:
            store.delete(key)
    if cleared:
        print(
            f"deleted what was left of {len(cleared)} deleted run(s): {', '.join(sorted(cleared))}"
        )
    if young:
        echo(
            f"{PROG}: kept what is left of {len(young)} deleted run(s) for now: "
            f"{', '.join(sorted(young))} (parts younger than {LEFTOVER_AGE / 60:.0f} minutes "
            "may be a new run's, being created under the id); prune again later",
            stream=sys.stderr,
        )
    return len(gone)


def _leftovers(store: Store, workflow: str | None, before: float) -> dict[str, list[ObjectInfo]]:
    """Parts (and signals) of runs with no head, all last written before
    ``before``, by run name: what an interrupted ``rm``/``prune`` left (see the
    module docstring).
    """
    heads: set[str] = set()
    parts: defaultdict[str, list[ObjectInfo]] = defaultdict(list)
    for info in store.list(f"{workflow}/" if workflow else ""):
        path = info.key.split("/")
        if path[0].startswith("_"):  # _index/: no run's (no workflow name starts with _)
            continue
        if len(path) == 3 and path[2] == ckpt.CHECKPOINT_OBJECT:
            heads.add(f"{path[0]}/{path[1]}")
        elif len(path) == 4 and path[2] in ("parts", "signals", "history"):
            parts[f"{path[0]}/{path[1]}"].append(info)
    return {
        run: infos
        for run, infos in parts.items()
        if run not in heads and all(i.modified < before for i in infos)
    }


def register(command: Callable[..., Any]) -> None:
    """Add the ``rm`` and ``prune`` subcommands through build_parser's ``command`` factory."""
    rm = command(
        "rm",
        _cmd_rm,
        "delete one run's checkpoint",
        "Delete a run's checkpoint object and its parts (format 2), the checkpoint first. Refused "
        "without --force for a run a live process owns (status running) or with a step in "
        "doubt (the new run would fire it with a new idempotency key). A stopped run can be "
        "deleted. For a WORKFLOW/RUN whose checkpoint is gone, deletes the parts an "
        "interrupted rm or prune left.",
    )
    rm.add_argument("run", metavar="RUN", type=run_ref, help=RUN_HELP)
    rm.add_argument("--force", action="store_true", help="delete even a live-owned or in-doubt run")

    prune = command(
        "prune",
        _cmd_prune,
        "delete old completed (or failed) runs; dry run unless --yes",
        "Delete the checkpoints of completed (--completed: also the tombstones of runs "
        "whose state was deleted on completion) and/or failed (--failed) runs "
        "whose last checkpoint is older than --older-than. Lists them without deleting "
        "unless --yes. Runs with a pending intent and objects that are not durable_steps "
        "checkpoints are never deleted. Also deletes the parts an interrupted rm or prune "
        "left (no checkpoint is left for them) once they are --older-than old, and at "
        "least 10 minutes.",
    )
    prune.add_argument(
        "--completed", action="store_true", help="prune completed runs and tombstones"
    )
    prune.add_argument("--failed", action="store_true", help="prune failed runs")
    prune.add_argument(
        "--older-than",
        type=arg(parse_duration),
        required=True,
        metavar="AGE",
        help="only runs last written this long ago or more: 30m, 12h, 7d, 2w, 0s",
    )
    prune.add_argument("--workflow", "-w", type=workflow_name, help="only runs of this workflow")
    prune.add_argument("--yes", "-y", action="store_true", help="really delete them")
