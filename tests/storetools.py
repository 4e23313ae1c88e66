"""Store helpers shared by the edge-case tests."""

from __future__ import annotations

import json
from typing import Any

import durable_steps as ds


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
