"""Which live container each container of a shadow was copied from: guarantee 9
(no container reachable by two paths) for JSON states written as changes.

A small state is checked whole at every commit (``check_json``), which refuses
a dict or list met twice: JSON would store it twice, and after a resume the two
would be separate copies (``s["b"] = s["a"]``, then ``s["a"].append(x)``: one
list live, two after a crash). A big state is written as its change
(:mod:`~durable_steps._record.delta`), found by comparing values with a shadow
whose containers are copies: equal values, so a container put at a second path
(``s["b"] = s["a"]``, ``msgs.append(msgs[0])``) is checked only as a value
there, and one replaced by an *equal* alias (``s["b"] = s["a"]`` where both
held ``[1]``) is no change at all. Walking the whole state per commit, as the
small check does, would make every commit cost the size of the state in
Python, which the change finder exists to avoid.

Design: :class:`Twins` maps every container of the shadow to the live
container it was copied from (``live``), and back (``shadow``); the maps hold
both, so no id is reused while it is in them. The committed state has no
alias (each commit proves it), so each live container sits at exactly one
position, its twin's. A commit then

1. compares identities where it already compares values, in the same C-level
   passes (``_alike``, the index): a position whose live container is not its
   twin (re-identified: a copy, an equal alias) is noted as *moved*,
   ``(shadow, new live)``; its value is compared as before, so the ops do not
   change (a history rebuilt as equal new dicts every step, as pydantic-ai's
   is, is still written as its append). That costs three C calls per
   container, not a walk in Python; the Python work stays per level and per
   change (per re-identified container: what the step itself rebuilt);
2. collects the containers now at positions the last commit did not have them
   at (*fresh*): those in the ops' values (set, appended) and the moved ones.
   That is proportional to the change;
3. refuses an alias (:meth:`Twins.aliased`) when a fresh container is met
   twice, or is a committed container whose committed position still holds
   it: its shadow twin is neither moved nor inside what the ops replace,
   delete or cut (walked only when a fresh container is a committed one:
   a value moved, rare);
4. after the commit, unpairs what the ops removed, re-pairs the moved, and
   pairs the copies of the ops' values.

A refusal then re-checks the whole state with ``check_json``, so the error is
the small state's, naming the same path (and a state it passes is not refused).
Keys need no map: the shadow shares the live state's key objects, so a key
replaced by an equal one of another type (a ``StrEnum`` member for its str)
is a key that is not the same object, whose type the finder then checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["Twins", "containers", "taken"]


def containers(value: Any) -> list[Any]:
    """The dicts and lists in ``value`` (itself included), without recursion.

    ``value`` must hold no cycle (a checked value, or a shadow's).
    """
    if type(value) is not dict and type(value) is not list:
        return []
    found, at = [value], 0
    while at < len(found):
        node = found[at]
        at += 1
        children = node.values() if type(node) is dict else node
        found += [c for c in children if type(c) is dict or type(c) is list]
    return found


def taken(shadow: Any, ops: list[list[Any]]) -> Iterator[Any]:
    """The committed values ``ops`` replace, delete or cut off (a root set aside)."""
    for op in ops:
        kind, path = op[0], op[1]
        if kind == "ext" or not path:
            continue
        parent = shadow
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        if kind == "cut":
            yield parent[last][op[2] :]
        elif type(parent) is list or last in parent:  # not a new key
            yield parent[last]


class Twins:
    """The shadow's containers paired with the live ones they were copied from
    (see the module docstring).
    """

    __slots__ = ("live", "shadow")

    def __init__(self) -> None:
        self.live: dict[int, Any] = {}
        """``id(shadow container)`` → the live container it was copied from."""
        self.shadow: dict[int, Any] = {}
        """``id(live container)`` → its shadow copy."""

    def clear(self) -> None:
        self.live.clear()
        self.shadow.clear()

    def pair_alike(self, shadow: Any, live: Any) -> None:
        """Pair every container of ``shadow`` with the one at its position in
        ``live`` (an equal value: a copy of it, or what it was copied from).
        """
        pairs = [(shadow, live)] if type(shadow) in (dict, list) else []
        while pairs:
            copy, original = pairs.pop()
            self.repair(copy, original)
            if type(copy) is dict:
                items = zip(copy.values(), original.values(), strict=True)
            else:
                items = zip(copy, original, strict=True)
            pairs += [(a, b) for a, b in items if type(a) is dict or type(a) is list]

    def repair(self, copy: Any, original: Any) -> None:
        """Pair shadow container ``copy`` with ``original`` instead of its old twin."""
        old = self.live.get(id(copy))
        if old is not None and self.shadow.get(id(old)) is copy:
            del self.shadow[id(old)]
        self.live[id(copy)] = original
        self.shadow[id(original)] = copy

    def unpair(self, value: Any) -> None:
        """Forget the containers of ``value``, a part of the shadow that goes."""
        live, shadow = self.live, self.shadow
        for copy in containers(value):
            original = live.pop(id(copy), None)
            if original is not None and shadow.get(id(original)) is copy:
                del shadow[id(original)]

    def aliased(self, committed: Any, ops: list[list[Any]], moved: list[tuple[Any, Any]]) -> bool:
        """Whether ``ops`` and ``moved`` (found against ``committed``, the
        shadow) leave a container reachable by two paths. The ops' values must
        have been checked (no cycle).
        """
        if any(op[0] == "set" and not op[1] for op in ops):
            return False  # the whole state replaced: checked whole as a value
        fresh = [c for _, c in moved]
        for op in ops:
            if op[0] == "set":
                fresh += containers(op[2])
            elif op[0] == "ext":
                for value in op[2]:
                    fresh += containers(value)
        ids = list(map(id, fresh))
        if len(set(ids)) < len(ids):
            return True
        shadow = self.shadow
        hits = [shadow[i] for i in ids if i in shadow]  # committed containers, now elsewhere
        if not hits:
            return False
        gone = {id(copy) for copy, _ in moved}  # positions holding another container now
        for value in taken(committed, ops):
            gone.update(map(id, containers(value)))
        return any(id(copy) not in gone for copy in hits)
