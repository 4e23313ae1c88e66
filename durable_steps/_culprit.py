"""Finding the value that cannot be encoded, so an error can name its path.

A serializer that refuses a state knows only that it failed; these walk the
state and return the path of the innermost value at fault and why
(``state['messages'][3]['at']: datetime is not a JSON type``).
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MAX_DEPTH", "TOO_DEEP", "json_problem", "locate", "pickle_problem", "short"]

MAX_DEPTH = 500
"""How deep containers may nest in a JSON state. JSON decoders recurse (the
standard library's gives up near 1,000 levels, less when called deep in a
stack), so a deeper state could be written and then never read back."""


def json_problem(value: Any) -> str | None:  # noqa: PLR0911 - a return per JSON type
    """Why ``value`` itself (not its children) cannot be stored as JSON, or None."""
    kind = type(value)
    if kind is str:
        try:
            value.encode()
        except UnicodeEncodeError as exc:  # e.g. a lone surrogate from surrogateescape
            return f"the text cannot be encoded as UTF-8 ({exc.reason} at {exc.start})"
        return None
    if kind is int:
        try:
            str(value)
        except ValueError as exc:  # longer than sys.get_int_max_str_digits()
            return f"the int is too long to write ({exc}); store it as a str"
        return None
    if kind is bool or value is None:
        return None
    if kind is float:
        return None if math.isfinite(value) else f"{value} is not standard JSON; use None or a str"
    if kind is dict:
        for key in value:
            if type(key) is not str:
                return (
                    f"its key {_show(key)} ({type(key).__name__}) would come back as the "
                    f"str {json.dumps(_json_key(key))}; use str keys"
                )
        return None
    if kind is list:
        return None
    if isinstance(value, (tuple, list, set, frozenset)):
        return f"{kind.__name__} would come back as a list; use a list"
    if isinstance(value, (dict, str, int, float)):
        plain = next(t for t in (dict, str, int, float) if isinstance(value, t))
        return f"{kind.__name__} would come back as a plain {plain.__name__}; convert it"
    return f"{kind.__name__} is not a JSON type"


def _json_key(key: Any) -> str:
    """The str JSON turns a non-str key into (what a resumed run would see)."""
    try:
        return str(next(iter(json.loads(json.dumps({key: 0})))))
    except (TypeError, ValueError):
        return repr(key)


def pickle_problem(value: Any) -> str | None:
    """Why ``value`` cannot be pickled, judged by pickling it whole."""
    try:
        import cloudpickle

        cloudpickle.dumps(value)
    except Exception as exc:
        return f"{type(value).__name__} ({exc})"
    return None


def locate(
    state: Any,
    root: str,
    problem: Callable[[Any], str | None],
    fallback: str,
    *,
    depth: int = 0,
    shared: bool = False,
) -> tuple[str, str]:
    """Return ``(path, reason)`` of the innermost value ``problem`` objects to.

    Walks dicts, lists, tuples and sets depth-first, with an explicit stack
    (no RecursionError however deep the state). A container whose children
    are all fine but which is itself refused (e.g. a dict with an int key) is
    reported; otherwise the search descends to the first refused child.
    Cycles and nesting deeper than MAX_DEPTH are reported as such, and with
    ``shared`` (JSON) a container met a second time; if nothing is found,
    ``(root, fallback)``.
    """
    # Each entry: a container, its path, and an iterator over (label, child).
    stack: list[tuple[Any, str, Iterator[tuple[str, Any]]]] = []
    on_path: set[int] = set()  # ids of the containers being walked: a cycle
    first_seen: dict[int, str] = {}  # every container met, and where (JSON only)

    def enter(value: Any, path: str) -> tuple[str, str] | None:
        if not isinstance(value, (dict, list, tuple, set, frozenset)):
            why = problem(value)
            return (path, why) if why else None
        if id(value) in on_path:
            return path, "it contains itself (a reference cycle)"
        if shared and id(value) in first_seen:
            return path, (
                f"it is the same {type(value).__name__} as {short(first_seen[id(value)])}; "
                "JSON stores it twice, so after a resume the two would be separate "
                "copies. Keep it in one place, or store a copy (list(x), dict(x))"
            )
        if depth + len(stack) >= MAX_DEPTH:
            return path, TOO_DEEP
        first_seen[id(value)] = path
        on_path.add(id(value))
        stack.append((value, path, _labelled(value)))
        return None

    found = enter(state, root)
    while stack and not found:
        value, path, children = stack[-1]
        label_child = next(children, None)
        if label_child is not None:
            found = enter(label_child[1], f"{path}[{label_child[0]}]")
            continue
        stack.pop()
        on_path.discard(id(value))
        why = problem(value)
        found = (path, why) if why else None
    return found or (root, fallback)


TOO_DEEP = (
    f"it is nested more than {MAX_DEPTH} levels deep; flatten it "
    "(e.g. nodes in a list, linked by index)"
)


def _labelled(value: Any) -> Iterator[tuple[str, Any]]:
    """A container's children, each with its path label (the key's repr)."""
    if isinstance(value, dict):
        return ((_show(k), v) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return (("…", v) for v in value)  # no index to name
    return ((str(i), v) for i, v in enumerate(value))


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _show(value: Any) -> str:
    """A repr short enough for a message, whatever ``value`` holds."""
    return _REPR.repr(value)


def short(path: str) -> str:
    """``path`` for a message: a path 500 levels deep is shown by its ends."""
    return path if len(path) <= 160 else f"{path[:100]}…{path[-50:]}"
