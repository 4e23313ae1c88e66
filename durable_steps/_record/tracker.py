"""The change finder of a JSON state between commits: its shadow, its indexes, its pairs.

See :mod:`durable_steps._record.delta` for how a change is found, and
:mod:`durable_steps._record.identity` for how aliasing is refused at any size.
"""

from __future__ import annotations

from typing import Any

from .delta import Indexes, Seen, find
from .identity import Twins, taken
from .ops import apply, snapshot

__all__ = ["Tracker"]


class Tracker:
    """The shadow of the last committed state, and the change since it.

    ``changes(state)`` returns the ops since the last :meth:`commit`; after the
    ops are durably written, ``commit(ops)`` moves the shadow forward by the
    same ops (O(size of the change), not of the state).

    The shadow's containers are paired with the live ones (:class:`Twins`,
    see :mod:`~durable_steps._record.identity`), so :meth:`aliased` can tell a
    container put at a second path. ``committed`` is the live state, or, with
    ``live=False``, a copy of it (a decoded record): then nothing is paired
    until the first commit pairs the shadow with the state it was found in,
    and :attr:`paired` says that the caller must check that state whole.
    """

    def __init__(self, committed: Any, *, live: bool = True) -> None:
        self._indexes: Indexes = {}
        self._twins = Twins()
        self._moved: list[tuple[Any, Any]] = []
        self._live: Any = None  # the state of the last changes() while unpaired
        self.paired = live
        self._shadow = snapshot(committed)
        if live:
            self._twins.pair_alike(self._shadow, committed)

    def changes(self, state: Any) -> list[list[Any]]:
        """The ops that turn the last committed state into ``state``."""
        seen = Seen(self._indexes, self._twins.live if self.paired else None)
        ops = find(self._shadow, state, seen)
        self._moved, self._live = list(seen.moved.values()), None if self.paired else state
        return ops

    def aliased(self, ops: list[list[Any]]) -> bool:
        """Whether the last :meth:`changes` (``ops``, their values checked)
        puts a container at a second path (see :meth:`Twins.aliased`).
        """
        return self.paired and self._twins.aliased(self._shadow, ops, self._moved)

    def commit(self, ops: list[list[Any]]) -> None:
        """Record that ``ops`` (of the last :meth:`changes`) are now part of
        the committed state: the shadow moves forward, and so do its pairs.
        """
        twins = self._twins
        self._outdate(ops)
        if any(op[0] == "set" and not op[1] for op in ops):
            twins.clear()  # a new root: every container of the shadow goes
        elif self.paired:
            for value in taken(self._shadow, ops):
                twins.unpair(value)
            for copy, original in self._moved:
                twins.repair(copy, original)
        # The ops' values are the live objects: copy them structurally so a
        # later in-place change to the live state still shows as a change.
        copied = [_copied(op, twins if self.paired else None) for op in ops]
        self._shadow = apply(self._shadow, copied)
        if not self.paired:
            twins.clear()
            twins.pair_alike(self._shadow, self._live)
            self.paired, self._live = True, None
        self._moved = []

    def _outdate(self, ops: list[list[Any]]) -> None:
        """Drop the indexes ``ops`` (about to be applied to the shadow) make wrong.

        An append leaves every index right: it covers a prefix. A cut, or a
        container replaced or removed, drops them all (rebuilt when next
        needed): the index of a list inside what goes would otherwise be kept
        alive by it. A leaf set or deleted in a dict the index of the list
        holding it covers cuts that index short of the dict: an agent that
        updates its last message every step must not have the whole
        transcript flattened again every commit. A leaf changed deeper
        leaves it right: an index holds the shadow's nested containers, not
        their contents.
        """
        indexes = self._indexes
        for op in ops:
            if not indexes:
                return
            kind, path = op[0], op[1]
            if kind == "ext":
                continue
            if kind not in ("set", "del") or not path:  # a cut, the root replaced
                indexes.clear()
                return
            parent, grand = self._shadow, None
            for step in path[:-1]:
                parent, grand = parent[step], parent
            last = path[-1]
            replaced = parent[last] if type(parent) is list or last in parent else None
            if type(replaced) in (dict, list):
                indexes.clear()
                return
            if type(grand) is list:
                index = indexes.get(id(grand))
                if index is not None and index.source is grand and path[-2] < index.n:
                    index.cut(path[-2])

    def reset(self, committed: Any) -> None:
        """Start over from ``committed``, the live state (after a failed attempt, a resume)."""
        self._shadow = snapshot(committed)
        self._indexes.clear()
        self._twins.clear()
        self._twins.pair_alike(self._shadow, committed)
        self.paired, self._moved, self._live = True, [], None

    def committed(self) -> Any:
        """A copy of the committed state, to be the live state from now on
        (a retry's): the shadow is paired with it.
        """
        copy = snapshot(self._shadow)
        if self.paired:
            self._twins.clear()
            self._twins.pair_alike(self._shadow, copy)
        self._moved = []
        return copy


def _copied(op: list[Any], twins: Twins | None) -> list[Any]:
    """``op`` with its value a structural copy (paired with the live value)."""
    if len(op) < 3 or op[0] not in ("set", "ext"):
        return op
    if op[0] == "ext":
        values = [snapshot(v) for v in op[2]]
        if twins is not None:
            for copy, value in zip(values, op[2], strict=True):
                twins.pair_alike(copy, value)
        return [op[0], op[1], values]
    copy = snapshot(op[2])
    if twins is not None:
        twins.pair_alike(copy, op[2])
    return [op[0], op[1], copy]
