"""The storage primitive: bytes in, bytes out, three kinds of write.

A checkpoint store needs exactly what object stores with conditional writes
offer, and nothing more:

* ``get(key)`` returns the bytes and an opaque *version* (S3: the ETag), or
  ``None`` when the key does not exist.
* ``put(key, data, match=None)`` creates the key only if it does not exist
  (S3 ``If-None-Match: *``).
* ``put(key, data, match=version)`` replaces the key only if its current
  version is ``version`` (S3 ``If-Match: <ETag>``).
* ``delete(key, match=version)`` removes it on the same condition, so a late
  delete never removes a newer run that reused the id.

Both writes return the new version, so the caller never has to read an
object back to learn it. A refused precondition raises
:class:`~durable_steps.CheckpointConflict`; every other failure raises
:class:`~durable_steps.StoreError`. There is no unconditional overwrite: every
checkpoint write of durable_steps is create-only or compare-and-swap, which is
what keeps a run single-writer.

Stores are synchronous; the async runner calls them through
``asyncio.to_thread``. Implementations must be safe to call from several
threads.

Any object with callable ``get``, ``put``, ``delete``, ``list`` and ``close``
is a store (``open_store`` looks them up with ``getattr``, so a wrapper that
forwards through ``__getattr__`` qualifies).

Optional methods. Callers look these up with ``getattr(store, name, None)``
and do without when a store lacks them:

* ``clock_skew() -> float | None``: seconds this host's clock is ahead of the
  store's clock (negative: behind), as measured from the store's most recent
  response; ``None`` when unknown. Stores on this host's clock (local,
  memory) return ``0.0``.

And one optional attribute, read with ``getattr(store, name, 0.0)``:

* ``min_write_interval: float``: seconds the service needs between two
  writes of one object name (GCS: about 1). A run then paces its head's
  writes by it and writes the journaled calls made in between together
  (see ``durable_steps._fleet.pacing``). Absent or 0: no limit, every write at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["REQUIRED_METHODS", "ObjectInfo", "Store"]

REQUIRED_METHODS = ("get", "put", "delete", "list", "close")
"""What an object must have, callable, to be a store."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object found by :meth:`Store.list`."""

    key: str
    version: str
    size: int
    modified: float
    """Last modification, seconds since the epoch."""


@runtime_checkable
class Store(Protocol):
    """What a checkpoint store implements. See the module docstring."""

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(data, version)``, or ``None`` if ``key`` does not exist."""
        ...

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write ``data``; create-only when ``match`` is ``None``, else
        compare-and-swap against ``match``. Return the new version.

        Raises :class:`~durable_steps.CheckpointConflict` when the condition
        does not hold.
        """
        ...

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key``; removing a missing key is not an error.

        With ``match``, remove it only if its version is ``match``; raise
        :class:`~durable_steps.CheckpointConflict` if another writer changed
        it since (S3 ``If-Match`` on DeleteObject).
        """
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield every object whose key starts with ``prefix``."""
        ...

    def close(self) -> None:
        """Release connections and handles. The store is unusable after."""
        ...
