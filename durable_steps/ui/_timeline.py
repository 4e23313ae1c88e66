"""A run's timeline: what it did, step by step and pass by pass, each with its time.

Built from what the run keeps: every commit it made (its *history*: step,
pass, attempts, start, duration, outcome), then what the step in progress
left in the head — its intent, its journaled calls and effects with their
keys, the wait it suspended in, the last failure. The header's own
``history`` holds only the last :data:`~durable_steps._record.checkpoint.HISTORY_LIMIT`
commits; where the run kept no more, the page says how many earlier commits
it cannot show.

Entries are listed oldest first and paginated (:data:`PAGE` a page), so a
run of 10,000 steps is as quick to show as one of ten.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .._record import checkpoint as ckpt
from ..cli._format import human_duration
from ..cli._runs import effect_label

__all__ = ["PAGE", "Entry", "Timeline", "build", "call_text"]

PAGE = 200
"""Timeline entries per page."""


@dataclass(frozen=True)
class Entry:
    """One thing the run did, for one row of the timeline."""

    at: float
    """When it started (epoch seconds), or for a commit of the header's history, when it
    was committed."""
    kind: str
    """``created``, ``step`` (a commit), ``resolved``, ``intent``, ``call``,
    ``effect``, ``wait``, ``failure``."""
    step: str = ""
    iteration: int | None = None
    attempts: int | None = None
    duration: float | None = None
    outcome: str = ""
    key: str = ""
    detail: str = ""
    exact: bool = True
    """False: ``at`` is only to the second (a commit the header's own history lists)."""
    rerun: str = ""
    """What the history records of this step's earlier runs in its pass (a failure,
    a person's resolution), in words; empty: it ran once (as far as is recorded)."""

    @property
    def duration_text(self) -> str:
        """The duration as ``show`` prints it (empty when there is none)."""
        return "" if self.duration is None else human_duration(self.duration)


@dataclass(frozen=True)
class Timeline:
    """One page of a run's timeline."""

    entries: list[Entry]
    page: int
    pages: int
    total: int
    missing: int
    """Commits the run made that it kept no record of (older than its history)."""
    source: str
    """Where the commits came from: ``header`` (the recent ones) or ``history`` (all)."""
    broken: tuple[str, str] | None = None
    """Why the history kept ends early, ``(reason, words)``: a chunk ``missing`` (not
    kept), ``tampered`` (its bytes do not match its digest) or ``foreign``
    (``ui._history``); None when it does not."""

    @property
    def damaged(self) -> bool:
        """A chunk of the history is there but is not what its name promises."""
        return self.broken is not None and self.broken[0] != "missing"

    def passes(self) -> list[tuple[int | None, list[Entry]]]:
        """The page's entries grouped by pass, in order (``None``: not of a pass)."""
        groups: list[tuple[int | None, list[Entry]]] = []
        for entry in self.entries:
            if groups and groups[-1][0] == entry.iteration:
                groups[-1][1].append(entry)
            else:
                groups.append((entry.iteration, [entry]))
        return groups


def _commits(header: ckpt.Checkpoint) -> list[Entry]:
    """The commits the header's bounded history lists."""
    out = []
    for item in header.history:
        step, iteration, attempts, millis, at = item[:5]
        seconds = int(millis) / 1000
        if attempts:
            outcome = "committed" if attempts == 1 else f"committed after {attempts} attempts"
            out.append(  # ``at``: the commit, in whole seconds (what the header keeps)
                Entry(
                    float(at),
                    "step",
                    str(step),
                    int(iteration),
                    int(attempts),
                    seconds,
                    outcome,
                    exact=False,
                )
            )
        else:  # a step resolved as fired: it counts as done without running
            out.append(
                Entry(
                    float(at),
                    "resolved",
                    str(step),
                    int(iteration),
                    0,
                    None,
                    "resolved as fired: counted as done, not run",
                    exact=False,
                )
            )
    return out


def _pending(header: ckpt.Checkpoint, calls: list[dict[str, Any]]) -> list[Entry]:
    """What the head says of the step in progress: intent, calls, effects, wait, failure."""
    out: list[Entry] = []
    intent = header.intent
    if intent:
        resolution = intent.get("resolution")
        out.append(
            Entry(
                float(intent.get("at") or header.updated_at),
                "intent",
                str(intent.get("step")),
                _int(intent.get("iteration")),
                None,
                None,
                f"resolved as {resolution}" if resolution else "may have fired (in doubt)",
                str(intent.get("key") or ""),
                f"policy {intent.get('policy') or 'not recorded'}",
            )
        )
    journal = header.journal
    if journal:
        step, iteration = str(journal["step"]), _int(journal["iteration"])
        for call in calls:
            ours = call_text(call)
            out.append(
                Entry(
                    header.updated_at,
                    "timeout" if ours else str(call["kind"]),
                    step,
                    iteration,
                    None,
                    None,
                    "recorded: the wait times out then"
                    if ours
                    else "recorded: replayed when the step runs again",
                    str(call.get("key") or ""),
                    ours[0] if ours else str(call["name"]),
                )
            )
        if not calls and journal.get("calls"):
            out.append(
                Entry(
                    header.updated_at,
                    "call",
                    step,
                    iteration,
                    None,
                    None,
                    f"{journal['calls']} result(s) recorded (not decoded here)",
                )
            )
        for effect in journal.get("open") or ():
            resolution = effect.get("resolution")
            out.append(
                Entry(
                    float(effect.get("at") or header.updated_at),
                    "effect",
                    step,
                    iteration,
                    None,
                    None,
                    f"resolved as {resolution}" if resolution else "in doubt: may have fired",
                    str(effect.get("key") or ""),
                    effect_label(effect),
                )
            )
    wait = header.wait
    if header.status == "waiting" and wait:
        what = f"signal {wait.get('signal')!r}" if wait.get("signal") else "a time"
        out.append(
            Entry(
                float(wait.get("since") or header.updated_at),
                "wait",
                str(wait.get("step")),
                _int(wait.get("iteration")),
                None,
                None,
                f"waiting for {what}",
            )
        )
    error = header.error
    if error:
        out.append(
            Entry(
                float(error.get("at") or header.updated_at),
                "failure",
                str(error.get("step")),
                _int(error.get("iteration")),
                _int(error.get("attempts")),
                None,
                "failed",
                "",
                f"{error.get('type')}: {error.get('message')}",
            )
        )
    return sorted(out, key=lambda e: e.at)


def call_text(call: dict[str, Any]) -> tuple[str, str] | None:
    """A journaled call the library made itself, in words: ``(what, result)``;
    None for the step's own calls. ``wait_for(timeout=)`` journals its deadline
    as a ``sleep`` named ``deadline:<signal>``, a time, not a call of the step's.
    """
    name, result = str(call.get("name")), call.get("result")
    if call.get("kind") == "sleep" and name.startswith("deadline:"):
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result))
            if isinstance(result, (int, float)) and not isinstance(result, bool)
            else repr(result)
        )
        return f"timeout of wait for {name.removeprefix('deadline:')!r} at {when}", when
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Kept(Protocol):
    """A run's kept history, read a page at a time (``ui._history.History``)."""

    @property
    def first(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def broken(self) -> tuple[str, str] | None: ...
    def entries(self, lo: int, hi: int) -> list[Entry]: ...


class _Listed:
    """The header's recent commits, as a :class:`Kept`."""

    first = 0
    broken = None

    def __init__(self, entries: list[Entry]) -> None:
        self._entries = entries
        self.total = len(entries)

    def entries(self, lo: int, hi: int) -> list[Entry]:
        return self._entries[lo:hi]


def build(
    header: ckpt.Checkpoint,
    calls: list[dict[str, Any]],
    page: int = 1,
    kept: Kept | None = None,
) -> Timeline:
    """Page ``page`` (from 1) of the run's timeline: its creation, its commits
    (``kept``: the run's whole history, when it keeps one; else the header's
    recent commits), then what the step in progress left in the head.
    """
    source = "history" if kept is not None else "header"
    if kept is None:
        kept = _Listed(_commits(header))
        missing = max(0, header.committed - len(header.history))
    else:
        missing = max(kept.first, header.committed - kept.total)
    total = kept.total
    pending = _pending(header, calls)
    error = header.error
    if error and total:  # the history holds the failure too: show the head's (its message)
        last = kept.entries(total - 1, total)
        where = (error.get("step"), error.get("iteration"))
        if last and last[0].kind == "failure" and (last[0].step, last[0].iteration) == where:
            total -= 1  # ...and what the history says of its step's earlier runs
            pending = [
                replace(e, rerun=last[0].rerun) if e.kind == "failure" else e for e in pending
            ]
    count = 1 + total + len(pending)
    pages = max(1, -(-count // PAGE))
    page = min(max(1, page), pages)
    lo, hi = (page - 1) * PAGE, page * PAGE
    shown = [Entry(header.created_at, "created", outcome="run created")] if lo == 0 else []
    shown += kept.entries(max(0, lo - 1), min(total, hi - 1))
    shown += pending[max(0, lo - 1 - total) : max(0, hi - 1 - total)]
    return Timeline(shown, page, pages, count, missing, source, kept.broken)
