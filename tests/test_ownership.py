"""Who may run a run: leases judged by host identity and the store's clock, claims,
adopting our own unreported writes, and what a refused write says.

The processes here are in-process executions with store wrappers that make the
faults deterministic; tests/test_worker.py does the same with real processes
(SIGSTOP, SIGKILL) and tests/test_s3_runner.py over the wire through a fault proxy.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._fleet import leases
from durable_steps._record import checkpoint as ckpt
from tests.storetools import Wrapped, rewrite_header

KEY = ckpt.checkpoint_key("own", "r1")


def header(store: ds.Store) -> ckpt.Checkpoint:
    found = store.get(KEY)
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


def owner_record(**fields: Any) -> dict[str, Any]:
    """An owner on another host whose lease ends in 30 s, with ``fields`` changed."""
    now = time.time()
    return {
        "host": "elsewhere",
        "pid": 4242,
        "started": 1.0,
        "token": "their-token",
        "until": now + 30,
        "lease": 60.0,
        "skew": 0.0,
        "boot": "their-boot",
        "pidns": 1,
        **fields,
    }


def stopped_run(store: ds.Store, lease: float = 60.0) -> ds.Workflow:
    """Run r1 of workflow 'own' (steps a, b) stopped after a, and the workflow."""
    wf = ds.Workflow("own", store=store, lease=lease)
    wf.step(name="a")(lambda s: s.update(a=1))
    wf.step(name="b")(lambda s: s.update(b=1))
    crashing = ds.Workflow("own", store=ds.testing.CrashingStore(store, after_write=2))
    crashing.step(name="a")(lambda s: s.update(a=1))
    crashing.step(name="b")(lambda s: s.update(b=1))
    with pytest.raises(ds.testing.SimulatedCrash):
        crashing.run("r1", {})
    return wf


# --- judging an owner ---------------------------------------------------------------


def test_a_malformed_until_never_locks_a_run_for_good() -> None:
    """until=1e308 is capped at updated_at + lease: the run frees when that lease ends."""
    now = time.time()
    owner = owner_record(until=1e308)
    assert leases.judge(owner, now=now, since=now - 10) == "live"
    assert leases.judge(owner, now=now, since=now - 61) == "expired"


def test_an_owner_with_a_slow_clock_keeps_its_run() -> None:
    """An owner 120 s behind the store writes an until that looks past; its recorded skew
    translates it, so a correct process does not steal the live run."""
    now = time.time()
    behind = owner_record(until=now - 120 + 60, skew=-120.0)
    assert leases.judge(behind, now=now) == "live"
    assert leases.judge({**behind, "skew": None}, now=now) == "expired"  # what it was


def test_a_dead_owner_with_a_fast_clock_frees_its_run_in_time() -> None:
    """An owner 120 s ahead that died: its lease ends 60 s after its last write, not 180 s."""
    wrote = time.time()
    ahead = owner_record(until=wrote + 120 + 60, skew=120.0)
    assert leases.judge(ahead, now=wrote + 59) == "live"
    assert leases.judge(ahead, now=wrote + 61) == "expired"


def test_this_process_clock_is_read_in_the_store_clock() -> None:
    """A reader 120 s ahead of the store sees an honest lease as the store does."""
    now = time.time()
    honest = owner_record(until=now + 30)
    assert leases.judge(honest, now=now + 120, skew=120.0) == "live"
    assert leases.judge(honest, now=now + 120) == "expired"


def test_same_host_identity_is_more_than_the_hostname() -> None:
    """Another machine with our hostname (another boot id), or a container sharing it
    (another PID namespace), is another host: judged by its lease, never by our pid table."""
    here = owner_record(host=leases._HOST, pid=os.getpid(), boot=leases._BOOT)
    here["pidns"] = leases._PIDNS
    assert leases.judge(here) == "gone"  # our pid, but no execution of ours holds it
    if leases._BOOT is not None:
        twin = {**here, "pid": 999_999, "boot": "another-machines-boot"}
        assert leases.judge(twin) == "live"  # its lease is on: it may well be running
        assert leases.judge({**twin, "until": time.time() - 1}) == "expired"  # claim first
    if leases._PIDNS is not None:
        container = {**here, "pid": 999_999, "pidns": leases._PIDNS + 1}
        assert leases.judge(container) == "live"  # not our pid 999999: lease-based
        assert leases.judge({**container, "pidns": leases._PIDNS}) == "gone"


def test_a_lease_record_is_never_believed_for_long() -> None:
    """A record with no lease, or a lease of 1e308, is capped by the reader's lease or a
    day after its write: a malformed record locks a run for a bounded time only."""
    now = time.time()
    no_lease = {k: v for k, v in owner_record(until=1e308).items() if k != "lease"}
    assert leases.judge(no_lease, now=now, since=now - 10, lease=60) == "live"
    assert leases.judge(no_lease, now=now, since=now - 61, lease=60) == "expired"
    huge = owner_record(until=1e308, lease=1e308)
    assert leases.judge(huge, now=now, since=now - 3600) == "live"
    assert leases.judge(huge, now=now, since=now - 86_401) == "expired"


@pytest.mark.parametrize("pid", [2**40, 0, -1, True, "1"])
def test_an_impossible_pid_on_this_host_is_not_live(pid: Any) -> None:
    """An owner pid of 2**40 (or any non-pid) on this host never reaches os.kill."""
    assert leases.judge(owner_record(host=leases._HOST, pidns=None, boot=None, pid=pid)) == (
        "expired"
    )


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="zombies are seen in /proc")
def test_a_zombie_owner_is_gone_and_without_proc_kill_alone_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real owner process: live while it runs, gone once SIGKILLed though never reaped
    (a zombie); where /proc cannot be read (macOS) the zombie counts as alive, as before."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = owner_record(host=leases._HOST, pidns=None, boot=None, pid=proc.pid)
        here["started"] = leases._process_started(proc.pid)
        assert leases.judge(here) == "live"
        assert leases.judge({**here, "started": here["started"] + 1}) == "gone"  # a reused pid
        proc.kill()  # not reaped: a zombie until wait()
        deadline = time.monotonic() + 10
        while (leases._proc_stat(proc.pid) or (b"?",))[0] != b"Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        assert leases.judge(here) == "gone"
        monkeypatch.setattr(leases, "_proc_stat", lambda pid: None)  # no /proc
        assert leases.judge(here) == "live"
        proc.wait()
        assert leases.judge(here) == "gone"
    finally:
        proc.kill()
        proc.wait()


_LEADER_EXITS = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)  # the main thread ends; the process runs on
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="zombies are seen in /proc")
def test_a_process_whose_main_thread_exited_is_alive_though_its_leader_shows_z() -> None:
    """/proc shows a process as Z once its main thread exited, even while other threads
    run: such an owner is alive, not a zombie, and keeps its run."""
    proc = subprocess.Popen([sys.executable, "-c", _LEADER_EXITS], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        while (leases._proc_stat(proc.pid) or (b"?",))[0] != b"Z":
            assert time.monotonic() < deadline, "the main thread never exited"
            time.sleep(0.01)
        here = owner_record(host=leases._HOST, pidns=None, boot=None, pid=proc.pid)
        here["started"] = leases._process_started(proc.pid)
        assert leases.judge(here) == "live"
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes its stdout


# --- clocks against the store ------------------------------------------------------


class Skewed(Wrapped):
    """A store whose clock this process reads as ``skew`` seconds behind its own."""

    def __init__(self, inner: ds.Store, skew: float) -> None:
        super().__init__(inner)
        self.skew = skew

    def clock_skew(self) -> float:
        return self.skew


def test_a_fast_clock_neither_steals_nor_takes_over() -> None:
    """A process whose clock is 120 s ahead: a lease that looks past to it but is live in
    the store's clock is not stolen, and an expired one is refused naming the skew."""
    inner = ds.MemoryStore()
    stopped_run(inner)
    wf = ds.Workflow("own", store=Skewed(inner, 120.0))
    wf.step(name="a")(lambda s: None)
    wf.step(name="b")(lambda s: s.update(b=1))
    # Its lease ends 30 s from now by the store's clock: 90 s ago by this process's.
    rewrite_header(inner, KEY, owner=owner_record(until=time.time() - 90))
    with pytest.raises(ds.RunLocked, match="is being run by elsewhere:4242"):
        wf.run("r1")
    rewrite_header(inner, KEY, owner=owner_record(until=time.time() - 200))
    with pytest.raises(ds.RunLocked, match=r"this clock is 120s ahead of the store's"):
        wf.run("r1")
    assert header(inner).next_step == 1  # untouched


