"""Runs as Ray tasks, on a real local Ray cluster of three nodes started here.

The fixture starts ``ray start --head`` (no CPUs: it schedules, runs nothing)
and two worker nodes on loopback, each in a process group of its own with its
own temp dir, free ports and ``$DURABLE_STEPS_HOST`` — so the nodes judge each
other's leases as separate machines would. Killing a node SIGKILLs its process
group and every descendant; nothing else on the machine is touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray

import durable_steps as ds
from durable_steps._fleet import leases
from durable_steps.integrations.ray import RayDriver, submit_run
from tests import workerapp
from tests.conftest import StoreTarget
from tests.test_worker import COMMITS, DONE, Child, check_ledger, fleet, header, lines

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.workerapp:workflow"
LEASE = 3.0  # the workflow's lease on the cluster: short, so waits for it are too
COMMIT_STEPS = [
    [name, i] for i in range(workerapp.PASSES) for name in ("fetch", "charge", "finish")
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc (Ray may start its own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(stat[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass
class Node:
    """One ``ray start --block`` and everything it started."""

    name: str
    proc: subprocess.Popen[bytes]
    temp: str
    log: Path

    def started(self) -> bool:
        """Whether ``ray start`` says this node is up."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
        return "Ray runtime started" in self.log.read_text()

    def kill(self) -> None:
        """SIGKILL this node's processes (and only them)."""
        below = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class Cluster:
    """The address, the nodes, and the files the workerapp steps write."""

    address: str
    base: Path
    env: dict[str, str]
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def store(self) -> str:
        return str(self.base / "store")

    @property
    def ledger(self) -> Path:
        return self.base / "ledger.txt"

    @property
    def steps(self) -> Path:
        return self.base / "steps.txt"

    def start(self, name: str, *args: str) -> Node:
        temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: unix socket paths
        log = self.base / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("ray")),
                    "start",
                    "--block",
                    f"--temp-dir={temp}",
                    "--node-ip-address=127.0.0.1",
                    f"--dashboard-agent-listen-port={free_port()}",
                    f"--metrics-export-port={free_port()}",
                    "--disable-usage-stats",
                    *args,
                ],
                cwd=ROOT,
                env={**self.env, "DURABLE_STEPS_HOST": name},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.nodes[name] = Node(name, proc, temp, log)
        return self.nodes[name]

    def node_logs(self) -> str:
        return "\n".join(f"--- {n.name}\n{n.log.read_text()[-3000:]}" for n in self.nodes.values())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A head (0 CPUs) and two 1-CPU nodes, ``node-b`` and ``node-c``, on loopback."""
    base = tmp_path_factory.mktemp("ray")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_USAGE_STATS_ENABLED": "0",
        "WORKERAPP_LEASE": str(LEASE),
        "WORKERAPP_STEP_SECONDS": "0.5",  # a wide window to kill a node mid-run
        "WORKERAPP_LEDGER": str(base / "ledger.txt"),
        "WORKERAPP_LOG": str(base / "steps.txt"),
    }
    env.pop("DURABLE_STEPS_STORE", None)
    made = Cluster(f"127.0.0.1:{port}", base, env)
    try:
        made.start(
            "head",
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            "--num-cpus=0",
        )
        wait_until(made.nodes["head"].started, 90, "the head node", made)
        for name in ("node-b", "node-c"):
            made.start(name, f"--address={made.address}", "--num-cpus=1")
        for name in ("node-b", "node-c"):
            wait_until(made.nodes[name].started, 90, name, made)
        ray.init(address=made.address, log_to_driver=False)
        wait_until(lambda: sum(1 for n in ray.nodes() if n["Alive"]) == 3, 60, "3 nodes", made)
        yield made
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        for node in reversed(list(made.nodes.values())):
            node.kill()
            shutil.rmtree(node.temp, ignore_errors=True)


def wait_until(
    predicate: object, timeout: float, what: str, cluster: Cluster | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            extra = f"\n{cluster.node_logs()}" if cluster else ""
            raise AssertionError(f"timed out waiting for {what}{extra}")
        time.sleep(0.2)


def pids_of(cluster: Cluster, run_id: str) -> list[int]:
    """The pid of each step start of ``run_id``, in order."""
    return [int(e[3]) for e in lines(cluster.steps) if e[1] == run_id]


def assert_one_writer_at_a_time(cluster: Cluster, run_id: str) -> None:
    """Once another process ran a step of the run, the earlier one never ran one again."""
    spans: list[int] = []
    for pid in pids_of(cluster, run_id):
        if not spans or spans[-1] != pid:
            assert pid not in spans, f"{run_id}: steps interleaved between {spans} and {pid}"
            spans.append(pid)


def assert_completed_once(store: ds.Store, run_id: str) -> None:
    """Completed, unowned, each step committed once in order."""
    h = header(store, run_id)
    assert (h.status, h.committed, h.owner) == ("completed", COMMITS, None), run_id
    assert [[e[0], e[1]] for e in h.history] == COMMIT_STEPS, run_id


def test_twenty_runs_survive_a_node_killed_mid_run(cluster: Cluster) -> None:
    """20 runs via `worker --ray`, a node SIGKILLed mid-run: each completes once, one key each."""
    store = ds.LocalStore(cluster.store)
    wf = fleet(store, lease=LEASE)
    # The kill lands in the first runs; the rest then queue on the one node left, so
    # each run more costs its steps' time there: 20 leave plenty after the kill.
    runs = [f"k{i:02d}" for i in range(20)]
    for r in runs:
        wf.submit(r, workerapp.initial_state())
    driver = subprocess.Popen(
        [
            *(sys.executable, "-m", "durable_steps", "worker", "--ray", cluster.address),
            *("--app", APP, "--store", cluster.store, "--until-idle", "--poll", "0.5"),
        ],
        cwd=ROOT,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        victim = cluster.nodes["node-b"]
        # Mid-run: the victim's worker has started a run's steps, and not all of them.
        wait_until(lambda: node_is_mid_run(cluster, victim, runs), 60, "node-b mid-run", cluster)
        victim.kill()
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.communicate()
    assert driver.returncode == 0, err[-4000:]
    # No "lost": each task Ray retried waited out its dead attempt's lease and finished the run.
    expected = (
        "worker fleet: 20 completed, 0 failed, 0 in-doubt, 0 released, 0 waiting, 0 lost, "
        "0 stranded, 0 errors"
    )
    assert expected in out, out + err[-4000:]
    resumed = [r for r in runs if len(set(pids_of(cluster, r))) > 1]
    assert resumed, "no run was resumed after the kill"
    for r in runs:
        assert_completed_once(store, r)
        assert_one_writer_at_a_time(cluster, r)
        assert wf.run(r) == DONE
    ledger = [e for e in lines(cluster.ledger) if e[0] in runs]
    cluster.ledger.with_suffix(".k").write_text("".join(" ".join(e) + "\n" for e in ledger))
    check_ledger(cluster.ledger.with_suffix(".k"), runs, max_duplicates=len(resumed))


def node_is_mid_run(cluster: Cluster, node: Node, runs: list[str]) -> bool:
    """Whether a process of ``node`` has started some, not all, steps of a run."""
    below = descendants(node.proc.pid)
    for r in runs:
        mine = [pid for pid in pids_of(cluster, r) if pid in below]
        if mine and len(mine) < len(COMMIT_STEPS) and len(pids_of(cluster, r)) == len(mine):
            return True
    return False


def owner_host(store: ds.Store, run_id: str) -> str | None:
    owner = header(store, run_id).owner
    return None if owner is None else owner.get("host")


def test_live_owner_on_another_host_is_not_taken_over(cluster: Cluster, tmp_path: Path) -> None:
    """A run a live process on "another host" owns is left to it; the task reports it lost."""
    store = ds.LocalStore(cluster.store)
    target = StoreTarget("local", cluster.store)
    child = Child(
        target,
        "-m",
        "tests.workerapp",
        "live1",
        WORKERAPP_STEP_SECONDS="8",
        WORKERAPP_LEASE=str(LEASE),
        WORKERAPP_LEDGER=str(cluster.ledger),
        WORKERAPP_LOG=str(cluster.steps),
        DURABLE_STEPS_HOST="elsewhere",
    )
    try:
        wait_until(lambda: pids_of(cluster, "live1"), 30, "the owner's first step")
        ref = submit_run(APP, "live1", store=cluster.store, wait=LEASE * 1.5)
        assert ray.get(ref, timeout=60) == "lost"
        assert owner_host(store, "live1") == "elsewhere"  # the heartbeat kept it
        code, err = child.wait(timeout=60)
    finally:
        child.kill()
    assert code == 0, err
    assert_completed_once(store, "live1")
    assert set(pids_of(cluster, "live1")) == {child.proc.pid}


def test_paused_owner_on_another_host_keeps_its_run_until_the_lease_ends(
    cluster: Cluster,
) -> None:
    """A task waits out a SIGSTOPped owner's lease (no RunLocked), then resumes the run.

    The owner's lease (8 s) outlasts a task's start, so the task finds it live.
    """
    store = ds.LocalStore(cluster.store)
    child = Child(
        StoreTarget("local", cluster.store),
        "-m",
        "tests.workerapp",
        "paused1",
        WORKERAPP_STEP_SECONDS="14",
        WORKERAPP_LEASE="8",
        WORKERAPP_LEDGER=str(cluster.ledger),
        WORKERAPP_LOG=str(cluster.steps),
        DURABLE_STEPS_HOST="elsewhere",
    )
    try:
        wait_until(lambda: pids_of(cluster, "paused1"), 30, "the owner's first step")
        child.signal(signal.SIGSTOP)
        paused = header(store, "paused1")
        assert paused.owner is not None
        lease_ends = leases.lease_end(paused.owner, since=paused.updated_at)
        ref = submit_run(APP, "paused1", store=cluster.store, wait=30)
        taken_at = None
        while taken_at is None:
            if owner_host(store, "paused1") not in ("elsewhere", None):
                taken_at = time.time()
            elif header(store, "paused1").status == "completed":
                taken_at = time.time()
            time.sleep(0.05)
            assert time.time() < lease_ends + 30, "never taken over"
        assert taken_at >= lease_ends, f"taken over {lease_ends - taken_at:.2f}s early"
        assert ray.get(ref, timeout=60) == "completed"
        child.signal(signal.SIGCONT)
        code, err = child.wait(timeout=60)
    finally:
        child.kill()
    assert code == 3, err  # the straggler woke, tried to write, and was fenced off
    assert_completed_once(store, "paused1")
    assert_one_writer_at_a_time(cluster, "paused1")


def test_driver_reports_failed_runs_and_task_options_reach_ray(cluster: Cluster) -> None:
    """RayDriver: runs complete, a run that cannot resume is reported, Ray options apply."""
    store = ds.LocalStore(cluster.store)
    wf = fleet(store, lease=LEASE)
    runs = [f"d{i}" for i in range(4)]
    for r in runs:
        wf.submit(r, workerapp.initial_state())
    # A state the steps cannot use: each attempt raises, the step fails.
    ds.Workflow("fleet", steps=wf.steps, store=store, lease=LEASE).submit("dbad", {"x": 1})
    driver = RayDriver(
        APP,
        store=cluster.store,
        max_in_flight=2,
        poll=0.2,
        task_options={"num_cpus": 1, "resources": {}, "max_retries": 1},
    )
    report = driver.run(until_idle=True)
    assert sorted(report.completed) == runs
    assert report.failed == ["dbad"]
    assert (report.errors, report.lost, report.in_doubt) == ([], [], [])
    for r in runs:
        assert_completed_once(store, r)
    # A resource no node has: Ray cannot place the task, so it never starts.
    ref = submit_run(APP, "d0", store=cluster.store, resources={"no-such-gpu": 1})
    ready_refs, _ = ray.wait([ref], timeout=2)
    assert ready_refs == []
    ray.cancel(ref)
