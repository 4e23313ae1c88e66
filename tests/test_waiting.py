"""Waiting through the bucket: ctx.sleep, ctx.wait_for, signals, wait=True, resolve(result=)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._fleet.signals import signal_key
from durable_steps._record import checkpoint as ckpt


class Crash(BaseException):
    """Ends a step like a kill: nothing after it is written."""


def head(wf: ds.Workflow, run: str) -> ckpt.Checkpoint:
    found = wf.store.get(ckpt.checkpoint_key(wf.name, run))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


def approval_flow(store: Path, made: list[str], **options: Any) -> ds.Workflow:
    """draft (a call), approve (waits for a signal), pay (an effect)."""
    wf = ds.Workflow("refunds", store=store, **options)

    @wf.step()
    def draft(state: dict[str, Any], ctx: ds.Context) -> None:
        state["draft"] = ctx.call("model", lambda: made.append("model") or "refund 20")

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        state["note"] = ctx.call("summary", lambda: made.append("summary") or "summary")
        state["approval"] = ctx.wait_for("approval")

    @wf.step()
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        if state["approval"]["approved"]:
            state["paid"] = ctx.effect("refund", lambda idempotency_key: made.append("pay") or 20)

    return wf


def test_a_sleep_suspends_the_run_until_it_is_due(tmp_path: Path) -> None:
    """ctx.sleep: RunSuspended with the wake time, lease released; a rerun before it
    raises again without calling anything; after it, the step goes on from the replay.
    """
    made: list[str] = []
    wf = ds.Workflow("sleepy", store=tmp_path)

    @wf.step()
    def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        state["before"] = ctx.call("before", lambda: made.append("before") or 1)
        ctx.sleep(0.6)
        state["after"] = ctx.call("after", lambda: made.append("after") or 2)

    started = time.time()
    with pytest.raises(ds.RunSuspended) as info:
        wf.run("r")
    assert info.value.signal is None
    assert info.value.until is not None
    assert started + 0.6 <= info.value.until < started + 2
    stored = head(wf, "r")
    assert stored.status == "waiting"
    assert stored.owner is None
    assert stored.wait is not None
    assert stored.wait["until"] == info.value.until
    with pytest.raises(ds.RunSuspended):
        wf.run("r")
    assert made == ["before"]
    time.sleep(max(0.0, info.value.until - time.time()) + 0.05)
    assert wf.run("r") == {"before": 1, "after": 2}
    assert made == ["before", "after"]


def test_wait_true_blocks_until_the_sleep_is_due(tmp_path: Path) -> None:
    """wf.run(wait=True) sleeps in the process and then continues."""
    wf = ds.Workflow("blocking", store=tmp_path)

    @wf.step()
    def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.sleep(0.5)
        state["woke"] = True

    started = time.monotonic()
    assert wf.run("r", wait=True) == {"woke": True}
    assert time.monotonic() - started >= 0.5


def test_sleep_until_takes_a_datetime_or_epoch_seconds_and_refuses_nonsense(
    tmp_path: Path,
) -> None:
    """A past datetime returns at once; a string or NaN is a DefinitionError in the step."""
    wf = ds.Workflow("until", store=tmp_path)
    seen: list[str] = []

    @wf.step()
    def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.sleep_until(datetime.now() - timedelta(seconds=5))
        ctx.sleep_until(time.time() - 1)
        seen.append("past")
        ctx.sleep_until(state["when"])

    assert wf.run("a", {"when": 0}) == {"when": 0}
    with pytest.raises(ds.StepFailed) as info:
        wf.run("b", {"when": "tomorrow"})
    assert isinstance(info.value.__cause__, ds.DefinitionError)
    assert "finite number" in str(info.value.__cause__)


def test_a_signal_sent_while_the_run_waits_is_delivered_once(tmp_path: Path) -> None:
    """Suspended for 'approval'; the signal arrives; the rerun gets its payload, pays once."""
    made: list[str] = []
    wf = approval_flow(tmp_path, made)
    with pytest.raises(ds.RunSuspended) as info:
        wf.run("t-1")
    assert info.value.signal == "approval"
    assert re.search(r"durable-steps (--store \S+ )?signal refunds/t-1 approval", str(info.value))
    with pytest.raises(ds.RunSuspended):
        wf.run("t-1")  # not yet sent: still waiting, nothing called
    assert made == ["model", "summary"]
    assert wf.signal("t-1", "approval", {"approved": True}) is True
    assert wf.signal("t-1", "approval", {"approved": False}) is False  # once per name
    final = wf.run("t-1")
    assert final["approval"] == {"approved": True}
    assert final["paid"] == 20
    assert made == ["model", "summary", "pay"]


def test_a_signal_sent_before_the_wait_is_used_at_once(tmp_path: Path) -> None:
    """A run told in advance never suspends."""
    made: list[str] = []
    wf = approval_flow(tmp_path, made)
    wf.submit("t-2")
    assert wf.signal("t-2", "approval", {"approved": False})
    assert wf.run("t-2")["approval"] == {"approved": False}
    assert "pay" not in made


def test_signals_to_missing_or_finished_runs_and_bad_payloads_are_refused(tmp_path: Path) -> None:
    """No such run, a finished run, a non-JSON or oversized payload, a bad name: refused."""
    made: list[str] = []
    wf = approval_flow(tmp_path, made)
    with pytest.raises(ds.DurableStepsError, match="does not exist"):
        wf.signal("nobody", "approval")
    wf.submit("t-3")
    with pytest.raises(ds.SerializationError):
        wf.signal("t-3", "approval", {"when": object()})
    with pytest.raises(ds.SerializationError, match="more than"):
        wf.signal("t-3", "approval", "x" * 300_000)
    with pytest.raises(ds.DurableStepsError, match="not a valid signal name"):
        wf.signal("t-3", "../approval")
    wf.signal("t-3", "approval", {"approved": False})
    wf.run("t-3")
    with pytest.raises(ds.DurableStepsError, match="completed"):
        wf.signal("t-3", "other")


def test_wait_true_picks_up_a_signal_sent_from_elsewhere(tmp_path: Path) -> None:
    """wait=True polls the signal's key and continues once another thread sends it."""
    made: list[str] = []
    wf = approval_flow(tmp_path, made)
    wf.submit("t-4")
    sender = threading.Timer(0.3, wf.signal, args=("t-4", "approval", {"approved": True}))
    sender.start()
    try:
        assert wf.run("t-4", wait=True)["paid"] == 20
    finally:
        sender.cancel()


