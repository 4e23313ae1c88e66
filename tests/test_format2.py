"""Checkpoint format 2: a small head, immutable parts, bytes proportional to the change."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import durable_steps as ds
from durable_steps import cli
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import finders as _finders
from durable_steps._record import format2 as f2
from durable_steps.testing import CrashingStore, SimulatedCrash
from tests.conftest import StoreTarget, one_s3_kind_each
from tests.crashchild import initial_state, workflow_name
from tests.storetools import Wrapped, committed

FIXTURES = Path(__file__).parent / "fixtures"
CHILD = Path(__file__).parent / "crashchild.py"


class Counting(Wrapped):
    """Counts each store call and the bytes written."""

    def __init__(self, inner: ds.Store) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.written = 0

    def get(self, key: str) -> tuple[bytes, str] | None:
        self.calls["get"] += 1
        return super().get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self.calls["put"] += 1
        self.written += len(data)
        return super().put(key, data, match=match)

    def list(self, prefix: str) -> Any:
        self.calls["list"] += 1
        return super().list(prefix)


def chat(store: Any, *, steps: int, serializer: str = "json", **options: Any) -> ds.Workflow:
    """A workflow appending one distinct 2 KB message per step, for ``steps`` steps."""
    wf = ds.Workflow(
        "chat",
        store=store,
        serializer=serializer,
        until=lambda s: len(s["messages"]) >= steps,
        **options,
    )

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        n = len(state["messages"])
        state["messages"].append({"role": "assistant", "content": f"{n:06d}" + "x" * 2042})

    return wf


def parts_of(store: ds.Store, workflow: str, run_id: str) -> list[str]:
    return sorted(i.key for i in store.list(f2.parts_prefix(workflow, run_id)))


def head(store: ds.Store, workflow: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


# --- costs -----------------------------------------------------------------------


SERIALIZERS = ["json", "pickle"]


@pytest.mark.parametrize(
    ("store_target", "serializer"),
    [
        *((kind, name) for kind in ("memory", "local") for name in SERIALIZERS),
        # Over the wire each serializer on one server: 300 PUTs cost seconds there.
        *(pytest.param(k, n, marks=pytest.mark.s3) for k, n in one_s3_kind_each(SERIALIZERS)),
    ],
    indirect=["store_target"],
)
def test_growth_costs_are_proportional_to_the_change(store: ds.Store, serializer: str) -> None:
    """300 appends of 2 KB: ≤ 1.1 PUTs per step (besides the run's index entries), a
    small fraction of a full rewrite's bytes, at most 3 parts, and a resume of 1 + 3
    GETs with no LIST.
    """
    counting = Counting(store)
    final = chat(counting, steps=300, serializer=serializer).run("r1", {"messages": []})
    assert len(final["messages"]) == 300
    index = 2 + 1 + 1  # a new store's registry, the run's marker, its done entry
    assert counting.calls["put"] <= 1.1 * 300 + 1 + index
    full_rewrites = sum(2048 * n for n in range(1, 301))
    assert counting.written < 0.08 * full_rewrites
    assert len(head(store, "chat", "r1").parts) <= 3
    assert parts_of(store, "chat", "r1") == sorted(
        f2.parts_prefix("chat", "r1") + p["name"] for p in head(store, "chat", "r1").parts
    ), "dropped parts are deleted"
    counting.calls.clear()
    again = chat(counting, steps=300, serializer=serializer).run("r1")
    assert again == final
    assert counting.calls["get"] <= 4
    assert counting.calls["list"] == 0


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_a_run_whose_calls_flush_its_tail_stays_proportional(serializer: str) -> None:
    """An agent step that records its model call (``ctx.call``) before appending
    the reply: the call's head writes flush the tail, so the commits rarely do.
    The parts must stay balanced all the same — after every commit the changes
    parts weigh less than the base — and 300 steps write at most twice what
    the same loop without the call writes (before: three times, with one
    changes part rewritten whole at every flush, growing past the state).
    """
    replies = [os.urandom(1024).hex() for _ in range(300)]

    def written(journaled: bool) -> int:
        counting = Counting(ds.MemoryStore())
        wf = ds.Workflow(
            "calls",
            store=counting,
            serializer=serializer,
            until=lambda s: len(s["messages"]) >= 300,
            on_event=[check],
        )

        @wf.step()
        def turn(state: dict[str, Any], ctx: ds.Context) -> None:
            n = len(state["messages"])
            reply = ctx.call("model", lambda: replies[n]) if journaled else replies[n]
            state["messages"].append({"role": "assistant", "content": reply})

        stores.append(counting)
        final = wf.run("r", {"messages": []})
        assert [m["content"] for m in final["messages"]] == replies
        return counting.written

    def check(event: ds.Event) -> None:
        if event.kind != "step_committed":
            return
        parts = head(stores[-1], "calls", "r").parts
        base = parts[0]["size"] if parts and parts[0]["kind"] == "base" else 0
        changes = sum(p["size"] for p in parts if p["kind"] == "changes")
        if changes and changes >= base:  # (a subscriber's exception would be ignored)
            unbalanced.append(parts)

    stores: list[Counting] = []
    unbalanced: list[Any] = []
    plain = written(journaled=False)
    assert written(journaled=True) <= 2 * plain
    assert unbalanced == []


def test_intent_writes_and_failures_do_not_re_encode_the_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The intent write of a non-idempotent step and the failure record carry the
    committed tail unchanged: nothing encodes the state after the last commit.
    """
    log: list[str] = []

    def spied(name: str) -> None:
        original = getattr(_finders.JSONFinder, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            log.append("encode")
            return original(*args, **kwargs)

        monkeypatch.setattr(_finders.JSONFinder, name, spy)

    for name in ("encode", "whole_record"):  # every way a commit encodes a JSON state
        spied(name)

    class Writes(Wrapped):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.endswith("/checkpoint"):  # the head: not grow's 100 KB flushed into a part
                log.append("head")
                writes.append(data)
            return super().put(key, data, match=match)

    writes: list[bytes] = []
    wf = ds.Workflow("spy", store=Writes(ds.MemoryStore()))  # type: ignore[arg-type]
    wf.step(name="grow")(lambda s: s.update(big="x" * 100_000))

    @wf.step(idempotent=False)
    def pay(state: dict[str, Any]) -> None:
        raise RuntimeError("card declined")

    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    assert len(writes) == 4  # create, commit of grow, intent of pay, its failure
    # An encode before each of the first two heads, none before the last two.
    assert log == ["encode", "head", "encode", "head", "head", "head"]
    tails = [w.partition(b"\n")[2] for w in writes[1:]]
    assert tails[0] == tails[1] == tails[2]


def test_heartbeat_flushes_a_big_tail_once_then_renews_with_the_header_only() -> None:
    """A long step's renewals: the first flushes the tail into a part, later ones are small."""
    store = ds.MemoryStore()
    sizes: list[tuple[str, int]] = []

    class Sizes(Wrapped):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.startswith("_index/"):  # the index of runs: not what is tested
                return super().put(key, data, match=match)
            sizes.append((key.rsplit("/", 2)[-2], len(data)))
            return super().put(key, data, match=match)

    wf = ds.Workflow("beat", store=Sizes(store), lease=0.6)  # type: ignore[arg-type]
    wf.step(name="grow")(lambda s: s.update(notes="n" * 12_000))  # a tail under the threshold

    @wf.step()
    def slow(state: dict[str, Any]) -> None:
        time.sleep(1.1)  # five renewals at 0.2 s

    wf.run("r1", {})
    during = sizes[2:-1]  # after create and the first commit, before the last commit
    assert any(kind == "parts" for kind, _ in during), sizes
    renewals = [n for kind, n in during if kind == "r1"]
    assert len(renewals) >= 3
    assert all(n < 4096 for n in renewals[1:]), renewals


# --- what a resume rebuilds --------------------------------------------------------


def test_edits_truncations_and_replacements_are_saved_exactly(store: ds.Store) -> None:
    """An old message edited in place, a list cut short, keys replaced and removed: a
    resume rebuilds exactly the live state (types included).
    """
    wf = ds.Workflow("edit", store=store)

    @wf.step()
    def grow(state: dict[str, Any]) -> None:
        state["messages"] = [{"i": i, "text": "t" * 3000} for i in range(20)]
        state["meta"] = {"a": 1}

    @wf.step()
    def edit(state: dict[str, Any]) -> None:
        state["messages"][3]["text"] = "edited"
        del state["messages"][10:]
        state["meta"] = {"a": 1.0, "b": [True]}
        state["new"] = None

    @wf.step()
    def stop(state: dict[str, Any]) -> None:
        raise RuntimeError("stop here")

    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    _, state = committed(store, ckpt.checkpoint_key("edit", "r1"))
    expected = [{"i": i, "text": "edited" if i == 3 else "t" * 3000} for i in range(10)]
    assert state == {"messages": expected, "meta": {"a": 1.0, "b": [True]}, "new": None}
    assert type(state["meta"]["a"]) is float


def test_pickle_states_keep_python_values_at_top_level_granularity(store: ds.Store) -> None:
    """A pickle state's top-level values and list items are saved as they change."""

    class Note:
        def __init__(self, text: str) -> None:
            self.text = text

        __hash__ = None  # type: ignore[assignment]

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Note) and other.text == self.text

    wf = ds.Workflow("pk2", store=store, serializer="pickle", until=lambda s: s["n"] >= 40)

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["n"] += 1
        state["notes"].append(Note("x" * 1500 + str(state["n"])))
        state["pair"] = (state["n"], {1, 2})
        if state["n"] == 30:
            state["notes"][2] = Note("edited")
            del state["notes"][20:]

    final = wf.run("r1", {"n": 0, "notes": []})
    again = ds.Workflow("pk2", store=store, serializer="pickle", steps=wf.steps).run("r1")
    assert again == final
    assert again["notes"][2] == Note("edited")
    assert head(store, "pk2", "r1").format == 2


def test_a_failed_attempt_restarts_from_the_committed_state(store: ds.Store) -> None:
    """A retry starts from the state of the last commit, rebuilt without reading the store."""
    seen: list[int] = []
    wf = ds.Workflow("retry2", store=store)
    wf.step(name="grow")(lambda s: s["messages"].append("m" * 20_000))

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def flaky(state: dict[str, Any]) -> None:
        seen.append(len(state["messages"]))
        state["messages"].append("half-done")
        if len(seen) == 1:
            raise RuntimeError("first attempt fails")

    with ds.testing.no_wait():
        final = wf.run("r1", {"messages": []})
    assert seen == [1, 1]
    assert final["messages"][1:] == ["half-done"]


# --- garbage ------------------------------------------------------------------------


def test_tombstone_rm_and_prune_remove_every_part(store: ds.Store, tmp_path: Path) -> None:
    """on_complete="delete" leaves no part; rm and prune delete the head and all parts,
    referenced or left behind by a crashed writer.
    """
    chat(store, steps=60, on_complete="delete").run("gone", {"messages": []})
    assert head(store, "chat", "gone").status == "deleted"
    assert parts_of(store, "chat", "gone") == []
    for run_id in ("kept", "old"):
        chat(store, steps=60).run(run_id, {"messages": []})
        store.put(f2.parts_prefix("chat", run_id) + "9-00000000000000aa", b"crashed writer's")
        assert len(parts_of(store, "chat", run_id)) >= 2
    url = str(tmp_path / "s")
    local = ds.open_store(url)
    for key in [i.key for i in store.list("chat/")]:
        found = store.get(key)
        assert found is not None
        local.put(key, found[0])
    for argv in (["rm", "chat/kept"], ["prune", "--completed", "--older-than", "0s", "--yes"]):
        assert cli.main(["--store", url, *argv]) == 0
    assert [i.key for i in local.list("")] == []


def test_the_worker_scan_never_takes_parts_for_runs(store: ds.Store) -> None:
    """Parts under a run's prefix are not runs: the scan finds each run once."""
    wf = chat(store, steps=80)
    with pytest.raises(SimulatedCrash):
        chat(CrashingStore(store, before_write=60), steps=80).run("a", {"messages": []})
    wf.submit("b", {"messages": []})
    assert parts_of(store, "chat", "a")
    assert sorted(ds.Worker(wf).claimable()) == ["a", "b"]


# --- signing ---------------------------------------------------------------------------


def signed(store: ds.Store, key: str = "k1") -> ds.Workflow:
    return chat(store, steps=40, serializer="pickle", signing_key=key)


@pytest.mark.parametrize("how", ["edited", "swapped", "other-run"])
def test_a_part_changed_swapped_or_taken_from_another_run_is_refused(how: str) -> None:
    """With a signing key, a part whose bytes are not the ones the head lists is refused
    before anything in it is unpickled.
    """
    store = ds.MemoryStore()
    with pytest.raises(SimulatedCrash):
        signed(CrashingStore(store, before_write=30)).run("r1", {"messages": []})  # type: ignore[arg-type]
    with pytest.raises(SimulatedCrash):
        signed(CrashingStore(store, before_write=30)).run("r2", {"messages": []})  # type: ignore[arg-type]
    part = f2.parts_prefix("chat", "r1") + head(store, "chat", "r1").parts[0]["name"]
    data, _version = store.get(part)  # type: ignore[misc]
    if how == "edited":
        bad = data[:-5] + b"XXXXX"
    elif how == "swapped":
        bad = data.replace(b'"kind":"base"', b'"kind":"base" ')
    else:
        other = f2.parts_prefix("chat", "r2") + head(store, "chat", "r2").parts[0]["name"]
        bad = store.get(other)[0]  # type: ignore[index]
    store.delete(part)
    store.put(part, bad)
    with pytest.raises(ds.CorruptCheckpoint, match="not the one its head lists"):
        signed(store).run("r1")


def test_a_signed_head_cannot_be_pointed_at_other_parts() -> None:
    """Editing the head's part list breaks its signature: refused unread."""
    store = ds.MemoryStore()
    with pytest.raises(SimulatedCrash):
        signed(CrashingStore(store, before_write=30)).run("r1", {"messages": []})  # type: ignore[arg-type]
    key = ckpt.checkpoint_key("chat", "r1")
    data, version = store.get(key)  # type: ignore[misc]
    store.put(key, data.replace(b'"size":', b'"size": ', 1), match=version)
    with pytest.raises(ds.CorruptCheckpoint, match="signature does not verify"):
        signed(store).run("r1")


# --- format 1 -------------------------------------------------------------------------


def test_a_format_1_checkpoint_resumes_completes_and_stays_format_1(store: ds.Store) -> None:
    """A checkpoint written by durable_steps 0.1 (format 1, committed as a fixture)
    resumes at its next step, completes, and keeps its format.
    """
    data = (FIXTURES / "format1-checkpoint").read_bytes()
    key = ckpt.checkpoint_key("format1-fixture", "r1")
    store.put(key, data)
    wf = ds.Workflow("format1-fixture", store=store)
    ran: list[str] = []

    @wf.step()
    def greet(state: dict[str, Any]) -> None:
        ran.append("greet")

    @wf.step()
    def fail_once(state: dict[str, Any]) -> None:
        ran.append("fail_once")

    @wf.step()
    def reply(state: dict[str, Any]) -> None:
        state["messages"].append({"role": "assistant", "content": "hi"})

    final = wf.run("r1")
    assert ran == ["fail_once"]
    assert final == {
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
        "n": 1,
    }
    header = head(store, "format1-fixture", "r1")
    assert (header.format, header.status, header.committed) == (1, "completed", 3)


def test_show_says_which_format_a_run_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`show` names the format; `show --state` rebuilds a format-2 state from its parts."""
    url = str(tmp_path / "s")
    store = ds.open_store(url)
    final = chat(store, steps=50).run("new", {"messages": []})
    assert cli.main(["--store", url, "show", "chat/new", "--state", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == final
    assert cli.main(["--store", url, "show", "chat/new"]) == 0
    assert re.search(r"format +2 \(a head with", capsys.readouterr().out)


# --- crashes -------------------------------------------------------------------------


def child(target: StoreTarget, tmp: Path, crash: str | None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(CHILD), "--store", target.url, "--run", "r1"]
    cmd += ["--log", str(tmp / "log"), "--ledger", str(tmp / "ledger"), "--flush-every-commit"]
    if crash:
        cmd += ["--crash", crash]
    return subprocess.run(
        cmd,
        env=target.child_env(),
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "crash",
    ["after-part:1:0", "after-part:4:0", "after-part:7:0", "before-drop:1:0", "before-drop:3:0"],
)
@pytest.mark.parametrize(
    "durable_target", ["local", pytest.param("seaweedfs", marks=pytest.mark.s3)], indirect=True
)
def test_sigkill_between_a_part_and_its_head_or_during_compaction(
    durable_target: StoreTarget, tmp_path: Path, crash: str
) -> None:
    """A real SIGKILL after a part is written but before the head lists it (a flush or a
    compaction), or before a dropped part is deleted: the resumed run ends in the
    uncrashed run's state, and no part is left that its head does not list.
    """
    killed = child(durable_target, tmp_path, crash)
    assert killed.returncode == -9, killed.stderr
    done = child(durable_target, tmp_path, None)
    assert done.returncode == 0, done.stderr
    store = durable_target.open()
    try:
        name = workflow_name("plain")
        header, state = committed(store, ckpt.checkpoint_key(name, "r1"))
        assert header.status == "completed"
        assert state == json.loads(done.stdout)
        assert state["passes"] == 3
        assert len(state["trail"]) == 12
        assert state == uncrashed(tmp_path)
    finally:
        store.close()


def uncrashed(tmp: Path) -> Any:
    """The final state of an uncrashed run of the child's workflow (in memory)."""
    from tests.crashchild import build_workflow

    (tmp / "u").mkdir(exist_ok=True)
    wf = build_workflow(ds.MemoryStore(), tmp / "u" / "log", tmp / "u" / "ledger")
    return wf.run("r1", initial_state())


# --- the property -----------------------------------------------------------------


edits = st.lists(
    st.tuples(
        st.sampled_from(["append", "edit", "cut", "replace", "key", "drop"]),
        st.integers(0, 10**6),
    ),
    min_size=1,
    max_size=4,
)


def agent_step(state: dict[str, Any], plan: list[tuple[str, int]]) -> None:
    """Apply one step's worth of random edits to an agent-like state."""
    messages = state["messages"]
    for kind, r in plan:
        if kind == "append" or not messages:
            messages.append({"role": "tool", "content": f"{r}" * (r % 700 + 1), "n": r})
        elif kind == "edit":
            messages[r % len(messages)]["content"] = f"edited {r}"
        elif kind == "cut":
            del messages[r % len(messages) :]
        elif kind == "replace":
            state["messages"] = messages = [{"role": "summary", "content": "s" * (r % 5000)}]
        elif kind == "key":
            state[f"k{r % 5}"] = [r, float(r) / 7, r % 2 == 0]
        else:
            state.pop(f"k{r % 5}", None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plans=st.lists(edits, min_size=1, max_size=25),
    crashes=st.lists(st.integers(1, 40), max_size=3),
    serializer=st.sampled_from(["json", "pickle"]),
    mode=st.sampled_from(["as-is", "changes", "flush"]),
)
def test_random_edits_with_random_crashes_resume_to_the_uncrashed_state(
    plans: list[list[tuple[str, int]]], crashes: list[int], serializer: str, mode: str
) -> None:
    """Random appends, in-place edits, truncations and replacements, with crashes at
    random writes: the resumed run's final state encodes byte for byte like an
    uncrashed run's — with these small states written whole (as-is), as changes
    (and collapsed), or flushed into parts at (almost) every commit.
    """
    old = f2._MIN_FLUSH, f2._FLUSH_RECORDS, f2.WHOLE_UP_TO
    if mode != "as-is":  # the states here are small: make them be written as changes
        f2.WHOLE_UP_TO = -1
    if mode == "flush":  # every kind of compaction is reached
        f2._MIN_FLUSH, f2._FLUSH_RECORDS = 1, 0
    try:

        def build(store: Any) -> ds.Workflow:
            wf = ds.Workflow(
                "prop", store=store, serializer=serializer, until=lambda s: s["i"] >= len(plans)
            )

            @wf.step()
            def step(state: dict[str, Any]) -> None:
                agent_step(state, plans[state["i"]])
                state["i"] += 1

            return wf

        reference = build(ds.MemoryStore()).run("r", {"i": 0, "messages": []})
        store = ds.MemoryStore()
        for at in crashes:
            try:
                build(CrashingStore(store, before_write=at)).run("r", {"i": 0, "messages": []})
            except SimulatedCrash:
                pass
        final = build(store).run("r", {"i": 0, "messages": []})
        _, stored = committed(store, ckpt.checkpoint_key("prop", "r"))
        encode = ds.JSONSerializer().dumps if serializer == "json" else repr
        assert encode(final) == encode(reference) == encode(stored)  # type: ignore[operator]
    finally:
        f2._MIN_FLUSH, f2._FLUSH_RECORDS, f2.WHOLE_UP_TO = old


def test_no_part_is_left_unlisted_by_racing_writers(tmp_path: Path) -> None:
    """8 processes race on one run: the winner's head lists only parts it wrote or read,
    and every listed part is readable.
    """
    url = str(tmp_path / "s")
    code = (
        "import sys, durable_steps as ds\n"
        "from tests.test_format2 import chat\n"
        "try:\n"
        f"    chat(ds.open_store({url!r}), steps=60).run('race', {{'messages': []}})\n"
        "except (ds.CheckpointConflict, ds.RunLocked):\n"
        "    sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path) for _ in range(8)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert 0 in codes, codes
    assert set(codes) <= {0, 3}, codes
    store = ds.open_store(url)
    header, state = committed(store, ckpt.checkpoint_key("chat", "race"))
    assert header.status == "completed"
    assert len(state["messages"]) == 60


def test_a_head_read_just_before_a_compaction_is_read_again() -> None:
    """A reader that got a head whose part was then compacted away reads the head
    again instead of calling the run corrupt.
    """
    store = ds.MemoryStore()
    key = ckpt.checkpoint_key("chat", "r1")
    with pytest.raises(SimulatedCrash):
        chat(CrashingStore(store, before_write=30), steps=200).run("r1", {"messages": []})
    stale = store.get(key)
    assert stale is not None
    final = chat(store, steps=200).run("r1")
    gone = ckpt.decode(stale[0], where="t")[0].parts
    assert all(store.get(f2.parts_prefix("chat", "r1") + p["name"]) is None for p in gone)

    class StaleOnce(Wrapped):
        served = False

        def get(self, k: str) -> tuple[bytes, str] | None:
            if k == key and not self.served:
                self.served = True
                return stale
            return super().get(k)

    assert chat(StaleOnce(store), steps=200).run("r1") == final
