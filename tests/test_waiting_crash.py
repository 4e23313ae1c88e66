"""Waiting runs under workers and real crashes.

A worker scanning 100 waiting runs resumes exactly the signalled ones, from
its one LIST per scan. Then ``tests/waitchild.py`` (``draft`` -> ``approve``:
``ctx.wait_for("approval")`` then a refund effect -> ``notify``) is
SIGKILLed at each boundary of suspending and waking, on a local directory
and on a real S3 server (each case on one of SeaweedFS and moto, alternating;
a sample there is fast, the rest is marked slow), and
finished: the approval's payload reaches the step's logic the same every
time and is acted on once (one refund key), no signal is lost, and no step
is skipped or committed twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget, one_s3_kind_each
from tests.crashchild import read_lines
from tests.forkserver import ForkServer
from tests.waitchild import EXIT_ALREADY_SENT, EXIT_WAITING, WORKFLOW, build_workflow

CHILD = Path(__file__).with_name("waitchild.py")
KILLED = -signal.SIGKILL
_forks = ForkServer(CHILD)
RUN = "t-7"
PAYLOAD = {"amount": 3400, "approved": True, "by": "ana"}
FINAL = {
    "draft": {"amount": 3400, "ticket": "t-7"},
    "notified": True,
    "payload": PAYLOAD,
    "refund": {"refunded": 3400},
}


# --- one worker, 100 waiting runs ---------------------------------------------------


class CountingStore:
    """Counts the store calls made through it."""

    def __init__(self, inner: ds.Store) -> None:
        self.inner = inner
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        if name != "clock_skew":  # a memory store's clock is this process's: no request
            self.calls[name] += 1
        return getattr(self.inner, name)


def test_a_worker_resumes_exactly_the_signalled_runs_from_its_listing() -> None:
    """100 waiting, 50 signalled: exactly those resume; a scan is 1 LIST of the index of
    runs, and no GET: a waiting run's marker and its signal's nudge tell it all."""
    counting = CountingStore(ds.MemoryStore())
    wf = ds.Workflow("hundred", store=counting)  # type: ignore[arg-type]

    @wf.step()
    def hold(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = ctx.wait_for("go")

    @wf.step()
    def after(state: dict[str, Any]) -> None:
        state["after"] = True

    runs = [f"r{i:03d}" for i in range(100)]
    for run_id in runs:
        assert wf.submit(run_id)
    worker = ds.Worker(wf, concurrency=4, poll=0.01)
    first = worker.run(until_idle=True)
    assert sorted(first.waiting) == runs
    assert (first.completed, first.errors, first.lost) == ([], [], [])

    def scan(observer: ds.Worker) -> tuple[list[str], dict[str, int]]:
        counting.calls.clear()
        found = sorted(observer.claimable())
        return found, dict(counting.calls)

    observer = ds.Worker(wf)  # scans only: its counts are not mixed with any resume's
    assert scan(observer) == ([], {"list": 2})  # the registry once, then the live runs
    assert scan(observer) == ([], {"list": 1})
    assert scan(worker) == ([], {"list": 1})  # it has seen them all waiting

    chosen = runs[::2]
    for run_id in chosen:
        assert wf.signal(run_id, "go", {"for": run_id})
    assert scan(observer) == (chosen, {"list": 1})  # the signals are in the LIST
    assert scan(worker) == (chosen, {"list": 1})

    second = worker.run(until_idle=True)
    assert sorted(second.completed) == chosen
    assert (second.waiting, second.errors, second.lost) == ([], [], [])
    assert scan(observer) == ([], {"list": 1})  # the 50 that finished left the index
    assert scan(observer) == ([], {"list": 1})
    assert scan(worker) == ([], {"list": 1})
    for run_id in runs:
        header = ckpt.decode(counting.inner.get(f"hundred/{run_id}/checkpoint")[0], where="")[0]  # type: ignore[index]
        assert header.status == ("completed" if run_id in chosen else "waiting")
    for run_id in chosen:
        assert wf.run(run_id) == {"got": {"for": run_id}, "after": True}


# --- SIGKILL at every boundary of suspend and wake --------------------------------------

BEFORE_SIGNAL = ("before-wait", "after-wait")  # killed on the way to the wait
WAKE = ("after-record", "inside-after-wait", "inside-effect", "before-commit", "after-commit")
CASES = [(crash, False, crash) for crash in (*BEFORE_SIGNAL, "after-signal", *WAKE)]
CASES += [
    ("after-record", True, "worker-after-claim"),
    ("inside-effect", True, "worker-inside-effect"),
]
S3_SAMPLE = ("after-wait", "after-signal", "inside-effect", "worker-after-claim")
"""On the S3 servers (a child there pays for boto3) these; the others are marked slow."""


def _params() -> list[Any]:
    # Every case on the local store; over the wire each case on one server, not both.
    params = [
        pytest.param("local", crash, worker, id=f"local-{name}") for crash, worker, name in CASES
    ]
    for kind, (crash, worker, name) in one_s3_kind_each(CASES):
        marks = [pytest.mark.s3, *(() if name in S3_SAMPLE else (pytest.mark.slow,))]
        params.append(pytest.param(kind, crash, worker, marks=marks, id=f"{kind}-{name}"))
    return params


@dataclass
class Child:
    """Runs ``waitchild.py`` against one store target, in ``tmp``."""

    target: StoreTarget
    tmp: Path

    def __call__(self, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
        """``waitchild.py MODE --store URL --run RUN ARGS``, a fresh fork of the fork server."""
        proc = _forks.run(
            [mode, "--store", self.target.url, "--run", RUN, *args],
            cwd=self.tmp,
            out=self.tmp / "child",
            env=self.target.child_env(),
            timeout=90,
        )
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    def log(self) -> list[str]:
        """The executions log."""
        return read_lines(self.tmp / "executions.log")

    def ledger(self) -> list[str]:
        """The refunds the payments API saw: ``<key> <amount>``."""
        return read_lines(self.tmp / "ledger.log")


def _header(store: ds.Store) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(WORKFLOW, RUN))
    assert found is not None
    return ckpt.decode(found[0], where=RUN)[0]


@pytest.mark.parametrize(
    ("durable_target", "crash", "worker"), _params(), indirect=["durable_target"]
)
def test_sigkill_around_suspend_and_wake_delivers_the_signal_once(
    durable_target: StoreTarget, tmp_path: Path, crash: str, worker: bool
) -> None:
    """Killed at the boundary, then finished: one payload, acted on once; no step skipped."""
    child, store = Child(durable_target, tmp_path), durable_target.open()
    run = ("run", "--worker") if worker else ("run",)

    # 1. The run reaches its wait (or is killed on the way); a rerun waits again.
    first = child("run", *(("--crash", crash) if crash in BEFORE_SIGNAL else ()))
    assert first.returncode == (KILLED if crash in BEFORE_SIGNAL else EXIT_WAITING), first.stderr
    again = child("run")
    assert again.returncode == EXIT_WAITING, again.stdout + again.stderr
    assert "waiting at step 'approve' for signal 'approval'" in again.stderr
    waiting = _header(store)
    assert (waiting.status, waiting.owner, waiting.committed) == ("waiting", None, 1)
    assert child.log().count("model") == 1  # the draft's model call was not made again

    # 2. A person approves; the sender may die right after the signal object lands.
    data = ("--data", json.dumps(PAYLOAD))
    if crash == "after-signal":
        assert child("send", *data, "--crash", crash).returncode == KILLED
        other = ("--data", json.dumps({**PAYLOAD, "amount": 1}))
        assert child("send", *other).returncode == EXIT_ALREADY_SENT  # the retry is refused
    else:
        sent = child("send", *data)
        assert sent.returncode == 0, sent.stderr

    # 3. The run wakes (killed at the boundary), then finishes.
    if crash in WAKE:
        killed = child(*run, "--crash", crash)
        assert killed.returncode == KILLED, killed.stdout + killed.stderr
    done = child(*run)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == FINAL

    log, ledger = child.log(), child.ledger()
    got = [line for line in log if line.startswith("got:")]
    assert got  # every time the step's logic ran past the wait, it got the same payload
    assert set(got) == {f"got:{json.dumps(PAYLOAD, sort_keys=True)}"}
    assert len(got) == (2 if crash in WAKE[1:4] else 1)  # re-runs only after a kill in it
    assert len({line.split()[0] for line in ledger}) == 1  # one refund key: acted on once
    assert {line.split()[1] for line in ledger} == {"3400"}
    assert len(ledger) == (2 if crash == "inside-effect" else 1)  # re-fired with its key
    assert [log.count(s) for s in ("model", "draft", "notify")] == [1, 1, 1]
    header = _header(store)
    assert (header.status, header.committed) == ("completed", 3)
    assert [entry[0] for entry in header.history] == ["draft", "approve", "notify"]
    assert child("run").returncode == 0  # and a further run does nothing
    assert (child.log(), child.ledger()) == (log, ledger)
    store.close()


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_a_signal_sent_before_the_wait_survives_a_kill_after_its_record(
    durable_target: StoreTarget, tmp_path: Path
) -> None:
    """An early signal is used at once; killed after its record, the rerun replays the record."""
    child, store = Child(durable_target, tmp_path), durable_target.open()
    assert build_workflow(store, tmp_path / "x", tmp_path / "y", None).submit(RUN)  # it must exist
    assert child("send", "--data", json.dumps(PAYLOAD)).returncode == 0
    killed = child("run", "--crash", "after-record")
    assert killed.returncode == KILLED, killed.stderr
    store.delete(f"{WORKFLOW}/{RUN}/signals/approval")  # the journal holds the payload now
    done = child("run")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == FINAL
    assert len(child.ledger()) == 1
    store.close()


# --- found while testing: for the core to decide --------------------------------------


def test_a_non_idempotent_step_may_not_wait() -> None:
    """A wait in an idempotent=False step is refused before anything waits or fires:
    woken, it would run again from its start, and its intent would look like a crash.
    """
    store = ds.MemoryStore()
    wf = ds.Workflow("mail", store=store)
    sent: list[str] = []

    @wf.step(idempotent=False, in_doubt="raise")
    def send(state: dict[str, Any], ctx: ds.Context) -> None:
        if ctx.wait_for("approval")["approved"]:
            sent.append(ctx.idempotency_key)

    with pytest.raises(ds.StepFailed) as info:
        wf.run("m1")
    cause = info.value.__cause__
    assert isinstance(cause, ds.DefinitionError)
    assert "may not wait" in str(cause)
    assert "ctx.effect" in str(cause)
    assert sent == []
