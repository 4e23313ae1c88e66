"""Presentation: human units, ``--older-than`` durations, aligned tables, colour.

Colour switches itself off in a pipe or when ``NO_COLOR`` is set. Nothing
here knows about runs or stores.

Anything read from a store (names, error messages, host names, states) may
hold terminal escapes: it passes through :func:`clean` before it is styled
or printed -- :func:`table` cleans its cells, :func:`echo` whole lines.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

__all__ = [
    "Style",
    "clean",
    "echo",
    "human_age",
    "human_duration",
    "human_size",
    "json_text",
    "parse_duration",
    "run_size",
    "status_label",
    "table",
    "timestamp",
    "use_color",
]

# C0 (with tab, CR and LF), DEL and C1 control characters, and lone
# surrogates (a non-UTF-8 file name, or "\ud800" in a JSON header): a
# terminal obeys the first, and the second cannot even be encoded for it.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# What json.dumps(ensure_ascii=False) leaves raw: JSON requires escaping only
# below U+0020, and these are inside strings, so \uXXXX keeps the value exact.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\ud800-\udfff]")


def clean(text: str, *, newlines: bool = False) -> str:
    r"""``text`` safe to print: control characters and lone surrogates escaped.

    ``\x1b[2J`` shows as ``\\x1b[2J``, a carriage return as ``\\r``, U+009B
    as ``\\x9b``. Newlines are escaped too unless ``newlines`` (for text the
    command lays out on several lines itself, such as a pretty-printed state).
    """

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if newlines and char == "\n":
            return char
        code = ord(char)
        return _ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")

    return _UNSAFE.sub(escape, text)


def echo(text: str, *, stream: TextIO | None = None) -> None:
    """Print one uncoloured line, cleaned (to stdout, or ``stream``)."""
    print(clean(text), file=stream)


def json_text(value: Any) -> str:
    """``value`` as indented JSON, exact, with nothing a terminal would obey."""
    text = json.dumps(value, indent=2, ensure_ascii=False, default=repr)
    return _JSON_UNSAFE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


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


def run_size(head: int, header: dict[str, Any] | None) -> int:
    """The bytes a run occupies: its head (``head`` bytes) plus, for format 2,
    the parts the head lists (their sizes are in the head: no extra request).
    Unlisted parts (a crashed writer's garbage) are not counted.
    """
    parts = (header or {}).get("parts")
    if not isinstance(parts, list):
        return head
    sizes = (p.get("size") for p in parts if isinstance(p, dict))
    return head + sum(n for n in sizes if type(n) is int and n > 0)


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
    """Local time and age, e.g. ``2025-01-31 14:02:07 (3m ago)``; a time to come
    (a wait's timeout) says how far off it is: ``(in 23h)``.
    """
    now = time.time() if now is None else now
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    if epoch - now >= 1:
        return f"{when} (in {human_age(epoch - now).removesuffix(' ago')})"
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
    "deleted": "blue",
    "failed": "red",
    "in_doubt": "yellow",
    "running": "cyan",
    "stopped": "magenta",
    "queued": "white",
    "waiting": "blue",
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

    Cells are cleaned (they often come from the store) and widths measured
    on the plain text; ``color(row, column, padded)`` then decorates each
    padded cell, so escapes never break the alignment. Columns listed in
    ``right`` are right-aligned.
    """
    rows = [[clean(cell) for cell in row] for row in rows]
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
        return (indent + "  ".join(parts)).rstrip()  # an empty last cell leaves none

    return [line(headers, None)] + [line(row, r) for r, row in enumerate(rows)]
