"""The index of runs: entries follow their runs, and finding work costs what is live."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import index as _index
from durable_steps._fleet import listing
from durable_steps._record import checkpoint as ckpt
from durable_steps.stores import ObjectInfo
from tests.conftest import StoreTarget, _target

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "store-before-index.json"
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._@=+:-]{0,40}", fullmatch=True)


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


class Counting:
    """A store that counts its requests by kind."""

    def __init__(self, inner: ds.Store) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def get(self, key: str) -> tuple[bytes, str] | None:
        self.calls["get"] += 1
        return self.inner.get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self.calls["put"] += 1
        return self.inner.put(key, data, match=match)

    def delete(self, key: str, *, match: str | None = None) -> None:
        self.calls["delete"] += 1
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.calls["list"] += 1
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def entries(store: ds.Store) -> set[str]:
    """Every index entry but the registry's, as keys."""
    return {
        info.key
        for info in store.list("_index/")
        if info.key.startswith(("_index/live", "_index/done/"))
    }


def head(store: ds.Store, workflow: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


def consistent(store: ds.Store) -> None:
    """The index says what the heads say: each head's entry, nothing else but nudges."""
    wanted = set()
    for info in store.list(""):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[2] == "checkpoint" and not parts[0].startswith("_"):
            wanted.add(_index.entry_of(head(store, parts[0], parts[1])))
    found = {k for k in entries(store) if "~signal-" not in k}
    assert found == wanted


# --- names ---------------------------------------------------------------------------


long_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._@=+:-]{100,199}", fullmatch=True)


@given(
    workflow=names,
    run_id=names | long_names,  # over LONG_RUN_ID: a folder of its own
    signal=st.none() | names | long_names,  # over SIGNAL_CHARS: its token
    until=st.none() | st.floats(1e9, 4e9),
    status=st.sampled_from(["running", "waiting", "failed", "in_doubt", "completed", "deleted"]),
    owned=st.booleans(),
    committed=st.integers(0, 3),
)
def test_an_entry_name_says_what_its_head_says(
    workflow: str,
    run_id: str,
    signal: str | None,
    until: float | None,
    status: str,
    owned: bool,
    committed: int,
) -> None:
    """Every entry a head calls for parses back to its run, nonce, class, wake time and
    signal, whatever '-' and '.' the names hold."""
    wait = {"step": "s", "iteration": 0, "until": until, "signal": signal, "since": 1.0}
    header = ckpt.Checkpoint(
        workflow,
        run_id,
        ("s",),
        "json",
        status=status,  # type: ignore[arg-type]
        owner={"host": "h", "pid": 1, "token": "t", "until": 2e9} if owned else None,
        committed=committed,
        wait=wait if status == "waiting" else None,
        next_step=1 if status in ("completed", "deleted") else 0,
    )
    entry = _index.parse(ObjectInfo(_index.entry_of(header), "v", 0, 5.0))
    assert entry is not None
    assert (entry.workflow, entry.run_id) == (workflow, run_id)
    assert header.run_nonce.startswith(entry.nonce)
    kind = _index.class_of(header)
    assert entry.kind == (status if kind is None else kind)
    token = None if signal is None else _index.signal_token(signal)
    if status == "waiting":
        assert entry.signal == token
        assert entry.until == (None if until is None else int(until * 1000) / 1000)
    if kind is None:
        assert entry.finished == pytest.approx(header.updated_at, abs=0.001)
    if signal is not None:
        nudge = _index.parse(
            ObjectInfo(_index.nudge_key(workflow, run_id, header.run_nonce, signal), "v", 0, 0)
        )
        assert nudge is not None
        assert (nudge.kind, nudge.signal, nudge.run_id) == ("signal", token, run_id)


def test_what_is_not_an_entry_is_not_taken_for_one() -> None:
    """Objects an operator leaves under _index/ parse as nothing."""
    for key in (
        "_index/live/w/r/notes.txt",
        "_index/live/w/r/running-short",
        "_index/done/w/1/not-a-number-x-completed-r",
        "_index/done/w/1/0000000000001-0123456789abcdef-running-r",
        "_index/live/w/r",
    ):
        assert _index.parse(ObjectInfo(key, "v", 0, 0)) is None


# --- entries follow their runs -----------------------------------------------------------