def test_the_lease_records_this_hosts_skew_and_identity() -> None:
    """Every lease written carries the writer's lease, skew, boot id and PID namespace."""
    inner = ds.MemoryStore()
    wf = ds.Workflow("own", store=Skewed(inner, -3.25), lease=7.0)
    seen: list[dict[str, Any]] = []
    wf.step(name="a")(lambda s: seen.append(header(inner).owner or {}))
    wf.step(name="b")(lambda s: None)
    wf.run("r1", {})
    owner = seen[0]
    assert owner["lease"] == 7.0
    assert owner["skew"] == -3.25
    assert owner["boot"] == leases._BOOT
    assert owner["pidns"] == leases._PIDNS


# --- claims -------------------------------------------------------------------------


class Recording(Wrapped):
    """Records every store call, and what the step saw when it was called."""

    def __init__(self, inner: ds.Store) -> None:
        super().__init__(inner)
        self.calls: list[str] = []

    def get(self, key: str) -> tuple[bytes, str] | None:
        self.calls.append("get")
        return super().get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self.calls.append("put")
        return super().put(key, data, match=match)


def test_resume_from_an_expired_remote_owner_claims_before_any_step() -> None:
    """The owner may be paused, not dead: the resume writes a claim before running anything."""
    inner = ds.MemoryStore()
    stopped_run(inner)
    rewrite_header(inner, KEY, owner=owner_record(until=time.time() - 5))
    store = Recording(inner)
    wf = ds.Workflow("own", store=store)
    wf.step(name="a")(lambda s: None)
    wf.step(name="b")(lambda s: store.calls.append("step b"))
    assert wf.run("r1") == {"a": 1}
    assert store.calls[:3] == ["get", "put", "step b"]


