"""Journaled calls (ctx.call / ctx.effect): replay, keys, doubt, concurrency, limits.

Crashes here are in-process stand-ins: a BaseException (``Crash``) escapes the
step the way a SIGKILL would end it — nothing after it is written, nothing is
recorded as a failure — and a fresh ``wf.run`` resumes from what the store
holds. ``tests/test_journal_crash.py`` does the same with real SIGKILLs.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.stores import MemoryStore
from tests.storetools import committed


class Crash(BaseException):
    """Ends a step like a kill: not an Exception, so nothing catches it."""


class Counting(MemoryStore):
    """A memory store that keeps every write's size (to measure what calls cost)."""

    def __init__(self, latency: float = 0.0) -> None:
        super().__init__()
        self.writes: list[tuple[str, int]] = []
        self.latency = latency

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self.writes.append((key, len(data)))
        time.sleep(self.latency)  # a store's round trip, so concurrent records can meet
        return super().put(key, data, match=match)


def header_of(store: ds.Store, workflow: str, run: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(workflow, run))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


@pytest.fixture(params=["json", "pickle"])
def serializer(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_retry_replays_finished_calls_and_refires_the_effect_with_its_key(
    tmp_path: Path, serializer: str
) -> None:
    """A flaky tool retried by the step's policy does not repeat the model call before it."""
    seen: list[Any] = []

    def model(messages: list[str]) -> dict[str, Any]:
        seen.append("model")
        return {"tools": ["a", "b"], "n": len(messages)}

    def charge(item: str, idempotency_key: str) -> str:
        seen.append((item, idempotency_key))
        if item == "b" and sum(1 for s in seen if s[0] == "b") == 1:
            raise TimeoutError("flaky")
        return f"paid {item}"

    wf = ds.Workflow("retry", store=tmp_path, serializer=serializer)

    @wf.step(retry=ds.Retry(attempts=3, wait=0))
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        reply = ctx.call("model", model, state["messages"])
        for item in reply["tools"]:
            state["messages"].append(ctx.effect(f"charge:{item}", charge, item))

    assert wf.run("r", {"messages": []}) == {"messages": ["paid a", "paid b"]}
    assert seen.count("model") == 1
    b_keys = [s[1] for s in seen if s[0] == "b"]
    assert len(b_keys) == 2
    assert b_keys[0] == b_keys[1]
    assert len([s for s in seen if s[0] == "a"]) == 1


def test_call_returns_the_decoded_record_on_both_paths(tmp_path: Path, serializer: str) -> None:
    """The value returned is a decoded copy: changing it changes neither the record nor a replay."""
    wf = ds.Workflow("decoded", store=tmp_path, serializer=serializer)
    made = {"reply": ["a"]}
    got: list[Any] = []

    @wf.step(retry=ds.Retry(attempts=2, wait=0))
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        reply = ctx.call("model", lambda: made)
        got.append((reply is made, copy.deepcopy(reply)))
        reply["reply"].append("changed by the step")
        if len(got) == 1:
            raise TimeoutError("retry")

    wf.run("r")
    assert got == [(False, {"reply": ["a"]}), (False, {"reply": ["a"]})]
    assert made == {"reply": ["a"]}


def test_json_results_are_stored_as_json_gives_them_back(tmp_path: Path) -> None:
    """An SDK-like dict subclass, a tuple, an int key: stored plain, alike on both paths."""

    class SDKObject(dict):  # type: ignore[type-arg]  # like stripe.StripeObject
        pass

    wf = ds.Workflow("plain", store=tmp_path)
    got: list[Any] = []

    @wf.step(retry=ds.Retry(attempts=2, wait=0))
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        got.append(ctx.call("sdk", lambda: SDKObject(id="ch_1", pair=(1, 2), by_id={7: "x"})))
        if len(got) == 1:
            raise TimeoutError("retry: the second attempt replays")

    wf.run("r")
    assert got == [{"id": "ch_1", "pair": [1, 2], "by_id": {"7": "x"}}] * 2
    assert all(type(value) is dict for value in got)


def test_a_resume_after_a_crash_replays_calls_and_reuses_the_key(tmp_path: Path) -> None:
    """Killed after two effects: the rerun calls nothing recorded and fires the third once."""
    ledger: list[tuple[str, str]] = []
    model_calls = []
    crash = {"on": True}

    def charge(item: str, idempotency_key: str) -> str:
        ledger.append((item, idempotency_key))
        if item == "b" and crash["on"]:
            crash["on"] = False
            raise Crash  # after the side effect landed, before the result is recorded
        return item

    wf = ds.Workflow("resume", store=tmp_path)

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        tools = ctx.call("model", lambda: model_calls.append(1) or ["a", "b", "c"])
        state["done"] = [ctx.effect(f"pay:{t}", charge, t) for t in tools]

    with pytest.raises(Crash):
        wf.run("r")
    assert header_of(wf.store, "resume", "r").journal is not None
    assert wf.run("r") == {"done": ["a", "b", "c"]}
    assert len(model_calls) == 1
    assert [i for i, _ in ledger] == ["a", "b", "b", "c"]
    assert ledger[1][1] == ledger[2][1]  # the in-doubt effect re-fired under its key
    assert len({k for _, k in ledger}) == 3
    assert wf.run("r") == {"done": ["a", "b", "c"]}  # a third run does nothing
    assert len(ledger) == 4
    assert header_of(wf.store, "resume", "r").journal is None


def test_effect_keys_are_short_ascii_and_distinct_per_name_step_pass_and_run() -> None:
    """Keys are stable for one effect and differ for every other name, step, pass, run."""
    keys = {
        ckpt.effect_key(nonce, it, step, name)
        for nonce in ("n1", "n2")
        for it in (0, 1)
        for step in ("a", "a:b")
        for name in ("x", "b:x", "")
    }
    assert len(keys) == 2 * 2 * 2 * 3
    assert all(len(k) <= 64 and k.isascii() and k.isprintable() for k in keys)
    assert ckpt.effect_key("n", 0, "s", "x") == ckpt.effect_key("n", 0, "s", "x")
    assert ckpt.effect_key("n", 0, "s", "x") != ckpt.idempotency_key("n", 0, 0, "s")


def test_a_name_used_twice_in_one_attempt_is_refused(tmp_path: Path) -> None:
    """Two calls named alike in one attempt raise DefinitionError naming the call."""
    wf = ds.Workflow("twice", store=tmp_path)

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.call("tool", lambda: 1)
        ctx.call("tool", lambda: 2)

    with pytest.raises(ds.StepFailed) as info:
        wf.run("r")
    assert isinstance(info.value.__cause__, ds.DefinitionError)
    assert "'tool'" in str(info.value.__cause__)
    assert "twice/r" in str(info.value.__cause__)


def test_an_unsaveable_result_names_the_call_step_and_run(tmp_path: Path) -> None:
    """A result JSON cannot hold raises SerializationError; nothing is recorded."""
    wf = ds.Workflow("unsaveable", store=tmp_path)
    calls = []

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        calls.append(1)
        ctx.call("sdk", lambda: {"reply": object()})

    with pytest.raises(ds.StepFailed) as info:
        wf.run("r")
    cause = info.value.__cause__
    assert isinstance(cause, ds.SerializationError)
    message = str(cause)
    assert "unsaveable/r" in message
    assert "'act'" in message
    assert "ctx.call('sdk')" in message
    assert cause.path is not None
    assert "reply" in cause.path
    journal = header_of(wf.store, "unsaveable", "r").journal
    assert journal is None or journal["calls"] == 0


def test_the_commit_clears_the_journal_so_the_next_pass_calls_again(tmp_path: Path) -> None:
    """A call name recorded in one pass runs again in the next pass (a new journal)."""
    wf = ds.Workflow("passes", store=tmp_path, until=lambda s: s["n"] >= 3)
    made: list[int] = []

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["n"] += ctx.call("model", lambda: made.append(ctx.iteration) or 1)

    assert wf.run("r", {"n": 0}) == {"n": 3}
    assert made == [0, 1, 2]


def test_in_doubt_raise_names_the_effect_and_resolve_settles_it(tmp_path: Path) -> None:
    """in_doubt='raise': StepInDoubt names the effect; resolve(fired=True) skips it."""
    fired: list[str] = []
    crash = {"on": True}

    def refund(idempotency_key: str) -> str:
        fired.append(idempotency_key)
        if crash["on"]:
            raise Crash
        return "refunded"

    wf = ds.Workflow("raise", store=tmp_path)

    @wf.step(in_doubt="raise")
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["refund"] = ctx.effect("refund", refund)

    with pytest.raises(Crash):
        wf.run("r")
    with pytest.raises(ds.StepInDoubt) as info:
        wf.run("r")
    assert info.value.effect == "refund"
    assert info.value.key == fired[0]
    assert "effect 'refund'" in str(info.value)
    assert header_of(wf.store, "raise", "r").status == "in_doubt"
    assert len(fired) == 1
    wf.resolve("r", fired=True)
    assert wf.run("r") == {"refund": None}
    assert len(fired) == 1


def test_resolve_not_fired_refires_the_effect_with_the_same_key(tmp_path: Path) -> None:
    """resolve(fired=False) makes the rerun fire the effect again, same key."""
    fired: list[str] = []
    crash = {"on": True}

    def refund(idempotency_key: str) -> str:
        fired.append(idempotency_key)
        if crash["on"]:
            crash["on"] = False
            raise Crash
        return "refunded"

    wf = ds.Workflow("notfired", store=tmp_path)

    @wf.step(in_doubt="raise")
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["refund"] = ctx.effect("refund", refund)

    with pytest.raises(Crash):
        wf.run("r")
    with pytest.raises(ds.StepInDoubt):
        wf.run("r")
    wf.resolve("r", fired=False)
    assert wf.run("r") == {"refund": "refunded"}
    assert fired == [fired[0], fired[0]]


def test_reconcile_is_asked_about_each_effect_in_doubt(tmp_path: Path) -> None:
    """reconcile gets ctx.effect_in_doubt and the effect's key; True skips the effect."""
    asked: list[tuple[str | None, str]] = []
    fired: list[str] = []
    crash = {"on": True}

    def send(to: str, idempotency_key: str) -> str:
        fired.append(to)
        if crash["on"] and to == "b":
            crash["on"] = False
            raise Crash
        return to

    def reconcile(state: Any, ctx: ds.Context) -> bool:
        asked.append((ctx.effect_in_doubt, ctx.idempotency_key))
        return True

    wf = ds.Workflow("reconcile", store=tmp_path)

    @wf.step(reconcile=reconcile)
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["sent"] = [ctx.effect(f"send:{t}", send, t) for t in ("a", "b", "c")]

    with pytest.raises(Crash):
        wf.run("r")
    assert wf.run("r") == {"sent": ["a", None, "c"]}
    assert [name for name, _ in asked] == ["send:b"]
    assert asked[0][1] == ckpt.effect_key(
        header_of(wf.store, "reconcile", "r").run_nonce, 0, "act", "send:b"
    )
    assert fired == ["a", "b", "c"]


def test_concurrent_acalls_are_each_recorded_and_share_writes(tmp_path: Path) -> None:
    """50 gathered acalls, crash after: a rerun calls none of them again."""
    store = Counting(latency=0.01)
    made: list[int] = []
    crash = {"on": True}

    async def tool(i: int) -> int:
        await asyncio.sleep(0.001)
        made.append(i)
        return i * i

    wf = ds.Workflow("gather", store=store)

    @wf.step()
    async def act(state: dict[str, Any], ctx: ds.Context) -> None:
        out = await asyncio.gather(*(ctx.acall(f"tool:{i}", tool, i) for i in range(50)))
        if crash["on"]:
            crash["on"] = False
            raise Crash
        state["out"] = out

    with pytest.raises(Crash):
        asyncio.run(wf.arun("r"))
    heads = [k for k, _ in store.writes if k.endswith("/checkpoint")]
    assert len(heads) < 1 + 25  # the create, then far fewer writes than calls: group commit
    assert asyncio.run(wf.arun("r")) == {"out": [i * i for i in range(50)]}
    assert sorted(made) == list(range(50))


def test_threads_in_a_sync_step_record_each_call_once(tmp_path: Path) -> None:
    """Eight threads making calls in one step: every result recorded, none lost."""
    made: list[int] = []
    lock = threading.Lock()
    crash = {"on": True}

    def tool(i: int) -> int:
        with lock:
            made.append(i)
        return i

    wf = ds.Workflow("threads", store=tmp_path)

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        results: list[int] = []

        def worker(base: int) -> None:
            for i in range(base, base + 10):
                results.append(ctx.call(f"t:{i}", tool, i))

        threads = [threading.Thread(target=worker, args=(b * 10,)) for b in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if crash["on"]:
            crash["on"] = False
            raise Crash
        state["sum"] = sum(results)

    with pytest.raises(Crash):
        wf.run("r")
    assert header_of(wf.store, "threads", "r").journal["calls"] == 80  # type: ignore[index]
    assert wf.run("r") == {"sum": sum(range(80))}
    assert sorted(made) == list(range(80))


def test_many_calls_do_not_rewrite_earlier_results() -> None:
    """3,000 calls in one step: each write stays bounded, not growing with the journal."""
    store = Counting()
    wf = ds.Workflow("many", store=store)
    blob = "x" * 200

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["n"] = sum(len(ctx.call(f"c:{i}", lambda: blob)) for i in range(3000))

    assert wf.run("r") == {"n": 600_000}
    heads = [size for key, size in store.writes if key.endswith("/checkpoint")]
    assert len(heads) >= 3000
    assert max(heads[-500:]) < 64 * 1024  # a bounded tail, not 600 KB of earlier results
    total = sum(size for _, size in store.writes)
    assert total < 900_000_000 / 10  # each write the recent tail only: far from ~900 MB


def test_a_custom_serializer_run_keeps_its_journal_in_format_1(tmp_path: Path) -> None:
    """Format-1 runs (custom serializers) journal too: the results ride in the header."""

    class Upper(ds.JSONSerializer):
        name = "json-upper"

    wf = ds.Workflow("custom", store=tmp_path, serializer=Upper())
    made = []
    crash = {"on": True}

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["a"] = ctx.call("a", lambda: made.append("a") or "A")
        if crash["on"]:
            crash["on"] = False
            raise Crash

    with pytest.raises(Crash):
        wf.run("r")
    head = header_of(wf.store, "custom", "r")
    assert head.format == 1
    assert head.journal is not None
    assert len(head.journal["inline"]) == 1
    assert wf.run("r") == {"a": "A"}
    assert made == ["a"]


def test_calls_emit_events(tmp_path: Path) -> None:
    """call_started, call_recorded, call_replayed and effect_in_doubt reach subscribers."""
    events: list[ds.Event] = []
    crash = {"on": True}

    def pay(idempotency_key: str) -> int:
        if crash["on"]:
            crash["on"] = False
            raise Crash
        return 1

    wf = ds.Workflow("events", store=tmp_path, on_event=[events.append])

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.call("model", lambda: 1)
        ctx.effect("pay", pay)

    with pytest.raises(Crash):
        wf.run("r")
    wf.run("r")
    kinds = [(e.kind, e.call) for e in events if e.kind.startswith(("call", "effect"))]
    assert ("call_recorded", "model") in kinds
    assert ("call_replayed", "model") in kinds
    assert ("effect_in_doubt", "pay") in kinds
    assert kinds.count(("call_started", "pay")) == 2


def test_a_step_called_by_hand_runs_its_calls_directly() -> None:
    """Outside a run (a unit test of the step function) ctx.call just calls."""
    ctx = ds.Context("r", "wf", "act", 0, 1, "ds-key")
    assert ctx.call("x", lambda a: a + 1, 1) == 2
    key = ctx.effect("e", lambda idempotency_key: idempotency_key)
    assert key.startswith("ds-")
    assert len(key) <= 64


def test_state_of_a_journaled_run_is_readable_by_the_test_tools(tmp_path: Path) -> None:
    """The tail's journal records never leak into the committed state."""
    wf = ds.Workflow("clean", store=tmp_path)

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["x"] = ctx.call("x", lambda: {"big": "y" * 5000})

    wf.run("r")
    key = ckpt.checkpoint_key("clean", "r")
    assert committed(wf.store, key)[1] == {"x": {"big": "y" * 5000}}


def test_a_call_left_running_by_its_step_cannot_write_after_the_commit(tmp_path: Path) -> None:
    """A ctx.call a step left running in a thread, finishing after the step committed, is
    refused with DefinitionError: the completed run's checkpoint stays as committed.
    """
    started, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    wf = ds.Workflow("stray", store=tmp_path)

    def slow() -> int:
        started.set()
        release.wait(10)
        return 1

    def stray(ctx: ds.Context) -> None:
        try:
            ctx.call("late", slow)
        except BaseException as exc:
            errors.append(exc)

    threads: list[threading.Thread] = []

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        threads.append(threading.Thread(target=stray, args=(ctx,)))
        threads[0].start()
        started.wait(10)  # the call is under way: it passed every check made at its start
        state["x"] = 1

    assert wf.run("r") == {"x": 1}
    release.set()
    threads[0].join(10)
    assert len(errors) == 1
    assert isinstance(errors[0], ds.DefinitionError)
    assert "'late'" in str(errors[0])
    head = header_of(wf.store, "stray", "r")
    assert head.status == "completed"
    assert head.journal is None
    assert wf.run("r") == {"x": 1}


@pytest.mark.parametrize(
    ("entry", "refused"),
    [
        ({"name": "refund", "key": "ds-k", "at": 1.0, "policy": "refire"}, False),
        ({"name": "refund", "key": "ds-k", "at": 1.0, "resolution": None, "policy": None}, False),
        ({"name": "refund", "key": "ds-k", "at": 1.0, "resolution": "fired"}, False),
        ({"key": "ds-k", "at": 1.0}, True),
        ({"name": "refund", "key": "", "at": 1.0}, True),
        ({"name": "refund", "key": "ds-k", "at": -1}, True),
        ({"name": "refund", "key": "ds-k", "at": 1.0, "resolution": "maybe"}, True),
        ({"name": "refund", "key": "ds-k", "at": 1.0, "policy": "retry"}, True),
        ("refund", True),
    ],
)
def test_a_header_journal_open_entry_must_be_an_effect_intent(entry: Any, refused: bool) -> None:
    """A header whose journal lists an open effect that is not an effect intent (no name,
    a bad key, time, resolution or policy) is refused as corrupt; a well-formed one reads.
    """
    store = MemoryStore()
    wf = ds.Workflow("shape", store=store)
    wf.step(name="turn")(lambda s: None)
    wf.run("r1", {})
    key = ckpt.checkpoint_key("shape", "r1")
    found = store.get(key)
    assert found is not None
    header, payload = ckpt.decode(found[0], where=key)
    journal = {"step": "turn", "iteration": 0, "calls": 0, "open": [entry]}
    data = ckpt.encode(header.replace(journal=journal), payload)
    if refused:
        with pytest.raises(ds.CorruptCheckpoint, match=r"journal\.open entry .* is not an effect"):
            ckpt.decode(data, where=key)
    else:
        assert ckpt.decode(data, where=key)[0].journal == journal
