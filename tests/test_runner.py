"""The runner's behaviour: every guarantee of DESIGN.md, on every store, sync and async.

Crashes here are simulated in-process (``testing.SimulatedCrash`` from a store
wrapper or a step); tests/test_crash.py kills real processes with SIGKILL.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.testing import CrashingStore, SimulatedCrash

Runner = Callable[..., Any]


@pytest.fixture(params=["sync", "async"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Run a workflow with wf.run or, under asyncio, with wf.arun."""

    def runner(wf: ds.Workflow, run_id: str, state: Any = None) -> Any:
        if request.param == "sync":
            return wf.run(run_id, state)
        return asyncio.run(wf.arun(run_id, state))

    return runner


def header_of(store: ds.Store, wf: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(wf, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


class Recorder:
    """Steps that log what ran, with which key, for assertions."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (step, iteration, attempt)
        self.keys: list[tuple[str, int, str]] = []

    def note(self, ctx: ds.Context) -> None:
        self.calls.append((ctx.step, ctx.iteration, ctx.attempt))
        self.keys.append((ctx.step, ctx.iteration, ctx.idempotency_key))


# --- steps, state and loops ----------------------------------------------------


def test_steps_run_in_order_in_place_or_returned(store: ds.Store, run: Runner) -> None:
    """Steps run in order; in-place changes and returned states both carry on."""
    wf = ds.Workflow("order", store=store)

    @wf.step()
    def first(state: dict[str, Any]) -> None:
        state["seen"].append("first")

    @wf.step()
    def second(state: dict[str, Any]) -> dict[str, Any]:
        return {"seen": [*state["seen"], "second"], "replaced": True}

    @wf.step()
    def third(state: dict[str, Any], ctx: ds.Context) -> None:
        state["seen"].append(ctx.step)

    final = run(wf, "r1", {"seen": []})
    assert final == {"seen": ["first", "second", "third"], "replaced": True}
    assert header_of(store, "order", "r1").status == "completed"


def test_until_repeats_passes_and_is_checked_first(store: ds.Store, run: Runner) -> None:
    """until() is checked before each pass: passes repeat while it is false."""
    rec = Recorder()
    wf = ds.Workflow("loop", store=store, until=lambda s: s["n"] >= 3)

    @wf.step()
    def inc(state: dict[str, Any], ctx: ds.Context) -> None:
        rec.note(ctx)
        state["n"] += 1

    assert run(wf, "r1", {"n": 0}) == {"n": 3}
    assert [c[1] for c in rec.calls] == [0, 1, 2]
    assert run(wf, "already-done", {"n": 5}) == {"n": 5}
    assert len(rec.calls) == 3, "until true before the first pass runs nothing"
    assert header_of(store, "loop", "already-done").status == "completed"


def test_finish_ends_the_run_early(store: ds.Store, run: Runner) -> None:
    """ctx.finish() completes the run with the step's commit; nothing after runs."""
    wf = ds.Workflow("early", store=store, until=lambda s: False)

    @wf.step()
    def decide(state: dict[str, Any], ctx: ds.Context) -> None:
        state["n"] += 1
        if state["n"] == 2:
            ctx.finish()

    @wf.step()
    def after(state: dict[str, Any]) -> None:
        state["after"] += 1

    assert run(wf, "r1", {"n": 0, "after": 0}) == {"n": 2, "after": 1}
    assert header_of(store, "early", "r1").status == "completed"


def test_new_run_without_state_starts_from_empty_dict(store: ds.Store, run: Runner) -> None:
    """state=None on a new run starts from {}."""
    wf = ds.Workflow("empty", store=store)
    wf.step(name="set")(lambda s: s.update(x=1))
    assert run(wf, "r1") == {"x": 1}


def test_completed_run_reruns_nothing(store: ds.Store, run: Runner) -> None:
    """A rerun of a completed run returns its final state and runs no step."""
    calls: list[str] = []
    wf = ds.Workflow("done", store=store)

    @wf.step()
    def bump(state: dict[str, Any]) -> None:
        calls.append("bump")
        state["n"] += 1

    assert run(wf, "r1", {"n": 0}) == {"n": 1}
    assert run(wf, "r1", {"n": 100}) == {"n": 1}
    assert calls == ["bump"]


def _tombstone(store: ds.Store, workflow: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    assert found is not None
    header, payload = ckpt.decode(found[0], where="test")
    assert (header.status, payload, header.owner, header.intent) == ("deleted", b"", None, None)
    return header


def test_on_complete_delete_leaves_a_tombstone(store: ds.Store, run: Runner) -> None:
    """on_complete='delete' drops the state but keeps a tombstone: a rerun returns None
    and fires nothing; once the tombstone is removed the id starts a new run with new keys.
    """
    keys: list[str] = []
    wf = ds.Workflow("tidy", store=store, on_complete="delete")

    @wf.step(idempotent=False)
    def charge(state: dict[str, Any], ctx: ds.Context) -> None:
        keys.append(ctx.idempotency_key)
        state["secret"] = "card-4242"

    assert run(wf, "r1", {}) == {"secret": "card-4242"}
    tomb = _tombstone(store, "tidy", "r1")
    assert b"card-4242" not in store.get(ckpt.checkpoint_key("tidy", "r1"))[0]  # type: ignore[index]
    assert run(wf, "r1", {}) is None
    assert len(keys) == 1
    assert not wf.submit("r1", {})  # the id stays taken
    found = store.get(ckpt.checkpoint_key("tidy", "r1"))
    assert found is not None
    store.delete(ckpt.checkpoint_key("tidy", "r1"), match=found[1])  # what `rm` does
    run(wf, "r1", {})
    assert len(keys) == 2
    assert keys[0] != keys[1]
    assert tomb.run_nonce != _tombstone(store, "tidy", "r1").run_nonce


def test_resume_of_a_deleted_run_returns_none_and_writes_nothing(store: ds.Store) -> None:
    """wf.resume (and aresume) of a run completed under on_complete='delete' returns None,
    as a rerun does: the run exists (its tombstone), so no RunNotFound, but no state is kept.
    """
    fired: list[str] = []
    wf = ds.Workflow("tidy", store=store, on_complete="delete")
    wf.step(name="charge", idempotent=False)(lambda s: fired.append("charge"))
    assert wf.run("r1", {"card": "4242"}) == {"card": "4242"}
    before = store.get(ckpt.checkpoint_key("tidy", "r1"))
    assert wf.resume("r1") is None
    assert asyncio.run(wf.aresume("r1")) is None
    assert store.get(ckpt.checkpoint_key("tidy", "r1")) == before  # nothing written
    assert fired == ["charge"]
    with pytest.raises(ds.RunNotFound):
        wf.resume("never-ran")


def test_on_complete_delete_after_crash_before_delete(store: ds.Store, run: Runner) -> None:
    """A completed run left behind by a crash before its delete is deleted by the rerun, unrun."""
    calls: list[int] = []
    marking = ds.Workflow("tidy", store=store)
    marking.step(name="once")(lambda s: calls.append(1))
    run(marking, "r1", {})
    deleting = ds.Workflow("tidy", store=store, on_complete="delete")
    deleting.step(name="once")(lambda s: calls.append(2))
    assert run(deleting, "r1") == {}
    assert calls == [1]
    _tombstone(store, "tidy", "r1")
    assert run(deleting, "r1") is None


def test_step_is_still_a_plain_function() -> None:
    """Decorated steps stay callable as the function, for unit tests."""

    @ds.step(idempotent=False)
    def charge(state: dict[str, Any], ctx: Any) -> str:
        return f"charged {state['amount']} with {ctx}"

    assert charge({"amount": 5}, "k") == "charged 5 with k"
    wf = ds.Workflow("plain", store="memory://")

    @wf.step()
    def think(state: dict[str, Any]) -> int:
        return state["x"] * 2

    assert think({"x": 21}) == 42
    assert [s.name for s in wf.steps] == ["think"]


def test_steps_list_accepts_plain_functions(run: Runner) -> None:
    """Workflow(steps=[...]) takes Step objects and plain functions, in order."""

    def read(state: dict[str, Any]) -> None:
        state["log"].append("read")

    write = ds.step(lambda s: s["log"].append("write"), name="write", idempotent=False)
    wf = ds.Workflow("mixed", steps=[read, write], store="memory://")
    assert run(wf, "r1", {"log": []}) == {"log": ["read", "write"]}
    assert [s.idempotent for s in wf.steps] == [True, False]


# --- context and idempotency keys ------------------------------------------------


def test_context_fields_and_key_shape(store: ds.Store, run: Runner) -> None:
    """ctx names the run, step, pass and attempt; keys are <=64 printable ASCII."""
    seen: list[ds.Context] = []
    wf = ds.Workflow("ctx", store=store, until=lambda s: s["n"] == 2)

    @wf.step(idempotent=False)
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        seen.append(ctx)
        state["n"] += 1

    run(wf, "r-7", {"n": 0})
    assert [(c.run_id, c.workflow, c.step, c.iteration, c.attempt) for c in seen] == [
        ("r-7", "ctx", "pay", 0, 1),
        ("r-7", "ctx", "pay", 1, 1),
    ]
    for c in seen:
        assert len(c.idempotency_key) <= 64
        assert c.idempotency_key.isascii()
        assert c.idempotency_key.isprintable()
        assert not c.in_doubt
    assert seen[0].idempotency_key != seen[1].idempotency_key


def test_intent_with_key_is_durable_before_the_step_fires(store: ds.Store, run: Runner) -> None:
    """A non-idempotent step's key and intent are in the stored checkpoint when it runs."""
    observed: list[ckpt.Checkpoint] = []
    wf = ds.Workflow("intent", store=store)

    @wf.step(idempotent=False)
    def charge(state: dict[str, Any], ctx: ds.Context) -> None:
        header = header_of(store, "intent", ctx.run_id)
        observed.append(header)
        assert header.intent is not None
        assert header.intent["key"] == ctx.idempotency_key
        assert header.intent["step"] == "charge"

    run(wf, "r1", {})
    assert len(observed) == 1
    assert header_of(store, "intent", "r1").intent is None


def test_keys_differ_between_runs_and_restarts(store: ds.Store, run: Runner) -> None:
    """Keys differ between runs, and for a run deleted and started again under its id."""
    rec = Recorder()
    wf = ds.Workflow("keys", store=store)

    @wf.step(idempotent=False)
    def send(state: dict[str, Any], ctx: ds.Context) -> None:
        rec.note(ctx)

    run(wf, "a", {})
    run(wf, "b", {})
    store.delete(ckpt.checkpoint_key("keys", "a"))
    run(wf, "a", {})
    keys = [k for _, _, k in rec.keys]
    assert len(keys) == 3
    assert len(set(keys)) == 3


def test_key_is_stable_across_retries_and_resume(store: ds.Store, run: Runner) -> None:
    """The same key is used by every retry and by the re-fire after a crash."""
    rec = Recorder()
    crash = {"armed": True}
    wf = ds.Workflow("stable", store=store)

    @wf.step(idempotent=False, retry=ds.Retry(attempts=3, wait=0))
    def charge(state: dict[str, Any], ctx: ds.Context) -> None:
        rec.note(ctx)
        if ctx.attempt < 3:
            raise TimeoutError("gateway slow")
        if crash["armed"]:
            crash["armed"] = False
            raise SimulatedCrash("process dies after the charge went out")

    with pytest.raises(SimulatedCrash):
        run(wf, "r1", {})
    run(wf, "r1")
    assert [c[2] for c in rec.calls] == [1, 2, 3, 1, 2, 3]  # attempts restart after a resume
    assert len({k for _, _, k in rec.keys}) == 1


# --- in-doubt steps ------------------------------------------------------------


def _crash_once_inside(wf: ds.Workflow, *, run: Runner, **options: Any) -> Recorder:
    """Define a non-idempotent step 'pay' that crashes on its first call, and crash the run."""
    rec = Recorder()
    armed = {"crash": True}

    @wf.step(idempotent=False, **options)
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        rec.note(ctx)
        state["paid"] = state.get("paid", 0) + 1
        if armed["crash"]:
            armed["crash"] = False
            raise SimulatedCrash("died after paying")

    with pytest.raises(SimulatedCrash):
        run(wf, "r1", {})
    return rec


def test_in_doubt_refires_with_same_key_by_default(
    store: ds.Store, run: Runner, caplog: pytest.LogCaptureFixture
) -> None:
    """An intent without a commit re-fires with the same key, marked in doubt, and says so."""
    wf = ds.Workflow("refire", store=store)
    rec = _crash_once_inside(wf, run=run)
    seen: list[bool] = []
    wf.on_event = (lambda e: seen.append(e.kind == "step_in_doubt"),)
    with caplog.at_level(logging.WARNING, "durable_steps"):
        assert run(wf, "r1") == {"paid": 1}
    assert rec.keys[0][2] == rec.keys[1][2]
    assert any(seen)
    assert "may have fired" in caplog.text


def test_reconcile_true_counts_step_as_done(store: ds.Store, run: Runner) -> None:
    """reconcile() returning True skips the re-fire and commits what it recorded."""
    asked: list[str] = []

    def already_paid(state: dict[str, Any], ctx: ds.Context) -> bool:
        asked.append(ctx.idempotency_key)
        state["reconciled"] = True
        return True

    wf = ds.Workflow("recon", store=store)
    rec = _crash_once_inside(wf, run=run, reconcile=already_paid)
    assert run(wf, "r1") == {"reconciled": True}
    assert len(rec.calls) == 1
    assert asked == [rec.keys[0][2]]
    assert header_of(store, "recon", "r1").history[-1][2] == 0  # committed with 0 attempts


def test_reconcile_false_refires_from_committed_state(store: ds.Store, run: Runner) -> None:
    """reconcile() returning False re-fires with the same key; its state changes are dropped."""

    def not_paid(state: dict[str, Any], ctx: ds.Context) -> bool:
        state["garbage"] = True
        return False

    wf = ds.Workflow("recon-no", store=store)
    rec = _crash_once_inside(wf, run=run, reconcile=not_paid)
    assert run(wf, "r1") == {"paid": 1}
    assert rec.keys[0][2] == rec.keys[1][2]


def test_in_doubt_raise_then_resolve_fired(store: ds.Store, run: Runner) -> None:
    """in_doubt='raise' stops with StepInDoubt; resolve(fired=True) lets the run go on."""
    wf = ds.Workflow("ask", store=store)
    rec = _crash_once_inside(wf, run=run, in_doubt="raise")
    with pytest.raises(ds.StepInDoubt) as raised:
        run(wf, "r1")
    err = raised.value
    assert err.key == rec.keys[0][2]
    assert err.step == "pay"
    assert err.run == "ask/r1"
    assert "resolve" in str(err)
    assert header_of(store, "ask", "r1").status == "in_doubt"
    wf.resolve("r1", fired=True)
    assert run(wf, "r1") == {}
    assert len(rec.calls) == 1


def test_in_doubt_raise_then_resolve_not_fired(store: ds.Store, run: Runner) -> None:
    """resolve(fired=False) makes the next run fire the step again with the same key."""
    wf = ds.Workflow("ask-no", store=store)
    rec = _crash_once_inside(wf, run=run, in_doubt="raise")
    with pytest.raises(ds.StepInDoubt):
        run(wf, "r1")
    wf.resolve("r1", fired=False)
    assert run(wf, "r1") == {"paid": 1}
    assert rec.keys[0][2] == rec.keys[1][2]


def test_resolve_without_doubt_is_an_error(store: ds.Store) -> None:
    """resolve() on a run with nothing in doubt, or no run, says so."""
    wf = ds.Workflow("calm", store=store)
    wf.step(name="noop")(lambda s: None)
    with pytest.raises(ds.DurableStepsError, match="does not exist"):
        wf.resolve("r1", fired=True)
    wf.run("r1", {})
    with pytest.raises(ds.DurableStepsError, match="no step or effect in doubt"):
        wf.resolve("r1", fired=True)


# --- single writer --------------------------------------------------------------


def test_straggler_is_fenced(store: ds.Store) -> None:
    """A straggler whose run was finished by another writer gets CheckpointConflict and stops."""
    entered, release = threading.Event(), threading.Event()
    ran_after: list[str] = []
    straggling = {"on": True}
    wf = ds.Workflow("fence", store=store)

    @wf.step()
    def slow(state: dict[str, Any]) -> None:
        state["by"] = threading.current_thread().name
        if straggling["on"] and threading.current_thread().name == "straggler":
            entered.set()
            release.wait(30)

    @wf.step()
    def after(state: dict[str, Any]) -> None:
        ran_after.append(threading.current_thread().name)

    errors: list[BaseException] = []

    def straggler() -> None:
        try:
            wf.run("r1", {})
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=straggler, name="straggler")
    t.start()
    assert entered.wait(30)
    with pytest.raises(ds.RunLocked, match=r"fence/r1 is being run by .*takeover=True"):
        wf.run("r1")  # the straggler's execution is live in this process
    winner = wf.run("r1", takeover=True)  # resumes at 'slow' and finishes the run
    release.set()
    t.join(30)
    assert winner["by"] == "MainThread"
    assert len(errors) == 1
    assert isinstance(errors[0], ds.CheckpointConflict)
    assert errors[0].step == "slow"
    assert ran_after == ["MainThread"]
    header = header_of(store, "fence", "r1")
    assert header.status == "completed"
    assert header.committed == 2


def test_concurrent_creation_one_wins(store: ds.Store) -> None:
    """Two processes starting the same new run: the second's create is refused."""
    wf = ds.Workflow("create", store=store)
    wf.step(name="noop")(lambda s: None)
    first = ds.Workflow("create", store=store)
    first.step(name="noop")(lambda s: None)
    crashing = CrashingStore(store, after_write=1)
    first.store = crashing
    with pytest.raises(SimulatedCrash):
        first.run("r1", {"by": "first"})
    # a second writer that had read "no checkpoint" before the first created it
    late = ds.Workflow("create", store=store)
    late.step(name="noop")(lambda s: None)

    class StaleRead:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def get(self, key: str) -> None:
            return None

    late.store = StaleRead()  # type: ignore[assignment]
    with pytest.raises(ds.CheckpointConflict):
        late.run("r1", {"by": "late"})
    assert wf.run("r1") == {"by": "first"}


# --- retries and failures -------------------------------------------------------


def test_retry_starts_from_committed_state(store: ds.Store, run: Runner) -> None:
    """Changes a failed attempt made in place are gone when the next attempt starts."""
    seen: list[Any] = []
    wf = ds.Workflow("clean", store=store)

    @wf.step()
    def setup(state: dict[str, Any]) -> None:
        state["items"] = [1]

    @wf.step(retry=ds.Retry(attempts=3, wait=0, on=ConnectionError))
    def flaky(state: dict[str, Any], ctx: ds.Context) -> None:
        seen.append(list(state["items"]))
        state["items"].append(ctx.attempt)
        if ctx.attempt < 3:
            raise ConnectionError("flaky")

    assert run(wf, "r1", {}) == {"items": [1, 3]}
    assert seen == [[1], [1], [1]]


def test_step_failed_records_error_and_resumes_there(store: ds.Store, run: Runner) -> None:
    """Used-up retries raise StepFailed (cause kept), record the failure, resume there."""
    calls: list[str] = []
    broken = {"on": True}
    wf = ds.Workflow("fail", store=store)

    @wf.step()
    def fetch(state: dict[str, Any]) -> None:
        calls.append("fetch")
        state["fetched"] = True

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=ValueError))
    def parse(state: dict[str, Any]) -> None:
        calls.append("parse")
        state["half"] = True
        if broken["on"]:
            raise ValueError("bad json from the model")

    with pytest.raises(ds.StepFailed) as raised:
        run(wf, "r1", {})
    err = raised.value
    assert isinstance(err.__cause__, ValueError)
    assert err.attempts == 2
    assert (err.run, err.step) == ("fail/r1", "parse")
    header = header_of(store, "fail", "r1")
    assert header.status == "failed"
    assert header.next_step == 1
    assert header.error is not None
    assert header.error["type"] == "builtins.ValueError"
    assert header.error["message"] == "bad json from the model"
    assert header.error["attempts"] == 2
    broken["on"] = False
    assert run(wf, "r1") == {"fetched": True, "half": True}
    assert calls == ["fetch", "parse", "parse", "parse"]
    assert header_of(store, "fail", "r1").error is None


