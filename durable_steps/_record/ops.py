"""Change ops on JSON values: the structural copy a shadow is, and replaying ops.

See :mod:`durable_steps._record.delta` for what the ops are and how they are found.
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply", "snapshot"]


def snapshot(value: Any) -> Any:
    """A structural copy of ``value``: containers copied, leaves shared."""
    try:
        return _snapshot(value)
    except RecursionError:  # a state nested a few hundred deep (JSON allows 500)
        return _snapshot_deep(value)


def _snapshot(value: Any) -> Any:
    kind = type(value)
    if kind is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    if kind is list:
        return [_snapshot(v) for v in value]
    return value


def _snapshot_deep(value: Any) -> Any:
    """:func:`snapshot` with an explicit stack: any depth, a little slower."""
    if type(value) is not dict and type(value) is not list:
        return value
    root: Any = {} if type(value) is dict else []
    stack = [(value, root)]
    while stack:
        source, copy = stack.pop()
        pairs = source.items() if type(source) is dict else enumerate(source)
        for key, item in pairs:
            kind = type(item)
            kept: Any = item
            if kind is dict or kind is list:
                kept = {} if kind is dict else []
                stack.append((item, kept))
            if type(copy) is dict:
                copy[key] = kept  # in the source's order: keys keep their order
            else:
                copy.append(kept)
    return root


def apply(state: Any, ops: list[list[Any]]) -> Any:
    """Replay ``ops`` (made by :func:`diff`) on ``state``; return the new root.

    ``state`` is changed in place where it can be; a ``set`` of the root
    returns the new value. Raises ``ValueError`` for ops that do not fit the
    state (a damaged record), never anything else.
    """
    for op in ops:
        try:
            state = _apply_one(state, op)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"change {op[:2]!r} does not fit the state ({exc!r})") from exc
    return state


def _apply_one(state: Any, op: list[Any]) -> Any:  # noqa: PLR0912 - a branch per kind of op
    kind, path = op[0], op[1]
    if not isinstance(path, list):
        raise TypeError("the path is not a list")
    if kind in ("ext", "cut"):
        target = state
        for step in path:
            target = target[step]
        if type(target) is not list:
            raise TypeError(f"{kind} on a value that is not a list")
        if kind == "ext":
            target.extend(op[2])
        elif isinstance(op[2], int) and 0 <= op[2] <= len(target):
            del target[op[2] :]
        else:
            raise ValueError("cut outside the list")
        return state
    if kind not in ("set", "del"):
        raise ValueError(f"unknown change {kind!r}")
    if not path:
        if kind == "del":
            raise ValueError("del needs a path")
        return op[2]
    parent = state
    for step in path[:-1]:
        parent = parent[step]
    if kind == "del":
        del parent[path[-1]]
    else:
        parent[path[-1]] = op[2]
    return state