def test_arun_wait_true_picks_up_a_signal(tmp_path: Path) -> None:
    """The same under asyncio."""
    made: list[str] = []
    wf = approval_flow(tmp_path, made)
    wf.submit("t-5")

    async def main() -> dict[str, Any]:
        async def send() -> None:
            await asyncio.sleep(0.3)
            await asyncio.to_thread(wf.signal, "t-5", "approval", {"approved": True})

        sender = asyncio.create_task(send())
        result = await wf.arun("t-5", wait=True)
        await sender
        return result  # type: ignore[no-any-return]

    assert asyncio.run(main())["paid"] == 20


def test_a_timeout_raises_signal_timeout_in_the_step(tmp_path: Path) -> None:
    """Past its timeout, wait_for raises SignalTimeout where the step can catch it."""
    wf = ds.Workflow("timeouts", store=tmp_path)

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        try:
            state["approval"] = ctx.wait_for("approval", timeout=0.4)
        except ds.SignalTimeout as exc:
            state["approval"] = f"timed out: {exc.signal}"

    with pytest.raises(ds.RunSuspended) as info:
        wf.run("r")
    assert info.value.signal == "approval"
    assert info.value.until is not None
    time.sleep(max(0.0, info.value.until - time.time()) + 0.05)
    assert wf.run("r") == {"approval": "timed out: approval"}


def test_a_received_payload_is_replayed_after_a_crash(tmp_path: Path) -> None:
    """The payload is journaled: a crash after receiving it, and the signal object
    deleted, still give the re-run step the same payload.
    """
    crash = {"on": True}
    wf = ds.Workflow("replayed", store=tmp_path)

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        state["approval"] = ctx.wait_for("approval")
        if crash["on"]:
            crash["on"] = False
            raise Crash

    wf.submit("r")
    wf.signal("r", "approval", {"by": "ana"})
    with pytest.raises(Crash):
        wf.run("r")
    wf.store.delete(signal_key("replayed", "r", "approval"))
    assert wf.run("r") == {"approval": {"by": "ana"}}


def test_waiting_events_reach_subscribers(tmp_path: Path) -> None:
    """run_suspended, signal_received and run_woken are emitted."""
    events: list[ds.Event] = []
    made: list[str] = []
    wf = approval_flow(tmp_path, made, on_event=[events.append])
    with pytest.raises(ds.RunSuspended):
        wf.run("t-6")
    wf.signal("t-6", "approval", {"approved": False})
    wf.run("t-6")
    kinds = [e.kind for e in events]
    assert kinds.index("run_suspended") < kinds.index("run_woken") < kinds.index("signal_received")


def test_on_complete_delete_removes_the_signals(tmp_path: Path) -> None:
    """A deleted run's signals go with it."""
    made: list[str] = []
    wf = approval_flow(tmp_path, made, on_complete="delete")
    wf.submit("t-7")
    wf.signal("t-7", "approval", {"approved": False})
    assert wf.run("t-7")["approval"] == {"approved": False}
    assert list(wf.store.list("refunds/t-7/signals/")) == []
    assert wf.run("t-7") is None


def test_a_signed_workflow_refuses_an_unsigned_signal(tmp_path: Path) -> None:
    """With a signing key, a signal written without it is refused before it is used."""
    made: list[str] = []
    signed = approval_flow(tmp_path, made, signing_key="k" * 32)
    unsigned = approval_flow(tmp_path, made)
    signed.submit("t-8")
    assert unsigned.signal("t-8", "approval", {"approved": True})
    with pytest.raises(ds.StepFailed) as info:
        signed.run("t-8")
    assert isinstance(info.value.__cause__, ds.CorruptCheckpoint)
    assert "not signed" in str(info.value.__cause__)
    signed.submit("t-9")
    assert signed.signal("t-9", "approval", {"approved": False})
    assert signed.run("t-9")["approval"] == {"approved": False}


def test_resolve_with_a_result_gives_the_effect_that_value(tmp_path: Path) -> None:
    """resolve(fired=True, result=...) records what the in-doubt effect returned."""
    fired: list[str] = []

    def lookup(idempotency_key: str) -> dict[str, Any]:
        fired.append(idempotency_key)
        raise Crash

    wf = ds.Workflow("resolved", store=tmp_path)

    @wf.step(in_doubt="raise")
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["tool"] = ctx.effect("refund", lookup)

    with pytest.raises(Crash):
        wf.run("r")
    with pytest.raises(ds.StepInDoubt):
        wf.run("r")
    with pytest.raises(ds.DefinitionError, match="fired=False"):
        wf.resolve("r", fired=False, result={"id": "re_1"})
    wf.resolve("r", fired=True, result={"id": "re_1"})
    assert wf.run("r") == {"tool": {"id": "re_1"}}
    assert len(fired) == 1