def test_unlisted_exception_is_not_retried(run: Runner) -> None:
    """Only exceptions in Retry(on=...) are retried; others fail on the first attempt."""
    attempts: list[int] = []
    wf = ds.Workflow("picky", store="memory://")

    @wf.step(retry=ds.Retry(attempts=5, wait=0, on=(TimeoutError,)))
    def call(state: dict[str, Any], ctx: ds.Context) -> None:
        attempts.append(ctx.attempt)
        raise KeyError("not transient")

    with pytest.raises(ds.StepFailed) as raised:
        run(wf, "r1", {})
    assert attempts == [1]
    assert raised.value.attempts == 1


@pytest.mark.parametrize(
    ("retry", "errors", "says"),
    [
        (None, [ValueError("bad")], "failed on attempt 1: ValueError: bad."),
        (
            ds.Retry(attempts=3, wait=0, on=ValueError),
            [ValueError("a"), ValueError("b"), ValueError("c")],
            "failed on all 3 attempts: ValueError: c.",
        ),
        (
            ds.Retry(attempts=3, wait=0, on=TimeoutError),
            [TimeoutError("slow"), KeyError("k")],
            "failed on attempt 2: KeyError: 'k'.",
        ),
    ],
    ids=["one-attempt", "attempts-used-up", "not-retried-on-attempt-2"],
)
def test_step_failed_says_which_attempt(
    retry: ds.Retry | None, errors: list[Exception], says: str, run: Runner
) -> None:
    """StepFailed's message gives the attempt number, or "all N attempts" when retries ran out."""
    wf = ds.Workflow("wording", store="memory://")

    @wf.step(retry=retry)
    def call(state: dict[str, Any], ctx: ds.Context) -> None:
        raise errors[ctx.attempt - 1]

    with pytest.raises(ds.StepFailed) as raised:
        run(wf, "r1", {})
    assert f"run wording/r1: step 'call' (iteration 0) {says}" in str(raised.value)


