"""Finding what changed in a JSON state since the last commit, and replaying it.

An agent's state grows: every turn appends a reply and tool results to a
list. Writing only the change keeps the bytes of a run proportional to how
much it produced, not to the square of its length. Nothing is declared by
the user; :class:`~durable_steps._record.tracker.Tracker` compares the live state with
a *shadow* of the last committed one.

The shadow is a structural copy: every dict and list is copied, every leaf
(str, int, float, bool, None — JSON has no other) is shared, since leaves are
immutable. Comparing the live state with it is then cheap: ``==`` on two
dicts whose values are the very same string objects stops at each identity,
so an unchanged message costs a few pointer comparisons, never a look at its
text, and the state is never re-encoded to find the change. The containers
cannot be shared too: an old message edited in place would then change in
the shadow as well and go unseen. So every commit looks at every container,
but in C: the Python work is per nesting level and per changed item (see
:func:`_alike`), not per message.

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

A long list of dicts (a transcript: at least ``_INDEX_FROM`` items, the
root itself or a value of a dict the finder looks into — the root, or any
dict that changed) also gets an *index* (:class:`_Index`): its shadow's
dicts flattened once into a list of their sizes, one of their keys and one
of their values. The unchanged messages of the live list are
then checked against three flat lists instead of a thousand shadow dicts,
which halves what every commit reads (and it reads cold memory: the process
has just slept in an fsync). The index is built when first needed and
extended as the list grows; it vouches for the messages before the first
changed one. :class:`Tracker` cuts it short of a message whose own keys a
commit changes, and drops every index when a commit replaces or removes a
container or cuts a list.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from itertools import accumulate, chain, compress, repeat
from operator import is_, is_not, ne
from typing import Any

from .ops import apply, snapshot

__all__ = ["Indexes", "Seen", "apply", "diff", "find", "snapshot"]

Path = list[str | int]
_MAX_DEPTH = 64  # below this, a changed value is replaced whole
_CHUNK = 256  # pairs compared together (see _alike)
_INDEX_FROM = 64  # lists of dicts this long get an _Index (shorter ones are as fast without)
_LEAVES = (str, int, float, bool, type(None))
Twinned = dict[int, Any] | None
"""A :class:`Twins`' ``live`` map, when identities are compared too (see :func:`_alike`)."""


def _alike(olds: list[Any], news: list[Any], seen: Seen | None = None) -> bool:
    """Whether every ``olds[i]`` is the same JSON value as ``news[i]``.

    The same means equal, of the same types, dicts with their keys in the
    same order, all the way down: ``1 == True == 1.0``, ``0.0 == -0.0`` and
    dicts equal in any key order all encode differently. One C-level ``==``
    over all the pairs finds every other change at a few pointer comparisons
    per unchanged value (the shadow shares its leaves with the state it was
    copied from, and ``==`` checks identity first). What ``==`` cannot see is
    then checked one nesting level at a time, each level as a few C-level
    passes (``map``, ``compress``, ``chain``) over all its pairs, so the
    Python work is per level and per type, never per value: an identical
    pair is done; the others must have the same types, floats the same
    ``repr`` (what JSON writes), dicts the same keys in the same order; their
    items make the next level.

    Keys are alike only if they are the shadow's key objects or exact
    ``str``: an equal ``StrEnum`` key is a change (for the JSON check to
    refuse). With ``seen`` pairing the shadow (see
    :mod:`~durable_steps._record.identity`), a container that is not the very
    live container its shadow was copied from (a copy, an equal alias) is
    noted in ``seen.moved`` on the way, in the same C-level passes, and is
    still alike: a history rebuilt as equal new dicts every step (as
    pydantic-ai's is) must not be written whole every step.
    """
    if olds != news:
        return False
    # A few hundred items at a time: their levels stay in the CPU's cache
    # (level by level over 10,000 nested messages at once is twice as slow).
    return all(map(_alike_levels, _chunks(olds), _chunks(news), repeat(seen)))


def _chunks(items: list[Any]) -> Iterator[list[Any]]:
    return (items[i : i + _CHUNK] for i in range(0, len(items), _CHUNK))


