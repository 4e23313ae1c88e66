"""Turning the state into bytes and back.

A serializer is a small protocol, separate from storage: ``name``, ``dumps``
and ``loads``. Two ship with durable_steps:

* :class:`JSONSerializer` (``"json"``, the default): human-readable, and safe
  to load from a bucket other people can write to. It stores only what comes
  back from JSON as an equal value of the same types, so a resumed run sees
  exactly the state the live run had (guarantee 9). :func:`check_json`
  refuses, with a :class:`~durable_steps.SerializationError` naming the path:

  - tuples and sets (a tuple would come back as a list): use a list;
  - dict keys that are not ``str`` (``{1: x}`` would come back as
    ``{"1": x}``, a ``KeyError: 1`` only after a crash, and ``{1: a, "1": b}``
    would lose one value): use str keys;
  - NaN and ±Infinity (not standard JSON; other readers reject them): use
    None or a sentinel string;
  - subclasses of the JSON types (an ``IntEnum``, ``OrderedDict`` or
    ``defaultdict`` would come back as the plain type): convert them;
  - containers nested deeper than :data:`MAX_DEPTH` (decoders recurse, and
    would fail on resume) and reference cycles;
  - text that is not valid UTF-8 (a lone surrogate) and anything else
    the encoder refuses.

  Or use ``serializer="pickle"``, which keeps Python types.
* :class:`PickleSerializer` (``"pickle"``): cloudpickle, for arbitrary Python
  objects. **Loading a pickle runs code chosen by whoever wrote it**: only
  load checkpoints from a bucket that nobody else can write to, or sign them.

:class:`SignedSerializer` wraps another serializer with an HMAC-SHA256 tag and
refuses to decode bytes whose tag does not verify — checked *before* the inner
serializer sees them, so a tampered pickle is never unpickled. With
``serializer="pickle"``, a workflow signs automatically when given
``signing_key=`` or when ``$DURABLE_STEPS_SIGNING_KEY`` is set.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import pickle
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._culprit import MAX_DEPTH, TOO_DEEP, json_problem, locate, pickle_problem, short
from .errors import CorruptCheckpoint, DefinitionError, SerializationError

__all__ = [
    "SIGNING_KEY_ENV",
    "JSONSerializer",
    "PickleSerializer",
    "Serializer",
    "SignedSerializer",
    "check_json",
    "resolve_serializer",
]

SIGNING_KEY_ENV = "DURABLE_STEPS_SIGNING_KEY"
SIGNED_SUFFIX = "+hmac-sha256"
"""What a :class:`SignedSerializer` adds to its inner serializer's name
(``json+hmac-sha256``): how a reader of a head tells that it says it is signed."""

# Built once: json.dumps() with options makes a new encoder on every call.
# check_circular is off because check_json has already refused cycles (as
# nesting deeper than MAX_DEPTH): the encoder's own check would cost a dict
# insert and delete per container on every commit.
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)


@runtime_checkable
class Serializer(Protocol):
    """Encodes a state to bytes and back.

    ``dumps`` raises :class:`~durable_steps.SerializationError` (with ``path``
    set) for a value it cannot encode; ``loads`` raises
    :class:`~durable_steps.CorruptCheckpoint` for bytes it cannot decode.
    ``name`` is recorded in every checkpoint, so a run is never decoded by a
    serializer other than the one that wrote it.
    """

    name: str

    def dumps(self, state: Any) -> bytes:
        """Encode ``state``."""
        ...

    def loads(self, data: bytes) -> Any:
        """Decode bytes made by :meth:`dumps`."""
        ...


class JSONSerializer:
    """UTF-8 JSON; the default. Refuses what JSON would not give back unchanged
    (see the module docstring and :func:`check_json`).
    """

    name = "json"

    def dumps(self, state: Any) -> bytes:
        """Encode ``state`` as compact JSON, or say which value cannot be."""
        check_json(state)
        try:
            return _COMPACT_JSON.encode(state).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            # What check_json leaves to the encoder: a lone surrogate, an int
            # longer than str() allows, a stack already deep when committing.
            raise _json_error(*locate(state, "state", json_problem, str(exc))) from exc

    def loads(self, data: bytes) -> Any:
        """Decode JSON bytes."""
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptCheckpoint(f"the state is not valid JSON ({exc})") from exc


def _sdk_object(value: Any) -> Any:
    """An SDK object as plain data: a pydantic model (the ``openai`` SDK's) by
    ``model_dump(mode="json")``, a Stripe object by ``to_dict()``.
    """
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_RESULT_JSON = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_sdk_object
)
_JSON_LEAVES = (str, int, float, bool, type(None))


def plain_json(value: Any, path: str) -> Any:
    """``value`` as JSON gives it back: what a journaled call's result is stored as.

    A result is returned *decoded* whether it ran now or was replayed, so it
    need not survive the round trip unchanged the way the state must: a
    dict or list subclass, a tuple, an ``IntEnum`` or an int key is stored
    as the plain value JSON makes of it, and an SDK object (a pydantic
    model, as the ``openai`` SDK returns; a Stripe object) as its
    ``model_dump(mode="json")`` or ``to_dict()``. What JSON cannot encode at
    all (another object, NaN, a cycle) raises
    :class:`~durable_steps.SerializationError` naming where it sits.
    """
    try:
        return json.loads(_RESULT_JSON.encode(value))
    except (TypeError, ValueError, RecursionError) as exc:
        where = _unencodable(value, path) or path
        raise SerializationError(f"{where} cannot be stored as JSON ({exc}).", path=where) from exc


def _unencodable(value: Any, path: str) -> str | None:
    """Where the first value JSON cannot encode sits in ``value`` (walked without recursion)."""
    stack = [(value, path, 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            return where
        if isinstance(node, dict):
            for key, child in reversed(list(node.items())):
                if not isinstance(key, _JSON_LEAVES):
                    return f"{where} (key {key!r})"
                stack.append((child, f"{where}[{key!r}]", depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend(
                (c, f"{where}[{i}]", depth + 1) for i, c in reversed(list(enumerate(node)))
            )
        elif not isinstance(node, _JSON_LEAVES) or (
            isinstance(node, float) and not math.isfinite(node)
        ):
            return where
    return None


def check_json(value: Any, path: str = "state", *, depth: int = 0) -> None:
    """Raise :class:`~durable_steps.SerializationError` unless ``value`` would
    come back from JSON as an equal value of the same types.

    Allowed: ``str``, ``int``, ``bool``, ``None``, finite ``float``, and
    ``list`` and ``dict`` with ``str`` keys of those, nested at most
    :data:`MAX_DEPTH` deep — exactly these types, not subclasses. The error's
    ``path`` names the first value refused, e.g. ``state['pair']``; ``path``
    is where ``value`` sits in the state and ``depth`` how many containers
    hold it there, so an incremental writer can check just the part that
    changed: ``check_json(message, "state['messages'][41]", depth=2)``.

    Only containers are walked (strings are not scanned), so the cost grows
    with the number of items, not with the bytes of text: for states of
    message dicts with long strings (2 KB to 1 MB) it costs 10-20% of
    encoding them, and turning off the encoder's own cycle check (this walk
    refuses cycles) gives part of that back. Decoding the output and comparing
    instead costs 12-75% and misses subclasses (an IntEnum equals its int).
    What only the encoder can tell (text that is not UTF-8, an int too long
    for ``str()``) is reported by :meth:`JSONSerializer.dumps` with the same
    kind of error.
    """
    if type(value) is dict or type(value) is list:
        clean = depth < MAX_DEPTH and _json_clean(value, depth)
    else:  # a scalar state: rare, the slow check will do
        clean = json_problem(value) is None
    if not clean:
        found = locate(value, path, json_problem, "it cannot be encoded", depth=depth, shared=True)
        raise _json_error(*found)


def _json_error(path: str, why: str) -> SerializationError:
    return SerializationError(
        f'{short(path)} cannot be stored as JSON: {why} (or use serializer="pickle"). '
        "JSON gives back only str, int, finite float, bool, None, and lists and dicts "
        f"with str keys, nested at most {MAX_DEPTH} deep; anything else would differ "
        "after a resume.",
        path=path,
    )


def _json_clean(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is JSON that round-trips; the fast path of check_json.

    ``value`` is a dict or list ``depth`` containers down. An explicit stack,
    not recursion: a state nested 100,000 deep must get a SerializationError,
    not a RecursionError. A cycle is refused as nesting deeper than MAX_DEPTH
    (no set of ids to maintain on the hot path).
    """
    stack = [(value, depth)]
    pop, push = stack.pop, stack.append
    # A container met twice (``s["a"] = s["b"] = []``, or a cycle) would come
    # back from JSON as two separate copies: a change to one would no longer
    # show in the other after a resume.
    seen = {id(value)}
    remember, before = seen.add, len(seen)
    while stack:
        node, depth = pop()  # only dicts and lists are pushed
        if type(node) is dict:
            for key in node:
                if type(key) is not str:
                    return False
            children = node.values()
        else:
            children = node
        depth += 1
        for child in children:
            kind = type(child)
            if kind is str or kind is int or kind is bool or child is None:
                continue
            if kind is float:
                if child - child != 0:  # NaN and ±Infinity: inf - inf is NaN
                    return False
            elif (kind is dict or kind is list) and depth < MAX_DEPTH:
                remember(id(child))
                if len(seen) == before:
                    return False
                before += 1
                push((child, depth))
            else:
                return False
    return True


