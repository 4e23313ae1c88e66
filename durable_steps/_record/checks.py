"""What a checkpoint header's fields may hold: the checks behind ``_checkpoint.decode``.

Every check returns why a value cannot be trusted (a short phrase for the
``CorruptCheckpoint`` message), or ``None``. The CRC covers the payload only,
so each header field is checked here: a hand-edited or damaged header must
stop as ``CorruptCheckpoint``, not as a ``TypeError`` halfway through a run.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable
from typing import Any, TypeGuard

__all__ = ["field_problem", "format_problem", "is_int", "parts_problem", "show"]

STATUSES = ("running", "waiting", "failed", "in_doubt", "completed", "deleted")
_PART_NAME = re.compile(r"[0-9]{1,20}-[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX12 = re.compile(r"[0-9a-f]{12}")


def format_problem(version: object) -> str | None:
    """Why ``format`` is not a format this version reads (a newer one aside)."""
    if not is_int(version):
        return f"format is {show(version)}, not a format number"
    if version < 1:
        return f"format {version} is not a valid checkpoint format"
    return None


def parts_problem(parts: object) -> str | None:
    """Why a format-2 head's ``parts`` is not a list of at most 3 part records."""
    if not isinstance(parts, list) or len(parts) > 3:
        return "parts is not a list of at most 3 parts"
    for i, part in enumerate(parts):
        if not (
            isinstance(part, dict)
            and part.keys() == {"name", "kind", "size", "sha256"}
            and isinstance(part["name"], str)
            and _PART_NAME.fullmatch(part["name"])
            and part["kind"] in (("base", "changes") if i == 0 else ("changes",))
            and _is_count(part["size"])
            and isinstance(part["sha256"], str)
            and _HEX64.fullmatch(part["sha256"])
        ):
            return f"part {show(part)} is not a part record"
    return None


def field_problem(h: dict[str, Any]) -> str | None:  # noqa: PLR0911 - a return per check
    """Why a decoded header (its fields, as a dict) cannot be trusted, or None.

    The CRC covers the payload only, so every header field is checked here:
    a hand-edited or damaged header must stop as CorruptCheckpoint, not as a
    TypeError halfway through a run (possibly after a step fired).
    """
    for name in ("workflow", "run_id", "run_nonce", "serializer"):
        if not isinstance(h[name], str):
            return f"{name} is not a string"
    status, steps, version, code = h["status"], h["steps"], h["version"], h["code"]
    if not isinstance(status, str) or status not in STATUSES:
        return f"unknown status {show(status)}"
    if not steps or not all(isinstance(s, str) for s in steps):
        return "steps is not a list of names"
    for name in ("iteration", "next_step", "committed"):
        value = h[name]
        if not _is_count(value):
            return f"{name} is {show(value)}, not a count"
    if version is not None and not (isinstance(version, str) and len(version) <= 200):
        return f"version is {show(version)}, not a version string"
    if code is not None and not (
        isinstance(code, dict)
        and all(isinstance(v, str) and _HEX12.fullmatch(v) for v in code.values())
    ):
        return "code is not a map of step fingerprints"
    ended = status in ("completed", "deleted")
    next_step = h["next_step"]
    if next_step > len(steps) or (next_step == len(steps) and not ended):
        return f"next_step {next_step} is past the {len(steps)} steps"
    for name in ("created_at", "updated_at"):
        value = h[name]
        if not _is_time(value):
            return f"{name} is {show(value)}, not a time"
    if status == "waiting" and h["wait"] is None:
        return "status waiting without a wait"
    return _record_problem(h) or _journal_problem(h["journal"], h["format"])


def _journal_problem(journal: object, version: int) -> str | None:  # noqa: PLR0911 - per check
    """Why a ``journal`` field is not a journal record (see the module docstring)."""
    if journal is None:
        return None
    if not isinstance(journal, dict):
        return "journal is not an object"
    if not (isinstance(journal.get("step"), str) and _is_count(journal.get("iteration"))):
        return "journal has no step and iteration"
    if not _is_count(journal.get("calls")):
        return f"journal.calls is {show(journal.get('calls'))}"
    was = journal.get("was", [])
    if not (isinstance(was, list) and all(isinstance(name, str) for name in was)):
        return f"journal.was is {show(was)}, not a list of step names"
    opened = journal.get("open")
    if not isinstance(opened, list):
        return "journal.open is not a list"
    for entry in opened:
        if not isinstance(entry, dict) or _shape_problem("open", entry, _EFFECT_INTENT):
            return f"journal.open entry {show(entry)} is not an effect intent"
    inline = journal.get("inline")
    if version == 1 and not (
        isinstance(inline, list)
        and all(
            isinstance(e, list)
            and len(e) == 4
            and isinstance(e[0], str)
            and e[1] in ("call", "effect", "sleep", "signal", "timeout")
            and (e[2] is None or _is_key(e[2]))
            and isinstance(e[3], str)
            for e in inline
        )
    ):
        return "journal.inline is not a list of [name, kind, key, data]"
    return None


def _record_problem(h: dict[str, Any]) -> str | None:
    """The nested fields' part of :func:`_field_problem`."""
    for entry in h["history"]:
        if len(entry) != 5 or not isinstance(entry[0], str) or not all(map(is_int, entry[1:])):
            return f"history entry {show(list(entry))} is not [step, iteration, attempts, ms, at]"
    for name, shape in _SHAPES.items():
        value = h[name]
        if value is None:
            continue
        if not isinstance(value, dict):
            return f"{name} is not an object"
        problem = _shape_problem(name, value, shape)
        if problem:
            return problem
    return None


