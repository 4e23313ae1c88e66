"""GCS's limit of about one write per second to one object name, and how runs keep to it.

The emulator (fake-gcs-server) does not enforce the limit, so a
:class:`~tests.faultproxy.FaultProxy` in front of it answers 429 to a second
write of one object name within a second (``rate_limit``). Through it: a
step making 20 quick journaled calls on GCS succeeds without a single 429
(paced head writes, the calls coalesced into them; see
``durable_steps._fleet.pacing``), while the same step with pacing off fails with
StoreError. The rest (replays, effects, other stores unchanged) runs on a
local store that declares an interval, which is where the journal's logic
lives.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._fleet.pacing import MAX_INTERVAL, Pace, write_interval
from durable_steps._record import checkpoint as ckpt
from tests.cloudservers import FakeGCSServer
from tests.faultproxy import FaultProxy

QUICK = 20


class Paced:
    """A store that declares ``min_write_interval`` and counts head writes."""

    def __init__(self, inner: Any, interval: float) -> None:
        self.inner = inner
        self.min_write_interval = interval
        self.heads: list[tuple[float, ckpt.Checkpoint]] = []
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        return self.inner.get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        version = self.inner.put(key, data, match=match)
        if "/parts/" not in key and not key.startswith("_index/"):
            with self._lock:
                self.heads.append((time.monotonic(), ckpt.decode(data, where=key)[0]))
        return version

    def delete(self, key: str, *, match: str | None = None) -> None:
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ds.ObjectInfo]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def read_head(store: Any, workflow: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


def quick_workflow(store: Any, executed: list[str], name: str = "quick") -> ds.Workflow:
    """One step making QUICK quick sequential ``ctx.call``s."""
    wf = ds.Workflow(name, store=store)

    def lookup(i: int) -> dict[str, int]:
        executed.append(f"q:{i}")
        return {"i": i, "double": 2 * i}

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = [ctx.call(f"q:{i}", lookup, i)["double"] for i in range(QUICK)]
        ctx.finish()

    return wf


@pytest.fixture
def proxy(gcs: FakeGCSServer) -> Iterator[FaultProxy]:
    p = FaultProxy(gcs.endpoint_url).start()
    p.rate_limit(1.0)
    yield p
    p.stop()


def gcs_store(gcs: FakeGCSServer, bucket: str, proxy: FaultProxy, **options: Any) -> Any:
    prefix = f"t-{time.monotonic_ns()}"
    options.setdefault("min_write_interval", 1.0)  # GCSStore's own (the fixture turns it off)
    return gcs.open(bucket, prefix, endpoint_url=proxy.endpoint_url, **options)


@pytest.mark.cloud
def test_the_proxy_answers_429_to_a_second_write_of_one_object_within_a_second(
    gcs: FakeGCSServer, gcs_bucket: str, proxy: FaultProxy
) -> None:
    store = gcs_store(gcs, gcs_bucket, proxy, retry_attempts=1)
    try:
        version = store.put("a", b"1")
        with pytest.raises(ds.StoreError, match="HTTP 429"):
            store.put("a", b"2", match=version)
        store.put("b", b"1")  # another name: its own budget
        time.sleep(1.05)
        store.put("a", b"2", match=version)
        assert store.get("a")[0] == b"2"
        assert proxy.limited == 1
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.cloud
def test_twenty_quick_calls_in_one_step_succeed_on_gcs(
    gcs: FakeGCSServer, gcs_bucket: str, proxy: FaultProxy
) -> None:
    store = gcs_store(gcs, gcs_bucket, proxy)
    assert write_interval(store) == 1.0
    executed: list[str] = []
    try:
        final = quick_workflow(store, executed).run("r1", {})
        assert final["out"] == [2 * i for i in range(QUICK)]
        assert executed == [f"q:{i}" for i in range(QUICK)]
        assert proxy.limited == 0, proxy.refused
        head = read_head(store, "quick", "r1")
        assert head.status == "completed"
        assert head.journal is None
        heads = [t for t, name in proxy.writes if name.endswith(ckpt.checkpoint_key("quick", "r1"))]
        # Created, the quick calls coalesced into at most a write or two, committed.
        assert 2 <= len(heads) <= 4, heads
        assert all(b - a >= 1.0 for a, b in itertools.pairwise(heads))
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.cloud
def test_calls_made_at_twenty_a_second_are_recorded_while_the_step_runs_on_gcs(
    gcs: FakeGCSServer, gcs_bucket: str, proxy: FaultProxy
) -> None:
    """Sustained: 50 calls at ~20 a second. Each second's calls ride on one head
    write while the step goes on (durable, not only kept in memory), no 429."""
    store = gcs_store(gcs, gcs_bucket, proxy)
    wf = ds.Workflow("sustained", store=store)
    durable: list[int] = []

    def lookup(i: int) -> int:
        time.sleep(0.05)
        if i == 49:  # the last call: how many of the step's calls are durable by now
            head = read_head(store, "sustained", "r1")
            durable.append(head.journal["calls"] if head.journal else 0)
        return i

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = [ctx.call(f"q:{i}", lookup, i) for i in range(50)]
        ctx.finish()

    try:
        assert wf.run("r1", {})["out"] == list(range(50))
        assert proxy.limited == 0, proxy.refused
        assert durable[0] >= 20, durable
        heads = [t for t, n in proxy.writes if n.endswith(ckpt.checkpoint_key("sustained", "r1"))]
        assert 3 <= len(heads) <= 6, heads  # create, a write a second, the commit
    finally:
        store.close()


@pytest.mark.cloud
def test_without_pacing_the_same_step_fails_with_store_error(
    gcs: FakeGCSServer, gcs_bucket: str, proxy: FaultProxy
) -> None:
    """What the pacing prevents (and that the proxy above can catch it)."""
    store = gcs_store(
        gcs, gcs_bucket, proxy, min_write_interval=0, retry_attempts=2, retry_wait=0.01
    )
    try:
        with pytest.raises(ds.StoreError, match="429"):
            quick_workflow(store, []).run("r1", {})
        assert proxy.limited >= 2
    finally:
        store.close()


def test_an_effect_waits_for_its_slot_and_its_intent_carries_the_calls_before_it(
    tmp_path: Path,
) -> None:
    store = Paced(ds.LocalStore(tmp_path / "s"), 0.2)
    wf = ds.Workflow("fx", store=store)
    seen: list[ckpt.Checkpoint] = []

    def pay(idempotency_key: str) -> str:
        seen.append(read_head(store.inner, "fx", "r1"))
        return idempotency_key

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        state["calls"] = [ctx.call(f"q:{i}", lambda i=i: i) for i in range(5)]
        state["paid"] = ctx.effect("pay", pay)
        state["after"] = ctx.call("after", lambda: 1)
        ctx.finish()

    final = wf.run("r1", {})
    (head,) = seen
    assert head.journal is not None
    assert head.journal["calls"] == 5, "the deferred calls ride on the intent's write"
    assert [e["name"] for e in head.journal["open"]] == ["pay"]
    assert final["paid"] == head.journal["open"][0]["key"]
    times = [t for t, _ in store.heads]
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(times)), times


def test_deferred_results_replay_in_a_retry_in_this_process(tmp_path: Path) -> None:
    store = Paced(ds.LocalStore(tmp_path / "s"), 1.0)  # no timer fires during the attempts
    wf = ds.Workflow("retry", store=store)
    executed: list[int] = []
    attempts: list[int] = []

    def lookup(i: int) -> int:
        executed.append(i)
        return i

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=ValueError))
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        attempts.append(ctx.attempt)
        state["out"] = [ctx.call(f"q:{i}", lookup, i) for i in range(4)]
        if ctx.attempt == 1:
            raise ValueError("flaky")
        ctx.finish()

    start = time.monotonic()
    assert wf.run("r1", {})["out"] == [0, 1, 2, 3]
    assert attempts == [1, 2]
    assert executed == [0, 1, 2, 3], "the second attempt replayed the deferred results"
    # Created, then committed: the deferred results were never written on their own.
    assert [h.status for _, h in store.heads] == ["running", "completed"]
    assert time.monotonic() - start >= 1.0  # the commit waited for its slot


def test_a_timer_writes_deferred_results_once_the_slot_is_due(tmp_path: Path) -> None:
    store = Paced(ds.LocalStore(tmp_path / "s"), 0.2)
    wf = ds.Workflow("timer", store=store)
    durable: list[int] = []

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        for i in range(3):
            ctx.call(f"q:{i}", lambda: i)
        time.sleep(0.5)  # a long tool run, unjournaled: the timer wrote the calls meanwhile
        head = read_head(store.inner, "timer", "r1")
        durable.append(head.journal["calls"] if head.journal else -1)
        ctx.finish()

    wf.run("r1", {})
    assert durable == [3]


def test_other_stores_write_every_call_before_it_returns(tmp_path: Path) -> None:
    """No interval declared: nothing deferred, one head write per call, as before."""
    store = Paced(ds.LocalStore(tmp_path / "s"), 0.0)
    assert write_interval(store) == 0.0
    assert write_interval(ds.LocalStore(tmp_path / "t")) == 0.0
    wf = ds.Workflow("plain", store=store)
    counts: list[int] = []

    @wf.step
    def work(state: dict[str, Any], ctx: ds.Context) -> None:
        for i in range(3):
            ctx.call(f"q:{i}", lambda: i)
            head = read_head(store.inner, "plain", "r1")
            counts.append(head.journal["calls"] if head.journal else -1)
        ctx.finish()

    wf.run("r1", {})
    assert counts == [1, 2, 3]
    assert len(store.heads) == 1 + 3 + 1  # create, a write per call, the commit


@pytest.mark.parametrize("value", [None, "1", True, -1.0, float("nan"), float("inf")])
def test_an_odd_declared_interval_means_none(value: Any, tmp_path: Path) -> None:
    store = Paced(ds.LocalStore(tmp_path / "s"), value)
    assert write_interval(store) == 0.0


def test_a_huge_declared_interval_is_capped(tmp_path: Path) -> None:
    assert write_interval(Paced(ds.LocalStore(tmp_path / "s"), 1e9)) == MAX_INTERVAL


def test_a_head_read_moments_after_its_stamp_waits_a_whole_interval() -> None:
    """A resume right after a crash: the killed writer's last write may have
    landed just now (its stamp predates its paced send), so the first write waits."""
    pace = Pace(1.0)
    assert pace.due()
    pace.seen(time.time() - 1.5)  # stamped 1.5 s ago, perhaps sent a moment ago
    assert not pace.due()
    assert pace.slot() - time.monotonic() > 0.9
    old = Pace(1.0)
    old.seen(time.time() - 3600)
    assert old.due()
    none = Pace(0.0)
    none.seen(time.time())
    none.wrote()
    assert none.due()
    assert none.slot() == 0.0


def test_a_lease_too_short_for_the_write_interval_is_refused(tmp_path: Path) -> None:
    wf = ds.Workflow("short", store=Paced(ds.LocalStore(tmp_path / "s"), 1.0), lease=2.0)

    @wf.step
    def work(state: dict[str, Any]) -> None:
        pass

    with pytest.raises(ds.DefinitionError, match=r"lease=2 s is too short.*lease=3 or more"):
        wf.run("r1", {})


def test_async_calls_and_threads_are_deferred_and_paced_too(tmp_path: Path) -> None:
    """acall off the loop, and calls from threads in a sync step (group commit
    with deferral): all recorded, every head write a whole interval apart."""
    import asyncio

    store = Paced(ds.LocalStore(tmp_path / "s"), 0.1)
    awf = ds.Workflow("async", store=store)

    async def fetch(i: int) -> int:
        await asyncio.sleep(0.01)
        return i

    @awf.step
    async def gather(state: dict[str, Any], ctx: ds.Context) -> None:
        state["seq"] = [await ctx.acall(f"s:{i}", fetch, i) for i in range(10)]
        state["par"] = await asyncio.gather(*(ctx.acall(f"p:{i}", fetch, i) for i in range(10)))
        ctx.finish()

    final = asyncio.run(awf.arun("r1", {}))
    assert final == {"seq": list(range(10)), "par": list(range(10))}

    twf = ds.Workflow("threads", store=store)

    @twf.step
    def threads(state: dict[str, Any], ctx: ds.Context) -> None:
        out: list[Any] = [None] * 40

        def worker(first: int) -> None:
            for i in range(first, 40, 4):
                time.sleep(0.005)
                out[i] = ctx.call(f"t:{i}", lambda i=i: i)

        pool = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        state["out"] = out
        ctx.finish()

    assert twf.run("r1", {})["out"] == list(range(40))
    for workflow in ("async", "threads"):
        times = [t for t, h in store.heads if h.workflow == workflow]
        assert all(b - a >= 0.1 for a, b in itertools.pairwise(times)), (workflow, times)
        assert len(times) < 10, (workflow, len(times))  # not a write per call
