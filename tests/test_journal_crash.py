"""Real crashes of journaled calls: a child SIGKILLs itself at every journal boundary.

Each test runs ``tests/journalchild.py`` on a local directory or a real S3
server (SeaweedFS, moto), killed at one boundary of a journaled call; reruns
it to completion in a second child; then checks what really happened against
the child's executions log (every fn call), its ledger (what the "payment
API" saw, with keys), the head the kill left, and an uncrashed run's final
state. One crashed run and one rerun per kill point on the local store, and
per kill point on one real S3 server (alternating SeaweedFS and moto, see
``one_s3_kind_each``: each point goes over the wire once, not twice). Also: 50
concurrent calls (gathered acalls and aeffects, threads) killed mid-way,
``in_doubt="raise"`` after a kill, a format-1 run, and an owner SIGSTOPped
mid-step and taken over.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._record import checkpoint as ckpt
from durable_steps._record.format2 import load_state
from tests.conftest import StoreTarget, one_s3_kind_each
from tests.forkserver import ForkServer
from tests.journalchild import (
    EFFECTS,
    EXIT_IN_DOUBT,
    FANOUT,
    GATHER,
    PASSES,
    THREADS,
    TURNS,
    Crash,
    KillingStore,
    call_names,
    fanout_workflow,
    initial_state,
    read_lines,
    turns_workflow,
)

CHILD = Path(__file__).with_name("journalchild.py")
RUN = "r1"
KILLED = -signal.SIGKILL
_forks = ForkServer(CHILD)
ORDER = [(it, name) for it in range(PASSES) for name in call_names(it)]
"""Every journaled call of a ``turns`` run, in the order they are made."""

TURN_CRASHES: list[Crash] = [
    ("before-record", "model", 0),  # the run's first call, right after the create
    ("before-record", "model", 1),  # the model answered; not recorded yet
    ("after-record", "model", 1),
    ("after-intent", "tool:t1-1", 1),  # intent durable, charge not started
    ("inside", "tool:t1-1", 1),  # the charge landed in the ledger
    ("before-record", "tool:t1-1", 1),  # the charge returned; not recorded yet
    ("after-record", "tool:t1-1", 1),
    ("between", "tool:t1-0", 1),  # between two effects, in the step
    ("before-commit", "turn", 1),  # every call recorded, the pass not committed
    ("after-commit", "turn", 1),
    ("after-commit", "turn", PASSES - 1),  # the commit that completes the run
]


def _cases(cases: list[Any], ids: Callable[[Any], str] = str) -> list[Any]:
    """``(durable_target, case)`` params: every case on the local store, and on
    one real S3 server each (alternating: over the wire once, not on both).
    """
    params = [pytest.param("local", case, id=f"local-{ids(case)}") for case in cases]
    params += [
        pytest.param(kind, case, marks=pytest.mark.s3, id=f"{kind}-{ids(case)}")
        for kind, case in one_s3_kind_each(cases)
    ]
    return params


def crash_id(crash: Crash) -> str:
    """``("inside", "tool:t1-1", 1)`` -> ``inside:tool:t1-1:1``."""
    return ":".join(map(str, crash))


def exec_line(iteration: int, name: str) -> str:
    """How the executions log spells a call of ``name`` in pass ``iteration``."""
    return f"model:{iteration}" if name == "model" else name


def lines(calls: list[tuple[int, str]]) -> list[str]:
    """The executions log of ``calls``, in order."""
    return [exec_line(it, name) for it, name in calls]


@cache
def reference_json(workflow: str) -> str:
    """An uncrashed run's final state as the child prints it (in-process, memory store)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        log, ledger = Path(tmp) / "log", Path(tmp) / "ledger"
        if workflow == TURNS:
            final = turns_workflow(ds.MemoryStore(), log, ledger, None).run("ref", initial_state())
        else:
            wf = fanout_workflow(workflow, ds.MemoryStore(), log, ledger, None)
            final = run_fanout(wf, "ref")
    return json.dumps(final, sort_keys=True)