def _alike_levels(a: list[Any], b: list[Any], seen: Seen | None) -> bool:
    """:func:`_alike` for pairs already known equal (``==``), level by level."""
    while a:
        kept = list(map(is_not, a, b))
        if not all(kept):  # identical pairs are the same value: nothing below to look at
            a, b = list(compress(a, kept)), list(compress(b, kept))
        types = list(map(type, a))
        if types != list(map(type, b)):
            return False
        kinds = set(types)
        below_a: list[Any] = []
        below_b: list[Any] = []
        for kind in kinds & {dict, list, float}:  # equal str, int, bool, None: the same JSON
            if len(kinds) == 1:
                ka, kb = a, b
            else:
                mask = list(map(is_, types, repeat(kind)))
                ka, kb = list(compress(a, mask)), list(compress(b, mask))
            if not _alike_kind(kind, ka, kb, below_a, below_b, seen=seen):
                return False
        a, b = below_a, below_b
    return True


def _alike_kind(
    kind: type,
    a: list[Any],
    b: list[Any],
    below_a: list[Any],
    below_b: list[Any],
    *,
    seen: Seen | None,
) -> bool:
    """One level of :func:`_alike` for pairs of equal (``==``) values of type
    ``kind``: whether they can still be the same; their items go below.
    """
    if kind is float:
        return list(map(repr, a)) == list(map(repr, b))
    if seen is not None and seen.twins is not None:
        odd = list(map(is_not, map(seen.twins.get, map(id, a)), b))
        if any(odd):  # containers that are not their shadow's twins (copies, aliases)
            seen.note(compress(a, odd), compress(b, odd))
    if kind is dict:  # equal dicts: the same keys; in the same order?
        keys = list(chain.from_iterable(b))
        known = list(chain.from_iterable(a))
        if known != keys or not _same_keys(known, keys):
            return False
        # Views made and dropped one at a time: thousands alive at once would
        # wake the garbage collector, which walks the whole state.
        values = chain.from_iterable(map(dict.values, a))
        if not all(map(is_, values, chain.from_iterable(map(dict.values, b)))):
            below_a += chain.from_iterable(map(dict.values, a))
            below_b += chain.from_iterable(map(dict.values, b))
        return True  # else the usual case: every value shared with the shadow
    below_a += chain.from_iterable(a)
    below_b += chain.from_iterable(b)
    return True


def _same_keys(known: list[Any], keys: list[Any]) -> bool:
    """Equal keys (``==``) that are the shadow's own key objects, or exact ``str``."""
    return all(map(is_, known, keys)) or set(map(type, keys)) <= {str}


def _differ(
    olds: list[Any], news: list[Any], start: int = 0, seen: Seen | None = None
) -> list[int]:
    """The indexes (plus ``start``) where ``olds`` and ``news`` are not alike.

    Halving: an unchanged run of items costs one :func:`_alike` over it,
    each changed item a few more over the halves around it.
    """
    if len(olds) <= 4:  # one pass each is as cheap as one over all
        return [
            start + i
            for i, (old, new) in enumerate(zip(olds, news, strict=True))
            if not _same(old, new, seen)
        ]
    if _alike(olds, news, seen):
        return []
    mid = len(olds) // 2
    return _differ(olds[:mid], news[:mid], start, seen) + _differ(
        olds[mid:], news[mid:], start + mid, seen
    )


def _same(old: Any, new: Any, seen: Seen | None = None) -> bool:
    """``old`` and ``new`` are the same JSON value (see :func:`_alike`)."""
    return old is new or _alike([old], [new], seen)