class PickleSerializer:
    """cloudpickle: any Python object, including lambdas and local classes.

    Loading runs code chosen by whoever wrote the bytes; see the module
    docstring.
    """

    name = "pickle"

    def dumps(self, state: Any) -> bytes:
        """Pickle ``state``, or say which value cannot be pickled."""
        try:
            import cloudpickle  # only pickle users pay for importing it

            return cloudpickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-any-return]
        except Exception as exc:  # cloudpickle turns a RecursionError into a PicklingError
            path, why = locate(state, "state", pickle_problem, f"{exc}")
            advice = (
                ""
                if why == TOO_DEEP
                else " Keep open files, sockets, locks and clients out of the state and "
                "rebuild them in the step that uses them."
            )
            raise SerializationError(
                f"{short(path)} cannot be pickled: {why}.{advice}", path=path
            ) from exc

    def loads(self, data: bytes) -> Any:
        """Unpickle ``data`` (runs code: trust the writer)."""
        try:
            # The unpickler builds containers with a stack, not recursion, so
            # even a 100,000-deep state loads; any failure is corruption.
            return pickle.loads(data)  # noqa: S301 - documented; sign to refuse foreign bytes
        except Exception as exc:
            raise unpickling_failed(exc, "the state") from exc


def unpickling_failed(exc: Exception, what: str) -> CorruptCheckpoint:
    """The error for pickled bytes (``what``) that do not unpickle: what to do
    when the cause is a deploy (a class or function moved or renamed), else corruption.
    """
    if isinstance(exc, (ImportError, AttributeError)):
        return CorruptCheckpoint(
            f"{what} cannot be unpickled ({exc!r}): it refers to a class or function by "
            "module and name, and that name is gone (moved or renamed since the run was "
            "saved). Keep it importable under its old name (e.g. an alias `OldName = "
            "NewName` in the old module) to resume the run, and convert the state in "
            "Workflow(migrate=...) if it must change."
        )
    return CorruptCheckpoint(f"{what} cannot be unpickled ({exc!r})")