def test_retry_waits_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry waits grow from wait towards max_wait; no_wait() removes the sleeps."""
    slept: list[float] = []
    monkeypatch.setattr("durable_steps._protocol.runner.time.sleep", slept.append)
    wf = ds.Workflow("backoff", store="memory://")

    @wf.step(retry=ds.Retry(attempts=4, wait=1.0, max_wait=3.0))
    def always(state: dict[str, Any]) -> None:
        raise TimeoutError

    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    assert len(slept) == 3
    assert all(1.0 <= s <= 3.0 for s in slept)
    assert slept[-1] == 3.0
    slept.clear()
    with ds.testing.no_wait(), pytest.raises(ds.StepFailed):
        wf.run("r2", {})
    assert slept == []


def test_base_exceptions_propagate_unrecorded(run: Runner) -> None:
    """KeyboardInterrupt in a step propagates as is; the run stays resumable at that step."""
    store = ds.MemoryStore()
    wf = ds.Workflow("interrupt", store=store)

    @wf.step()
    def stop(state: dict[str, Any]) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(wf, "r1", {})
    header = header_of(store, "interrupt", "r1")
    assert header.status == "running"
    assert header.next_step == 0


# --- resume after simulated crashes ---------------------------------------------------


@pytest.mark.parametrize("where", ["before_write", "after_write"])
@pytest.mark.parametrize("write", [1, 2, 3, 4, 5])
def test_resume_after_crash_at_each_write(where: str, write: int, run: Runner) -> None:
    """A crash around any write resumes at the first uncommitted step; nothing committed reruns."""
    inner = ds.MemoryStore()
    calls: list[str] = []

    def make(store: ds.Store) -> ds.Workflow:
        wf = ds.Workflow("resume", store=store)
        wf.step(name="a")(lambda s: calls.append("a") or s.update(a=1))
        wf.step(name="b", idempotent=False)(lambda s: calls.append("b") or s.update(b=1))
        wf.step(name="c")(lambda s: calls.append("c") or s.update(c=1))
        return wf

    with pytest.raises(SimulatedCrash):
        run(make(CrashingStore(inner, **{where: write})), "r1", {})
    before = list(calls)
    assert run(make(inner), "r1", {}) == {"a": 1, "b": 1, "c": 1}
    # writes: 1 create, 2 commit a, 3 intent b, 4 commit b, 5 commit c
    committed = {"before_write": write - 1, "after_write": write}[where]
    done_steps = {0: [], 1: [], 2: ["a"], 3: ["a"], 4: ["a", "b"], 5: ["a", "b", "c"]}[committed]
    rerun = calls[len(before) :]
    assert not set(done_steps) & set(rerun)
    assert sorted(set(before) | set(rerun)) == ["a", "b", "c"] or committed == 5


# --- changed code and bad input ----------------------------------------------------


def test_workflow_changed_names_the_difference(store: ds.Store) -> None:
    """A reorder of the steps still to run raises WorkflowChanged; an added step resumes by name."""
    wf = ds.Workflow("evolve", store=store)
    wf.step(name="plan")(lambda s: None)
    wf.step(name="act")(lambda s: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    swapped = ds.Workflow("evolve", store=store)
    swapped.step(name="act")(lambda s: None)
    swapped.step(name="plan")(lambda s: None)
    with pytest.raises(ds.WorkflowChanged, match="order of the steps still to run") as raised:
        swapped.run("r1")
    assert raised.value.run == "evolve/r1"
    assert raised.value.step == "plan"
    changed = ds.Workflow("evolve", store=store)
    changed.step(name="plan")(lambda s: None)
    changed.step(name="act")(lambda s: s.update(act=1))
    changed.step(name="review")(lambda s: s.update(review=1))
    assert changed.run("r1") == {"act": 1, "review": 1}


def test_unserializable_state_names_path_and_keeps_checkpoint(store: ds.Store, run: Runner) -> None:
    """A value JSON cannot hold raises SerializationError with its path; the checkpoint is kept."""
    wf = ds.Workflow("badstate", store=store)

    @wf.step()
    def ok(state: dict[str, Any]) -> None:
        state["tools"] = ["search", "fetch"]

    @wf.step()
    def bad(state: dict[str, Any]) -> None:
        state["tools"].append(threading.Lock())

    with pytest.raises(ds.SerializationError) as raised:
        run(wf, "r1", {})
    err = raised.value
    assert err.path == "state['tools'][2]"
    assert "state['tools'][2]" in str(err)
    assert "lock" in str(err).lower()
    assert (err.run, err.step) == ("badstate/r1", "bad")
    before = store.get(ckpt.checkpoint_key("badstate", "r1"))
    header = header_of(store, "badstate", "r1")
    assert header.next_step == 1
    assert store.get(ckpt.checkpoint_key("badstate", "r1")) == before


def test_unserializable_initial_state(store: ds.Store) -> None:
    """A new run whose initial state cannot be saved writes nothing."""
    wf = ds.Workflow("badinit", store=store)
    wf.step(name="noop")(lambda s: None)
    with pytest.raises(ds.SerializationError, match=r"state\['when'\]"):
        wf.run("r1", {"when": object()})
    assert store.get(ckpt.checkpoint_key("badinit", "r1")) is None


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b"not a checkpoint at all", "not a durable_steps checkpoint"),
        (lambda b: b[: len(b) - 7], "truncated or damaged"),
        (lambda b: b.replace(b'{"n":1}', b'{"n":7}'), "truncated or damaged"),
        (lambda b: b.replace(b'{"format":2', b'{"format":3', 1), "newer"),
        (lambda b: b"", "not a durable_steps checkpoint"),
    ],
    ids=["garbage", "truncated", "bitflip", "newer-format", "empty"],
)
def test_corrupt_checkpoint_is_refused_untouched(
    store: ds.Store, mangle: Callable[[bytes], bytes], message: str
) -> None:
    """Corrupt, truncated, empty or newer checkpoints raise CorruptCheckpoint, untouched."""
    wf = ds.Workflow("corrupt", store=store)
    wf.step(name="one")(lambda s: s.update(n=1))
    wf.step(name="two")(lambda s: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    key = ckpt.checkpoint_key("corrupt", "r1")
    data, version = store.get(key)  # type: ignore[misc]
    bad = mangle(data)
    store.put(key, bad, match=version)
    stored = store.get(key)
    with pytest.raises(ds.CorruptCheckpoint, match=message) as raised:
        wf.run("r1")
    assert raised.value.run == "corrupt/r1"
    assert store.get(key) == stored


def test_pickle_state_round_trips_objects(store: ds.Store, run: Runner) -> None:
    """serializer='pickle' keeps arbitrary objects (sets, lambdas, classes) across a resume."""

    class Note:
        def __init__(self, text: str) -> None:
            self.text = text

    wf = ds.Workflow("pickled", store=store, serializer="pickle")
    armed = {"crash": True}

    @wf.step()
    def make(state: dict[str, Any]) -> None:
        state.update(tags={"a", "b"}, note=Note("hi"), fn=lambda x: x + 1)

    @wf.step()
    def use(state: dict[str, Any]) -> None:
        if armed["crash"]:
            armed["crash"] = False
            raise SimulatedCrash
        state["out"] = (state["fn"](1), state["note"].text, sorted(state["tags"]))

    with pytest.raises(SimulatedCrash):
        run(wf, "r1", {})
    assert run(wf, "r1")["out"] == (2, "hi", ["a", "b"])


def test_signed_pickle_refuses_tampering_and_unsigned(store: ds.Store, tmp_path: Any) -> None:
    """With a signing key, a tampered or unsigned pickle is refused before it is unpickled."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    key = ckpt.checkpoint_key("signed", "r1")
    wf = ds.Workflow("signed", store=store, serializer="pickle", signing_key="s3cret")
    wf.step(name="one")(lambda s: None)
    wf.step(name="two")(lambda s: (_ for _ in ()).throw(RuntimeError("pause")))
    with pytest.raises(ds.StepFailed):
        wf.run("r1", {"x": 1})
    data, version = store.get(key)  # type: ignore[misc]
    header, payload = ckpt.decode(data, where="t")
    import cloudpickle

    evil = payload[:32] + cloudpickle.dumps({"x": Evil()})
    store.put(key, ckpt.encode(header, evil), match=version)
    with pytest.raises(ds.CorruptCheckpoint, match="signature"):
        wf.run("r1")
    assert not marker.exists()

    unsigned = ds.Workflow("signed", store=store, serializer="pickle")
    unsigned.step(name="one")(lambda s: None)
    unsigned.step(name="two")(lambda s: None)
    unsigned.run("r2", {"x": Evil()})  # written without a key
    with pytest.raises(ds.CorruptCheckpoint, match="not signed"):
        wf.run("r2")
    assert not marker.exists()


