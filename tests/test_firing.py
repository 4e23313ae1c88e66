"""An effect still in flight is never started again until it is done (``_firing``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from tests.conftest import StoreTarget, _target


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


class Api:
    """A side-effecting API that counts calls per key, and overlapping calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.running: Counter[str] = Counter()
        self.overlaps = 0

    def enter(self, key: str) -> None:
        with self.lock:
            self.calls[key] += 1
            self.running[key] += 1
            self.overlaps += self.running[key] > 1

    def leave(self, key: str) -> None:
        with self.lock:
            self.running[key] -= 1


def test_a_retry_waits_for_a_sibling_effect_still_firing_and_replays_it(
    target: StoreTarget,
) -> None:
    """gather(effect that fails fast, slow effect): the retry does not start the slow
    one again while it runs; it finishes once, is recorded, and the retry replays it."""
    api = Api()
    wf = ds.Workflow("gather", store=target.open())
    tries = {"n": 0}

    async def failing(*, idempotency_key: str) -> str:
        tries["n"] += 1
        if tries["n"] == 1:
            raise TimeoutError("the payments API timed out")
        return "ok"

    async def slow(*, idempotency_key: str) -> str:
        api.enter(idempotency_key)
        try:
            await asyncio.sleep(0.3)
            return "refunded"
        finally:
            api.leave(idempotency_key)

    @wf.step(retry=ds.Retry(attempts=3, wait=0))
    async def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["out"] = await asyncio.gather(
            ctx.aeffect("first", failing), ctx.aeffect("refund", slow)
        )

    final = asyncio.run(wf.arun("r1", {}))
    assert final == {"out": ["ok", "refunded"]}
    assert api.overlaps == 0
    assert list(api.calls.values()) == [1]  # fired once: the retry replayed its result


def test_a_thread_left_firing_by_a_failed_sync_step_is_waited_for(target: StoreTarget) -> None:
    """A sync step that starts an effect in a thread and fails before joining it: the
    runner waits for the thread's effect before retrying, which then replays it."""
    api = Api()
    wf = ds.Workflow("threads", store=target.open())
    tries = {"n": 0}

    def charge(*, idempotency_key: str) -> str:
        api.enter(idempotency_key)
        try:
            time.sleep(0.3)
            return "charged"
        finally:
            api.leave(idempotency_key)

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        tries["n"] += 1
        results: list[str] = []
        worker = threading.Thread(target=lambda: results.append(ctx.effect("charge", charge)))
        worker.start()
        if tries["n"] == 1:
            raise RuntimeError("the step gave up before the charge came back")
        worker.join()
        state["out"] = results

    assert wf.run("r1", {}) == {"out": ["charged"]}
    assert api.overlaps == 0
    assert list(api.calls.values()) == [1]


def test_a_suspended_run_woken_here_never_overlaps_the_effect_it_left_running(
    target: StoreTarget,
) -> None:
    """An async step suspends (wait_for) while an effect task is in flight: the run
    waits for the effect before it suspends; woken in this process, it replays it."""
    api = Api()
    store = target.open()
    wf = ds.Workflow("approve", store=store)

    async def notify(*, idempotency_key: str) -> str:
        api.enter(idempotency_key)
        try:
            await asyncio.sleep(0.3)
            return "sent"
        finally:
            api.leave(idempotency_key)

    @wf.step()
    async def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        sent = asyncio.ensure_future(ctx.aeffect("notify", notify))
        await asyncio.sleep(0.01)  # the effect is under way
        state["answer"] = ctx.wait_for("approval")
        state["sent"] = await sent

    with pytest.raises(ds.RunSuspended):
        asyncio.run(wf.arun("r1", {}))
    assert api.calls.total() == 1
    assert wf.signal("r1", "approval", "yes")
    final = asyncio.run(wf.arun("r1"))
    assert final == {"answer": "yes", "sent": "sent"}
    assert api.overlaps == 0
    assert list(api.calls.values()) == [1]


def test_a_start_while_another_start_of_the_key_fires_takes_its_outcome() -> None:
    """Two starts of one key in one process: the second waits, then records what the
    first returned without calling it (the registry alone, two journals)."""
    from durable_steps._execution import firing as _firing

    first, _ = _firing.claim("ds-k1")
    assert first is not None
    again, earlier = _firing.claim("ds-k1")
    assert again is None
    assert earlier is not None
    assert not earlier.done()
    first.done((True, "result"))
    assert earlier.result(timeout=1) == (True, "result")
    third, _ = _firing.claim("ds-k1")  # released: claimable again
    assert third is not None
    third.done((False, None))
