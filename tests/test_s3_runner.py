"""Whole runs on real S3 servers: the request budget, and faults on the wire.

The budget is counted with botocore's event hooks on the client the store
uses, so it is what really went over the wire. The faults come from
tests/faultproxy.py, placed between the client and the real server.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import durable_steps as ds
from durable_steps.testing import SimulatedCrash
from tests.faultproxy import FaultProxy
from tests.s3servers import S3Server

pytestmark = pytest.mark.s3


@pytest.fixture(params=["seaweedfs", "moto"])
def server(request: pytest.FixtureRequest) -> S3Server:
    server: S3Server = request.getfixturevalue(request.param)
    return server


@pytest.fixture
def bucket(server: S3Server, request: pytest.FixtureRequest) -> str:
    name: str = request.getfixturevalue(f"{server.name}_bucket")
    return name


class Wire:
    """Every request a boto3 client sends: operation name and headers."""

    def __init__(self, client: Any) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []  # since the last reset()
        self.everything: list[tuple[str, dict[str, str]]] = []
        client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request: Any, event_name: str, **_: Any) -> None:
        seen = (event_name.rsplit(".", 1)[-1], dict(request.headers))
        self.requests.append(seen)
        self.everything.append(seen)

    def reset(self) -> None:
        self.requests.clear()

    def counts(self) -> Counter[str]:
        kinds = {"PutObject": "PUT", "GetObject": "GET", "ListObjectsV2": "LIST"}
        return Counter(kinds.get(op, op) for op, _ in self.requests)

    def unconditional_puts(self) -> int:
        return sum(
            1
            for op, headers in self.everything
            if op == "PutObject" and "If-None-Match" not in headers and "If-Match" not in headers
        )


def agent(store: ds.Store, ledger: list[tuple[int, str]], crash_at: set[str]) -> ds.Workflow:
    """plan → pay (non-idempotent) → draft, two passes; crash_at names 'step:iteration'."""
    wf = ds.Workflow("agent", store=store, until=lambda s: s["passes"] == 2)

    def maybe_crash(ctx: ds.Context) -> None:
        point = f"{ctx.step}:{ctx.iteration}"
        if point in crash_at:
            crash_at.discard(point)
            raise SimulatedCrash(point)

    @wf.step()
    def plan(state: dict[str, Any], ctx: ds.Context) -> None:
        state["log"].append(f"plan{ctx.iteration}")

    @wf.step(idempotent=False)
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        ledger.append((ctx.iteration, ctx.idempotency_key))
        maybe_crash(ctx)
        state["log"].append(f"pay{ctx.iteration}")

    @wf.step()
    def draft(state: dict[str, Any], ctx: ds.Context) -> None:
        maybe_crash(ctx)
        state["log"].append(f"draft{ctx.iteration}")
        state["passes"] += 1

    return wf


FINAL = {"log": ["plan0", "pay0", "draft0", "plan1", "pay1", "draft1"], "passes": 2}


def test_request_budget_over_the_wire(server: S3Server, bucket: str) -> None:
    """1 PUT per idempotent step, 2 per non-idempotent; creating a run costs its head and
    its index marker, completing it a done entry and the marker's DELETE (the first run
    of a workflow in a process also looks it up in the registry); resume: 1 GET, no LIST.
    """
    client = server.client()
    store = ds.S3Store(bucket, f"budget-{uuid.uuid4().hex[:8]}", client=client)
    store.check_conditional_writes()  # once per process and bucket, not per run
    wire = Wire(client)
    ledger: list[tuple[int, str]] = []

    assert agent(store, ledger, set()).run("fresh", {"log": [], "passes": 0}) == FINAL
    # registry (LIST it, LIST the store: empty, so PUT "complete" and the workflow's
    # entry) + marker + create + 2 passes x (plan 1 + pay 2 + draft 1) + done entry,
    # and the DELETE of the marker
    assert wire.counts() == {"GET": 1, "LIST": 2, "PUT": 2 + 1 + 1 + 2 * 4 + 1, "DeleteObject": 1}

    wire.reset()
    with pytest.raises(SimulatedCrash):
        agent(store, ledger, {"draft:1"}).run("crashy", {"log": [], "passes": 0})
    assert wire.counts() == {"GET": 1, "PUT": 1 + 1 + 4 + 3}  # draft:1 never committed

    wire.reset()
    assert agent(store, ledger, set()).run("crashy") == FINAL
    # draft:1's commit (which also claims the run), its done entry and the marker's
    # DELETE; a resumed run LISTs its parts once at completion for what crashes left
    assert wire.counts() == {"GET": 1, "PUT": 2, "DeleteObject": 1, "LIST": 1}

    wire.reset()
    assert agent(store, ledger, set()).run("crashy") == FINAL
    assert wire.counts() == {"GET": 1}  # completed: read, run nothing

    assert sum(op == "PutObject" for op, _ in wire.everything) == 13 + 9 + 2
    assert wire.unconditional_puts() == 0
    assert len({key for _, key in ledger}) == 4  # two runs x two passes, one key each


def test_probe_is_paid_once_per_process_and_bucket(server: S3Server) -> None:
    """The conditional-write probe costs 2 PUT + 1 DELETE before the first write to a bucket,
    nothing for later stores on it, and a new run after it still costs 1 GET + its PUTs."""
    bucket = server.make_bucket()
    client = server.client()
    wire = Wire(client)
    first = ds.S3Store(bucket, "a", client=client)
    assert wire.counts() == {}  # nothing at construction: a read-only store never probes
    ledger: list[tuple[int, str]] = []
    assert agent(first, ledger, set()).run("r", {"log": [], "passes": 0}) == FINAL
    # the probe's 2 PUTs and DELETE, then the run (see the budget test above)
    run = {"GET": 1, "LIST": 2, "PUT": 4 + 2 * 4 + 1, "DeleteObject": 1}
    assert wire.counts() == {**run, "PUT": 2 + run["PUT"], "DeleteObject": 2}
    wire.reset()
    second = ds.S3Store(bucket, "b", client=client)
    assert agent(second, ledger, set()).run("r", {"log": [], "passes": 0}) == FINAL
    assert wire.counts() == run
    assert wire.unconditional_puts() == 0
    client.close()


class FaultsBeforeWrites:
    """Queues a proxy fault just before the store's N-th write (1-based) of a run's own
    objects (its index entries pass through uncounted, as CrashingStore does)."""

    def __init__(self, inner: ds.Store, schedule: dict[int, Callable[[], None]]) -> None:
        self.inner, self.schedule, self.writes = inner, schedule, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        if key.startswith("_index/"):
            return self.inner.put(key, data, match=match)
        self.writes += 1
        if self.writes in self.schedule:
            self.schedule[self.writes]()
        return self.inner.put(key, data, match=match)


@pytest.fixture
def proxy(server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(server.endpoint_url).start()
    yield p
    p.stop()


def test_run_survives_faults_on_every_kind_of_write(
    server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """Lost responses, 5xx, SlowDown, 409 and timeouts on creates, intents and commits:
    the run completes with the right state, one payment per key, no false conflict."""
    client = server.client(endpoint_url=proxy.endpoint_url, read_timeout=1.5)
    s3 = ds.S3Store(bucket, f"faults-{uuid.uuid4().hex[:8]}", client=client, sleep=lambda _: None)
    s3.check_conditional_writes()  # its requests are not the run's: keep the schedule on those
    proxy.clear()
    # writes: 1 create, 2 plan0, 3 intent pay0, 4 pay0, 5 draft0, 6 plan1, 7 intent pay1, ...
    schedule: dict[int, Callable[[], None]] = {
        1: proxy.drop_after,  # the create landed, its response was lost
        3: proxy.drop_after,  # the intent landed, its response was lost
        4: lambda: proxy.status(503),
        5: proxy.slowdown,
        6: proxy.conflict409,
        7: lambda: proxy.delay(3.0),  # the intent PUT outlives the read timeout
        8: proxy.drop_before,
        9: proxy.drop_after,  # the final commit (with the terminal marker) lost its answer
    }
    ledger: list[tuple[int, str]] = []
    store = FaultsBeforeWrites(s3, schedule)
    final = agent(store, ledger, set()).run("r1", {"log": [], "passes": 0})  # type: ignore[arg-type]
    assert final == FINAL
    assert proxy.pending() == 0, "every scheduled fault was hit"
    assert [it for it, _ in ledger] == [0, 1], "each payment fired exactly once"
    assert ledger[0][1] != ledger[1][1]
    fresh = agent(ds.S3Store(bucket, s3.prefix, client=server.client()), ledger, set())
    assert fresh.run("r1") == FINAL  # completed, and readable by a clean client
    assert len(ledger) == 2


def _delete_agent(store: ds.Store, ledger: list[tuple[int, str]]) -> ds.Workflow:
    wf = agent(store, ledger, set())
    wf.on_complete = "delete"
    return wf


def _three_attempt_store(server: S3Server, bucket: str, proxy: FaultProxy, name: str) -> ds.S3Store:
    """A store behind the proxy, under a fresh prefix, that gives up after 3 attempts."""
    client = server.client(endpoint_url=proxy.endpoint_url)
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    return ds.S3Store(bucket, prefix, client=client, retry_attempts=3, sleep=lambda _: None)


def _lose_the_answer(proxy: FaultProxy) -> Callable[[], None]:
    """A fault for the next write: it lands, its answer is lost, both retries get 503."""

    def lose() -> None:
        proxy.drop_after()
        proxy.status(503, times=2)

    return lose


def test_a_lost_tombstone_answer_never_reports_or_restarts_a_completed_run(
    server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """on_complete='delete': the tombstone lands, its answer is lost, the retries get 503.
    wf.run still returns the final state, and a rerun finds the tombstone and pays nothing."""
    s3 = _three_attempt_store(server, bucket, proxy, "tomb")
    lose_the_answer = _lose_the_answer(proxy)
    ledger: list[tuple[int, str]] = []
    store = FaultsBeforeWrites(s3, {10: lose_the_answer})  # 9 writes of the run, then the tombstone
    assert _delete_agent(store, ledger).run("r1", {"log": [], "passes": 0}) == FINAL  # type: ignore[arg-type]
    assert proxy.pending() == 0
    clean = ds.S3Store(bucket, s3.prefix, client=server.client())
    assert _delete_agent(clean, ledger).run("r1", {"log": [], "passes": 0}) is None
    assert [it for it, _ in ledger] == [0, 1], "no payment fired again"


def test_a_stale_create_can_never_bring_a_deleted_run_back(
    server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """A create held past the read timeout lands after the run completed and was deleted:
    the tombstone keeps the key taken, so it is refused and the run does not come back."""
    client = server.client(endpoint_url=proxy.endpoint_url, read_timeout=1.0)
    s3 = ds.S3Store(bucket, f"stale-{uuid.uuid4().hex[:8]}", client=client, sleep=lambda _: None)
    proxy.delay(6.0)  # the first create outlives the read timeout; its retry goes through
    ledger: list[tuple[int, str]] = []
    assert _delete_agent(s3, ledger).run("r1", {"log": [], "passes": 0}) == FINAL
    proxy.wait_idle(timeout=30)  # the held create has been forwarded and answered
    clean = ds.S3Store(bucket, s3.prefix, client=server.client())
    assert _delete_agent(clean, ledger).run("r1", {"log": [], "passes": 0}) is None
    assert [it for it, _ in ledger] == [0, 1], "the deleted run never ran again"


def test_a_renewal_that_landed_then_failed_is_no_conflict(
    server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """A heartbeat renewal lands, its answer is lost and its retries get 503: the next
    renewal adopts our own write instead of stopping the run with a false conflict."""
    s3 = _three_attempt_store(server, bucket, proxy, "renew")
    lose_the_answer = _lose_the_answer(proxy)
    store = FaultsBeforeWrites(s3, {2: lose_the_answer})  # 1 create, 2 the first renewal
    wf = ds.Workflow("renew", store=store, lease=1.5)  # type: ignore[arg-type]  # beat every 0.5 s
    wf.step(name="slow")(lambda s: time.sleep(2.0))
    assert wf.run("r1", {}) == {}
    assert proxy.pending() == 0
