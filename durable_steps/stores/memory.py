"""An in-process store: for tests, notebooks and trying things out."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from itertools import count

from ..errors import CheckpointConflict
from ._protocol import ObjectInfo

__all__ = ["MemoryStore"]


class MemoryStore:
    """A dict behind a lock, with the same conditional writes as S3.

    Versions are a counter, so a stale compare-and-swap is refused exactly as
    a real bucket would refuse it. Nothing survives the process; use it to
    test workflows (``ds.testing`` crashes them on purpose) or pass the same
    instance to several workflows to share it.
    """

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, str, float]] = {}
        self._lock = threading.Lock()
        self._versions = count(1)

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(data, version)`` or ``None``."""
        with self._lock:
            found = self._objects.get(key)
        return None if found is None else (found[0], found[1])

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Create-only (``match=None``) or compare-and-swap write."""
        with self._lock:
            current = self._objects.get(key)
            if (current is not None) if match is None else (current is None or current[1] != match):
                expected = "no object" if match is None else f"version {match}"
                raise CheckpointConflict(
                    f"memory://{key}: expected {expected}; another writer changed it"
                )
            version = str(next(self._versions))
            self._objects[key] = (bytes(data), version, time.time())
            return version

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key`` if present (and, with ``match``, at that version)."""
        with self._lock:
            current = self._objects.get(key)
            if match is not None and current is not None and current[1] != match:
                raise CheckpointConflict(f"memory://{key}: not at version {match} any more")
            self._objects.pop(key, None)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield the objects under ``prefix``, in key order."""
        with self._lock:
            snapshot = sorted((k, v) for k, v in self._objects.items() if k.startswith(prefix))
        for key, (data, version, modified) in snapshot:
            yield ObjectInfo(key, version, len(data), modified)

    def clock_skew(self) -> float:
        """0.0: the store's clock is this host's."""
        return 0.0

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"MemoryStore({len(self._objects)} objects)"