def test_signing_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$DURABLE_STEPS_SIGNING_KEY signs pickle checkpoints without code changes."""
    monkeypatch.setenv("DURABLE_STEPS_SIGNING_KEY", "from-env")
    wf = ds.Workflow("envsig", store="memory://", serializer="pickle")
    assert wf.serializer.name == "pickle+hmac-sha256"
    assert ds.Workflow("envjson", store="memory://").serializer.name == "json"


def test_serializer_change_is_refused(store: ds.Store) -> None:
    """Resuming a JSON run with the pickle serializer raises WorkflowChanged."""
    wf = ds.Workflow("ser", store=store)
    wf.step(name="a")(lambda s: None)
    wf.step(name="b")(lambda s: (_ for _ in ()).throw(RuntimeError("pause")))
    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    other = ds.Workflow("ser", store=store, serializer="pickle")
    other.step(name="a")(lambda s: None)
    other.step(name="b")(lambda s: None)
    with pytest.raises(ds.WorkflowChanged, match="serializer 'json'"):
        other.run("r1")


def test_until_that_raises_keeps_the_step_uncommitted() -> None:
    """An until() that raises names the run; the last step is not committed and reruns."""
    store = ds.MemoryStore()
    wf = ds.Workflow("until-bug", store=store, until=lambda s: s["missing"])
    calls: list[int] = []
    wf.step(name="work")(lambda s: calls.append(s.pop("missing")))
    with pytest.raises(ds.DurableStepsError, match="until-bug/r1: until") as raised:
        wf.run("r1", {"missing": False})
    assert raised.value.step == "work"
    assert isinstance(raised.value.__cause__, KeyError)
    assert header_of(store, "until-bug", "r1").committed == 0
    with pytest.raises(ds.DurableStepsError, match="until-bug/r2: until"):
        wf.run("r2", {})
    assert store.get(ckpt.checkpoint_key("until-bug", "r2")) is None


# --- definitions ---------------------------------------------------------------------


def test_bad_definitions_fail_when_decorated() -> None:
    """Bad step and workflow definitions raise DefinitionError at once, with a clear message."""
    wf = ds.Workflow("defs", store="memory://")
    wf.step(name="same")(lambda s: None)
    with pytest.raises(ds.DefinitionError, match="already has a step named 'same'"):
        wf.step(name="same")(lambda s: None)

    def gen(state: Any) -> Any:
        yield state

    with pytest.raises(ds.DefinitionError, match="generator"):
        ds.step(gen)
    # in_doubt= and reconcile= are allowed on idempotent steps: they decide the
    # doubt of the step's effects (ctx.effect).
    assert ds.step(lambda s, c: None, name="r", in_doubt="raise").in_doubt == "raise"
    with pytest.raises(ds.DefinitionError, match="in_doubt"):
        ds.step(lambda s: None, name="r", idempotent=False, in_doubt="maybe")  # type: ignore[arg-type]
    with pytest.raises(ds.DefinitionError, match="drop"):
        ds.step(
            lambda s: None,
            name="r",
            idempotent=False,
            in_doubt="raise",
            reconcile=lambda s, c: True,
        )
    with pytest.raises(ds.DefinitionError, match=r"fn\(state\) or fn\(state, ctx\)"):
        ds.step(lambda a, b, c: None, name="three")
    with pytest.raises(ds.DefinitionError, match="pass name="):
        ds.step(lambda s: None)
    with pytest.raises(ds.DefinitionError, match="retry must be"):
        ds.step(lambda s: None, name="r", retry=3)  # type: ignore[arg-type]
    with pytest.raises(ds.DefinitionError, match="attempts"):
        ds.Retry(attempts=0)
    with pytest.raises(ds.DefinitionError, match="wait"):
        ds.Retry(wait=5, max_wait=1)
    with pytest.raises(ds.DefinitionError, match="on must be"):
        ds.Retry(on=(KeyboardInterrupt,))  # type: ignore[arg-type]
    with pytest.raises(ds.DefinitionError, match="workflow name"):
        ds.Workflow("../etc", store="memory://")
    with pytest.raises(ds.DefinitionError, match="on_complete"):
        ds.Workflow("x", store="memory://", on_complete="keep")  # type: ignore[arg-type]
    with pytest.raises(ds.DefinitionError, match="unknown serializer"):
        ds.Workflow("x", store="memory://", serializer="yaml")
    with pytest.raises(ds.DefinitionError, match="unknown scheme"):
        ds.Workflow("x", store="ftp://host/dir")
    with pytest.raises(ds.DefinitionError, match="no bucket"):
        ds.Workflow("x", store="s3:///prefix")
    assert isinstance(ds.DefinitionError("x"), ValueError)


@pytest.mark.parametrize("run_id", ["../escape", "a/b", ".hidden", "", "x" * 201, "sp ace"])
def test_bad_run_ids_are_refused(run_id: str, tmp_path: Any) -> None:
    """Run ids that could escape the store or hide files are refused before any I/O."""
    wf = ds.Workflow("ids", store=tmp_path / "store")
    wf.step(name="noop")(lambda s: None)
    with pytest.raises(ds.DefinitionError, match="run id"):
        wf.run(run_id, {})
    assert not (tmp_path / "store").exists()


def test_async_steps_need_arun() -> None:
    """An async step in wf.run() is refused with a pointer to arun()."""
    wf = ds.Workflow("asy", store="memory://")

    @wf.step()
    async def think(state: dict[str, Any]) -> None:
        await asyncio.sleep(0)

    with pytest.raises(ds.DefinitionError, match="arun"):
        wf.run("r1", {})
    with pytest.raises(ds.DefinitionError, match="no steps"):
        ds.Workflow("nothing", store="memory://").run("r1", {})


def test_async_and_sync_steps_mix_under_arun(store: ds.Store) -> None:
    """arun awaits async steps (and async reconcile) and calls sync ones."""
    wf = ds.Workflow("mixed-async", store=store, until=lambda s: len(s["log"]) >= 4)

    @wf.step()
    async def fetch(state: dict[str, Any], ctx: ds.Context) -> None:
        await asyncio.sleep(0)
        state["log"].append(f"fetch{ctx.iteration}")

    @wf.step()
    def summarize(state: dict[str, Any]) -> dict[str, Any]:
        return {"log": [*state["log"], "sum"]}

    final = asyncio.run(wf.arun("r1", {"log": []}))
    assert final == {"log": ["fetch0", "sum", "fetch1", "sum"]}


# --- defaults, logging, events, errors -------------------------------------------------


def test_default_store_is_local_directory(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without store=, runs go to $DURABLE_STEPS_STORE, else ./.durable_steps."""
    wf = ds.Workflow("dflt")
    wf.step(name="noop")(lambda s: None)
    wf.run("r1", {})
    assert (tmp_path / ".durable_steps" / "dflt" / "r1" / "checkpoint").is_file()
    monkeypatch.setenv("DURABLE_STEPS_STORE", str(tmp_path / "elsewhere"))
    wf2 = ds.Workflow("dflt")
    wf2.step(name="noop")(lambda s: None)
    wf2.run("r1", {})
    assert (tmp_path / "elsewhere" / "dflt" / "r1" / "checkpoint").is_file()
    assert isinstance(ds.Workflow("m", store="memory://").store, ds.MemoryStore)
    assert isinstance(ds.Workflow("f", store=f"file://{tmp_path}/f").store, ds.LocalStore)


