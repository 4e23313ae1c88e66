"""Regressions found by the review of journaled calls, waiting and deploys.

Each test reproduces one finding and fails on the code before its fix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._fleet.signals import signal_key
from durable_steps._record import checkpoint as ckpt


class Crash(BaseException):
    """Ends a step like a kill: nothing after it is written."""


def test_a_migration_keeps_the_journal_of_the_step_in_progress(tmp_path: Path) -> None:
    """migrate() on a run stopped mid-step with a long journal: its save must not
    fold the journal's records into a base (the run became unreadable).
    """
    calls: list[int] = []
    crash = {"on": False}

    def make(version: str, migrate: Any = None) -> ds.Workflow:
        wf = ds.Workflow("mig", store=tmp_path, version=version, migrate=migrate)

        @wf.step()
        def x(state: dict[str, Any], ctx: ds.Context) -> None:
            for i in range(15):
                ctx.call(f"c{i}", lambda i=i: calls.append(i) or "z" * 1000)
            ctx.sleep(0.3)
            if crash["on"]:
                crash["on"] = False
                raise Crash  # after the migration was saved, before the commit
            state["done"] = True

        return wf

    def grow(state: dict[str, Any], old: str | None) -> dict[str, Any]:
        state["pad"] = "p" * 20_000  # a save big enough to flush
        return state

    with pytest.raises(ds.RunSuspended):
        make("1").run("r", {})
    time.sleep(0.35)
    crash["on"] = True
    with pytest.raises(Crash):
        make("2", grow).run("r", {})
    assert make("2", grow).run("r", {})["done"] is True  # a fresh load reads the journal
    assert calls == list(range(15))  # every call replayed after the migration


def test_a_failed_renewal_does_not_drop_committed_changes(tmp_path: Path) -> None:
    """A renewal that flushed the tail into a part, then failed to write the head,
    must leave the commit keeping the tail (it dropped every change in it).
    """

    class Flaky(ds.LocalStore):
        fail = False
        armed = False

        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if "/parts/" in key and Flaky.fail:
                Flaky.armed = True
            elif key.endswith("/checkpoint") and Flaky.armed:
                Flaky.armed = Flaky.fail = False
                raise ds.StoreError(f"{key}: 503 Slow Down (injected, once)")
            return super().put(key, data, match=match)

    wf = ds.Workflow("hb", store=Flaky(tmp_path), lease=0.9)

    @wf.step()
    def a(state: dict[str, Any]) -> None:
        state["notes"] = "n" * 3000  # committed, in the tail

    @wf.step()
    def b(state: dict[str, Any]) -> None:
        Flaky.fail = True
        time.sleep(0.45)  # one renewal at ~0.3 s
        state["b"] = 1

    @wf.step()
    def c(state: dict[str, Any]) -> None:
        raise Crash

    with pytest.raises(Crash):
        wf.run("r", {"start": True})
    resumed = ds.Workflow("hb", store=tmp_path, lease=0.9)
    resumed.step(name="a")(lambda s: None)
    resumed.step(name="b")(lambda s: None)
    resumed.step(name="c")(lambda s: s.update(c=1))
    assert resumed.run("r") == {"start": True, "notes": "n" * 3000, "b": 1, "c": 1}


def test_a_recorded_timeout_is_replayed_even_if_the_signal_came_since(tmp_path: Path) -> None:
    """Timed out, an escalation fired, then a crash; the signal arrives; the re-run
    takes the timeout branch again instead of also firing the other effect.
    """
    fired: list[str] = []
    crash = {"on": True}
    wf = ds.Workflow("timeout", store=tmp_path)

    @wf.step()
    def decide(state: dict[str, Any], ctx: ds.Context) -> None:
        try:
            ctx.wait_for("approval", timeout=0.2)
            state["did"] = ctx.effect("charge", lambda idempotency_key: fired.append("c") or "c")
        except ds.SignalTimeout:
            state["did"] = ctx.effect("escalate", lambda idempotency_key: fired.append("e") or "e")
        if crash["on"]:
            crash["on"] = False
            raise Crash

    with pytest.raises(ds.RunSuspended):
        wf.run("r")
    time.sleep(0.25)
    with pytest.raises(Crash):
        wf.run("r")
    assert wf.signal("r", "approval", {"ok": True})
    assert wf.run("r") == {"did": "e"}
    assert fired == ["e"]


def test_a_run_lost_to_another_process_is_not_retried(tmp_path: Path) -> None:
    """A journal write refused (the run was taken over) ends the step, even under
    retry=Retry(on=Exception): nothing more fires after the loss.
    """
    fired: list[int] = []
    wf = ds.Workflow("lost", store=tmp_path)

    @wf.step(retry=ds.Retry(attempts=3, wait=0, on=Exception))
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        fired.append(ctx.attempt)
        if ctx.attempt == 1:  # someone else takes the run over now
            other = ds.Workflow("lost", store=tmp_path)
            other.step(name="act")(lambda s: None)
            other.run("r", takeover=True)
        ctx.call("model", lambda: 1)

    with pytest.raises(ds.CheckpointConflict):
        wf.run("r")
    assert fired == [1]


def test_a_signal_to_an_earlier_run_under_the_id_is_not_delivered(tmp_path: Path) -> None:
    """A signal left by a deleted run (a racing rm) is ignored by the new run under
    that id, and a new send replaces it.
    """
    wf = ds.Workflow("incarnations", store=tmp_path, on_complete="delete")

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        state["by"] = ctx.wait_for("approval")

    wf.submit("r")
    stale = wf.store.get(signal_key("incarnations", "r", "approval"))
    assert stale is None
    assert wf.signal("r", "approval", {"for": "first"})
    kept = wf.store.get(signal_key("incarnations", "r", "approval"))
    assert kept is not None
    assert wf.run("r")["by"] == {"for": "first"}
    assert wf.run("r") is None  # the tombstone
    wf.store.delete(ckpt.checkpoint_key("incarnations", "r"))  # rm, whose signal sweep lost a race
    wf.store.put(signal_key("incarnations", "r", "approval"), kept[0], match=None)
    with pytest.raises(ds.RunSuspended):
        wf.run("r")  # the new run does not take the old run's approval
    assert wf.signal("r", "approval", {"for": "second"})  # replaces the stale object
    assert wf.run("r")["by"] == {"for": "second"}


def test_a_signal_received_by_one_pass_is_refused_to_the_next(tmp_path: Path) -> None:
    """Waiting again on a name another pass received raises DefinitionError, not the
    old payload (a second refund would have been approved by the first approval).
    """
    wf = ds.Workflow("loop", store=tmp_path, until=lambda s: len(s["got"]) >= 2)

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"].append(ctx.wait_for("approval"))

    wf.submit("r", {"got": []})
    wf.signal("r", "approval", 1)
    with pytest.raises(ds.StepFailed) as info:
        wf.run("r")
    cause = info.value.__cause__
    assert isinstance(cause, ds.DefinitionError)
    assert "received already" in str(cause)
    assert "ctx.iteration" in str(cause)


def test_an_effect_whose_record_failed_is_recorded_not_fired_by_the_retry(
    tmp_path: Path,
) -> None:
    """The effect returned but its result write failed: the step's retry records the
    value it returned instead of firing the effect again.
    """

    class FailOnce(ds.LocalStore):
        armed = True

        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            header = ckpt.split_header(data)
            journal = header[0].get("journal") if header else None
            if FailOnce.armed and journal and journal.get("calls") == 1:
                FailOnce.armed = False
                raise ds.StoreError("503 (injected, once)")
            return super().put(key, data, match=match)

    fired: list[str] = []
    wf = ds.Workflow("unrecorded", store=FailOnce(tmp_path))

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=ds.StoreError), in_doubt="raise")
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["paid"] = ctx.effect("charge", lambda idempotency_key: fired.append("x") or 5)

    assert wf.run("r") == {"paid": 5}
    assert fired == ["x"]


def test_an_effect_function_without_idempotency_key_is_refused_before_its_intent(
    tmp_path: Path,
) -> None:
    """fn(x) cannot take idempotency_key=: DefinitionError naming the fix, no intent."""
    wf = ds.Workflow("nokey", store=tmp_path)

    def pay(amount: int) -> int:
        return amount

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.effect("pay", pay, 5)

    with pytest.raises(ds.StepFailed) as info:
        wf.run("r")
    assert isinstance(info.value.__cause__, ds.DefinitionError)
    assert "idempotency_key" in str(info.value.__cause__)
    found = wf.store.get(ckpt.checkpoint_key("nokey", "r"))
    assert found is not None
    journal = ckpt.decode(found[0], where="t")[0].journal
    assert journal is None or journal["open"] == []


def test_a_woken_run_is_claimed_before_its_step_runs(tmp_path: Path) -> None:
    """A wake writes its claim before the step: a second process waking the run at
    the same moment is fenced off before it calls anything.
    """
    seen: list[tuple[str, bool]] = []
    wf = ds.Workflow("wake2", store=tmp_path)

    def model() -> int:
        found = wf.store.get(ckpt.checkpoint_key("wake2", "r"))
        assert found is not None
        head = ckpt.decode(found[0], where="t")[0]
        seen.append((head.status, head.owner is not None))
        return 1

    @wf.step()
    def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.sleep(0.2)
        state["model"] = ctx.call("model", model)

    with pytest.raises(ds.RunSuspended):
        wf.run("r")
    time.sleep(0.25)
    assert wf.run("r") == {"model": 1}
    assert seen == [("running", True)]