def test_resume_from_a_clean_stop_costs_one_get() -> None:
    """A run nobody owns (crashed here, released, never claimed) keeps the one-GET resume."""
    inner = ds.MemoryStore()
    stopped_run(inner)
    assert header(inner).owner is None or leases.judge(header(inner).owner) == "gone"
    store = Recording(inner)
    wf = ds.Workflow("own", store=store)
    wf.step(name="a")(lambda s: None)
    wf.step(name="b")(lambda s: store.calls.append("step b"))
    wf.run("r1")
    assert store.calls[:2] == ["get", "step b"]


def test_two_plain_reruns_of_an_in_doubt_step_fire_it_once() -> None:
    """A re-fire writes a fresh intent first, so of two reruns racing, only one fires."""
    inner = ds.MemoryStore()
    fired: list[str] = []
    gate = threading.Barrier(2, timeout=10)

    def make(store: ds.Store) -> ds.Workflow:
        wf = ds.Workflow("own", store=store)
        wf.step(name="pay", idempotent=False)(lambda s, ctx: fired.append(ctx.idempotency_key))
        return wf

    crashing = make(ds.testing.CrashingStore(inner, after_write=2))  # create, intent
    with pytest.raises(ds.testing.SimulatedCrash):
        crashing.run("r1", {})
    fired.clear()

    class BothRead(Wrapped):
        first = True

        def get(self, key: str) -> tuple[bytes, str] | None:
            found = super().get(key)
            if self.first:
                self.first = False
                gate.wait()  # both reruns have read the in-doubt checkpoint
            return found

    outcomes: list[str] = []

    def rerun() -> None:
        try:
            make(BothRead(inner)).run("r1")
            outcomes.append("done")
        except ds.CheckpointConflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=rerun) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict", "done"]
    assert len(fired) == 1


def test_the_intent_records_the_in_doubt_policy() -> None:
    """The intent says what a resume will do: refire, raise or reconcile."""
    store = ds.MemoryStore()
    seen: list[str] = []
    wf = ds.Workflow("own", store=store)
    wf.step(name="a", idempotent=False)(lambda s: seen.append(header(store).intent["policy"]))  # type: ignore[index]
    wf.step(name="b", idempotent=False, in_doubt="raise")(
        lambda s: seen.append(header(store).intent["policy"])  # type: ignore[index]
    )
    wf.step(name="c", idempotent=False, reconcile=lambda s, c: False)(
        lambda s: seen.append(header(store).intent["policy"])  # type: ignore[index]
    )
    wf.run("r1", {})
    assert seen == ["refire", "raise", "reconcile"]


# --- the lease while a step runs -----------------------------------------------------


