"""Finding what changed in a format-2 state, and turning it into records.

A finder compares the live state with the last commit's (see
:mod:`durable_steps._record.format2` for what becomes of its records): JSON states
with :class:`~durable_steps._record.tracker.Tracker`'s ops, at any depth; pickle states
at top-level granularity, each value as its own pickle. A small state is
written whole instead; its finder then keeps only that record.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import SerializationError
from ..serializers import (
    _COMPACT_JSON,
    JSONSerializer,
    SignedSerializer,
    check_json,
    plain_json,
    unpickling_failed,
)
from .identity import taken
from .ops import apply
from .tracker import Tracker

if TYPE_CHECKING:
    from ..serializers import Serializer

__all__ = ["JOURNAL", "Finder", "JSONFinder", "PickleFinder", "inner"]

JOURNAL = "jrn"
"""The op of a journal record: ``["jrn", [step, iteration, name, kind, key], value]``,
one per record, never mixed with a commit's ops (see ``_execution.journal``)."""


def inner(serializer: Serializer) -> Serializer:
    """The serializer under a signing one."""
    return serializer.inner if isinstance(serializer, SignedSerializer) else serializer


_SCALARS = frozenset((str, int, bool, float, type(None)))
"""Exact types a changed value needs no walk for: what ``check_json`` would
refuse of them is a float that is not finite (checked here) or what only the
encoder sees (a lone surrogate, an int too long), which :meth:`JSONFinder.encode`
names."""


def _path_text(path: list[Any]) -> str:
    return "state" + "".join(f"[{step!r}]" for step in path)


class Finder:
    """What both finders share: replaying a record, reading a journal record,
    and holding a small state as its last whole record instead of tracking it.

    A small state is written whole at every commit (see the module
    docstring); its finder then keeps that record (``_record``) and no shadow
    or cache. :meth:`committed` decodes the record, and the first
    :meth:`changes` after the state outgrew that mode builds the shadow from it.
    """

    _record: bytes | None = None
    removed = 0
    """About how many encoded bytes the last :meth:`changes` took out of the
    state (values replaced or deleted, lists cut): how a state that shrank
    (a transcript compacted) is noticed without encoding it."""

    def ops(self, record: bytes) -> list[list[Any]]:
        raise NotImplementedError

    def replay(self, state: Any, record: bytes) -> Any:
        return apply(state, self.ops(record))

    def journal_value(self, record: bytes) -> Any:
        """The value a journal record holds, decoded afresh."""
        return self.ops(record)[0][2]

    def whole_record(self, state: Any) -> bytes:
        """The record that sets the root to ``state`` (checked as a commit's values are)."""
        raise NotImplementedError

    def set_whole(self, record: bytes, state: Any, *, track: bool) -> None:
        """``record`` (a :meth:`whole_record` of ``state``) is committed: track
        ``state`` from now on, or keep only the record (a small state).
        """
        raise NotImplementedError


def _encoded_size(value: Any) -> int:
    return len(_COMPACT_JSON.encode(value))