def approvals(store: ds.Store, **options: Any) -> ds.Workflow:
    """ask waits for 'approval'; pay is an effect; a failing or sleeping variant by state."""
    wf = ds.Workflow("desk", store=store, **options)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        if state.get("sleep"):
            ctx.sleep(state["sleep"])
        state["answer"] = ctx.wait_for("approval") if state.get("wait") else "yes"

    @wf.step(in_doubt="raise")
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        if state.get("fail"):
            raise ValueError("the payments API said no")
        state["paid"] = ctx.effect("pay", lambda idempotency_key: idempotency_key)

    return wf


def test_entries_follow_every_class_change(target: StoreTarget) -> None:
    """submit, start, suspend, wake, fail, resolve, release, complete, tombstone, fork and
    rm each leave the index saying exactly what the heads say."""
    store = target.open()
    wf = approvals(store)
    wf.submit("queued", {"wait": True})
    assert entries(store) == {_index.entry_of(head(store, "desk", "queued"))}
    assert "~queued-" in next(iter(entries(store)))
    with pytest.raises(ds.RunSuspended):
        wf.run("queued")
    (marker,) = entries(store)
    assert "~waiting-" in marker
    assert marker.endswith("-x-approval")  # no wake time, its signal
    assert wf.signal("queued", "approval", "ok")
    consistent(store)
    assert any("~signal-" in k for k in entries(store))
    assert wf.run("queued") == {"wait": True, "answer": "ok", "paid": wf.run("queued")["paid"]}
    consistent(store)
    with pytest.raises(ds.RunSuspended):
        wf.run("sleepy", {"sleep": 3600})
    (sleeping,) = [k for k in entries(store) if "/sleepy~" in k]
    assert f"-{int(head(store, 'desk', 'sleepy').wait['until'] * 1000)}-" in sleeping  # type: ignore[index]
    with pytest.raises(ds.StepFailed):
        wf.run("failing", {"fail": True})
    consistent(store)
    assert any("/failing~failed-" in k for k in entries(store))
    with pytest.raises(ds.testing.SimulatedCrash):
        approvals(ds.testing.CrashingStore(store, after_write=3)).run("doubt", {})
    with pytest.raises(ds.StepInDoubt):
        wf.run("doubt")
    assert any("/doubt~in_doubt-" in k for k in entries(store))
    wf.resolve("doubt", fired=False)
    consistent(store)
    assert any("/doubt~stopped-" in k for k in entries(store))
    wf.fork("doubt", "forked")
    consistent(store)
    assert any("/forked~stopped-" in k for k in entries(store))
    tomb = approvals(store, on_complete="delete")
    tomb.run("tomb", {})
    consistent(store)
    assert any("-deleted-tomb" in k for k in entries(store))
    done = cli(target, "rm", "desk/queued")
    assert done.returncode == 0, done.stderr
    consistent(store)
    assert not [k for k in entries(store) if "queued" in k]


def cli(target: StoreTarget, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", target.url, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**target.child_env(), "PYTHONPATH": str(ROOT)},
    )


def test_a_worker_released_run_is_stopped_and_found_at_once(target: StoreTarget) -> None:
    """A worker stopped mid-run releases the run: its marker says stopped, so the next
    scan (another worker's) takes it without waiting for a lease."""
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    worker = ds.Worker(wf, concurrency=1)

    @wf.step()
    def first(state: dict[str, Any]) -> None:
        worker.stop()  # ends the run after this step's commit

    wf.step(name="second")(lambda state: None)
    wf.submit("r1", {})
    assert worker.run().released == ["r1"]
    assert any("/r1~stopped-" in k for k in entries(store))
    assert ds.Worker(wf).claimable() == ["r1"]
    assert ds.Worker(wf).run(until_idle=True).completed == ["r1"]
    consistent(store)


# --- what a scan costs -------------------------------------------------------------------


def test_a_scan_reads_the_live_runs_only_and_nothing_when_nothing_changed(
    tmp_path: Path,
) -> None:
    """Beside 300 finished runs: a new worker's first scan reads no head of the 4 live
    runs it can judge by their markers; a later scan makes one LIST and no GET; a signal
    sent, a timer due and a run submitted are each seen by the next scan."""
    inner = ds.LocalStore(tmp_path)
    fast = approvals(inner)
    for i in range(300):
        fast.run(f"done-{i}", {})
    with pytest.raises(ds.RunSuspended):
        fast.run("approve", {"wait": True})
    with pytest.raises(ds.RunSuspended):
        fast.run("sleep", {"sleep": 1.0})
    fast.submit("queued", {})
    counting = Counting(inner)
    worker = ds.Worker(approvals(counting))  # type: ignore[arg-type]
    assert worker.claimable() == ["queued"]
    assert counting.calls == {"list": 2}  # the registry once, then the live runs
    counting.calls.clear()
    assert worker.claimable() == ["queued"]
    assert counting.calls == {"list": 1}
    assert fast.signal("approve", "approval", "yes")
    fast.submit("new", {})
    time.sleep(1.0)
    counting.calls.clear()
    assert sorted(worker.claimable()) == ["approve", "new", "queued", "sleep"]
    assert counting.calls == {"list": 1}