def test_each_commit_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Every committed step is logged at INFO with its step, iteration and duration."""
    wf = ds.Workflow("logged", store="memory://", until=lambda s: s["n"] == 2)
    wf.step(name="tick")(lambda s: s.update(n=s["n"] + 1))
    with caplog.at_level(logging.INFO, "durable_steps"):
        wf.run("r1", {"n": 0})
    commits = [r.getMessage() for r in caplog.records if "committed step" in r.getMessage()]
    assert len(commits) == 2
    assert "'tick' (iteration 1, attempt 1) in 0.0" in commits[1]


def test_events_reach_subscribers_and_failures_are_isolated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Subscribers get every event in order; one that raises does not break the run."""
    kinds: list[tuple[str, str | None]] = []

    def broken(event: ds.Event) -> None:
        raise RuntimeError("metrics backend down")

    wf = ds.Workflow(
        "events", store="memory://", on_event=[broken, lambda e: kinds.append((e.kind, e.step))]
    )
    wf.step(name="a")(lambda s: None)
    wf.step(name="b", idempotent=False)(lambda s: None)
    with caplog.at_level(logging.ERROR, "durable_steps"):
        wf.run("r1", {})
    assert kinds == [
        ("run_started", None),
        ("step_started", "a"),
        ("step_committed", "a"),
        ("step_started", "b"),
        ("step_committed", "b"),
        ("run_completed", None),
    ]
    assert "metrics backend down" in caplog.text


