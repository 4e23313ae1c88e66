"""Waits, leases and the one head writer on a store that paces its writes (GCS).

A run on such a store defers quick ``ctx.call`` results into its next head
write (see ``durable_steps._fleet.pacing``). These tests pin what that must not
break: a wait writes the deferred results before the run suspends, so after
the wake the finished calls replay; the runner's own journal writes (a wait's
wake time) go through the journal's one writer, so no two head writes of a
run ever share a slot (on GCS: no 429); the lease stored in the head is
stamped when the write is sent, so store latency does not let it lapse; and
a refused write never silently overwrites another write of ours.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.cloudservers import FakeGCSServer
from tests.faultproxy import FaultProxy
from tests.test_gcs_rate import Paced as PacedHeads
from tests.test_gcs_rate import gcs_store, read_head


class Paced(PacedHeads):
    """test_gcs_rate's counting store, which also takes signals (no heads)."""

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        if "/signals/" in key:
            return str(self.inner.put(key, data, match=match))
        return super().put(key, data, match=match)


@pytest.fixture
def proxy(gcs: FakeGCSServer) -> Iterator[FaultProxy]:
    p = FaultProxy(gcs.endpoint_url).start()
    p.rate_limit(1.0)
    yield p
    p.stop()


def spaced(store: Paced, workflow: str, interval: float) -> None:
    """Every head write of ``workflow`` came a whole interval after the one before."""
    times = [t for t, h in store.heads if h.workflow == workflow]
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert all(g >= interval * 0.98 for g in gaps), gaps


def test_a_sync_wait_for_writes_the_deferred_calls_before_it_suspends(tmp_path: Path) -> None:
    store = Paced(ds.LocalStore(tmp_path / "s"), 1.0)  # the timer cannot fire before the wait
    wf = ds.Workflow("w", store=store)
    executed: list[str] = []

    def model(name: str) -> str:
        executed.append(name)
        return f"{name} v{len(executed)}"

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["draft"] = ctx.call("draft", model, "draft")
        state["ok"] = ctx.wait_for("go")  # no timeout: the wait itself records nothing
        ctx.finish()

    with pytest.raises(ds.RunSuspended):
        wf.run("r1", {})
    head = read_head(store.inner, "w", "r1")
    assert head.status == "waiting"
    assert head.journal is not None
    assert head.journal["calls"] == 1
    wf.signal("r1", "go", True)
    assert wf.run("r1", {}) == {"draft": "draft v1", "ok": True}
    assert executed == ["draft"], "the finished call replayed after the wake"
    spaced(store, "w", 1.0)


@pytest.mark.parametrize("wait", ["sleep", "wait_for"])
def test_an_async_wait_writes_the_deferred_calls_in_one_writer(wait: str, tmp_path: Path) -> None:
    """The wake time (or the look for the signal) is the runner's, off the loop;
    the deferred results ride on its write or on one before the suspension, and
    no two head writes share a slot."""
    store = Paced(ds.LocalStore(tmp_path / "s"), 0.5)
    wf = ds.Workflow("a", store=store)
    executed: list[str] = []

    async def quick(name: str) -> str:
        executed.append(name)
        return name

    @wf.step
    async def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = [await ctx.acall(n, quick, n) for n in ("a", "b")]
        if wait == "sleep":
            ctx.sleep(1.0)
        else:
            ctx.wait_for("go")
        ctx.finish()

    with pytest.raises(ds.RunSuspended):
        asyncio.run(wf.arun("r1", {}))
    head = read_head(store.inner, "a", "r1")
    assert head.status == "waiting"
    assert head.journal is not None
    assert head.journal["calls"] == (3 if wait == "sleep" else 2)  # a, b (and the wake time)
    if wait == "sleep":
        assert head.wait is not None
        time.sleep(max(0.0, head.wait["until"] - time.time()) + 0.05)
    else:
        wf.signal("r1", "go")
    assert asyncio.run(wf.arun("r1", {})) == {"got": ["a", "b"]}
    assert executed == ["a", "b"], "the finished calls replayed after the wake"
    spaced(store, "a", 0.5)