class JSONFinder(Finder):
    """JSON states: the :class:`Tracker`'s ops, each changed value checked
    (guarantee 9) where it sits, so an unchanged state costs no encode at all.
    """

    def __init__(self, serializer: Serializer, committed: Any) -> None:
        self.serializer = serializer
        self._tracker: Tracker | None = Tracker(committed)

    def _tracked(self) -> Tracker:
        if self._tracker is None:  # out of the small mode: its record is a copy, not the state
            self._tracker, self._record = Tracker(self.committed(), live=False), None
        return self._tracker

    def changes(self, state: Any) -> list[list[Any]]:
        """The ops since the last commit, refused (``SerializationError``)
        exactly where a small state's whole check would refuse them (guarantee
        9 at every size): each changed value is checked where it sits, and a
        container put at a second path is found by the tracker's pairs
        (:mod:`~durable_steps._record.identity`); either way the error is
        ``check_json(state)``'s, as a small state's is.
        """
        tracker = self._tracked()
        ops = tracker.changes(state)
        self.removed = sum(map(_encoded_size, taken(tracker._shadow, ops)))
        try:
            if not tracker.paired:  # nothing to tell an alias by: the small check, once
                check_json(state)
            self._check(ops, state)
        except SerializationError:
            check_json(state)  # the whole check's error, naming the same path
            raise  # what only a value's own check sees (none known): its error
        if tracker.aliased(ops):
            check_json(state)  # raises, naming the second path (as a small state's)
        return ops

    @staticmethod
    def _check(ops: list[list[Any]], state: Any) -> None:
        """Check each value ``ops`` set or append where it sits in ``state``."""
        for op in ops:
            if op[0] == "set":
                value, kind = op[2], type(op[2])
                if kind not in _SCALARS or (kind is float and value - value != 0):
                    check_json(value, _path_text(op[1]), depth=len(op[1]))
            elif op[0] == "ext":
                target = state
                for step in op[1]:
                    target = target[step]
                start = len(target) - len(op[2])
                for i, value in enumerate(op[2], start):
                    check_json(value, _path_text([*op[1], i]), depth=len(op[1]) + 1)

    def encode(self, ops: list[list[Any]], state: Any) -> bytes:
        """A record of ``ops``. The serializer checks them whole again: what a
        value's own check cannot see is there (a tuple or int key in a path,
        one dict put under two keys).
        """
        return self._named(self.serializer.dumps, ops, state)

    def _named(self, dumps: Callable[[Any], bytes], value: Any, state: Any) -> bytes:
        try:
            return dumps(value)
        except (SerializationError, TypeError, ValueError, RecursionError):
            # What only the encoder sees (a lone surrogate): name it in the state.
            inner(self.serializer).dumps(state)
            raise

    def whole_record(self, state: Any) -> bytes:
        if type(self.serializer) is not JSONSerializer:  # signed: its own bytes
            return self._named(self.serializer.dumps, [["set", [], state]], state)
        # The state is checked, not the op around it: a state nested as deep
        # as format 1 takes is taken (the op adds two levels), and an error
        # names the state's own path.
        check_json(state)
        return self._named(
            lambda ops: _COMPACT_JSON.encode(ops).encode(), [["set", [], state]], state
        )

    def set_whole(self, record: bytes, state: Any, *, track: bool) -> None:
        if track:  # the live state, checked whole by whole_record
            self._tracker, self._record = Tracker(state), None
        else:
            self._tracker, self._record = None, record

    def commit(self, ops: list[list[Any]]) -> None:
        self._tracked().commit(ops)

    def committed(self) -> Any:
        if self._tracker is None:
            assert self._record is not None
            return self.ops(self._record)[0][2]
        return self._tracker.committed()

    def ops(self, record: bytes) -> list[list[Any]]:
        """A record's ops, values decoded."""
        ops = self.serializer.loads(record)
        if not isinstance(ops, list):
            raise TypeError("a record is not a list of changes")
        return ops

    def journal_record(self, meta: list[Any], value: Any, path: str) -> bytes:
        """A journal record of ``value`` as JSON gives it back (see ``plain_json``)."""
        return self.serializer.dumps([[JOURNAL, meta, plain_json(value, path)]])


class _Pickler(threading.local):
    """One cloudpickle pickler per thread, reused for every value.

    Every value of a pickle state is pickled by cloudpickle, as format 1 and
    base parts are: one encoding per run, with its guarantees (classes and
    functions of ``__main__`` or of no importable module stored by value), so
    a run started as ``python agent.py`` resumes in a worker that imports
    ``agent``, and ``show --state`` decodes it. ``cloudpickle.dumps`` builds a
    new pickler per call, which costs five times the pickling of a small
    value; the finder pickles every item of a top-level list at every commit,
    so one pickler is kept per thread (a step's threads may record journaled
    calls at once), its memo cleared around each value: the bytes are those
    of ``cloudpickle.dumps``, and no value is kept alive after its pickle.
    """

    def __init__(self) -> None:
        self.pickler: Any = None
        self.buffer = io.BytesIO()

    def dumps(self, value: Any) -> bytes:
        if self.pickler is None:
            import cloudpickle  # only pickle users pay for importing it

            self.pickler = cloudpickle.Pickler(self.buffer, protocol=pickle.HIGHEST_PROTOCOL)
        buffer, pickler = self.buffer, self.pickler
        try:
            pickler.dump(value)
            return buffer.getvalue()
        except BaseException:
            self.pickler = None  # a failed dump may leave it half-way: start afresh
            raise
        finally:
            if self.pickler is not None:
                pickler.clear_memo()
            buffer.seek(0)
            buffer.truncate()