class SignedSerializer:
    """Wraps a serializer with an HMAC-SHA256 tag over its bytes.

    Layout: 32 bytes of tag, then the inner serializer's bytes. ``loads``
    verifies the tag in constant time before the inner serializer runs.

    The workflow also signs each checkpoint's header with :meth:`seal`, so
    the whole stored run is authenticated, not just its state.
    """

    _TAG = 32

    def __init__(self, inner: Serializer, key: bytes | str) -> None:
        if not key:
            raise DefinitionError("the signing key must not be empty")
        if not isinstance(inner, Serializer):
            raise DefinitionError(
                f"SignedSerializer wraps a Serializer object (e.g. ds.JSONSerializer()), "
                f"not {inner!r}; or pass serializer= and signing_key= to the Workflow"
            )
        self.inner = inner
        self.name = f"{inner.name}{SIGNED_SUFFIX}"
        self._key = key.encode() if isinstance(key, str) else key
        # A key of its own for headers (domain separation): a header tag can
        # never be replayed as a state tag or the other way round.
        self._header_key = hmac.new(
            self._key, b"durable_steps checkpoint header", "sha256"
        ).digest()

    def seal(self, header: bytes, payload: bytes) -> str:
        """The hex tag binding a checkpoint's header line to its payload.

        It covers the header bytes and the payload's own 32-byte tag, which
        authenticates the rest of the payload: so the cost of signing a
        header is constant, however large the state, and an intent or lease
        write that reuses the payload does not hash it again.
        """
        material = header + b"\n" + payload[: self._TAG]
        return hmac.new(self._header_key, material, hashlib.sha256).hexdigest()

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def dumps(self, state: Any) -> bytes:
        """Encode with the inner serializer and prepend the tag."""
        payload = self.inner.dumps(state)
        return self._tag(payload) + payload

    def loads(self, data: bytes) -> Any:
        """Verify the tag, then decode; a bad tag is refused unread."""
        tag, payload = data[: self._TAG], data[self._TAG :]
        if len(tag) != self._TAG or not hmac.compare_digest(tag, self._tag(payload)):
            raise CorruptCheckpoint(
                "the state's signature does not verify: the checkpoint was changed by "
                "someone without the signing key, or written with another key. It was "
                "not unpickled."
            )
        return self.inner.loads(payload)


def resolve_serializer(
    serializer: str | Serializer, signing_key: bytes | str | None = None
) -> Serializer:
    """Turn the ``serializer=`` and ``signing_key=`` options into a serializer.

    A pickle serializer is signed when a key is given or
    ``$DURABLE_STEPS_SIGNING_KEY`` is set; JSON needs no signature to be safe.
    """
    if isinstance(serializer, str):
        known: dict[str, Callable[[], Serializer]] = {
            "json": JSONSerializer,
            "pickle": PickleSerializer,
        }
        if serializer not in known:
            raise DefinitionError(
                f"unknown serializer {serializer!r}: use 'json', 'pickle' or a Serializer object"
            )
        serializer = known[serializer]()
    elif not isinstance(serializer, Serializer):
        raise DefinitionError(
            f"serializer must be 'json', 'pickle' or a Serializer, not {serializer!r}"
        )
    key = signing_key if signing_key is not None else os.environ.get(SIGNING_KEY_ENV)
    if key and serializer.name == "pickle":
        return SignedSerializer(serializer, key)
    if signing_key is not None and not isinstance(serializer, SignedSerializer):
        return SignedSerializer(serializer, signing_key)
    return serializer