class _Index:
    """The shadow list ``source``'s first ``n`` items (all dicts), flattened:
    their sizes, their keys and their values, in order.

    ``live[:k]`` holds the same JSON values as ``source[:k]`` exactly when
    every item is a dict of the same size, the keys are equal in order, and
    each value is the very object the shadow shares (a leaf) or alike the
    shadow's copy (a container, checked by :func:`_alike`). That is
    :func:`_alike` for these pairs, with the shadow's side read once from
    three flat lists.
    """

    __slots__ = ("ended", "keys", "n", "sizes", "source", "values")

    def __init__(self, source: list[Any]) -> None:
        self.source = source
        self.n = 0
        self.ended = False  # an item that is not a dict ends what it can cover
        self.sizes: list[int] = []
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.extend()

    def extend(self) -> None:
        """Cover the dicts appended to ``source`` since (up to its first non-dict)."""
        if self.ended:
            return
        added = self.source[self.n :]
        dicts = list(map(is_, map(type, added), repeat(dict)))
        if not all(dicts):
            added, self.ended = added[: dicts.index(False)], True
        self.n += len(added)
        self.sizes += map(len, added)
        self.keys += chain.from_iterable(added)
        self.values += chain.from_iterable(map(dict.values, added))

    def cut(self, n: int) -> None:
        """Cover only the first ``n`` items (:meth:`extend` covers the rest again)."""
        end = sum(self.sizes[:n])
        del self.sizes[n:], self.keys[end:], self.values[end:]
        self.n, self.ended = n, False

    def covered(self, live: list[Any], seen: Seen | None = None) -> int:
        """How many leading items of ``live`` (at most ``n``) are alike ``source``'s.

        Not all or nothing: an agent that edits its last message every step
        must still have the messages before it vouched for. With ``seen``, a
        message that is not its shadow's twin is noted (see :func:`_alike`).
        """
        kinds = list(map(is_, map(type, live), repeat(dict)))
        k = kinds.index(False) if not all(kinds) else len(live)
        if seen is not None and seen.twins is not None:
            source = self.source if k == len(self.source) else self.source[:k]
            odd = list(map(is_not, map(seen.twins.get, map(id, source)), live))
            if any(odd):
                seen.note(compress(source, odd), compress(live, odd))
        sizes = self.sizes if k == self.n else self.sizes[:k]
        lens = list(map(len, live[:k]))
        if lens != sizes:
            k = list(map(ne, lens, sizes)).index(True)
            sizes = sizes[:k]
        live = live[:k]
        ends = list(accumulate(sizes))  # where each item's keys end in the flat lists
        total = end = ends[-1] if ends else 0
        keys = list(chain.from_iterable(live))
        known = self.keys if end == len(self.keys) else self.keys[:end]
        if keys != known:  # an item's keys differ: it, and what follows, are not vouched for
            end = list(map(ne, keys, known)).index(True)
        elif not _same_keys(known, keys):  # an equal key of another type (a StrEnum's)
            end = next(i for i, key in enumerate(keys) if type(key) is not str)
        values = list(chain.from_iterable(map(dict.values, live)))[:end]
        shadow = self.values if end == len(self.values) else self.values[:end]
        moved = list(map(is_not, shadow, values))
        if any(moved):  # else the usual case: every value is the leaf the shadow shares
            differ = _differ(list(compress(shadow, moved)), list(compress(values, moved)), 0, seen)
            if differ:
                end = min(end, list(compress(range(end), moved))[differ[0]])
        return bisect_right(ends, end) if end < total else k


Indexes = dict[int, _Index]
"""A :class:`Tracker`'s indexes, by ``id`` of the shadow list (each holds its list)."""


def _indexed(
    old: list[Any], new: list[Any], indexes: Indexes | None, seen: Seen | None = None
) -> int:
    """How many leading items of ``new`` an index shows alike ``old``'s (0: none known)."""
    if indexes is None or len(old) < _INDEX_FROM:
        return 0
    index = indexes.get(id(old))
    if index is None or index.source is not old:
        index = indexes[id(old)] = _Index(old)
    elif index.n < len(old):
        index.extend()
    k = min(index.n, len(new))
    return index.covered(new[:k], seen) if k else 0


class Seen:
    """What a finding looks through (the indexes, the twins) and what it found
    besides ops: the positions whose live container is not its twin (``moved``).
    """

    __slots__ = ("indexes", "moved", "twins")

    def __init__(self, indexes: Indexes | None, twins: Twinned = None) -> None:
        self.indexes, self.twins = indexes, twins
        self.moved: dict[int, tuple[Any, Any]] = {}
        """By ``id`` of the shadow container: a pair is met again when halving."""

    def note(self, olds: Iterator[Any], news: Iterator[Any]) -> None:
        """Positions whose live container is not the twin of the shadow's ``olds``."""
        for old, new in zip(olds, news, strict=True):
            self.moved[id(old)] = (old, new)


def diff(old: Any, new: Any, indexes: Indexes | None = None) -> list[list[Any]]:
    """The ops that turn ``old`` (a shadow) into ``new``; empty if nothing changed.

    ``indexes`` (a :class:`Tracker`'s) lets long lists of dicts in ``old`` be
    checked through their :class:`_Index`; the ops are the same without it.
    """
    return find(old, new, Seen(indexes))