_PICKLER = _Pickler()


def _pickled(value: Any) -> bytes:
    """``value``'s pickle, as ``cloudpickle.dumps`` makes it (see :class:`_Pickler`)."""
    return _PICKLER.dumps(value)


def _compared(value: Any) -> bytes:
    """``value``'s bytes for telling whether it changed since the last commit,
    never stored: the standard pickler where it can (three times faster per
    small value than even a reused cloudpickle pickler, and the finder pickles
    every item of a top-level list at every commit), else cloudpickle's.
    Deterministic per value, which is all a comparison needs; in this process
    they unpickle to the committed state (a retry's), ``__main__`` included.
    """
    try:
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return _pickled(value)


def _pickled_or_named(value: Any) -> bytes:
    """:func:`_pickled`, or the serializer's error naming what cannot be pickled."""
    try:
        return _pickled(value)
    except Exception:
        from ..serializers import PickleSerializer

        PickleSerializer().dumps(value)  # raises, with the path of the value
        raise


class PickleFinder(Finder):
    """Pickle states, at top-level granularity: for a dict state, each
    top-level value is pickled and compared with its bytes at the last commit;
    a top-level list, element by element (appends, edits, truncations). Ops
    carry the values' pickles, and a failed attempt restarts from them.

    Objects shared between top-level values (or list items) are pickled apart,
    so after a resume they are equal copies, not one object.

    Two pickles of a changed value: what the cache compares (:func:`_compared`,
    every value at every commit) and what a record stores (:func:`_pickled`,
    cloudpickle, only for what changed): the cheap pickler to find the change,
    cloudpickle's guarantees for every byte written. :meth:`commit` moves the
    cache forward by the comparison bytes of the same ops (``_pending``).
    """

    def __init__(self, serializer: Serializer, committed: Any) -> None:
        self.serializer = serializer
        self.cache: dict[Any, bytes | list[bytes]] | bytes | None = {}
        self._root: Any = None  # the state of the last changes(), for a root set
        self._pending: list[list[Any]] = []  # the last changes() with comparison bytes
        self._load_cache(committed)

    def _cached(self) -> dict[Any, bytes | list[bytes]] | bytes:
        if self.cache is None:
            self._load_cache(self.committed())
            self._record = None
        assert self.cache is not None
        return self.cache

    def _load_cache(self, state: Any) -> None:
        if type(state) is dict:
            self.cache = {
                k: [_compared(x) for x in v] if type(v) is list else _compared(v)
                for k, v in state.items()
            }
        else:
            self.cache = _compared(state)

    def changes(self, state: Any) -> list[list[Any]]:
        from ..serializers import PickleSerializer

        try:
            return self._ops(state)
        except Exception:  # let the serializer name the value it cannot pickle
            PickleSerializer().dumps(state)
            raise

    def encode(self, ops: list[list[Any]], state: Any) -> bytes:
        return self.serializer.dumps(ops)

    def whole_record(self, state: Any) -> bytes:
        return self.serializer.dumps([["set", [], _pickled_or_named(state)]])

    def set_whole(self, record: bytes, state: Any, *, track: bool) -> None:
        if track:
            self._load_cache(state)
            self._record = None
        else:
            self.cache, self._record = None, record

    def _ops(self, state: Any) -> list[list[Any]]:
        cache = self._cached()
        self._root, self._pending = state, []
        if type(state) is not dict or not isinstance(cache, dict):
            return [] if _compared(state) == cache else [["set", [], _pickled(state)]]
        kept = [k for k in cache if k in state]
        if list(state)[: len(kept)] != kept:  # reordered: only the whole keeps the order
            return [["set", [], _pickled(state)]]
        ops: list[list[Any]] = [["del", [k]] for k in cache if k not in state]
        pending = list(ops)
        removed = sum(_pickled_size(cache[k]) for k in cache if k not in state)
        for key, value in state.items():
            old = cache.get(key)
            if type(value) is list and isinstance(old, list):
                items = [_compared(x) for x in value]
                if len(items) < len(old):
                    ops.append(["cut", [key], len(items)])
                    pending.append(ops[-1])
                    removed += sum(map(len, old[len(items) :]))
                edits = [i for i, b in enumerate(items[: len(old)]) if b != old[i]]
                ops += [["set", [key, i], _pickled(value[i])] for i in edits]
                pending += [["set", [key, i], items[i]] for i in edits]
                removed += sum(len(old[i]) for i in edits)
                if len(items) > len(old):
                    ops.append(["ext", [key], [_pickled(x) for x in value[len(old) :]]])
                    pending.append(["ext", [key], items[len(old) :]])
            else:
                blob = [_compared(x) for x in value] if type(value) is list else _compared(value)
                if blob != old:
                    stored = [_pickled(x) for x in value] if type(value) is list else None
                    ops.append(["set", [key], _pickled(value) if stored is None else stored])
                    pending.append(["set", [key], blob])
                    removed += 0 if old is None else _pickled_size(old)
        self.removed, self._pending = removed, pending
        return ops

    def commit(self, ops: list[list[Any]]) -> None:
        if ops and ops[0][:2] == ["set", []]:  # a new root: cached per key from now on
            self._load_cache(self._root)
        elif ops:  # by the comparison bytes of the same ops
            self.cache = apply(self._cached(), _copy_ops(self._pending))

    def committed(self) -> Any:
        cache = self.cache
        if cache is None:
            assert self._record is not None
            return self.ops(self._record)[0][2]
        if not isinstance(cache, dict):
            return pickle.loads(cache)  # noqa: S301 - our own bytes of this process
        return {k: _unpickle(v) for k, v in cache.items()}

    def ops(self, record: bytes) -> list[list[Any]]:
        """A record's ops, values unpickled."""
        ops = self.serializer.loads(record)
        if not isinstance(ops, list):
            raise TypeError("a record is not a list of changes")
        return [[*op[:2], _unpickle(op[2])] if len(op) > 2 else op for op in ops]

    def journal_record(self, meta: list[Any], value: Any, path: str) -> bytes:
        """A journal record of ``value``: its own pickle inside the record."""
        return self.serializer.dumps([[JOURNAL, meta, _pickled_or_named(value)]])


def _pickled_size(blob: bytes | list[bytes]) -> int:
    return len(blob) if isinstance(blob, bytes) else sum(map(len, blob))


def _copy_ops(ops: list[list[Any]]) -> list[list[Any]]:
    """Ops whose list values are copies: the cache must not share them with the ops."""
    return [[*op[:2], list(op[2])] if len(op) > 2 and type(op[2]) is list else op for op in ops]


def _unpickle(value: Any) -> Any:
    """A pickled value (or list of them) of a pickle record or cache.

    Raises :class:`~durable_steps.CorruptCheckpoint` for one that does not
    unpickle, whatever the unpickler raised (a class moved in a deploy gives
    ``AttributeError``; a damaged pickle, anything): the caller names the run
    and the record.
    """
    try:
        if isinstance(value, list):
            return [pickle.loads(x) for x in value]  # noqa: S301 - verified with its record
        if isinstance(value, bytes):
            return pickle.loads(value)  # noqa: S301 - verified with its record
    except Exception as exc:
        raise unpickling_failed(exc, "a value") from exc
    return value  # a "cut" length
