"""Store helpers shared by the edge-case tests."""

from __future__ import annotations

import json
from typing import Any

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._record import checkpoint as ckpt
from durable_steps._record.format2 import load_state


class Wrapped:
    """A store that delegates to ``inner``; tests override single methods."""

    def __init__(self, inner: ds.Store) -> None:
        self.inner = inner

    def get(self, key: str) -> tuple[bytes, str] | None:
        return self.inner.get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        return self.inner.put(key, data, match=match)

    def delete(self, key: str, *, match: str | None = None) -> None:
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Any:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def rewrite_header(store: ds.Store, key: str, **fields: Any) -> None:
    """Change header fields in place (payload, size and crc32 untouched)."""
    found = store.get(key)
    assert found is not None
    line, _, payload = found[0].partition(b"\n")
    record = json.loads(line)
    record.update(fields)
    store.put(key, json.dumps(record).encode() + b"\n" + payload, match=found[1])


def committed(store: ds.Store, key: str, serializer: Any = None) -> tuple[ckpt.Checkpoint, Any]:
    """A run's header and committed state as a resume rebuilds it, in either format."""
    found = store.get(key)
    assert found is not None
    header, payload = ckpt.decode(found[0], where=key)
    chosen = serializer or ds.serializers.resolve_serializer(header.serializer.split("+")[0])
    if header.format == 1:
        return header, chosen.loads(payload)
    loaded = drive_sync(load_state(header, payload, chosen, key), store)
    assert loaded is not None
    return header, loaded[0]