def test_a_running_run_is_read_once_a_lease(tmp_path: Path) -> None:
    """A run another process owns: its head is read when first seen, and again only when
    its owner's remembered lease runs out (the owner renewed it: still not claimable)."""
    inner = ds.LocalStore(tmp_path)
    wf = ds.Workflow("desk", store=inner, lease=1.2)
    release = threading.Event()

    @wf.step()
    def slow(state: dict[str, Any]) -> None:
        release.wait(10)

    runner = threading.Thread(target=wf.run, args=("busy", {}))
    runner.start()
    try:
        time.sleep(0.3)
        counting = Counting(inner)
        worker = ds.Worker(ds.Workflow("desk", store=counting, lease=1.2))  # type: ignore[arg-type]
        worker.workflow.step(name="slow")(lambda state: None)
        assert worker.claimable() == []
        assert counting.calls["get"] == 1
        counting.calls.clear()
        assert worker.claimable() == []
        assert counting.calls == {"list": 1}
        time.sleep(1.3)  # the lease this worker saw has run out; the owner renewed it
        counting.calls.clear()
        assert worker.claimable() == []
        assert counting.calls["get"] == 1
    finally:
        release.set()
        runner.join()


# --- a store written before the index ----------------------------------------------------


def load_fixture(store: ds.Store) -> None:
    for key, data in json.loads(FIXTURE.read_text()).items():
        store.put(key, base64.b64decode(data))


