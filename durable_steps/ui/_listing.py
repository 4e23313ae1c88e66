"""The list of runs: live ones first, then the recently finished, through the index.

What the page's first screen shows, at the cost of what is live (DESIGN part
3): one LIST of the live markers and a GET of each live head, then the done
entries newest first, only as many as the page shows (``listing.done_runs``
stops at the limit: at 100,000 finished runs the page reads one LIST page of
them). Counts per status come from the live heads already read; the finished
runs are counted up to :data:`COUNT_UP_TO` (a LIST page), never all of them.

A store the index does not cover whole (runs written by an earlier version,
before ``durable-steps reindex``) is listed run by run, as ``ls`` does, and
the page says so.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._drivers import drive_sync
from .._fleet import index as _index
from .._record import checkpoint as ckpt
from ..cli._indexed import _read, _updated, covered, done, locate_indexed, run_key, through_markers
from ..cli._ls import ls_row
from ..cli._runs import RunInfo, find_runs
from ..errors import DefinitionError
from ..stores import Store
from ._signed import unsealed_claim

__all__ = ["COUNT_UP_TO", "LIVE", "STATUSES", "Listing", "Row", "list_runs"]

LIVE = ("running", "queued", "stopped", "waiting", "failed", "in_doubt")
"""The live statuses, in the order the page counts them."""
STATUSES = (*LIVE, "completed", "deleted", "corrupt")
COUNT_UP_TO = 1000
"""Finished runs are counted up to this many per workflow (one LIST page):
"1000+" beyond, so the count never costs what ever ran."""
PAGE = 100
"""How many runs the list shows."""


@dataclass(frozen=True)
class Row:
    """One run of the list, as text cells (what ``ls`` prints) and a few facts."""

    workflow: str
    run_id: str
    status: str
    step: str
    iteration: str
    age: str
    size: str
    waiting_for: str
    updated_at: float | None

    def as_json(self) -> dict[str, Any]:
        """The row for the page's script (``/api/runs``)."""
        return {
            "workflow": self.workflow,
            "run_id": self.run_id,
            "status": self.status,
            "step": self.step,
            "iteration": self.iteration,
            "age": self.age,
            "size": self.size,
            "waiting_for": self.waiting_for,
        }


@dataclass
class Listing:
    """What the list page shows."""

    rows: list[Row]
    more: bool
    """More runs matched than the page shows."""
    counts: dict[str, str] = field(default_factory=dict)
    """Runs per status (``"1000+"`` for finished ones past :data:`COUNT_UP_TO`)."""
    workflows: list[str] = field(default_factory=list)
    indexed: bool = True
    """False: the index does not cover the store, and every run was read."""
    problem: str | None = None
    """Why the search found nothing it could look for (a malformed id)."""

    def as_json(self) -> dict[str, Any]:
        """The listing for ``/api/runs``."""
        return {
            "rows": [r.as_json() for r in self.rows],
            "more": self.more,
            "counts": self.counts,
            "indexed": self.indexed,
            "problem": self.problem,
        }


def _vetted(runs: list[RunInfo]) -> list[RunInfo]:
    """``runs``, a head that says it is signed and carries no signature marked corrupt:
    no workflow wrote it (see ``_signed``), so its status is nobody's to show.
    """
    return [
        dataclasses.replace(r, status="corrupt", problem="says it is signed; carries no signature")
        if r.header is not None and unsealed_claim(r.header)
        else r
        for r in runs
    ]


def _row(run: RunInfo, now: float) -> Row:
    cells = ls_row(run, now)
    updated = (run.header or {}).get("updated_at")
    return Row(
        run.workflow,
        run.run_id,
        run.status,
        cells[3],
        cells[4],
        cells[5],
        cells[6],
        cells[7],
        float(updated) if isinstance(updated, (int, float)) else None,
    )


def _finished_counts(store: Store, workflow: str | None, over: list[RunInfo]) -> dict[str, str]:
    """Completed and deleted runs per status, up to :data:`COUNT_UP_TO` per workflow:
    their done entries, and ``over``, the finished runs a crash left with only a
    ``running`` marker (``through_markers``), each run counted once.
    """
    names = [workflow] if workflow else sorted(drive_sync(_index.workflows(), store))
    counts: Counter[str] = Counter()
    seen: set[tuple[str, str]] = set()
    capped = False
    for name in names:
        listed = itertools.islice(store.list(_index.done_prefix(name)), COUNT_UP_TO + 1)
        entries = [e for e in map(_index.parse, listed) if e is not None]
        capped |= len(entries) > COUNT_UP_TO
        counts.update(e.kind for e in entries[:COUNT_UP_TO])
        seen.update((e.workflow, e.run_id) for e in entries)
    counts.update(r.status for r in over if run_key(r) not in seen)
    plus = "+" if capped else ""
    return {k: f"{n}{plus}" for k, n in counts.items() if n}


def _search(store: Store, workflow: str | None, query: str) -> tuple[list[RunInfo], str | None]:
    """The runs a search names: ``WORKFLOW/RUN_ID``, or a run id (exact)."""
    wanted, sep, run_id = query.strip().partition("/")
    try:
        if sep:
            names = [ckpt.validate_name(wanted, "workflow name")]
            ckpt.validate_name(run_id, "run id")
        else:
            run_id = ckpt.validate_name(wanted, "run id")
            names = locate_indexed(store, run_id) or []
            if not names and not covered(store, None):
                names = [w for w, r in _all_ids(store) if r == run_id]
    except DefinitionError as exc:
        return [], exc.message
    names = [n for n in names if workflow is None or n == workflow]
    runs = []
    for name in names:
        key = ckpt.checkpoint_key(name, run_id)
        found = store.get(key)
        if found is not None:
            runs.append(RunInfo.parse(name, run_id, key, *found))
    return _vetted(runs), None


