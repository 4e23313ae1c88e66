"""Turning the state into bytes and back.

A serializer is a small protocol, separate from storage: ``name``, ``dumps``
and ``loads``. Two ship with durable_steps:

* :class:`JSONSerializer` (``"json"``, the default): human-readable, and safe
  to load from a bucket other people can write to. JSON has no tuples and
  only string keys: tuples come back as lists and ``{1: x}`` as ``{"1": x}``,
  so keep the state in those terms (a resumed run sees the decoded form).
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
import os
import pickle
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .errors import CorruptCheckpoint, DefinitionError, SerializationError

__all__ = [
    "SIGNING_KEY_ENV",
    "JSONSerializer",
    "PickleSerializer",
    "Serializer",
    "SignedSerializer",
    "resolve_serializer",
]

SIGNING_KEY_ENV = "DURABLE_STEPS_SIGNING_KEY"
# Built once: json.dumps() with options makes a new encoder on every call.
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


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
    """UTF-8 JSON; the default. Tuples come back as lists, number keys as strings."""

    name = "json"

    def dumps(self, state: Any) -> bytes:
        """Encode ``state`` as compact JSON, or say which value cannot be."""
        try:
            # check_circular stays on: a cyclic state gets an error, not a
            # RecursionError.
            return _COMPACT_JSON.encode(state).encode()
        except (TypeError, ValueError) as exc:
            path, why = _locate(state, _json_problem)
            raise SerializationError(
                f"{path} cannot be stored as JSON: {why}. Make it a str, int, float, "
                'bool, None, list or dict with str keys, or use serializer="pickle".',
                path=path,
            ) from exc

    def loads(self, data: bytes) -> Any:
        """Decode JSON bytes."""
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpoint(f"the state is not valid JSON ({exc})") from exc


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
        except Exception as exc:
            path, why = _locate(state, _pickle_problem)
            raise SerializationError(
                f"{path} cannot be pickled: {why}. Keep open files, sockets, locks "
                "and clients out of the state and rebuild them in the step that uses them.",
                path=path,
            ) from exc

    def loads(self, data: bytes) -> Any:
        """Unpickle ``data`` (runs code: trust the writer)."""
        try:
            return pickle.loads(data)  # noqa: S301 - documented; sign to refuse foreign bytes
        except Exception as exc:
            raise CorruptCheckpoint(f"the state cannot be unpickled ({exc!r})") from exc


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
        self.inner = inner
        self.name = f"{inner.name}+hmac-sha256"
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


# --- finding the value that cannot be encoded ------------------------------


def _json_problem(value: Any) -> str | None:  # noqa: PLR0911 - a return per JSON type
    """Why ``value`` itself (not its children) cannot be JSON, or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:  # e.g. a lone surrogate from surrogateescape
            return f"the text cannot be encoded as UTF-8 ({exc.reason} at {exc.start})"
        return None
    if value is None or isinstance(value, (bool, int, float)):
        return None
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"its key {key!r} is a {type(key).__name__}; JSON keys are strings"
        return None
    if isinstance(value, (list, tuple)):
        return None
    return f"{type(value).__name__} is not a JSON type"


def _pickle_problem(value: Any) -> str | None:
    """Why ``value`` cannot be pickled, judged by pickling it whole."""
    try:
        import cloudpickle

        cloudpickle.dumps(value)
    except Exception as exc:
        return f"{type(value).__name__} ({exc})"
    return None


def _locate(state: Any, problem: Callable[[Any], str | None]) -> tuple[str, str]:
    """Return ``(path, reason)`` of the innermost value ``problem`` objects to.

    Walks dicts, lists and tuples depth-first. A container whose children are
    all fine but which is itself refused (e.g. a dict with an int key) is
    reported; otherwise the search descends to the first refused child. Cycles
    are reported as such.
    """
    seen: set[int] = set()

    def walk(value: Any, path: str) -> tuple[str, str] | None:
        if isinstance(value, (dict, list, tuple)):
            if id(value) in seen:
                return path, "it contains itself (a reference cycle)"
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                found = walk(child, f"{path}[{key!r}]")
                if found:
                    return found
            seen.discard(id(value))
        why = problem(value)
        return (path, why) if why else None

    return walk(state, "state") or ("state", "it cannot be encoded")
