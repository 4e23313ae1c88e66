"""Presentation for the ``durable-steps`` command line.

Human-friendly units (ages, sizes, durations), parsing of ``--older-than``
durations, aligned tables, colour that switches itself off in a pipe or when
``NO_COLOR`` is set, finding runs in a store, and the descriptions of runs
that ``ls`` and ``show`` print.
A ``running`` run no live process owns (``_lease.is_live``) is shown as
``stopped``. One that crashed in a process still alive looks owned to other
processes until its lease ends: only its own process knows that it is over.
"""

from __future__ import annotations

import json
import math
import os
import pprint
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from . import _checkpoint as ckpt
from ._lease import is_live, lease_end
from .errors import CorruptCheckpoint
from .stores import DEFAULT_STORE, STORE_ENV, Store

__all__ = [
    "EPILOG",
    "PROG",
    "RunInfo",
    "Style",
    "describe",
    "find_runs",
    "human_age",
    "human_duration",
    "human_size",
    "ls_row",
    "next_hint",
    "owner_text",
    "parse_duration",
    "peek_header",
    "run_status",
    "state_text",
    "status_label",
    "summary",
    "table",
    "timestamp",
    "use_color",
]

PROG = "durable-steps"
EPILOG = f"""\
statuses:
  running    a live process owns it now (`show` gives its host:pid and lease)
  stopped    nobody is running it: it crashed, was killed or released -- rerun
             the workflow or start a worker to resume it
  failed     a step raised and used up its retries
  in-doubt   a non-idempotent step may have fired before a crash: decide with `resolve`
  completed  finished; the checkpoint holds the final state
  corrupt    (ls only) the checkpoint cannot be read; `show` says why

find a stopped run and see why:
  {PROG} ls                                 every run: status, next step, age
  {PROG} ls --status failed                 runs stopped by a step's error
  {PROG} ls --status stopped                runs nobody is running (crashed, killed)
  {PROG} show support-agent/t-4411          the error, pending intent, recent steps
  {PROG} show support-agent/t-4411 --state  ... and the saved state
  then rerun the workflow (wf.run(run_id)): it resumes at the step shown

an in-doubt step, e.g. a payment that may have gone through before a crash:
  {PROG} ls --status in-doubt
  {PROG} show pay/order-17                  its idempotency key: look it up at the API
  {PROG} resolve pay/order-17 --fired       it happened: the rerun skips the step
  {PROG} resolve pay/order-17 --not-fired   it did not: the rerun fires it, same key

clean up:
  {PROG} rm pay/order-17                    one run (refuses live or in-doubt runs)
  {PROG} prune --completed --older-than 7d  list what would go; add --yes to delete

resume many runs, on as many machines as you like:
  {PROG} worker --app myagent:workflow      claim and finish unowned runs; SIGTERM stops

store: --store URL, else ${STORE_ENV}, else {DEFAULT_STORE}. A URL is a path,
  file:///path or s3://bucket/prefix (boto3's configuration: AWS_PROFILE,
  AWS_ENDPOINT_URL_S3 for MinIO, R2, Ceph, SeaweedFS, ...).

exit status:
  0 ok   1 error (store failed, unreadable checkpoint)   2 usage   3 run not found
  4 refused (a live process owns the run, the status does not allow it, nothing
    to resolve, not a checkpoint, or the run changed meanwhile)
colour only on a terminal, never when NO_COLOR is set."""
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*")


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``30m``, ``12h``, ``7d`` or ``2w``; ``ValueError`` otherwise."""
    match = _DURATION.fullmatch(text.lower())
    if match is None:
        raise ValueError(
            f"invalid duration {text!r}: use a number and a unit, e.g. 30m, 12h, 7d or 2w "
            "(units: s, m, h, d, w)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def human_age(seconds: float) -> str:
    """How long ago, e.g. ``just now``, ``42s ago``, ``3m ago``, ``2h ago``, ``5d ago``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return "just now"
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def human_size(size: int) -> str:
    """Bytes in a compact form: ``512 B``, ``2.1 KB``, ``3.4 MB``, ``1.0 GB`` (1 KB = 1024 B)."""
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1024
        if value < 1024 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """A step's duration: ``<1ms``, ``3ms``, ``1.25s``, ``2m 03s``, ``1h 02m``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 0.001:
        return "<1ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60):02d}m"


def timestamp(epoch: float, now: float | None = None) -> str:
    """Local time and age, e.g. ``2025-01-31 14:02:07 (3m ago)``."""
    now = time.time() if now is None else now
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    return f"{when} ({human_age(now - epoch)})"


def status_label(status: str) -> str:
    """The status as the command line spells it (``in_doubt`` → ``in-doubt``)."""
    return status.replace("_", "-")


def use_color(choice: str, stream: TextIO) -> bool:
    """Whether to colour ``stream``: ``always``, ``never``, or ``auto``.

    ``auto`` colours only a terminal, and never when ``NO_COLOR`` is set to a
    non-empty value (https://no-color.org) or ``TERM`` is ``dumb``.
    """
    if choice == "always":
        return True
    if choice == "never" or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


_ANSI_COLORS = ("black", "red", "green", "yellow", "blue", "magenta", "cyan", "white")
_CODES = {"bold": "1", "dim": "2"} | {name: str(30 + i) for i, name in enumerate(_ANSI_COLORS)}
_STATUS_COLORS = {
    "completed": "green",
    "failed": "red",
    "in_doubt": "yellow",
    "running": "cyan",
    "stopped": "magenta",
    "corrupt": "red",
}


class Style:
    """Applies ANSI colours, or nothing when colour is off."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def paint(self, text: str, color: str) -> str:
        """``text`` in ``color`` (a name of ``_CODES``) when colour is on."""
        if not self.enabled or not text:
            return text
        return f"\x1b[{_CODES[color]}m{text}\x1b[0m"

    def bold(self, text: str) -> str:
        """``text`` in bold."""
        return self.paint(text, "bold")

    def dim(self, text: str) -> str:
        """``text`` dimmed."""
        return self.paint(text, "dim")

    def status(self, status: str, text: str | None = None) -> str:
        """``text`` (default: the status's label) in the status's colour."""
        label = status_label(status) if text is None else text
        color = _STATUS_COLORS.get(status)
        return self.paint(label, color) if color else label


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    style: Style,
    color: Callable[[int, int, str], str] | None = None,
    right: Sequence[int] = (),
    indent: str = "",
) -> list[str]:
    """Lines of an aligned table with a bold header row.

    Widths are measured on the plain text; ``color(row, column, padded)``
    then decorates each padded cell, so escapes never break the alignment.
    Columns listed in ``right`` are right-aligned.
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    last = len(headers) - 1

    def line(cells: Sequence[str], row: int | None) -> str:
        parts = []
        for i, cell in enumerate(cells):
            padded = cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            if i == last and i not in right:
                padded = cell  # no trailing spaces
            if row is None:
                padded = style.bold(padded)
            elif color is not None:
                padded = color(row, i, padded)
            parts.append(padded)
        return indent + "  ".join(parts)

    return [line(headers, None)] + [line(row, r) for r, row in enumerate(rows)]


# --- runs ---------------------------------------------------------------------


def peek_header(data: bytes, workflow: str, run_id: str) -> dict[str, Any] | None:
    """The first-line header if ``data`` is a durable_steps checkpoint of this run.

    Only the header line is parsed (the payload may be damaged), and the run
    it names must be the one the key says: this is what ``rm`` and ``prune``
    require before deleting anything.
    """
    split = ckpt.split_header(data)
    record = split[0] if split else None
    if record is None or not isinstance(record.get("format"), int):
        return None
    if record.get("workflow") != workflow or record.get("run_id") != run_id:
        return None
    return record


@dataclass(frozen=True)
class RunInfo:
    """A run found in the store: its raw header (``None`` if unreadable)."""

    workflow: str
    run_id: str
    key: str
    size: int
    header: dict[str, Any] | None
    status: str  # the status shown (see run_status), or "corrupt"
    problem: str | None
    version: str  # as read: deletes are conditional on it

    @classmethod
    def parse(cls, workflow: str, run_id: str, key: str, data: bytes, version: str) -> RunInfo:
        """Describe the object ``data`` found at ``key``, readable or not."""
        raw = peek_header(data, workflow, run_id)
        status, problem = "corrupt", None
        try:
            header, _ = ckpt.decode(data, where=f"run {workflow}/{run_id}: checkpoint {key!r}")
            if raw is None:
                problem = f"{key!r} holds the checkpoint of another run ({header.run})"
            else:
                status = run_status(header.status, header.owner)
        except CorruptCheckpoint as exc:
            problem = exc.message
        return cls(workflow, run_id, key, len(data), raw, status, problem, version)

    @property
    def name(self) -> str:
        """``workflow/run_id``."""
        return f"{self.workflow}/{self.run_id}"


def find_runs(store: Store, workflow: str | None) -> list[RunInfo]:
    """Every run under ``workflow/`` (or the whole store): one LIST, one GET per run."""
    keys = []
    for info in store.list(f"{workflow}/" if workflow else ""):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[2] == ckpt.CHECKPOINT_OBJECT:
            keys.append((parts[0], parts[1], info.key))

    def fetch(item: tuple[str, str, str]) -> RunInfo | None:
        found = store.get(item[2])
        return None if found is None else RunInfo.parse(*item, *found)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(keys)))) as pool:
        return [run for run in pool.map(fetch, keys) if run is not None]


def run_status(status: str, owner: dict[str, Any] | None) -> str:
    """The status to show: a ``running`` run no live process owns is ``stopped``."""
    return "stopped" if status == "running" and not is_live(owner) else status


def owner_text(owner: dict[str, Any] | None, status: str) -> str:
    """Who runs a run: ``host:pid (lease ends in 42s)``, ``host:pid (gone)``, ``none``."""
    if not owner:
        return "none (stopped)" if status == "running" else "none"
    who = f"{owner.get('host')}:{owner.get('pid')}"
    left = lease_end(owner) - time.time()
    if is_live(owner):
        return f"{who} (lease ends in {left:.0f}s)"
    # Not live with its lease left: an owner on this host whose process is gone.
    return f"{who} (gone)" if left > 0 else f"{who} (lease ended {human_age(-left)})"


def _next_step(header: dict[str, Any]) -> str | None:
    """The name of the step an unfinished run resumes at (``None``: done or unknown)."""
    steps, index = header.get("steps") or [], header.get("next_step")
    if header.get("status") == "completed" or not isinstance(index, int):
        return None
    return str(steps[index]) if 0 <= index < len(steps) else None


def ls_row(run: RunInfo, now: float) -> list[str]:
    """The cells of ``run`` in ``ls``: workflow, run, status, step, iteration, age, size."""
    h = run.header or {}
    step, updated = _next_step(h), h.get("updated_at")
    if run.problem is not None:
        where = "?"
    elif run.status == "completed":
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
    ]


def state_text(state: Any, serializer: str) -> str:
    """A state for reading: indented JSON, or ``pprint`` for a pickled object."""
    if serializer.startswith("json"):
        return json.dumps(state, indent=2, ensure_ascii=False)
    return pprint.pformat(state, sort_dicts=False)


def next_hint(header: ckpt.Checkpoint) -> str:
    """What to do about a run, in one sentence (the ``next:`` line of ``show``)."""
    name = header.run
    step = header.steps[header.next_step] if header.next_step < len(header.steps) else "?"
    intent = header.intent or {}
    pending = bool(intent) and intent.get("resolution") is None
    doubt = f"{intent.get('step', step)!r} may have fired (key {intent.get('key')})"
    if header.status == "completed":
        return f"nothing left to do; a rerun returns the final state. Delete: {PROG} rm {name}"
    if header.status == "in_doubt":
        return (
            f"{doubt}: ask the service it calls whether that key went through, then "
            f"`{PROG} resolve {name} --fired` (it did: the rerun skips the step) or "
            "`--not-fired` (the rerun fires it again with the same key), and rerun the workflow"
        )
    if header.status == "failed":
        also = f"; {doubt}: if it did, `{PROG} resolve {name} --fired` first" if pending else ""
        return f"fix the cause, then rerun the workflow: it resumes at step {step!r}{also}"
    if is_live(header.owner):
        who = owner_text(header.owner, header.status)
        return f"it is being run by {who}: wait for it (`{PROG} show {name}` again to follow it)"
    resume = f"rerun the workflow or `{PROG} worker --app module:workflow`"
    if intent and not pending:
        return f"resolved as {intent['resolution']}; {resume} to continue"
    also = (
        f" ({doubt}: it re-fires with the same key; if it did fire, first "
        f"`{PROG} resolve {name} --fired`)"
        if pending
        else ""
    )
    return (
        f"nobody is running it (it crashed, was killed or released): {resume} to resume "
        f"at step {step!r}{also}; to discard it: {PROG} rm {name}{' --force' * bool(intent)}"
    )


def _fields(pairs: list[tuple[str, str]], style: Style) -> list[str]:
    width = max(len(label) for label, _ in pairs)
    return [f"  {style.dim(label.ljust(width))}  {value}" for label, value in pairs]


def describe(header: ckpt.Checkpoint, payload: bytes, size: int, style: Style) -> list[str]:
    now = time.time()
    n = len(header.steps)
    if header.status == "completed":
        where = f"finished in iteration {header.iteration}"
    else:
        step = header.steps[header.next_step] if header.next_step < n else "?"
        where = f"next step {step!r} ({header.next_step + 1} of {n}), iteration {header.iteration}"
    status = run_status(header.status, header.owner)
    lines = [f"{style.bold(header.run)}  {style.status(status)}"]
    lines += _fields(
        [
            ("position" if status in ("running", "completed") else "stopped at", where),
            ("owner", owner_text(header.owner, header.status)),
            ("committed", f"{header.committed} step commit{'s' * (header.committed != 1)}"),
            ("steps", " -> ".join(header.steps)),
            ("serializer", header.serializer),
            ("size", f"{human_size(size)} ({human_size(len(payload))} of state)"),
            ("created", timestamp(header.created_at, now)),
            ("updated", timestamp(header.updated_at, now)),
        ],
        style,
    )
    if header.intent:
        intent = header.intent
        resolution = intent.get("resolution") or "none yet"
        lines += ["", style.bold("pending intent")]
        lines += _fields(
            [
                ("step", f"{intent.get('step')} (iteration {intent.get('iteration')})"),
                ("idempotency key", str(intent.get("key"))),
                ("written", timestamp(float(intent.get("at", 0)), now)),
                ("resolution", resolution),
            ],
            style,
        )
    if header.error:
        err = header.error
        lines += ["", style.bold("last error")]
        lines += _fields(
            [
                ("step", f"{err.get('step')} (iteration {err.get('iteration')})"),
                ("error", style.paint(f"{err.get('type')}: {err.get('message')}", "red")),
                ("attempts", str(err.get("attempts"))),
                ("at", timestamp(float(err.get("at", 0)), now)),
            ],
            style,
        )
    if header.history:
        rows = [
            [
                str(s),
                str(i),
                str(a),
                human_duration(int(millis) / 1000) if a else "not run (resolved)",
                human_age(now - float(at)),
            ]
            for s, i, a, millis, at in header.history
        ]
        lines += ["", style.bold("recent steps (oldest first)")]
        headers = ["STEP", "ITER", "ATTEMPTS", "DURATION", "COMMITTED"]
        lines += table(headers, rows, style=style, right=(1, 2, 3), indent="  ")
    lines += ["", f"{style.bold('next:')} {next_hint(header)}"]
    return lines


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
        "next_step": _next_step(h) if run.problem is None else None,
        "iteration": h.get("iteration"),
        "committed": h.get("committed"),
        "updated_at": h.get("updated_at"),
        "age_seconds": round(now - h["updated_at"], 3) if "updated_at" in h else None,
        "size": run.size,
        "intent": h.get("intent"),
        "error": h.get("error"),
        "problem": run.problem,
    }
