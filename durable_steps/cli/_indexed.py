"""Reading runs through the index of runs: the live ones, the recent ones, a bare id.

What ``ls``, ``show RUN_ID``, ``prune`` and the web page look at, at the cost
of what is live (see ``durable_steps._fleet.index``): the live runs are one LIST
and a GET of each head; the finished ones are read newest first, as many as
asked. Nothing here writes: workers and ``reindex`` repair the index.

Where the index does not cover a workflow (runs written by an earlier
version, before ``durable-steps reindex``), :func:`covered` says so and the
commands list every run instead, as they always did.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .._drivers import drive_sync
from .._fleet import index as _index
from .._fleet import listing
from .._record import checkpoint as ckpt
from ..stores import Store
from ._base import EXIT_NOT_FOUND, EXIT_USAGE, CommandError, cmd
from ._runs import RunInfo, _run_keys, with_signals

__all__ = [
    "Orphan",
    "aged",
    "covered",
    "done",
    "finished",
    "finished_heads",
    "live",
    "locate",
    "locate_indexed",
    "recent",
    "through_markers",
]


def covered(store: Store, workflow: str | None) -> bool:
    """Whether the index lists every run of ``workflow`` (None: of the store)."""
    registered = drive_sync(_index.workflows(), store)
    if workflow is not None:
        return registered.get(workflow, False)
    return all(registered.values()) and drive_sync(_index.complete(), store)


def _read(store: Store, wanted: list[tuple[str, str, frozenset[str]]]) -> list[RunInfo]:
    """The heads of ``(workflow, run_id, signals)``, read in parallel, gone ones left out."""

    def fetch(item: tuple[str, str, frozenset[str]]) -> RunInfo | None:
        workflow, run_id, signals = item
        key = ckpt.checkpoint_key(workflow, run_id)
        found = store.get(key)
        if found is None:
            return None
        run = RunInfo.parse(workflow, run_id, key, *found)
        wait = (run.header or {}).get("wait") or {}
        name = wait.get("signal") if isinstance(wait, dict) else None
        if isinstance(name, str) and _index.signal_token(name) in signals:
            signals = signals | {name}  # a long name's nudge carries its token (see _index)
        return with_signals(store, run, frozenset(signals))

    if not wanted:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(wanted))) as pool:
        return [run for run in pool.map(fetch, wanted) if run is not None]


def live(store: Store, workflow: str | None, limit: int | None = None) -> list[RunInfo]:
    """The live runs the index lists, the most recently changed first (at most
    ``limit``), each head read (finished ones left out).
    """
    return through_markers(store, workflow, limit)[0]


def through_markers(
    store: Store, workflow: str | None, limit: int | None = None, *, only: str | None = None
) -> tuple[list[RunInfo], list[RunInfo]]:
    """The runs the live markers name (at most ``limit``; with ``only``, those with a
    marker of that class), each head read: the live ones, and the finished ones — a
    crash between a run's last head and its done entry leaves it with only its old
    ``running`` marker, and it must not vanish from ``ls`` and ``prune`` for that.
    """
    lives = [lv for lv in drive_sync(listing.live_runs(workflow), store) if lv.markers]
    if only is not None:
        lives = [lv for lv in lives if any(m.kind == only for m in lv.markers)]
    lives.sort(key=lambda lv: -lv.since)
    wanted = [(lv.workflow, lv.run_id, _signals(lv)) for lv in lives[:limit]]
    runs = _read(store, wanted)
    over = [r for r in runs if r.status in ("completed", "deleted")]
    return [r for r in runs if r.status not in ("completed", "deleted")], over


def _signals(live: listing.Live) -> frozenset[str]:
    """The signals sent to the run (its nudges), as ``waiting_for`` wants them."""
    nonces = {m.nonce for m in live.markers}
    return frozenset(n.signal for n in live.nudges if n.signal and n.nonce in nonces)


def done(store: Store, workflow: str | None, limit: int | None) -> list[_index.Entry]:
    """The finished runs of ``workflow`` (None: every registered one), newest first,
    as their done entries say (unchecked: :func:`finished_heads` checks them).
    """
    names = [workflow] if workflow else sorted(drive_sync(_index.workflows(), store))
    entries: list[_index.Entry] = []
    for name in names:
        entries += drive_sync(listing.done_runs(name, limit), store)
    entries.sort(key=lambda e: -(e.finished or 0.0))
    return entries if limit is None else entries[:limit]


def _entries(
    store: Store, workflow: str | None, status: str | None, limit: int | None
) -> list[_index.Entry]:
    """:func:`done`, only those of ``status`` (None: any), at most ``limit`` per workflow."""
    if status is None:
        return done(store, workflow, limit)
    names = [workflow] if workflow else sorted(drive_sync(_index.workflows(), store))
    entries: list[_index.Entry] = []
    for name in names:  # each workflow's entries come newest first: stop at the limit
        taken = 0
        for info in store.list(_index.done_prefix(name)):
            entry = _index.parse(info)
            if entry is not None and entry.kind == status:
                entries.append(entry)
                taken += 1
                if limit is not None and taken >= limit:
                    break
    entries.sort(key=lambda e: -(e.finished or 0.0))
    return entries


def finished_heads(
    store: Store,
    workflow: str | None,
    limit: int | None,
    *,
    status: str | None = None,
    extra: Sequence[RunInfo] = (),
) -> list[RunInfo]:
    """The newest finished runs (of ``status``), at most ``limit``, by their done
    entries — each checked against its head: a crash can leave an entry its head
    no longer calls for (a tombstone's old ``completed`` one, a deleted run's, a
    reused id's predecessor's). Such entries are skipped, each run shown once,
    and more entries are read until ``limit`` runs are found or none are left.
    ``extra``: finished runs found otherwise (through a stale marker), merged in.
    """
    ask = limit
    while True:
        entries = _entries(store, workflow, status, ask)
        heads = _read(store, [(e.workflow, e.run_id, frozenset()) for e in entries])
        found = {(r.workflow, r.run_id): r for r in heads}
        runs: dict[tuple[str, str], RunInfo] = {}
        for entry in entries:
            run = found.get((entry.workflow, entry.run_id))
            calls_for = None if run is None else _index.done_key_of(*run_key(run), run.header)
            if run is not None and calls_for == entry.key:
                runs.setdefault((run.workflow, run.run_id), run)
        for run in extra:
            if status is None or run.status == status:
                runs.setdefault((run.workflow, run.run_id), run)
        chosen = sorted(runs.values(), key=lambda r: -_updated(r))
        if limit is None or len(chosen) >= limit or ask is None or len(entries) < ask:
            return chosen if limit is None else chosen[:limit]
        ask *= 2  # stale entries took places: read further


def run_key(run: RunInfo) -> tuple[str, str]:
    """``(workflow, run_id)`` of ``run``."""
    return run.workflow, run.run_id


def _updated(run: RunInfo) -> float:
    when = (run.header or {}).get("updated_at")
    return float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else 0.0


@dataclass(frozen=True)
class Orphan:
    """Index entries that outlived what they said: those of a run whose head is
    gone (``gone``: what an interrupted ``rm`` or ``prune``, or a creation that
    gave up, left — its parts with them), or a done entry its head no longer
    calls for (a tombstone written, the old entry not yet deleted).
    """

    workflow: str
    run_id: str
    keys: tuple[str, ...]
    gone: bool = True


def aged(
    store: Store, workflow: str | None, *, finished_before: float | None, failed: bool
) -> tuple[list[RunInfo], list[Orphan]]:
    """What ``prune`` may take: the runs finished before ``finished_before`` (by their
    done entries) and, with ``failed``, the failed runs — each head read — and the
    entries whose head is gone.
    """
    wanted: list[tuple[str, str, tuple[str, ...]]] = []
    if finished_before is not None:
        wanted += [
            (e.workflow, e.run_id, (e.key,))
            for e in done(store, workflow, None)
            if (e.finished or 0.0) <= finished_before
        ]
    now, young = time.time(), set()
    for lv in drive_sync(listing.live_runs(workflow), store):
        keys = tuple(sorted(lv.keys))
        failing = failed and any(m.kind == "failed" for m in lv.markers)
        leftover = not lv.markers and finished_before is not None  # a gone run's nudges
        # A `running` marker may be all a crash left of a run that completed (its
        # done entry not yet written); entries none of which changed in GRACE may be
        # all an interrupted rm left (a waiting or in-doubt run's: no worker reads
        # those heads soon). Their heads are read: live runs, at most.
        maybe_done = any(m.kind == "running" for m in lv.markers)
        untouched = all(now - e.modified > _index.GRACE for e in lv.entries)
        if failing or leftover or (finished_before is not None and (maybe_done or untouched)):
            wanted.append((lv.workflow, lv.run_id, keys))
            if not untouched:  # no head may be a creation in progress: not an orphan
                young.add((lv.workflow, lv.run_id))
    found = {
        (r.workflow, r.run_id): r for r in _read(store, [(w, r, frozenset()) for w, r, _ in wanted])
    }
    runs = [found[w, r] for w, r, _ in wanted if (w, r) in found]
    orphans = [
        Orphan(w, r, keys) for w, r, keys in wanted if (w, r) not in found and (w, r) not in young
    ]
    for name, run_id, keys in wanted:
        run = found.get((name, run_id))
        calls_for = _index.done_key_of(name, run_id, run.header) if run is not None else None
        stale = tuple(k for k in keys if k.startswith(_index.ROOT + "done/") and k != calls_for)
        if run is not None and stale:
            orphans.append(Orphan(name, run_id, stale, gone=False))
    return list({r.name: r for r in runs}.values()), orphans


def finished(store: Store, workflow: str | None, status: str, limit: int | None) -> list[RunInfo]:
    """The newest finished runs with ``status`` (``completed``, ``deleted``), at most
    ``limit``: by their done entries, and the runs whose last head a crash left with
    only their ``running`` marker (each such head read: what is live, at most).
    """
    _, over = through_markers(store, workflow, only="running")
    return finished_heads(store, workflow, limit, status=status, extra=over)


def recent(store: Store, workflow: str | None, limit: int | None) -> list[RunInfo]:
    """The newest runs, live and finished: the live ones first, then the recently
    finished, at most ``limit`` in all (None: every one).
    """
    runs, over = through_markers(store, workflow, limit)
    if limit is not None and len(runs) >= limit:
        return runs[:limit]
    left = None if limit is None else limit - len(runs)
    shown = {run_key(r) for r in runs}
    finished = [
        r for r in finished_heads(store, workflow, left, extra=over) if run_key(r) not in shown
    ]
    return runs + finished


def locate_indexed(store: Store, run_id: str) -> list[str] | None:
    """The workflows with a run ``run_id``, through the index; None when the index
    cannot tell (a store it does not cover whole).
    """
    registered = drive_sync(_index.workflows(), store)
    if not (all(registered.values()) and drive_sync(_index.complete(), store)):
        return None
    found = {lv.workflow for lv in drive_sync(listing.live_runs(), store) if lv.run_id == run_id}
    others = [w for w in registered if w not in found]
    if others:
        with ThreadPoolExecutor(max_workers=min(16, len(others))) as pool:
            keys = [ckpt.checkpoint_key(w, run_id) for w in others]
            for workflow, got in zip(others, pool.map(store.get, keys), strict=True):
                if got is not None:
                    found.add(workflow)
    return sorted(found)


def locate(store: Store, ref: tuple[str | None, str]) -> tuple[str, str]:
    """The run a ``RUN`` argument names, as ``(workflow, run_id)``.

    ``WORKFLOW/RUN_ID`` names itself, unlooked-at. A bare ``RUN_ID`` must be
    the id of exactly one run in the store (through the index: a LIST of the
    live runs and a GET per registered workflow; else one LIST of everything):
    none exits 3, several exit 2 (usage: say which) naming them all.
    """
    workflow, run_id = ref
    if workflow is not None:
        return workflow, run_id
    workflows = locate_indexed(store, run_id)
    if workflows is None:  # a store the index does not cover: one LIST of everything
        workflows = sorted(w for w, r, _ in _run_keys(store, None) if r == run_id)
    if not workflows:
        raise CommandError(
            f"no run has the id {run_id!r}; list runs with `{cmd()} ls`", EXIT_NOT_FOUND
        )
    if len(workflows) > 1:
        names = ", ".join(f"{w}/{run_id}" for w in workflows)
        raise CommandError(
            f"run id {run_id!r} is ambiguous: {len(workflows)} runs have it ({names}); "
            "name one as WORKFLOW/RUN_ID",
            EXIT_USAGE,
        )
    return workflows[0], run_id