@pytest.mark.parametrize(
    "error",
    [
        ds.StepInDoubt("m", run="w/r", step="s", key="k", iteration=2),
        ds.StepFailed("m", run="w/r", step="s", attempts=3),
        ds.SerializationError("m", run="w/r", step="s", path="state['x']"),
        ds.CheckpointConflict("m", run="w/r", step="s"),
    ],
)
def test_errors_survive_pickling(error: ds.DurableStepsError) -> None:
    """Errors keep their message and structured fields through pickle."""
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.__dict__ == error.__dict__
    assert str(copy) == "m"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_display_on_a_terminal_and_in_a_pipe() -> None:
    """ds.Progress keeps one updated line on a terminal and prints a line per commit elsewhere."""
    pipe, tty = io.StringIO(), _Terminal()
    wf = ds.Workflow(
        "shown",
        store="memory://",
        until=lambda s: s["n"] == 2,
        on_event=[ds.Progress(pipe), ds.Progress(tty)],
    )
    wf.step(name="tick")(lambda s: s.update(n=s["n"] + 1))
    wf.run("r1", {"n": 0})
    lines = pipe.getvalue().splitlines()
    assert [line.split(" · ")[0] for line in lines] == [
        "shown/r1: pass 0",
        "shown/r1: pass 1",
        "shown/r1: completed",
    ]
    assert "2 steps" in lines[-1]
    assert "\r" not in pipe.getvalue()
    screen = tty.getvalue()
    assert screen.count("\n") == 1
    assert screen.endswith("\n")
    assert screen.rsplit("\r", 1)[-1].startswith("shown/r1: completed · 2 steps")


