"""ctx.wait_for and ctx.sleep in an async step do no store I/O on the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds

LATENCY = 0.2
"""Seconds each store request takes: a far-away bucket."""
STALL = LATENCY / 2
"""A request made on the loop stalls it LATENCY or more; half of it leaves room for a
loaded machine's scheduling jitter and still catches every request made there."""


class SlowStore:
    """A local store whose every request takes ``LATENCY`` (the thread sleeps)."""

    def __init__(self, path: Path) -> None:
        self.inner = ds.LocalStore(path)
        self.requests = 0

    def _wait(self) -> None:
        self.requests += 1
        time.sleep(LATENCY)

    def get(self, key: str) -> tuple[bytes, str] | None:
        self._wait()
        return self.inner.get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self._wait()
        return self.inner.put(key, data, match=match)

    def delete(self, key: str, *, match: str | None = None) -> None:
        self._wait()
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ds.ObjectInfo]:
        self._wait()
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


async def worst_tick(work: Any) -> tuple[Any, float]:
    """Run ``work`` beside a task that ticks every 5 ms; its result and the longest
    gap between two ticks (how long the loop was blocked at worst)."""
    worst = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            worst = max(worst, now - last)
            last = now

    ticking = asyncio.ensure_future(ticker())
    try:
        return await work, worst
    finally:
        stop.set()
        await ticking


def waiting_workflow(store: SlowStore, drafts: list[str] | None = None) -> ds.Workflow:
    wf = ds.Workflow("approvals", store=store)

    async def draft() -> str:
        if drafts is not None:
            drafts.append("drafted")
        return "refund 4411?"

    @wf.step()
    async def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["draft"] = await ctx.acall("draft", draft)
        state["answer"] = ctx.wait_for("approval", timeout=3600)
        ctx.sleep(0)  # due at once: recorded, and the step goes on

    @wf.step()
    async def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.sleep(0.3)

    return wf


def test_waits_in_an_async_step_never_block_the_loop(tmp_path: Path) -> None:
    """A wait that suspends, a signal found at wake, a signal there at the first wait,
    a durable sleep: with 200 ms per store request, the loop never stalls 100 ms."""
    store = SlowStore(tmp_path)
    wf = waiting_workflow(store)

    async def scenario() -> list[Any]:
        outcomes: list[Any] = []
        try:  # first reach of the wait: no signal yet, the run suspends
            await wf.arun("r1", {})
        except ds.RunSuspended as waiting:
            outcomes.append(waiting.signal)
        assert await asyncio.to_thread(wf.signal, "r1", "approval", "yes")
        outcomes.append(await wf.arun("r1", wait=True))  # woken: the payload, the nap
        return outcomes

    outcomes, worst = asyncio.run(worst_tick(scenario()))
    assert outcomes == ["approval", {"draft": "refund 4411?", "answer": "yes"}]
    assert store.requests > 10  # the store was used, at 200 ms a request
    assert worst < STALL, f"the event loop was blocked for {worst * 1000:.0f} ms"


def test_a_signal_already_there_at_the_first_wait_is_taken_off_the_loop(tmp_path: Path) -> None:
    """The signal was sent before the step waits: the step runs again once the runner
    found and recorded it off the loop, and the draft is not asked for twice."""
    store = SlowStore(tmp_path)
    drafts: list[str] = []
    wf = waiting_workflow(store, drafts)
    wf.submit("r2", {})
    assert wf.signal("r2", "approval", "no")
    final, worst = asyncio.run(worst_tick(wf.arun("r2", wait=True)))
    assert final == {"draft": "refund 4411?", "answer": "no"}
    assert drafts == ["drafted"]
    assert worst < STALL, f"the event loop was blocked for {worst * 1000:.0f} ms"


@pytest.mark.parametrize("payload", [None, {"ok": True}])
def test_a_sync_run_still_waits_in_the_step(tmp_path: Path, payload: Any) -> None:
    """Outside an event loop the wait reads the signal itself: no extra run of the step."""
    wf = ds.Workflow("sync", store=ds.LocalStore(tmp_path))
    runs = []

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        runs.append(1)
        state["answer"] = ctx.wait_for("approval")

    wf.submit("r1", {})
    assert wf.signal("r1", "approval", payload)
    assert wf.run("r1") == {"answer": payload}
    assert runs == [1]