def _all_ids(store: Store) -> list[tuple[str, str]]:
    """Every run's ``(workflow, run_id)`` by one LIST: for a store the index does not cover."""
    out = []
    for info in store.list(""):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[2] == ckpt.CHECKPOINT_OBJECT:
            out.append((parts[0], parts[1]))
    return out


def list_runs(
    store: Store,
    *,
    workflow: str | None = None,
    status: str | None = None,
    query: str = "",
    limit: int = PAGE,
) -> Listing:
    """The runs the list page shows, newest first: live runs, then finished ones.

    ``status`` filters (a live status reads only the live runs; ``completed``
    or ``deleted`` only the newest done entries), ``query`` finds a run by
    id. See the module docstring for what each costs.
    """
    now = time.time()
    workflows = sorted(drive_sync(_index.workflows(), store))
    if not covered(store, workflow):
        return _unindexed(
            store, workflow=workflow, status=status, query=query, limit=limit, workflows=workflows
        )
    # Every live head (the counts, the first rows), and the finished runs a crash
    # left with only their `running` marker: ls's one reading of the markers.
    lives, over = (_vetted(runs) for runs in through_markers(store, workflow))
    counts = {k: str(v) for k, v in Counter(r.status for r in lives).items()}
    counts.update(_finished_counts(store, workflow, over))
    problem = None
    if query:
        runs, problem = _search(store, workflow, query)
        if status is not None:
            runs = [r for r in runs if r.status == status]
    elif status in ("completed", "deleted"):
        runs, capped = _finished(store, workflow, status, limit + 1, over)
        if capped:
            problem = (
                f"only the newest {COUNT_UP_TO} finished runs of each workflow were looked at "
                f"for {status} ones; durable-steps ls --status {status} reads them all"
            )
    elif status is not None:
        runs = [r for r in lives if r.status == status]
    else:
        runs = list(lives)
        if len(runs) <= limit:  # then the finished ones, newest first
            entries = done(store, workflow, limit + 1 - len(runs))
            runs += _newest(_heads(store, entries), over, limit + 1 - len(runs))
    rows = [_row(r, now) for r in runs[:limit]]
    return Listing(rows, len(runs) > limit, counts, workflows, problem=problem)


def _finished(
    store: Store, workflow: str | None, status: str, limit: int, over: Sequence[RunInfo] = ()
) -> tuple[list[RunInfo], bool]:
    """The newest finished runs with ``status``, at most ``limit``, looking at no more
    than :data:`COUNT_UP_TO` done entries a workflow (``cli._indexed.finished`` reads
    on until it has ``limit``: past 100,000 completed runs, a search for a few deleted
    ones would read every entry), and ``over`` (finished runs with no done entry yet).
    True: the cap stopped the search.
    """
    names = [workflow] if workflow else sorted(drive_sync(_index.workflows(), store))
    entries: list[_index.Entry] = []
    capped = False
    for name in names:
        taken = 0
        for seen, info in enumerate(store.list(_index.done_prefix(name))):
            if seen >= COUNT_UP_TO:
                capped = True
                break
            entry = _index.parse(info)
            if entry is not None and entry.kind == status:
                entries.append(entry)
                taken += 1
                if taken >= limit:
                    break
    entries.sort(key=lambda e: -(e.finished or 0.0))
    found = _read(store, [(e.workflow, e.run_id, frozenset()) for e in entries[:limit]])
    return _newest(_vetted(found), [r for r in over if r.status == status], limit), capped


def _unindexed(
    store: Store,
    *,
    workflow: str | None,
    status: str | None,
    query: str,
    limit: int,
    workflows: list[str],
) -> Listing:
    """:func:`list_runs` of a store the index does not cover: every run read, as ``ls`` does."""
    now = time.time()
    runs = _vetted(find_runs(store, workflow))
    runs.sort(key=lambda r: -float((r.header or {}).get("updated_at") or 0))
    counts = {k: str(v) for k, v in Counter(r.status for r in runs).items()}
    if query:
        runs = [r for r in runs if query.strip() in (r.run_id, r.name)]
    if status is not None:
        runs = [r for r in runs if r.status == status]
    rows = [_row(r, now) for r in runs[:limit]]
    names = sorted({*workflows, *(r.workflow for r in runs)})
    # An empty store (or one not made yet) is not an old one: nothing to reindex.
    return Listing(rows, len(runs) > limit, counts, names, indexed=not counts)


def _heads(store: Store, entries: list[_index.Entry]) -> list[RunInfo]:
    """The heads of finished runs' done entries (gone ones left out), read in parallel."""
    return _vetted(_read(store, [(e.workflow, e.run_id, frozenset()) for e in entries]))


def _newest(heads: list[RunInfo], over: Sequence[RunInfo], limit: int) -> list[RunInfo]:
    """``heads`` (read through done entries) and ``over`` (finished runs a crash left
    with only a ``running`` marker), each run once, the newest first, at most ``limit``.
    """
    runs = {run_key(r): r for r in heads}
    for run in over:
        runs.setdefault(run_key(run), run)
    return sorted(runs.values(), key=lambda r: -_updated(r))[:limit]