def _shape_problem(name: str, value: dict[str, Any], shape: _Shape) -> str | None:
    """Which key of ``value`` (the field ``name``) does not fit ``shape``."""
    for key, (check, required) in shape.items():
        if key not in value:
            if required:
                return f"{name}.{key} is missing"
        elif not check(value[key]):
            return f"{name}.{key} is {show(value[key])}"
    return None


_PID_MAX = 2**22
"""Linux's ceiling for pid_max: a larger pid is no process (and overflows os.kill)."""


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return is_int(value) and value >= 0


def _is_number(value: object) -> TypeGuard[float]:
    """A finite int or float (not bool): a huge int would overflow math."""
    if isinstance(value, float):
        return math.isfinite(value)
    return is_int(value) and abs(value) < 2**63


def _is_time(value: object) -> bool:
    """Seconds since the epoch (or since boot): not negative, before the year 10000
    (what a date can show: a time beyond it broke every reader that prints it).
    """
    return _is_number(value) and 0 <= value < _YEAR_10000


_YEAR_10000 = 253_402_300_800


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_title(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 200


def _is_pid(value: object) -> bool:
    return is_int(value) and 0 < value < _PID_MAX


def _is_key(value: object) -> bool:
    """An idempotency key as handed to APIs: 1-64 printable ASCII characters."""
    return (
        isinstance(value, str) and 0 < len(value) <= 64 and value.isascii() and value.isprintable()
    )


def _is_lease(value: object) -> bool:
    return _is_number(value) and value > 0


def _one_of(*allowed: str) -> Callable[[object], bool]:
    return lambda value: isinstance(value, str) and value in allowed


def _or_null(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _is_names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_base64(value: object) -> bool:
    return isinstance(value, str) and _BASE64.fullmatch(value) is not None


def _is_chunk(value: object) -> bool:
    return isinstance(value, str) and _CHUNK.fullmatch(value) is not None


_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
_CHUNK = re.compile(r"[0-9]{8,20}-[0-9a-f]{32}")
_REQUIRED_KEY, _OPTIONAL_KEY = True, False
_Shape = dict[str, tuple[Callable[[object], bool], bool]]
_RESOLUTION = _one_of("fired", "not_fired")
_POLICY = _one_of("refire", "raise", "reconcile")
_EFFECT_INTENT: _Shape = {
    "name": (_is_str, _REQUIRED_KEY),
    "key": (_is_key, _REQUIRED_KEY),
    "at": (_is_time, _REQUIRED_KEY),
    "resolution": (_or_null(_RESOLUTION), _OPTIONAL_KEY),
    "policy": (_or_null(_POLICY), _OPTIONAL_KEY),
    "title": (_is_title, _OPTIONAL_KEY),
}
"""An entry of ``journal["open"]``: an effect's intent (see ``_execution.journal``)."""
_SHAPES: dict[str, _Shape] = {
    "intent": {
        "step": (_is_str, _REQUIRED_KEY),
        "index": (_is_count, _REQUIRED_KEY),
        "iteration": (_is_count, _REQUIRED_KEY),
        "key": (_is_key, _REQUIRED_KEY),
        "at": (_is_time, _REQUIRED_KEY),
        "resolution": (_RESOLUTION, _OPTIONAL_KEY),
        "policy": (_POLICY, _OPTIONAL_KEY),
    },
    "wait": {
        "step": (_is_str, _REQUIRED_KEY),
        "iteration": (_is_count, _REQUIRED_KEY),
        "until": (_or_null(_is_time), _REQUIRED_KEY),
        "signal": (_or_null(_is_str), _REQUIRED_KEY),
        "since": (_is_time, _REQUIRED_KEY),
        "accepts": (_is_str, _OPTIONAL_KEY),  # "approval" (see _fleet.approval); absent: anything
    },
    "error": {
        "step": (_is_str, _REQUIRED_KEY),
        "iteration": (_is_count, _REQUIRED_KEY),
        "type": (_is_str, _REQUIRED_KEY),
        "message": (_is_str, _REQUIRED_KEY),
        "attempts": (_is_count, _REQUIRED_KEY),
        "at": (_is_time, _REQUIRED_KEY),
    },
    "log": {  # see _record.history
        "names": (_is_names, _REQUIRED_KEY),
        "recent": (_is_base64, _REQUIRED_KEY),
        "n": (_is_count, _REQUIRED_KEY),
        "last": (_is_chunk, _OPTIONAL_KEY),
    },
    "owner": {
        "host": (_is_str, _REQUIRED_KEY),
        "pid": (_is_pid, _REQUIRED_KEY),
        "started": (_or_null(_is_time), _OPTIONAL_KEY),  # None where /proc is not readable
        "token": (_is_str, _REQUIRED_KEY),
        "until": (_is_time, _REQUIRED_KEY),
        "lease": (_is_lease, _OPTIONAL_KEY),
        "skew": (_or_null(_is_number), _OPTIONAL_KEY),
        "boot": (_is_str, _OPTIONAL_KEY),
        "pidns": (is_int, _OPTIONAL_KEY),
    },
}
"""What ``intent``, ``wait``, ``error``, ``log`` and ``owner`` hold when they are not null: per
key, its check and whether the writer always writes it. Other keys are kept
unchecked (a newer writer's optional extras)."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def show(value: object) -> str:
    """A repr short enough for a message, whatever a damaged header holds."""
    return _REPR.repr(value)
