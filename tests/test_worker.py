"""Run ownership, leases, fencing and the resume worker — with real processes.

The fleet test runs four ``durable-steps worker`` processes on a real S3
server, SIGKILLs them at random while they work, restarts them, and checks
that every run completed exactly once with one key per payment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import leases, listing
from durable_steps._record import checkpoint as ckpt
from tests import workerapp
from tests.conftest import StoreTarget, one_s3_kind_each

ROOT = Path(__file__).resolve().parent.parent
DONE = {"fetched": 2, "charged": 2, "passes": 2}
COMMITS = 3 * workerapp.PASSES


def fleet(store: ds.Store, lease: float = 60.0) -> ds.Workflow:
    """The workerapp workflow on ``store``."""
    return ds.Workflow(
        "fleet",
        steps=workerapp.workflow.steps,
        store=store,
        until=workerapp.workflow.until,
        lease=lease,
    )


def header(store: ds.Store, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key("fleet", run_id))
    assert found is not None
    return ckpt.decode(found[0], where=run_id)[0]


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The ledger and step log, for this process and its children."""
    paths = {"ledger": tmp_path / "ledger.txt", "log": tmp_path / "steps.txt"}
    monkeypatch.setenv("WORKERAPP_LEDGER", str(paths["ledger"]))
    monkeypatch.setenv("WORKERAPP_LOG", str(paths["log"]))
    monkeypatch.delenv("WORKERAPP_STEP_SECONDS", raising=False)
    return paths


def lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def check_ledger(path: Path, runs: list[str], max_duplicates: int) -> None:
    """Each (run, pass) paid with one key, distinct from all others; duplicates bounded."""
    keys: dict[tuple[str, str], list[str]] = defaultdict(list)
    for run_id, iteration, key in lines(path):
        keys[(run_id, iteration)].append(key)
    assert set(keys) == {(r, str(i)) for r in runs for i in range(workerapp.PASSES)}
    for point, seen in keys.items():
        assert len(set(seen)) == 1, f"{point} paid with different keys: {seen}"
    assert len({seen[0] for seen in keys.values()}) == len(keys)
    assert sum(len(seen) - 1 for seen in keys.values()) <= max_duplicates