def test_on_complete_delete_spares_a_newer_run(store: ds.Store) -> None:
    """The tombstone of a completed run is conditional: a run rewritten since then is kept."""
    wf = ds.Workflow("tidy2", store=store, on_complete="delete")
    key = ckpt.checkpoint_key("tidy2", "r1")

    @wf.step()
    def once(state: dict[str, Any]) -> None:
        state["n"] = 1

    class RewriteBeforeTombstone:
        """Another writer rewrites the checkpoint just before our tombstone arrives."""

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def put(self, k: str, data: bytes, *, match: str | None = None) -> str:
            if b'"status":"deleted"' in data:
                old, version = store.get(k)  # type: ignore[misc]
                store.put(k, old.replace(b'"committed":1,', b'"committed": 1,'), match=version)
            return store.put(k, data, match=match)

    wf.store = RewriteBeforeTombstone()  # type: ignore[assignment]
    assert wf.run("r1", {}) == {"n": 1}
    found = store.get(key)
    assert found is not None
    assert b'"committed": 1,' in found[0], "the newer checkpoint survived our late tombstone"


def test_resume_claims_with_its_first_write(store: ds.Store) -> None:
    """A plain rerun writes no separate claim: a long first step is claimed by its heartbeat."""
    seen: list[ckpt.Checkpoint] = []
    broken = {"on": True}
    wf = ds.Workflow("lazy", store=store, lease=0.3)  # heartbeat every 0.1 s

    @wf.step()
    def slow(state: dict[str, Any]) -> None:
        if broken["on"]:
            raise ValueError("first try fails")
        time.sleep(0.35)
        seen.append(header_of(store, "lazy", "r1"))

    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    failed = header_of(store, "lazy", "r1")
    assert (failed.status, failed.owner) == ("failed", None)
    broken["on"] = False
    wf.run("r1")
    during = seen[0]
    assert during.status == "running", "the heartbeat's write is the claim"
    assert during.owner is not None
    assert during.owner["pid"] == os.getpid()
    assert during.next_step == 0
