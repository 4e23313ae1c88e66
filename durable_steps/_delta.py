"""Finding what changed in a JSON state since the last commit, and replaying it.

An agent's state grows: every turn appends a reply and tool results to a
list. Writing only the change keeps the bytes of a run proportional to how
much it produced, not to the square of its length. Nothing is declared by
the user; :class:`Tracker` compares the live state with a *shadow* of the
last committed one.

The shadow is a structural copy: every dict and list is copied, every leaf
(str, int, float, bool, None — JSON has no other) is shared, since leaves are
immutable. Comparing the live state with it is then cheap: ``==`` on two
dicts whose values are the very same string objects stops at each identity,
so an unchanged message costs a few pointer comparisons, never a look at its
text, and the state is never re-encoded to find the change.

A change is a list of *ops*, each JSON-ready, on a *path* of dict keys and
list indexes from the root:

``["set", path, value]``   put ``value`` at ``path`` (a new key, a replaced value)
``["del", path]``          remove the key at ``path``
``["ext", path, values]``  append ``values`` to the list at ``path``
``["cut", path, n]``       truncate the list at ``path`` to ``n`` items

:func:`diff` finds the ops that turn the shadow into the live state exactly —
equal values *of the same types* in the same key order, so that the state a
resume rebuilds encodes byte for byte like the live one. An edit deep inside
an old message becomes one ``set`` at its path; a list cut short, a ``cut``; a
dict whose keys were reordered, or a list rewritten wholesale, one ``set`` of
the whole value (never wrong, only less small). :func:`apply` replays ops on
a decoded state. Neither does I/O or knows the format that stores the ops.
"""

from __future__ import annotations

from operator import is_
from typing import Any

__all__ = ["Tracker", "apply", "diff", "snapshot"]

Path = list[str | int]
_MAX_DEPTH = 64  # below this, a changed value is replaced whole
_LEAVES = (str, int, float, bool, type(None))


def snapshot(value: Any) -> Any:
    """A structural copy of ``value``: containers copied, leaves shared."""
    kind = type(value)
    if kind is dict:
        return {k: snapshot(v) for k, v in value.items()}
    if kind is list:
        return [snapshot(v) for v in value]
    return value


def _same(old: Any, new: Any) -> bool:  # noqa: PLR0911 - a return per kind of value
    """Equal, of the same types and in the same key order, all the way down.

    ``1 == True == 1.0`` and dicts compare equal in any key order, so ``==``
    alone is not enough. An unchanged part of the state shares its keys and
    leaves with the shadow by identity, so the checks run as C-level ``is``
    over whole key and value sequences first; Python only looks deeper at
    values that are not identical (nested containers, changed leaves).
    """
    if old is new:
        return True
    kind = type(new)
    if type(old) is not kind:
        return False
    if kind is dict:
        if len(old) != len(new) or not (all(map(is_, old, new)) or list(old) == list(new)):
            return False
        olds, news = old.values(), new.values()
    elif kind is list:
        if len(old) != len(new):
            return False
        olds, news = old, new
    else:
        return bool(old == new)
    if all(map(is_, olds, news)):
        return True
    return all(a is b or _same(a, b) for a, b in zip(olds, news, strict=True))


def diff(old: Any, new: Any) -> list[list[Any]]:
    """The ops that turn ``old`` (a shadow) into ``new``; empty if nothing changed."""
    ops: list[list[Any]] = []
    _diff(old, new, [], ops, 0)
    return ops


def _diff(old: Any, new: Any, path: Path, ops: list[list[Any]], depth: int) -> None:
    kind = type(new)
    if type(old) is not kind or depth >= _MAX_DEPTH or kind not in (dict, list):
        if not _same(old, new):
            ops.append(["set", list(path), new])
        return
    if kind is dict:
        _diff_dict(old, new, path, ops, depth)
    else:
        _diff_list(old, new, path, ops, depth)


def _diff_dict(
    old: dict[str, Any], new: dict[str, Any], path: Path, ops: list[list[Any]], depth: int
) -> None:
    kept = [k for k in old if k in new]
    if list(new)[: len(kept)] != kept:
        # Reordered, or a key added between old ones: a new key is appended at
        # the end on replay, so only the whole value keeps this order.
        ops.append(["set", list(path), new])
        return
    for key in old:
        if key not in new:
            ops.append(["del", [*path, key]])
    for key, value in new.items():
        if key not in old:
            ops.append(["set", [*path, key], value])
        elif not (value is old[key] or _same(old[key], value)):
            _diff(old[key], value, [*path, key], ops, depth + 1)


def _diff_list(
    old: list[Any], new: list[Any], path: Path, ops: list[list[Any]], depth: int
) -> None:
    common = min(len(old), len(new))
    changed = [i for i in range(common) if not _same(old[i], new[i])]
    if len(changed) > 8 and len(changed) * 2 > common:  # rewritten, not edited: send it whole
        ops.append(["set", list(path), new])
        return
    if len(new) < len(old):
        ops.append(["cut", list(path), len(new)])
    for i in changed:
        _diff(old[i], new[i], [*path, i], ops, depth + 1)
    if len(new) > len(old):
        ops.append(["ext", list(path), new[len(old) :]])


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


class Tracker:
    """The shadow of the last committed state, and the change since it.

    ``changes(state)`` returns the ops since the last :meth:`commit`; after the
    ops are durably written, ``commit(ops)`` moves the shadow forward by the
    same ops (O(size of the change), not of the state).
    """

    def __init__(self, committed: Any) -> None:
        self._shadow = snapshot(committed)

    def changes(self, state: Any) -> list[list[Any]]:
        """The ops that turn the last committed state into ``state``."""
        return diff(self._shadow, state)

    def commit(self, ops: list[list[Any]]) -> None:
        """Record that ``ops`` are now part of the committed state."""
        # The ops' values are the live objects: copy them structurally so a
        # later in-place change to the live state still shows as a change.
        copied = [[op[0], op[1], snapshot(op[2])] if len(op) > 2 else op for op in ops]
        self._shadow = apply(self._shadow, copied)

    def reset(self, committed: Any) -> None:
        """Start over from ``committed`` (after a failed attempt, a resume)."""
        self._shadow = snapshot(committed)