def find(old: Any, new: Any, seen: Seen) -> list[list[Any]]:
    ops: list[list[Any]] = []
    # With indexes, into a container root at once (it finds no ops when nothing
    # changed), so that its long lists are checked through them, not with the rest.
    into = seen.indexes is not None and type(old) is type(new) and type(new) in (dict, list)
    if into or not _same(old, new, seen):
        _diff(old, new, [], ops, 0, seen=seen)
    return ops


def _diff(old: Any, new: Any, path: Path, ops: list[list[Any]], depth: int, *, seen: Seen) -> None:
    """The ops for ``old`` and ``new``, known not to be the same (:func:`_same`)."""
    kind = type(new)
    if type(old) is not kind or depth >= _MAX_DEPTH or kind not in (dict, list):
        ops.append(["set", list(path), new])
        return
    if kind is dict:
        whole = _diff_dict(old, new, path, ops, depth, seen=seen)
    else:
        whole = _diff_list(old, new, path, ops, depth, seen=seen)
    if not whole and seen.twins is not None and seen.twins.get(id(old)) is not new:
        seen.moved[id(old)] = (old, new)  # a copy, or an alias: see _record.identity


def _diff_dict(
    old: dict[str, Any],
    new: dict[str, Any],
    path: Path,
    ops: list[list[Any]],
    depth: int,
    *,
    seen: Seen,
) -> bool:
    """The ops for two dicts; whether it set the whole ``new``."""
    kept = [k for k in old if k in new]
    if list(new)[: len(kept)] != kept or not set(map(type, new)) <= {str}:
        # Reordered, or a key added between old ones: a new key is appended at
        # the end on replay, so only the whole value keeps this order. A key
        # that is not exactly a str goes whole too, for the JSON check to see.
        ops.append(["set", list(path), new])
        return True
    for key in old:
        if key not in new:
            ops.append(["del", [*path, key]])
    deep = depth + 1 >= _MAX_DEPTH  # a changed value goes whole there: no index to look through
    for key in _changed_keys(old, new, kept, None if deep else seen.indexes, seen):
        _diff(old[key], new[key], [*path, key], ops, depth + 1, seen=seen)
    for key in list(new)[len(kept) :]:  # the new keys, after the kept ones (checked above)
        ops.append(["set", [*path, key], new[key]])
    return False


def _changed_keys(
    old: dict[str, Any],
    new: dict[str, Any],
    kept: list[str],
    indexes: Indexes | None,
    seen: Seen,
) -> list[str]:
    """The keys of ``kept`` whose values changed, in order: the other values
    checked together (:func:`_differ`); long lists always, as :func:`_diff_list`
    checks them through their index once (it finds no ops in an unchanged one).
    """
    long = set()
    if indexes is not None:
        long = {
            k
            for k in kept
            if type(old[k]) is list and type(new[k]) is list and len(old[k]) >= _INDEX_FROM
        }
    if not long:
        changed = _differ([old[k] for k in kept], [new[k] for k in kept], 0, seen)
        return [kept[i] for i in changed]
    rest = [k for k in kept if k not in long]
    found = {rest[i] for i in _differ([old[k] for k in rest], [new[k] for k in rest], 0, seen)}
    found.update(long)  # _diff_list finds their changes through the index, or none
    return [k for k in kept if k in found]


def _diff_list(
    old: list[Any],
    new: list[Any],
    path: Path,
    ops: list[list[Any]],
    depth: int,
    *,
    seen: Seen,
) -> bool:
    """The ops for two lists; whether it set the whole ``new``."""
    common = min(len(old), len(new))
    start = min(_indexed(old, new, seen.indexes, seen), common)  # an index vouches for these
    changed = _differ(old[start:common], new[start:common], start, seen)
    if len(changed) > 8 and len(changed) * 2 > common:  # rewritten, not edited: send it whole
        ops.append(["set", list(path), new])
        return True
    if len(new) < len(old):
        ops.append(["cut", list(path), len(new)])
    for i in changed:
        _diff(old[i], new[i], [*path, i], ops, depth + 1, seen=seen)
    if len(new) > len(old):
        ops.append(["ext", list(path), new[len(old) :]])
    return False