class SlowIntent(Wrapped):
    """The first intent write lands only after ``delay`` seconds (a slow store)."""

    def __init__(self, inner: ds.Store, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        if b'"intent":{' in data and self.delay:
            time.sleep(self.delay)
            self.delay = 0
        return super().put(key, data, match=match)


def test_a_slow_intent_write_does_not_leave_the_step_unleased() -> None:
    """The lease runs from when it was stamped: after a slow intent write the lease is
    renewed before the step fires, so the step never runs on a spent lease."""
    inner = ds.MemoryStore()
    left: list[float] = []
    wf = ds.Workflow("own", store=SlowIntent(inner, 0.8), lease=1.0)

    @wf.step(idempotent=False)
    def pay(state: dict[str, Any]) -> None:
        owner = header(inner).owner
        assert owner is not None
        left.append(owner["until"] - time.time())

    wf.run("r1", {})
    assert left[0] > 0.5, f"the step started with {left[0]:.2f}s of lease left"


class LandsButFails(Wrapped):
    """The ``nth`` write lands, then reports a store failure (a lost answer, then 5xx)."""

    def __init__(self, inner: ds.Store, nth: int) -> None:
        super().__init__(inner)
        self.nth, self.writes = nth, 0

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        if key.startswith("_index/"):  # the index of runs: not what is tested
            return super().put(key, data, match=match)
        self.writes += 1
        version = super().put(key, data, match=match)
        if self.writes == self.nth:
            raise ds.StoreError("the answer was lost, and the retries got 503")
        return version


def test_a_renewal_that_landed_unreported_is_adopted(caplog: pytest.LogCaptureFixture) -> None:
    """A lease renewal that landed but reported an error is recognised by our own token:
    the next write goes on top of it instead of failing with a false conflict."""
    inner = ds.MemoryStore()
    wf = ds.Workflow("own", store=LandsButFails(inner, nth=2), lease=0.3)  # beat every 0.1 s
    wf.step(name="slow")(lambda s: time.sleep(0.5))
    with caplog.at_level(logging.INFO, logger="durable_steps"):
        assert wf.run("r1", {}) == {}
    assert header(inner).status == "completed"
    assert "landed unreported" in caplog.text


# --- what a refused write says ---------------------------------------------------------


def test_a_checkpoint_deleted_mid_step_says_so() -> None:
    """A checkpoint removed while its step runs is reported as deleted, not as a takeover."""
    store = ds.MemoryStore()
    wf = ds.Workflow("own", store=store)

    @wf.step()
    def a(state: dict[str, Any]) -> None:
        found = store.get(KEY)
        assert found is not None
        store.delete(KEY, match=found[1])

    with pytest.raises(ds.CheckpointConflict, match="was deleted while it ran") as caught:
        wf.run("r1", {})
    assert caught.value.step == "a"
    assert store.get(KEY) is None  # not written back


def test_the_loser_of_a_create_race_is_told_so() -> None:
    """Two processes creating one run at once: the loser hears of a create, not a takeover."""
    store = ds.MemoryStore()

    class CreatedMeanwhile(Wrapped):
        def get(self, key: str) -> tuple[bytes, str] | None:
            found = super().get(key)
            other = ds.Workflow("own", store=store)
            other.step(name="a")(lambda s: None)
            other.submit("r1", {})
            return found

    wf = ds.Workflow("own", store=CreatedMeanwhile(store))
    wf.step(name="a")(lambda s: None)
    with pytest.raises(ds.CheckpointConflict, match="created run own/r1 at the same moment"):
        wf.run("r1", {})


def test_store_errors_name_the_run_and_the_step() -> None:
    """A store failure during a commit names the run and the step, and keeps the last checkpoint."""

    class FailingCommits(Wrapped):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if match is not None:
                raise ds.StoreError("disk full")
            return super().put(key, data, match=match)

    store = ds.MemoryStore()
    wf = ds.Workflow("own", store=FailingCommits(store))
    wf.step(name="a")(lambda s: None)
    with pytest.raises(ds.StoreError, match=r"run own/r1: the store failed at step 'a': disk full"):
        wf.run("r1", {})
    assert header(store).next_step == 0


def test_an_implicit_store_warns_when_keys_would_be_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run with non-idempotent steps created in the unchosen default store logs a warning."""
    wf = ds.Workflow("own")
    wf.step(name="pay", idempotent=False)(lambda s: None)
    quiet = ds.Workflow("calm")
    quiet.step(name="read")(lambda s: None)
    with caplog.at_level(logging.WARNING, logger="durable_steps"):
        quiet.run("r1", {})
        assert "default local store" not in caplog.text
        wf.run("r1", {})
    assert "default local store" in caplog.text
    assert "DURABLE_STEPS_STORE" in caplog.text


def test_one_slow_answer_is_not_clock_skew() -> None:
    """An answer held up 25 s reads as 25 s of skew; the estimate is the smallest recent
    reading, so it stays near zero and nobody ends this host's leases early."""
    from email.utils import formatdate

    from durable_steps.stores._remote import ClockSkew

    clock = ClockSkew()
    clock.observe(formatdate(time.time(), usegmt=True), 200)
    clock.observe(formatdate(time.time() - 25, usegmt=True), 200)  # dated 25 s before receipt
    assert clock.value is not None
    assert abs(clock.value) < 2
    ahead = ClockSkew()
    for _ in range(3):
        ahead.observe(formatdate(time.time() - 120, usegmt=True), 200)
    assert ahead.value is not None
    assert 118 < ahead.value < 122  # a clock really 120 s ahead still reads as such