def desk(store: ds.Store) -> ds.Workflow:
    """The workflow of tests/fixtures/make_store_before_index.py."""
    wf = ds.Workflow("desk", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        if state.get("wait"):
            state["answer"] = ctx.wait_for("approval")

    @wf.step()
    def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        if state.get("nap"):
            ctx.sleep(1)

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["refund"] = ctx.effect("refund", lambda idempotency_key: idempotency_key)

    wf.step(name="file")(lambda state: state.update(filed=True))
    return wf


def test_a_store_written_before_the_index_is_reindexed_and_resumes(
    target: StoreTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs written by the release before the index: ls and the worker say to reindex
    (and still find them); after `durable-steps reindex` every run is in the index and a
    worker resumes each one."""
    store = target.open()
    load_fixture(store)
    before = cli(target, "ls")
    assert before.returncode == 0, before.stderr
    assert "reindex" in before.stderr
    assert {line.split()[1] for line in before.stdout.splitlines()[1:]} == {
        "r-done",
        "r-wait",
        "r-sleep",
        "r-crash",
        "r-queued",
    }
    wf = desk(store)
    with caplog.at_level(logging.WARNING, logger="durable_steps"):
        assert sorted(ds.Worker(wf).claimable()) == ["r-crash", "r-queued", "r-sleep"]
    assert "reindex --workflow desk" in caplog.text
    done = cli(target, "reindex")
    assert done.returncode == 0, done.stderr
    assert "4 live and 1 finished run(s), 5 entries written" in done.stdout
    consistent(store)
    after = cli(target, "ls")
    assert "reindex" not in after.stderr
    assert wf.signal("r-wait", "approval", "go")
    report = ds.Worker(wf).run(until_idle=True)
    assert sorted(report.completed) == ["r-crash", "r-queued", "r-sleep", "r-wait"]
    assert head(store, "desk", "r-wait").status == "completed"
    consistent(store)
    again = cli(target, "reindex")
    assert "0 entries written" in again.stdout  # safe to repeat


def test_ls_is_newest_first_and_stops_at_its_limit(tmp_path: Path) -> None:
    """ls lists live runs, then the most recently finished, and --limit cuts it, saying so."""
    store = ds.LocalStore(tmp_path)
    wf = approvals(store)
    for i in range(6):
        wf.run(f"done-{i}", {})
    wf.submit("queued", {})
    target = StoreTarget("local", str(tmp_path))
    shown = cli(target, "ls", "--limit", "3")
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[1] for line in shown.stdout.splitlines()[1:]] == [
        "queued",
        "done-5",
        "done-4",
    ]
    assert "the newest 3 shown" in shown.stderr
    queued = cli(target, "ls", "--status", "queued")
    assert [line.split()[2] for line in queued.stdout.splitlines()[1:]] == ["queued"]
    everything = cli(target, "ls", "--all")
    assert len(everything.stdout.splitlines()) == 1 + 7
    assert drive_sync(_index.complete(), store)


# --- a SIGKILL at every write of the protocol ---------------------------------------------

CHILD = ROOT / "tests" / "indexchild.py"


def child(target: StoreTarget, op: str, kill: int = 0, when: str = "before") -> Any:
    when = ["--when", when]  # type: ignore[assignment]
    return subprocess.run(
        [sys.executable, str(CHILD), "--store", target.url, "--op", op, "--kill", str(kill), *when],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**target.child_env(), "PYTHONPATH": str(ROOT)},
        timeout=60,
    )


def live_heads(store: ds.Store) -> dict[str, ckpt.Checkpoint]:
    """The live runs the heads themselves say there are (every object listed)."""
    found = {}
    for info in store.list("desk/"):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[2] == "checkpoint":
            header = head(store, "desk", parts[1])
            if _index.class_of(header) is not None:
                found[parts[1]] = header
    return found


def recover(store: ds.Store, target: StoreTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fleet does next: the sender of a signal sends it again, workers run
    what is claimable, prune cleans what deletes left (with no grace left to wait)."""
    from durable_steps._fleet import finding as _finding

    monkeypatch.setattr(_index, "GRACE", 0.0)
    monkeypatch.setattr(_finding, "_RECHECK", 0.0)
    wf = desk_child(store)
    if "r" in live_heads(store) and head(store, "desk", "r").status == "waiting":
        wf.signal("r", "approval", "ok")
    for _ in range(2):
        ds.Worker(wf).run(until_idle=True)
    pruned = cli(target, "prune", "--completed", "--older-than", "0s", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    ds.Worker(wf).claimable()  # a scan after it all: it finds (and removes) what is stale


def desk_child(store: ds.Store) -> ds.Workflow:
    from tests.indexchild import desk as make

    return make(store)


def wipe(store: ds.Store) -> None:
    """An empty store again (and this process forgets it registered its workflow)."""
    for key in [info.key for info in store.list("")]:
        store.delete(key)
    _index._REGISTERED.clear()


def kill_points(target: StoreTarget, op: str) -> list[tuple[int, str]]:
    from tests.indexchild import prepare

    store = target.open()
    prepare(store, op)
    uncrashed = child(target, op)
    assert uncrashed.returncode == 0, uncrashed.stderr
    writes = int(uncrashed.stdout.split()[-1])
    wipe(store)
    return [(n, when) for n in range(1, writes + 1) for when in ("before", "after")]


SAMPLED = {"create": (2, "after"), "wake": (3, "before"), "rm": (1, "after")}


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(op, marks=() if op in SAMPLED else pytest.mark.matrix)
        for op in (
            "create",
            "submit",
            "signal",
            "wake",
            "tombstone",
            "resolve",
            "fork",
            "rm",
            "prune",
        )
    ],
)
@pytest.mark.parametrize(
    "durable_target",
    [
        "local",
        pytest.param("seaweedfs", marks=pytest.mark.s3),
        pytest.param("moto", marks=[pytest.mark.s3, pytest.mark.matrix]),
    ],
    indirect=True,
)
def test_a_sigkill_at_any_write_never_loses_a_live_run(
    durable_target: StoreTarget,
    op: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """SIGKILL before and after each write (heads, parts, entries) of creating, submitting,
    signalling, waking and completing, tombstoning, resolving, forking, rm and prune: each
    live head is findable through the index at once, and once the fleet went on (workers,
    prune) the index says exactly what the heads say."""
    from tests.indexchild import prepare

    target = durable_target
    points = kill_points(target, op)
    if not request.config.getoption("--full"):
        points = [SAMPLED.get(op, points[0])]
    for kill, when in points:
        store = target.open()
        wipe(store)
        prepare(store, op)
        killed = child(target, op, kill, when)
        assert killed.returncode == -9, (kill, when, killed.stdout, killed.stderr)
        lives = {lv.run_id: lv for lv in drive_sync(listing.live_runs("desk"), store)}
        for run_id, header in live_heads(store).items():
            nonces = {m.nonce for m in lives[run_id].markers} if run_id in lives else set()
            assert header.run_nonce[:16] in nonces, (op, kill, when, run_id)
        recover(store, target, monkeypatch)
        consistent(store)
        nudges = {k.split("/")[3].partition("~")[0] for k in entries(store) if "~signal-" in k}
        assert nudges <= set(live_heads(store)), "a nudge outlived its run"