@pytest.mark.slow
@pytest.mark.cloud
def test_an_async_sleep_after_quick_calls_meets_no_429_on_gcs(
    gcs: FakeGCSServer, gcs_bucket: str, proxy: FaultProxy
) -> None:
    store = gcs_store(gcs, gcs_bucket, proxy)
    wf = ds.Workflow("s", store=store)
    executed: list[str] = []

    async def quick(name: str) -> str:
        executed.append(name)
        return name

    @wf.step
    async def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = [await ctx.acall(n, quick, n) for n in ("a", "b")]
        ctx.sleep(1.5)
        ctx.finish()

    try:
        with pytest.raises(ds.RunSuspended):
            asyncio.run(wf.arun("r1", {}))
        head = read_head(store, "s", "r1")
        assert head.wait is not None
        assert head.journal is not None
        assert head.journal["calls"] == 3  # a, b and the wake time, none lost to a clash
        time.sleep(max(0.0, head.wait["until"] - time.time()) + 0.05)
        assert asyncio.run(wf.arun("r1", {})) == {"got": ["a", "b"]}
        assert executed == ["a", "b"]
        assert proxy.limited == 0, proxy.refused
    finally:
        store.close()


class Slow(Paced):
    """Paced, and every write takes ``latency`` seconds to land; remembers when
    each head landed and the lease it stored."""

    def __init__(self, inner: Any, interval: float, latency: float) -> None:
        super().__init__(inner, interval)
        self.latency = latency
        self.landed: list[tuple[float, float | None]] = []

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        time.sleep(self.latency)
        version = super().put(key, data, match=match)
        if key.endswith(ckpt.checkpoint_key("l", "r1")):
            owner = ckpt.decode(data, where=key)[0].owner
            self.landed.append((time.time(), owner["until"] if owner else None))
        return version


@pytest.mark.slow
def test_the_smallest_lease_allowed_holds_under_store_latency(tmp_path: Path) -> None:
    """lease = 3 x interval, writes taking 0.6 s to land: each head lands while
    the lease the one before it stored still runs (no takeover possible)."""
    store = Slow(ds.LocalStore(tmp_path / "s"), 1.0, 0.6)
    wf = ds.Workflow("l", store=store, lease=3.0)

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        start, i = time.monotonic(), 0
        while time.monotonic() - start < 4:
            ctx.call(f"c{i}", lambda: 1)
            i += 1
            if i % 40 == 0:
                ctx.effect(f"e{i}", lambda idempotency_key: 1)
            time.sleep(0.02)
        state["n"] = i

    wf.run("r1", {})
    assert len(store.landed) >= 4
    for (_, until), (landed, _) in itertools.pairwise(store.landed):
        assert until is not None
        assert landed < until, store.landed


class Twin(Paced):
    """After the second head write of a run lands, rewrites it with the same
    owner token (a second writer of ours, which the one-writer design rules out)."""

    def __init__(self, inner: Any, interval: float) -> None:
        super().__init__(inner, interval)
        self.count = 0

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        version = super().put(key, data, match=match)
        if key.endswith(ckpt.checkpoint_key("t", "r1")):
            self.count += 1
            if self.count == 2:
                header, payload = ckpt.decode(data, where=key)
                self.inner.put(key, ckpt.encode(header.evolve(), payload), match=version)
        return version


def test_a_refused_write_never_overwrites_another_write_of_ours(tmp_path: Path) -> None:
    store = Twin(ds.LocalStore(tmp_path / "s"), 0.0)
    wf = ds.Workflow("t", store=store)

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        for i in range(3):
            ctx.call(f"c{i}", int, i)

    with pytest.raises(ds.CheckpointConflict):
        wf.run("r1", {})
    twin = read_head(store.inner, "t", "r1")
    assert twin.journal is not None
    assert twin.journal["calls"] == 1
