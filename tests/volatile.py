"""What users see, without what differs between any two runs: one helper for every test.

Tests compare what a durable run gives with what the plain run gives
(messages, events, results). Both carry values that differ on every run
(when a message was made, how long a request took, the ids of the run and
conversation): :func:`normalized` replaces them by placeholders and leaves
everything else as it is. They are found by *type and shape*, never by a
list of field names, so a release that adds another timestamp or duration
field (pydantic-ai 2.78 added ``request_timestamp`` and ``duration``) needs
no change here:

- a ``datetime``/``date``/``time`` value, or a string in ISO 8601 date-time
  form (what pydantic writes for one), becomes ``"<time>"``;
- a ``timedelta``, or a string in ISO 8601 duration form (``"PT0.0007S"``),
  becomes ``"<duration>"``;
- a number under a key that names a time (ending in ``timestamp``, ``_at``,
  ``_time``, ``duration``) becomes ``"<time>"``/``"<duration>"`` (a time
  kept as epoch seconds has no shape of its own);
- a UUID (``8-4-4-4-12`` hex, or 32 hex digits), alone or inside a string
  (``pyd_ai_<hex>``, a generated tool call id), becomes ``<id1>``, ``<id2>``...,
  numbered in order of first appearance. Numbering rather than erasing keeps
  what a test must still see: that two messages carry the same run id, or
  that a replayed response carries another run's.

A ``None`` stays ``None``: a field one side fills and the other leaves empty
is still a difference. Objects (dataclasses, pydantic models, pydantic-ai
messages and events) are compared as their JSON (``to_jsonable_python``).
"""

from __future__ import annotations

import re
from datetime import date, time, timedelta
from typing import Any

from pydantic_core import to_jsonable_python

__all__ = ["normalized"]

TIME, DURATION = "<time>", "<duration>"
_ISO_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?"
    r"|\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?"
)
_ISO_DURATION = re.compile(r"-?P(?=\d|T\d)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(\d+H)?(\d+M)?([\d.]+S)?)?")
_UUID = re.compile(
    r"(?<![0-9a-fA-F])([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
    r"[0-9a-fA-F]{12}|[0-9a-fA-F]{32})(?![0-9a-fA-F])"
)
_TIME_KEYS = ("timestamp", "_at", "_time")
_DURATION_KEYS = ("duration",)


def normalized(value: Any) -> Any:
    """``value`` as JSON-like data, its volatile values replaced (module docstring)."""
    ids: dict[str, str] = {}
    return _walk(value, None, ids)


def _walk(value: Any, key: str | None, ids: dict[str, str]) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, timedelta):
        return DURATION
    if isinstance(value, (date, time)):  # a datetime is a date
        return TIME
    if isinstance(value, dict):
        return {k: _walk(v, k if isinstance(k, str) else None, ids) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_walk(v, None, ids) for v in value]
    if isinstance(value, str):
        return _string(value, ids)
    if isinstance(value, (int, float)):
        if key is not None and key.lower().endswith(_DURATION_KEYS):
            return DURATION
        if key is not None and key.lower().endswith(_TIME_KEYS):
            return TIME
        return value
    if isinstance(value, bytes):
        return to_jsonable_python(value, bytes_mode="base64")
    # A dataclass, a pydantic model, a message: its JSON (what a user stores or is sent)
    return _walk(to_jsonable_python(value, bytes_mode="base64"), key, ids)


def _string(text: str, ids: dict[str, str]) -> str:
    if _ISO_TIME.fullmatch(text):
        return TIME
    if _ISO_DURATION.fullmatch(text):
        return DURATION

    def number(found: re.Match[str]) -> str:
        return ids.setdefault(found.group(0).lower(), f"<id{len(ids) + 1}>")

    return _UUID.sub(number, text)
