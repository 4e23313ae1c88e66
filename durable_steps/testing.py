"""Helpers for testing your own workflows' crash recovery.

``no_wait()`` removes retry backoff sleeps::

    with ds.testing.no_wait():
        wf.run("t1", state)

``CrashingStore`` wraps a store and "crashes" (raises :class:`SimulatedCrash`,
a ``BaseException`` that no ``except Exception`` in a step swallows) right
before or right after its N-th write — the boundaries where a real process
can die: before an intent, after it, before a commit, after it. Rerun the
workflow on the inner store to check what your code does on resume::

    store = ds.MemoryStore()
    crashing = ds.testing.CrashingStore(store, after_write=2)
    wf = ds.Workflow("pay", steps=[charge], store=crashing)
    with pytest.raises(ds.testing.SimulatedCrash):
        wf.run("r1", {})
    crashing.disarm()
    wf.run("r1")  # resumes from what was written before the "crash"

For a real kill (SIGKILL) use a child process; the project's own test suite
does both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .stores import ObjectInfo, Store

__all__ = ["CrashingStore", "SimulatedCrash", "no_wait", "sleeps_disabled"]

_no_wait = threading.Event()


@contextmanager
def no_wait() -> Iterator[None]:
    """Within this block, retries follow each other without sleeping."""
    was_set = _no_wait.is_set()
    _no_wait.set()
    try:
        yield
    finally:
        if not was_set:
            _no_wait.clear()


def sleeps_disabled() -> bool:
    """Whether :func:`no_wait` is in force."""
    return _no_wait.is_set()


class SimulatedCrash(BaseException):
    """Raised by :class:`CrashingStore` in place of the process dying."""


class CrashingStore:
    """A store that crashes before or after its N-th write (1-based).

    ``before_write=N``: the N-th ``put`` raises without writing.
    ``after_write=N``: the N-th ``put`` writes, then raises (the caller never
    learns it succeeded). Reads, deletes and lists pass through. Writes of
    the index of runs (keys under ``_index/``) pass through uncounted: the
    boundaries are the run's own writes (its checkpoint and its parts).
    """

    def __init__(
        self, inner: Store, *, before_write: int | None = None, after_write: int | None = None
    ) -> None:
        self.inner = inner
        self.before_write = before_write
        self.after_write = after_write
        self.writes = 0

    def disarm(self) -> None:
        """Stop crashing; later calls pass straight through."""
        self.before_write = self.after_write = None

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Pass through."""
        return self.inner.get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Count the write; crash around it when it is the chosen one."""
        if key.startswith("_index/"):
            return self.inner.put(key, data, match=match)
        self.writes += 1
        if self.writes == self.before_write:
            raise SimulatedCrash(f"simulated crash before write {self.writes} ({key})")
        version = self.inner.put(key, data, match=match)
        if self.writes == self.after_write:
            raise SimulatedCrash(f"simulated crash after write {self.writes} ({key})")
        return version

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Pass through."""
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Pass through."""
        return self.inner.list(prefix)

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()