class Child:
    """``python -m tests.workerapp RUN`` (or any args) on a target, in its own process group."""

    def __init__(self, target: StoreTarget, *args: str, **env: str) -> None:
        child_env = {**target.child_env(), "DURABLE_STEPS_STORE": target.url, **env}
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        self.proc.communicate()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children started by a test; none survives it."""
    made: list[Child] = []
    yield made
    for child in made:
        with contextlib.suppress(ProcessLookupError):
            child.kill()


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def started(log: Path, step: str, run_id: str) -> bool:
    return any(e[0] == step and e[1] == run_id for e in lines(log))


def run_in_child(
    target: StoreTarget, files: dict[str, Path], children: list[Child], *, seconds: str, lease: str
) -> Child:
    """Start run r1 in a child whose fetch step takes ``seconds``; return once it is in it."""
    child = Child(
        target,
        "-m",
        "tests.workerapp",
        "r1",
        WORKERAPP_STEP_SECONDS=seconds,
        WORKERAPP_LEASE=lease,
    )
    children.append(child)
    wait_for(lambda: started(files["log"], "fetch", "r1"), what="the child's step")
    return child


# --- the Python API -------------------------------------------------------------------


def test_worker_completes_submitted_runs(
    durable_target: StoreTarget, files: dict[str, Path]
) -> None:
    """A worker claims every submitted run and runs it to completion, one key per payment."""
    store = durable_target.open()
    wf = fleet(store)
    runs = [f"r{i}" for i in range(10)]
    assert all(wf.submit(r, workerapp.initial_state()) for r in runs)
    assert not wf.submit("r0", {**workerapp.initial_state(), "fetched": 99}), "never overwrites"
    assert header(store, "r0").owner is None
    report = ds.Worker(wf, concurrency=3).run(until_idle=True)
    assert sorted(report.completed) == runs
    for r in runs:
        h = header(store, r)
        assert (h.status, h.committed, h.owner) == ("completed", COMMITS, None)
        assert wf.run(r) == DONE
    check_ledger(files["ledger"], runs, max_duplicates=0)


class CountingStore:
    """Counts the calls a worker makes."""

    def __init__(self, inner: ds.Store) -> None:
        self.inner = inner
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        if name != "clock_skew":  # a memory store's clock is this process's: no request
            self.calls[name] += 1
        return getattr(self.inner, name)


def test_scan_reads_only_changed_runs(files: dict[str, Path]) -> None:
    """A scan is one LIST of the index of runs: a submitted run is ready by its marker
    (no GET), a scan with nothing changed reads nothing, a finished run leaves it."""
    counting = CountingStore(ds.MemoryStore())
    wf = fleet(counting)  # type: ignore[arg-type]
    for i in range(30):
        wf.submit(f"r{i}", workerapp.initial_state())
    worker = ds.Worker(wf)
    counting.calls.clear()
    assert len(worker.claimable()) == 30
    assert dict(counting.calls) == {"list": 2}  # the registry (once), the live runs
    counting.calls.clear()
    assert len(worker.claimable()) == 30
    assert dict(counting.calls) == {"list": 1}
    wf.run("r7")
    counting.calls.clear()
    assert "r7" not in worker.claimable()
    assert dict(counting.calls) == {"list": 1}


def test_worker_leaves_failed_in_doubt_and_live_runs(files: dict[str, Path]) -> None:
    """Failed runs (unless retry_failed), in-doubt runs and runs with a live owner are skipped."""
    store = ds.MemoryStore()
    broken = ds.Workflow("fleet", steps=[ds.step(lambda s: 1 / 0, name="fetch")], store=store)
    with pytest.raises(ds.StepFailed):
        broken.run("failed", {})
    wf = fleet(store)
    wf.submit("fresh", workerapp.initial_state())
    live = {
        "workflow": "fleet",
        "run_id": "live",
        "steps": [s.name for s in wf.steps],
        "serializer": "json",
    }
    owner = {"host": "elsewhere", "pid": 1, "token": "t", "until": time.time() + 60}
    store.put(
        ckpt.checkpoint_key("fleet", "live"),
        ckpt.encode(ckpt.Checkpoint(**{**live, "steps": tuple(live["steps"])}, owner=owner), b"{}"),
    )
    assert ds.Worker(wf).claimable() == ["fresh"]
    assert sorted(ds.Worker(wf, retry_failed=True).claimable()) == ["failed", "fresh"]
    with pytest.raises(ds.RunLocked, match="elsewhere:1"):
        wf.run("live")


def test_graceful_stop_finishes_step_and_releases(files: dict[str, Path]) -> None:
    """stop() lets the current step commit, releases the run, and another worker resumes it."""
    store = ds.MemoryStore()
    entered, proceed = threading.Event(), threading.Event()

    def slow(state: dict[str, Any]) -> None:
        entered.set()
        proceed.wait(10)
        state["slow"] = True

    steps = [ds.step(slow, name="slow"), ds.step(lambda s: s.update(after=True), name="after")]
    wf = ds.Workflow("fleet", steps=steps, store=store)
    wf.submit("r1", {})
    worker = ds.Worker(wf)
    reports: list[ds.WorkerReport] = []
    thread = threading.Thread(target=lambda: reports.append(worker.run()))
    thread.start()
    assert entered.wait(10)
    worker.stop()
    proceed.set()
    thread.join(10)
    assert reports[0].released == ["r1"]
    h = header(store, "r1")
    assert (h.status, h.next_step, h.owner) == ("running", 1, None)
    assert ds.Worker(wf).run(until_idle=True).completed == ["r1"]
    assert wf.run("r1") == {"slow": True, "after": True}


# --- leases across processes ---------------------------------------------------------------


def test_live_owner_is_locked_out_while_heartbeat_renews(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """A run in a long step stays owned past its first lease (heartbeat): others get RunLocked."""
    child = run_in_child(durable_target, files, children, seconds="4", lease="1.0")
    time.sleep(1.5)  # past the lease the step started with: only heartbeats keep it
    wf = fleet(durable_target.open())
    with pytest.raises(ds.RunLocked, match=rf":{child.proc.pid} \(lease ends in"):
        wf.run("r1")
    renewed = header(wf.store, "r1")
    assert renewed.owner is not None
    assert renewed.owner["until"] > time.time()
    assert renewed.next_step == 0  # no commit renewed it: the heartbeat did


def test_same_host_takeover_after_sigkill_needs_no_wait(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """A SIGKILLed owner's run is taken over at once on the same host, despite a long lease."""
    child = run_in_child(durable_target, files, children, seconds="30", lease="600")
    child.signal(signal.SIGKILL)
    child.wait()
    wf = fleet(durable_target.open())
    assert header(wf.store, "r1").owner is not None  # the dead owner's lease is still on record
    began = time.monotonic()
    assert wf.run("r1") == DONE
    assert time.monotonic() - began < 10


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="zombies are seen in /proc")
@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_an_unreaped_sigkilled_owner_is_taken_over_at_once(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """A SIGKILLed owner its parent never reaped (a zombie: a container whose PID 1 does
    not reap) is gone, not live: its run is taken over at once, not after its lease."""
    child = run_in_child(durable_target, files, children, seconds="30", lease="600")
    child.signal(signal.SIGKILL)  # and no wait(): the child stays a zombie
    stat = Path(f"/proc/{child.proc.pid}/stat")
    status = Path(f"/proc/{child.proc.pid}/status")

    def zombie() -> bool:  # Z, and its other threads gone too (until then it is still dying)
        state = stat.read_bytes().rsplit(b")", 1)[1].split()[0]
        return state == b"Z" and b"\nThreads:\t1\n" in status.read_bytes()

    wait_for(zombie, what="a zombie")
    wf = fleet(durable_target.open())
    began = time.monotonic()
    assert wf.run("r1") == DONE
    assert time.monotonic() - began < 10
    assert stat.exists()  # still unreaped: the takeover did not wait for it


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_durable_steps_host_makes_a_dead_owner_another_hosts(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """With $DURABLE_STEPS_HOST, a SIGKILLed owner here counts as another host's: lease only."""
    child = Child(
        durable_target,
        "-m",
        "tests.workerapp",
        "r1",
        WORKERAPP_STEP_SECONDS="30",
        WORKERAPP_LEASE="2",
        DURABLE_STEPS_HOST="elsewhere",
    )
    children.append(child)
    wait_for(lambda: started(files["log"], "fetch", "r1"), what="the child's step")
    child.signal(signal.SIGKILL)
    child.wait()
    wf = fleet(durable_target.open(), lease=2.0)
    owner = header(wf.store, "r1").owner
    assert owner is not None
    assert owner["host"] == "elsewhere"
    with pytest.raises(ds.RunLocked, match=r"elsewhere:\d+ \(lease ends in"):
        wf.run("r1")  # its process is provably gone, but not to "another host"
    time.sleep(leases.lease_end(owner) - time.time() + 0.1)
    assert wf.run("r1") == DONE


def test_paused_owner_is_fenced_after_takeover(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """A holder paused (SIGSTOP) past its lease is taken over; on SIGCONT it is fenced and stops."""
    child = run_in_child(durable_target, files, children, seconds="2", lease="1.0")
    child.signal(signal.SIGSTOP)
    time.sleep(1.6)  # its lease runs out while it cannot renew
    wf = fleet(durable_target.open(), lease=30)
    assert wf.run("r1") == DONE  # the taker finishes the run
    taken = header(wf.store, "r1")
    child.signal(signal.SIGCONT)
    code, err = child.wait()
    assert code == 3, err  # CheckpointConflict: fenced, stopped
    assert "another process changed its checkpoint" in err
    after = header(wf.store, "r1")
    assert after == taken, "the straggler clobbered nothing"
    child_pid = str(child.proc.pid)
    assert [e[0] for e in lines(files["log"]) if e[3] == child_pid] == ["fetch"]


def test_a_straggler_that_wakes_first_wins_and_the_taker_runs_nothing(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """A paused owner past its lease may wake before the taker's first write: the taker
    claims before running anything, so one of them stops having run nothing (here the taker,
    since the straggler wrote first), instead of both running the step at once."""
    child = run_in_child(durable_target, files, children, seconds="2", lease="1.0")
    child.signal(signal.SIGSTOP)
    time.sleep(1.6)  # its lease runs out while it cannot renew
    inner = durable_target.open()

    class WakeAfterRead:
        """The straggler wakes after our read and commits its step before we go on."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def get(self, key: str) -> tuple[bytes, str] | None:
            found = inner.get(key)
            if child.proc.poll() is None:
                child.signal(signal.SIGCONT)
                wait_for(lambda: started(files["log"], "charge", "r1"), what="its commit")
            return found

    wf = fleet(WakeAfterRead(), lease=30)  # type: ignore[arg-type]
    with pytest.raises(ds.CheckpointConflict):
        wf.run("r1")
    code, err = child.wait()
    assert code == 0, err
    assert header(inner, "r1").status == "completed"
    assert not [e for e in lines(files["log"]) if e[3] == str(os.getpid())], "the taker ran a step"
    check_ledger(files["ledger"], ["r1"], max_duplicates=0)


def test_objects_that_are_no_run_never_stop_a_worker(
    tmp_path: Path, files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's copy at an invalid run id ('r1 copy', '_tmp'), a stray object in
    the index: the worker goes on with the real runs; where it lists every run (a
    store the index does not cover yet) it skips the copies with a warning."""
    store = ds.LocalStore(tmp_path / "store")
    wf = fleet(store)
    wf.submit("r1", workerapp.initial_state())
    data = store.get(ckpt.checkpoint_key("fleet", "r1"))[0]  # type: ignore[index]
    store.put("fleet/r1 copy/checkpoint", data)
    store.put("fleet/_tmp/checkpoint", data)
    store.put("_index/live2/fleet/r1 copy~queued-0123456789abcdef", b"")
    store.put("_index/live2/fleet/r1~notes.txt", b"an operator's")
    report = ds.Worker(wf, poll=0.05).run(until_idle=True)
    assert (report.completed, report.errors) == (["r1"], [])
    wf.submit("r2", workerapp.initial_state())
    store.delete("_index/workflows/fleet/flat")  # as if written before the index
    with caplog.at_level(logging.WARNING, logger="durable_steps"):
        report = ds.Worker(wf, poll=0.05).run(until_idle=True)
    assert (report.completed, report.errors) == (["r2"], [])
    assert "'r1 copy' is not a valid run id" in caplog.text
    assert "reindex --workflow fleet" in caplog.text


# --- the fleet --------------------------------------------------------------------------


def _start_worker(target: StoreTarget, children: list[Child]) -> Child:
    child = Child(
        target,
        "-m",
        "durable_steps",
        "worker",
        "--app",
        "tests.workerapp:workflow",
        "--concurrency",
        "3",
        "--poll",
        "0.2",
        WORKERAPP_STEP_SECONDS="0.01",
    )
    children.append(child)
    return child


@pytest.mark.slow
@pytest.mark.timeout(400)  # ~20 s on an idle machine; a minute when the machine is shared
@pytest.mark.parametrize(
    "durable_target", [pytest.param("moto", marks=pytest.mark.s3)], indirect=True
)
def test_fleet_of_workers_survives_random_kills(
    durable_target: StoreTarget, files: dict[str, Path], children: list[Child]
) -> None:
    """4 workers, 100 runs, random SIGKILLs and restarts: every run completes exactly once."""
    store = durable_target.open()
    wf = fleet(store)
    # 100 runs outlast the 12 kills (one every 0.3-0.7 s) several times over: every
    # kill lands among runs in flight; more runs would only cost more moto requests.
    runs = [f"r{i:03d}" for i in range(100)]
    for r in runs:
        wf.submit(r, workerapp.initial_state())
    workers = [_start_worker(durable_target, children) for _ in range(4)]
    rng = random.Random(1234)
    kills = 0
    done: set[str] = set()
    deadline = time.monotonic() + 150
    while len(done) < len(runs):
        assert time.monotonic() < deadline, f"only {len(done)} of {len(runs)} runs completed"
        time.sleep(rng.uniform(0.3, 0.7))
        if kills < 12:
            victim = rng.randrange(len(workers))
            workers[victim].signal(signal.SIGKILL)
            workers[victim].wait()
            kills += 1
            workers[victim] = _start_worker(durable_target, children)
        # The index's done entries tell which runs finished: one cheap LIST.
        done = {e.run_id for e in drive_sync(listing.done_runs("fleet"), store)}
    assert kills == 12, f"the runs were done after {kills} kills: the fleet was never tested"
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        code, err = w.wait()
        assert code == 0, err
    for r in runs:
        h = header(store, r)
        assert (h.status, h.committed, h.owner) == ("completed", COMMITS, None), r
        assert store.get(ckpt.checkpoint_key("fleet", r)) is not None
        assert wf.run(r) == DONE
    check_ledger(files["ledger"], runs, max_duplicates=kills)


SIGNALS = [signal.SIGTERM, signal.SIGINT]


@pytest.mark.parametrize(
    ("durable_target", "sig"),
    [
        *(pytest.param("local", sig, id=f"local-{sig.name}") for sig in SIGNALS),
        # Over the wire each signal on one server: the worker's code is the same on both.
        *(
            pytest.param(kind, sig, marks=pytest.mark.s3, id=f"{kind}-{sig.name}")
            for kind, sig in one_s3_kind_each(SIGNALS)
        ),
    ],
    indirect=["durable_target"],
)
def test_cli_worker_signal_releases_run(
    sig: signal.Signals,
    durable_target: StoreTarget,
    files: dict[str, Path],
    children: list[Child],
) -> None:
    """`durable-steps worker` on one SIGTERM or SIGINT finishes the step, releases the run
    and exits 0.
    """
    wf = fleet(durable_target.open())
    wf.submit("r1", workerapp.initial_state())
    child = Child(
        durable_target,
        "-m",
        "durable_steps",
        "worker",
        "--app",
        "tests.workerapp:workflow",
        WORKERAPP_STEP_SECONDS="1.5",
    )
    children.append(child)
    wait_for(lambda: started(files["log"], "fetch", "r1"), what="the worker's step")
    child.signal(sig)
    code, err = child.wait(timeout=30)
    assert code == 0, err
    assert "finishing current steps" in err
    h = header(wf.store, "r1")
    assert (h.status, h.next_step, h.owner) == ("running", 1, None)
    assert ds.Worker(wf).claimable() == ["r1"]


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)],
    ids=["SIGINT-SIGINT", "SIGTERM-SIGINT"],
)
def test_cli_worker_second_signal_exits_at_once(
    first: signal.Signals,
    second: signal.Signals,
    tmp_path: Path,
    files: dict[str, Path],
    children: list[Child],
) -> None:
    """A second signal (Ctrl-C too) ends `durable-steps worker` within ~2 s, mid-step, with a
    non-zero status; the cut-short step is not committed and the run can be resumed.
    """
    target = StoreTarget("local", str(tmp_path / "store"))
    wf = fleet(target.open())
    wf.submit("r1", workerapp.initial_state())
    child = Child(
        target,
        "-m",
        "durable_steps",
        "worker",
        "--app",
        "tests.workerapp:workflow",
        WORKERAPP_STEP_SECONDS="60",
    )
    children.append(child)
    wait_for(lambda: started(files["log"], "fetch", "r1"), what="the worker's step")
    child.signal(first)
    time.sleep(0.5)  # the first signal's handler has run; the step goes on
    assert child.proc.poll() is None
    child.signal(second)
    sent = time.monotonic()
    code, err = child.wait(timeout=30)
    assert time.monotonic() - sent < 2.0, err
    assert code != 0
    assert "send it again to exit at once" in err
    h = header(wf.store, "r1")
    assert (h.status, h.next_step, h.committed) == ("running", 0, 0)
    assert ds.Worker(wf).claimable() == ["r1"]  # its owner is gone: free at once


NOISY_APP = """
import logging

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import index as _index


def chatty(state):
    for name in ("botocore.endpoint", "botocore.credentials", "urllib3.connectionpool"):
        logging.getLogger(name).debug("third-party-debug-marker")
        logging.getLogger(name).info("third-party-info-marker")
    state["done"] = True


workflow = ds.Workflow("noisy", steps=[chatty])
"""


def test_cli_worker_logs_only_durable_steps(
    durable_target: StoreTarget, tmp_path: Path, children: list[Child]
) -> None:
    """`durable-steps worker` shows the library's INFO log, not botocore's or urllib3's."""
    (tmp_path / "noisyapp.py").write_text(NOISY_APP)
    wf = ds.Workflow(
        "noisy", steps=[ds.step(lambda s: None, name="chatty")], store=durable_target.open()
    )
    wf.submit("r1", {})
    child = Child(
        durable_target,
        "-m",
        "durable_steps",
        "worker",
        "--app",
        "noisyapp:workflow",
        "--until-idle",
        PYTHONPATH=str(tmp_path),
    )
    children.append(child)
    code, err = child.wait(timeout=60)
    assert code == 0, err
    assert "committed step 'chatty'" in err
    assert "run noisy/r1 completed" in err
    assert "third-party" not in err
    assert "Found credentials" not in err  # botocore's own INFO line, on the S3 stores


def test_import_durable_steps_never_imports_ray() -> None:
    """`import durable_steps` (and its worker and CLI) leaves Ray and the integration unloaded."""
    code = (
        "import sys, durable_steps, durable_steps.worker, durable_steps.cli\n"
        "durable_steps.cli.build_parser()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'ray' or 'integrations' in m]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