def run_fanout(wf: ds.Workflow, run_id: str) -> Any:
    """Run ``jrn-gather``, ``jrn-effects`` (async) or ``jrn-threads`` to its end."""
    import asyncio

    return asyncio.run(wf.arun(run_id, {})) if wf.steps[0].is_async else wf.run(run_id, {})


@dataclass
class Child:
    """The child on one store target, with its log files."""

    target: StoreTarget
    tmp: Path
    store: ds.Store = field(init=False)

    def __post_init__(self) -> None:
        self.store = self.target.open()
        self.log = self.tmp / "executions.log"
        self.ledger = self.tmp / "ledger.log"

    def run(self, workflow: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """Run the child's ``workflow`` on run ``RUN`` with ``extra`` arguments (a fresh
        fork of the fork server: a real process, without the imports' cost)."""
        args = [workflow, "--store", self.target.url, "--run", RUN]
        args += ["--log", str(self.log), "--ledger", str(self.ledger), *extra]
        return _forks.run(
            args, cwd=self.tmp, out=self.tmp / "child", env=self.target.child_env(), timeout=60
        )

    def finish(self, workflow: str, *extra: str) -> str:
        """Rerun without a crash; the final state's JSON the child printed."""
        proc = self.run(workflow, *extra)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def head(self, workflow: str) -> tuple[ckpt.Checkpoint, bytes]:
        """The stored head of run ``RUN`` and its payload (the format-2 tail)."""
        found = self.store.get(ckpt.checkpoint_key(workflow, RUN))
        assert found is not None
        return ckpt.decode(found[0], where=RUN)

    def recorded(self, workflow: str) -> list[str]:
        """The names of the calls the journal of ``RUN`` holds, as a resume reads them."""
        header, tail = self.head(workflow)
        loaded = drive_sync(load_state(header, tail, ds.JSONSerializer(), RUN), self.store)
        assert loaded is not None
        return [meta[2] for meta, _ in loaded[1].journal]

    def execs(self) -> list[str]:
        """The executions log: every fn call, in order."""
        return read_lines(self.log)

    def ledger_lines(self) -> list[str]:
        """The ledger: every charge that landed, ``tool:<id>:<key>``."""
        return read_lines(self.ledger)

    def assert_completed_and_inert(
        self, workflow: str, final: str, *, format1: bool = False
    ) -> None:
        """The run is completed with no journal; a third run returns ``final``, calls nothing."""
        header, _ = self.head(workflow)
        assert header.status == "completed"
        assert header.journal is None
        execs, ledger = self.execs(), self.ledger_lines()
        if workflow == TURNS:
            wf = turns_workflow(self.store, self.log, self.ledger, None, format1=format1)
            again = wf.run(RUN, initial_state())
        else:
            wf = fanout_workflow(workflow, self.store, self.log, self.ledger, None)
            again = run_fanout(wf, RUN)
        assert json.dumps(again, sort_keys=True) == final
        assert self.execs() == execs
        assert self.ledger_lines() == ledger


@pytest.fixture
def child(durable_target: StoreTarget, tmp_path: Path) -> Iterator[Child]:
    """A :class:`Child` on the target store; its store closed afterwards."""
    made = Child(durable_target, tmp_path)
    yield made
    made.store.close()


def expected_at_kill(crash: Crash) -> tuple[int, int, int, list[str]]:
    """For a kill at ``crash``: (fns started, passes committed, results in the
    journal, open effects) — what the kill must have left.
    """
    boundary, name, it = crash
    if name == "turn":
        done = sum(len(call_names(i)) for i in range(it + 1))
        committed = it + 1 if boundary == "after-commit" else it
        return done, committed, 0 if boundary == "after-commit" else len(call_names(it)), []
    at = ORDER.index((it, name))
    first = ORDER.index((it, "model"))
    started = at if boundary in ("before-intent", "after-intent") else at + 1
    recorded = at + 1 - first if boundary in ("after-record", "between") else at - first
    opened = boundary in ("after-intent", "inside") or (
        boundary == "before-record" and name != "model"
    )
    return started, it, recorded, [name] if opened else []


def ledger_keys(ledger: list[str], doubled: str | None) -> dict[str, str]:
    """Check the ledger; each effect's one key. Every tool call of the run was
    charged once (twice for ``doubled``, then with the same key)."""
    fired: dict[str, list[str]] = {}
    for line in ledger:
        name, key = line.rsplit(":", 1)
        fired.setdefault(name, []).append(key)
    assert sorted(fired) == sorted(n for _, n in ORDER if n != "model")
    for name, seen in fired.items():
        assert len(seen) == (2 if name == doubled else 1), (name, seen)
        assert len(set(seen)) == 1, f"{name} re-fired with another key: {seen}"
    keys = {name: seen[0] for name, seen in fired.items()}
    assert len(set(keys.values())) == len(keys), "two effects share a key"
    return keys


@pytest.mark.parametrize(
    ("durable_target", "crash"), _cases(TURN_CRASHES, crash_id), indirect=["durable_target"]
)
def test_sigkill_at_a_journal_boundary_then_rerun_matches_uncrashed_run(
    child: Child, crash: Crash
) -> None:
    """Killed here and rerun: calls ran once, one key per effect, final state byte-equal."""
    check_kill_and_rerun(child, crash)


FORMAT1_CRASHES = [c for c in TURN_CRASHES if c[0] in ("before-record", "inside", "after-record")]


@pytest.mark.parametrize("crash", FORMAT1_CRASHES, ids=crash_id)
@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_sigkill_of_a_format_1_run_keeps_its_journal_in_the_header(
    child: Child, crash: Crash
) -> None:
    """A format-1 run (journal in the header) killed here resumes just the same."""
    check_kill_and_rerun(child, crash, "--format1")
    assert child.head(TURNS)[0].format == 1


def check_kill_and_rerun(child: Child, crash: Crash, *extra: str) -> None:
    """Kill the child at ``crash``, rerun it (both with ``extra``), check everything."""
    boundary, name, it = crash
    proc = child.run(TURNS, "--crash", crash_id(crash), *extra)
    assert proc.returncode == KILLED, proc.stderr

    # What the kill left: the fns before it ran; the head holds exactly the
    # calls recorded so far and the intent of the effect in flight.
    started, committed, recorded, opened = expected_at_kill(crash)
    assert child.execs() == lines(ORDER[:started])
    header, _ = child.head(TURNS)
    assert header.committed == committed
    journal = header.journal
    assert (journal["calls"] if journal else 0) == recorded
    assert ([e["name"] for e in journal["open"]] if journal else []) == opened
    if journal is not None:
        assert (journal["step"], journal["iteration"]) == ("turn", it)
    intent_key = journal["open"][0]["key"] if journal and opened else None
    before = child.ledger_lines()

    final = child.finish(TURNS, *extra)

    # The rerun called exactly what was not recorded, from there on; a call
    # runs twice only if its fn had run and its record had not landed.
    done = sum(len(call_names(i)) for i in range(committed)) + recorded
    assert child.execs() == lines(ORDER[:started]) + lines(ORDER[done:])
    twice = {n for n, c in Counter(child.execs()).items() if c > 1}
    in_flight = set(lines(ORDER[done:started]))
    assert twice == in_flight
    assert len(in_flight) <= 1
    # Each effect one key, the in-flight one re-fired with the key its intent holds.
    doubled = name if boundary in ("inside", "before-record") and name != "model" else None
    keys = ledger_keys(child.ledger_lines(), doubled)
    assert child.ledger_lines()[: len(before)] == before
    if intent_key is not None:
        assert keys[name] == intent_key
    nonce = child.head(TURNS)[0].run_nonce
    assert keys == {n: ckpt.effect_key(nonce, i, "turn", n) for i, n in ORDER if n != "model"}
    # Byte-equal to an uncrashed run; completed; a third run calls nothing.
    assert final == reference_json(TURNS)
    child.assert_completed_and_inert(TURNS, final, format1="--format1" in extra)


@pytest.mark.parametrize(
    ("durable_target", "workflow"), _cases([GATHER, THREADS]), indirect=["durable_target"]
)
def test_sigkill_among_50_concurrent_calls_then_rerun_calls_each_unrecorded_once(
    child: Child, workflow: str
) -> None:
    """Killed at 25 of 50 concurrent calls: the rerun calls exactly the unrecorded ones."""
    proc = child.run(workflow, "--kill-at-calls", "25")
    assert proc.returncode == KILLED, proc.stderr
    header, _ = child.head(workflow)
    assert header.journal is not None
    held = child.recorded(workflow)
    assert header.journal["calls"] == len(held)
    assert 25 <= len(held) < FANOUT
    assert len(set(held)) == len(held)
    before = child.execs()
    assert set(held) <= set(before)  # recorded means its fn ran
    assert len(set(before)) == len(before)

    final = child.finish(workflow)

    everything = {f"tool:{i}" for i in range(FANOUT)}
    rerun = child.execs()[len(before) :]
    assert sorted(rerun) == sorted(everything - set(held))  # each unrecorded name once
    counts = Counter(child.execs())
    assert set(counts) == everything
    assert {n for n, c in counts.items() if c == 2} == set(before) - set(held)
    assert max(counts.values()) <= 2
    assert final == reference_json(workflow)
    child.assert_completed_and_inert(workflow, final)


@pytest.mark.parametrize(
    "durable_target", ["local", pytest.param("seaweedfs", marks=pytest.mark.s3)], indirect=True
)
def test_sigkill_among_50_gathered_aeffects_then_rerun_refires_only_open_ones(
    child: Child,
) -> None:
    """Killed among 50 aeffects: each fired one had a durable intent; only they re-fire."""
    proc = child.run(EFFECTS, "--kill-at-calls", "25")
    assert proc.returncode == KILLED, proc.stderr
    header, _ = child.head(EFFECTS)
    assert header.journal is not None
    held = set(child.recorded(EFFECTS))
    opened = {e["name"]: e["key"] for e in header.journal["open"]}
    assert len(held) >= 25
    assert not held & set(opened)
    started = set(child.execs())
    fired = {line.rsplit(":", 1)[0] for line in child.ledger_lines()}
    assert held <= fired
    assert started <= held | set(opened)  # no fn started before its intent was durable
    nonce = header.run_nonce
    assert opened == {n: ckpt.effect_key(nonce, 0, "fanout", n) for n in opened}

    final = child.finish(EFFECTS)

    everything = {f"tool:{i}" for i in range(FANOUT)}
    by_name: dict[str, list[str]] = {}
    for line in child.ledger_lines():
        name, key = line.rsplit(":", 1)
        by_name.setdefault(name, []).append(key)
    assert set(by_name) == everything
    assert {n for n, keys in by_name.items() if len(keys) == 2} == fired - held
    assert all(
        keys == [ckpt.effect_key(nonce, 0, "fanout", n)] * len(keys) for n, keys in by_name.items()
    )
    assert max(len(keys) for keys in by_name.values()) <= 2
    assert final == reference_json(EFFECTS)
    child.assert_completed_and_inert(EFFECTS, final)


@pytest.mark.parametrize(
    "durable_target", ["local", pytest.param("moto", marks=pytest.mark.s3)], indirect=True
)
def test_in_doubt_raise_names_the_killed_effect_and_resolve_settles_it(child: Child) -> None:
    """in_doubt="raise" after a kill in an effect names it; resolve(fired=True) ends it."""
    crash = ("inside", "tool:t1-1", 1)
    raising = ("--in-doubt", "raise")
    assert child.run(TURNS, "--crash", crash_id(crash), *raising).returncode == KILLED
    (line,) = [x for x in child.ledger_lines() if x.startswith("tool:t1-1:")]
    key = line.rsplit(":", 1)[1]
    execs = child.execs()

    proc = child.run(TURNS, *raising)
    assert proc.returncode == EXIT_IN_DOUBT, proc.stderr
    assert "tool:t1-1" in proc.stderr
    assert key in proc.stderr
    header, _ = child.head(TURNS)
    assert header.status == "in_doubt"
    assert child.execs() == execs  # nothing called, not even the model

    turns_workflow(child.store, child.log, child.ledger, None).resolve(RUN, fired=True)
    final = json.loads(child.finish(TURNS))

    ledger_keys(child.ledger_lines(), doubled=None)  # charged once, under its key
    assert Counter(child.execs())["model:1"] == 1
    assert Counter(child.execs())["tool:t1-1"] == 1
    # The effect counted as done without a result: its message holds None, and
    # nothing else differs from an uncrashed run.
    reference = json.loads(reference_json(TURNS))
    for message in reference["messages"]:
        if message.get("id") == "t1-1":
            message["content"] = None
    assert final == reference
    child.assert_completed_and_inert(TURNS, json.dumps(final, sort_keys=True))


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize(
    "durable_target", ["local", pytest.param("seaweedfs", marks=pytest.mark.s3)], indirect=True
)
def test_a_paused_owner_taken_over_mid_step_records_and_fires_nothing_more(
    child: Child,
) -> None:
    """An owner paused mid-step and taken over fires nothing more when it wakes."""
    crash = ("between", "tool:t1-0", 1)
    cmd = [sys.executable, str(CHILD), TURNS, "--store", child.target.url, "--run", RUN]
    cmd += ["--log", str(child.log), "--ledger", str(child.ledger), "--stop"]
    cmd += ["--crash", crash_id(crash)]
    paused = subprocess.Popen(
        cmd,
        env=child.target.child_env(),
        cwd=child.tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not stopped(paused.pid):
            assert paused.poll() is None, paused.communicate()
            assert time.monotonic() < deadline, "the child never reached its stop"
            time.sleep(0.05)
        execs = child.execs()
        assert execs[-1] == "tool:t1-0"

        wf = turns_workflow(child.store, child.log, child.ledger, None)
        final = json.dumps(wf.run(RUN, initial_state(), takeover=True), sort_keys=True)
        assert child.execs()[: len(execs)] == execs
        assert "model:1" not in child.execs()[len(execs) :]  # replayed, not called
        assert "tool:t1-0" not in child.execs()[len(execs) :]
        after_takeover = (child.execs(), child.ledger_lines())

        paused.send_signal(signal.SIGCONT)
        _, err = paused.communicate(timeout=60)
    finally:
        if paused.poll() is None:
            paused.kill()
            paused.wait()
    assert paused.returncode != 0
    assert "CheckpointConflict" in err or "conflict" in err.lower(), err
    assert (child.execs(), child.ledger_lines()) == after_takeover  # it fired nothing more
    ledger_keys(child.ledger_lines(), doubled=None)
    assert final == reference_json(TURNS)
    child.assert_completed_and_inert(TURNS, final)


def test_kill_points_are_distinct_head_writes(tmp_path: Path) -> None:
    """The child's KillingStore names each record, intent and commit once, in order."""
    seen: list[tuple[str, str, int]] = []

    class Recorder(KillingStore):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.startswith("_index/"):  # the index of runs: not what is tested
                return super().put(key, data, match=match)
            if "/parts/" not in key:
                seen.append(self.classify(data, match))
            return super().put(key, data, match=match)

    wf = turns_workflow(ds.MemoryStore(), tmp_path / "log", tmp_path / "ledger", None)
    wf.store = Recorder(wf.store.inner)  # type: ignore[attr-defined]
    wf.run(RUN, initial_state())
    expected: list[tuple[str, str, int]] = [("create", "run", 0)]
    for it in range(PASSES):
        for name in call_names(it):
            if name != "model":
                expected.append(("intent", name, it))
            expected.append(("record", name, it))
        expected.append(("commit", "turn", it))
    assert seen == expected
