"""Real crashes: a child process SIGKILLs itself at every write boundary.

Each test runs ``tests/crashchild.py`` (a 3-pass loop of ``plan``,
``charge`` (non-idempotent), ``draft``, ``send`` (non-idempotent)) on a
local directory or a real S3 server, killed at one boundary; then reruns it
to completion and checks the guarantees against what the child recorded:
the executions log (which steps really ran), the ledger (what the "payment
API" saw, with idempotency keys), the checkpoint, and the final state of an
uncrashed reference run of the same workflow in the same store.

Local runs cover every boundary at a representative set of points; the S3
servers (each child pays ~0.3 s to import boto3) a subset, each point of it on
one server (alternating SeaweedFS and moto, see ``one_s3_kind_each``).
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget, one_s3_kind_each
from tests.crashchild import (
    EXIT_IN_DOUBT,
    PASSES,
    STEPS,
    KillingStore,
    build_workflow,
    initial_state,
    read_lines,
    workflow_name,
)
from tests.forkserver import ForkServer

CHILD = Path(__file__).with_name("crashchild.py")
IDEMPOTENT = dict(STEPS)
ORDER = [(name, i) for i in range(PASSES) for name, _ in STEPS]
"""Every (step, iteration) of a run, in the order they execute."""
RUN = "r1"
KILLED = -signal.SIGKILL
_forks = ForkServer(CHILD)

Crash = tuple[str, str, int]


def fmt(points: list[tuple[str, int]]) -> list[str]:
    """``[("plan", 0)]`` → ``["plan:0"]``, the executions log's spelling."""
    return [f"{s}:{i}" for s, i in points]


# --- the crash matrix -----------------------------------------------------------

STEP_BOUNDARIES = ("inside", "before-commit", "after-commit")
INTENT_BOUNDARIES = ("before-intent", "after-intent")
LOCAL_POINTS = [("plan", 0), ("charge", 0), ("draft", 1), ("send", 1), ("charge", 2), ("send", 2)]
LOCAL_CRASHES: list[Crash] = [
    ("before-create", "run", 0),
    ("after-create", "run", 0),
    *(
        (boundary, step, it)
        for step, it in LOCAL_POINTS
        for boundary in (() if IDEMPOTENT[step] else INTENT_BOUNDARIES) + STEP_BOUNDARIES
    ),
]
S3_CRASHES: list[Crash] = [
    ("after-intent", "charge", 0),
    ("inside", "send", 1),
    ("before-commit", "draft", 1),
    ("after-commit", "charge", 2),
    ("after-commit", "send", 2),  # the commit that carries the terminal marker
]


def _cases(local: list[Crash], s3: list[Crash], s3_kinds: list[str] | None = None) -> list[Any]:
    # On the local store the cases sampled for S3 are the fast part; the full sweep is slow.
    # Over the wire each sampled case runs on one server (on each of ``s3_kinds`` if given).
    cases = [
        pytest.param(
            "local",
            c,
            marks=() if c in s3 else pytest.mark.slow,
            id=f"local-{':'.join(map(str, c))}",
        )
        for c in local
    ]
    wired = one_s3_kind_each(s3) if s3_kinds is None else [(k, c) for k in s3_kinds for c in s3]
    cases += [
        pytest.param(kind, c, marks=pytest.mark.s3, id=f"{kind}-{':'.join(map(str, c))}")
        for kind, c in wired
    ]
    return cases


# --- harness --------------------------------------------------------------------


@dataclass
class Harness:
    """One workflow variant on one store target, with the child's log files."""

    target: StoreTarget
    tmp: Path
    variant: str = "plain"
    store: ds.Store = field(init=False)

    def __post_init__(self) -> None:
        self.store = self.target.open()
        self.log = self.tmp / "executions.log"
        self.ledger = self.tmp / "ledger.log"

    def child(self, crash: Crash | None = None) -> subprocess.CompletedProcess[str]:
        """Run the child on run ``RUN``; crash at ``crash`` if given (a fresh fork of the
        fork server: a real process, without the imports' cost)."""
        cmd = [
            "--store",
            self.target.url,
            "--run",
            RUN,
            "--log",
            str(self.log),
            "--ledger",
            str(self.ledger),
            "--variant",
            self.variant,
        ]
        if crash is not None:
            cmd += ["--crash", ":".join(map(str, crash))]
        return _forks.run(
            cmd, cwd=self.tmp, out=self.tmp / "child", env=self.target.child_env(), timeout=60
        )

    def finish(self) -> dict[str, Any]:
        """Rerun the child without a crash; return the final state it printed."""
        proc = self.child()
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def workflow(self, log: Path | None = None, ledger: Path | None = None) -> ds.Workflow:
        """The child's workflow, in this process, on the same store."""
        return build_workflow(
            self.store, log or self.log, ledger or self.ledger, variant=self.variant
        )

    def checkpoint(self, run_id: str = RUN) -> ckpt.Checkpoint | None:
        """The stored header of ``run_id``, or None."""
        found = self.store.get(ckpt.checkpoint_key(workflow_name(self.variant), run_id))
        if found is None:
            return None
        return ckpt.decode(found[0], where=run_id)[0]

    def execs(self) -> list[str]:
        """The executions log: which steps (and reconcile hooks) ran."""
        return read_lines(self.log)

    def ledger_lines(self) -> list[str]:
        """The ledger: every non-idempotent firing, with its key."""
        return read_lines(self.ledger)

    def reference(self) -> tuple[dict[str, Any], list[str]]:
        """An uncrashed run on a fresh run id in the same store: (final state, keys)."""
        log, ledger = self.tmp / "ref-executions.log", self.tmp / "ref-ledger.log"
        final = self.workflow(log, ledger).run("reference", initial_state())
        assert read_lines(log) == fmt(ORDER)
        keys = ledger_keys(read_lines(ledger), doubled=None)
        assert self.checkpoint("reference").status == "completed"  # type: ignore[union-attr]
        return final, list(keys.values())

    def assert_completed_and_inert(self, final: dict[str, Any]) -> None:
        """The run is marked completed; a further run returns ``final`` and runs nothing."""
        header = self.checkpoint()
        assert header is not None
        assert header.status == "completed"
        assert header.intent is None
        assert header.committed == len(ORDER)  # no step committed twice
        execs, ledger = self.execs(), self.ledger_lines()
        assert self.workflow().run(RUN, initial_state()) == final
        assert self.execs() == execs
        assert self.ledger_lines() == ledger


@pytest.fixture
def harness(durable_target: StoreTarget, tmp_path: Path) -> Iterator[Callable[[str], Harness]]:
    """Build a Harness for a workflow variant; close its store afterwards."""
    made: list[Harness] = []

    def make(variant: str = "plain") -> Harness:
        made.append(Harness(durable_target, tmp_path, variant))
        return made[-1]

    yield make
    for h in made:
        h.store.close()


def ledger_keys(lines: list[str], doubled: tuple[str, int] | None) -> dict[tuple[str, int], str]:
    """Check the ledger; return each non-idempotent point's one key.

    Every non-idempotent (step, iteration) fired exactly once — twice for
    ``doubled``, and then with the same key — and keys are distinct across
    points and fit an idempotency-key field (<= 64 printable ASCII).
    """
    fired: dict[tuple[str, int], list[str]] = defaultdict(list)
    for line in lines:
        step, it, key = line.split(":", 2)
        fired[(step, int(it))].append(key)
    assert sorted(fired) == sorted(p for p in ORDER if not IDEMPOTENT[p[0]])
    keys = {}
    for point, point_keys in fired.items():
        assert len(point_keys) == (2 if point == doubled else 1), (point, point_keys)
        assert len(set(point_keys)) == 1, f"{point} re-fired with another key: {point_keys}"
        key = point_keys[0]
        assert len(key) <= 64
        assert key.isascii()
        assert key.isprintable()
        keys[point] = key
    assert len(set(keys.values())) == len(keys), "two steps or passes share a key"
    return keys


# --- tests ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("durable_target", "crash"), _cases(LOCAL_CRASHES, S3_CRASHES), indirect=["durable_target"]
)
def test_sigkill_then_resume_matches_uncrashed_run(
    harness: Callable[[str], Harness], crash: Crash
) -> None:
    """A SIGKILL at this boundary loses no commit, re-runs only the uncommitted step,
    re-fires with the persisted key, and ends in the uncrashed run's final state.
    """
    h = harness("plain")
    boundary, step, it = crash
    at = 0 if step == "run" else ORDER.index((step, it))

    proc = h.child(crash)
    assert proc.returncode == KILLED, proc.stderr

    # What the crash left: the steps before it ran, and exactly what was
    # committed is in the checkpoint (guarantee 1).
    started = at + 1 if boundary in STEP_BOUNDARIES else at
    assert h.execs() == fmt(ORDER[:started])
    header = h.checkpoint()
    in_doubt_key = None
    if boundary == "before-create":
        assert header is None
        committed = 0
    else:
        assert header is not None
        committed = at + 1 if boundary == "after-commit" else at
        assert header.committed == committed
        assert header.status == ("completed" if committed == len(ORDER) else "running")
        if boundary in ("after-intent", "inside", "before-commit") and not IDEMPOTENT[step]:
            assert header.intent is not None
            assert (header.intent["step"], header.intent["iteration"]) == (step, it)
            in_doubt_key = header.intent["key"]
        else:
            assert header.intent is None
    before_ledger = h.ledger_lines()

    final = h.finish()

    # (a) the rerun resumed at the first uncommitted step: nothing committed ran again.
    assert h.execs() == fmt(ORDER[:started]) + fmt(ORDER[committed:])
    counts = Counter(h.execs())
    for point in fmt(ORDER[:committed]):
        assert counts[point] == 1, point
    assert all(n <= 2 for n in counts.values())
    # (b) a key appears twice only for the step that fired and then died uncommitted.
    fired_uncommitted = boundary in ("inside", "before-commit") and not IDEMPOTENT[step]
    keys = ledger_keys(h.ledger_lines(), doubled=(step, it) if fired_uncommitted else None)
    assert h.ledger_lines()[: len(before_ledger)] == before_ledger
    if in_doubt_key is not None:
        assert keys[(step, it)] == in_doubt_key  # the persisted key was the one re-used
    # (c) the final state is the uncrashed run's; keys differ between runs.
    reference, reference_keys = h.reference()
    assert final == reference
    assert not set(keys.values()) & set(reference_keys)
    # (d) marked completed; a third run runs nothing.
    h.assert_completed_and_inert(reference)


def test_crash_boundaries_are_distinct_writes(tmp_path: Path) -> None:
    """The child's KillingStore sees every boundary of the matrix exactly once per run."""
    seen: list[Crash] = []

    class Recorder(KillingStore):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.startswith("_index/"):  # the index of runs: not what is tested
                return super().put(key, data, match=match)
            kind, step, it = self._classify(data, match)
            seen.append((kind, step, it))
            return super().put(key, data, match=match)

    wf = build_workflow(ds.MemoryStore(), tmp_path / "log", tmp_path / "ledger")
    wf.store = Recorder(wf.store.inner)  # type: ignore[attr-defined]
    wf.run(RUN, initial_state())
    expected: list[Crash] = [("create", "run", 0)]
    for step, it in ORDER:
        if not IDEMPOTENT[step]:
            expected.append(("intent", step, it))
        expected.append(("commit", step, it))
    assert seen == expected


@pytest.mark.parametrize(
    ("durable_target", "crash"),
    _cases([("inside", "charge", 1)], [("inside", "charge", 1)], s3_kinds=["moto"]),
    indirect=["durable_target"],
)
def test_in_doubt_raise_stops_until_resolved_fired(
    harness: Callable[[str], Harness], crash: Crash
) -> None:
    """in_doubt="raise": the rerun stops with StepInDoubt; after resolve(fired=True)
    the run completes without firing the step again.
    """
    h = harness("raise")
    assert h.child(crash).returncode == KILLED
    (fired_line,) = [line for line in h.ledger_lines() if line.startswith("charge:1:")]
    key = fired_line.split(":", 2)[2]

    proc = h.child()
    assert proc.returncode == EXIT_IN_DOUBT, proc.stderr
    assert "StepInDoubt" in proc.stderr
    assert "resolve" in proc.stderr
    assert key in proc.stderr
    header = h.checkpoint()
    assert header is not None
    assert header.status == "in_doubt"
    assert header.intent is not None
    assert header.intent["key"] == key
    assert h.execs() == fmt(ORDER[: ORDER.index(("charge", 1)) + 1])  # nothing ran

    h.workflow().resolve(RUN, fired=True)
    final = h.finish()

    assert Counter(h.execs())["charge:1"] == 1
    ledger_keys(h.ledger_lines(), doubled=None)
    reference, _ = h.reference()
    # The step counted as done without running: its change to the state is
    # absent (that is what reconcile= is for), and nothing else differs.
    expected = {**reference, "trail": [p for p in reference["trail"] if p != "charge:1"]}
    assert final == expected
    h.assert_completed_and_inert(expected)


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_in_doubt_raise_resolved_not_fired_refires_same_key(
    harness: Callable[[str], Harness],
) -> None:
    """in_doubt="raise" + resolve(fired=False): the rerun fires the step again with
    the same key and ends in the uncrashed run's final state.
    """
    h = harness("raise")
    assert h.child(("before-commit", "send", 0)).returncode == KILLED
    assert h.child().returncode == EXIT_IN_DOUBT
    h.workflow().resolve(RUN, fired=False)
    final = h.finish()
    ledger_keys(h.ledger_lines(), doubled=("send", 0))
    assert Counter(h.execs())["send:0"] == 2
    reference, _ = h.reference()
    assert final == reference
    h.assert_completed_and_inert(reference)


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_in_doubt_raise_asks_again_when_the_refire_dies(
    harness: Callable[[str], Harness],
) -> None:
    """in_doubt="raise": a re-fire allowed by resolve(fired=False) that is SIGKILLed
    after firing leaves the step in doubt again, so the next run raises StepInDoubt.
    """
    h = harness("raise")
    assert h.child(("after-intent", "charge", 0)).returncode == KILLED  # died before firing
    assert h.child().returncode == EXIT_IN_DOUBT
    assert not [line for line in h.ledger_lines() if line.startswith("charge:0:")]
    h.workflow().resolve(RUN, fired=False)  # correct: it had not fired

    assert h.child(("inside", "charge", 0)).returncode == KILLED  # fired, then died
    assert len([line for line in h.ledger_lines() if line.startswith("charge:0:")]) == 1
    proc = h.child()
    fired = [line for line in h.ledger_lines() if line.startswith("charge:0:")]
    assert proc.returncode == EXIT_IN_DOUBT, (
        f"the step may have fired, yet the run went on without asking (exit "
        f"{proc.returncode}; charge:0 fired {len(fired)} times)"
    )
    assert len(fired) == 1
    h.workflow().resolve(RUN, fired=True)
    final = h.finish()
    ledger_keys(h.ledger_lines(), doubled=None)
    reference, _ = h.reference()
    # Counted as done without running this time: its state change is absent.
    expected = {**reference, "trail": [p for p in reference["trail"] if p != "charge:0"]}
    assert final == expected
    h.assert_completed_and_inert(expected)


@pytest.mark.parametrize(
    ("durable_target", "crash"),
    _cases(
        [
            ("after-intent", "charge", 1),
            ("inside", "charge", 1),
            ("before-commit", "charge", 1),
            ("inside", "send", 2),
        ],
        [("inside", "charge", 1)],
        s3_kinds=["seaweedfs"],
    ),
    indirect=["durable_target"],
)
def test_reconcile_decides_in_doubt_step(harness: Callable[[str], Harness], crash: Crash) -> None:
    """reconcile= is asked once about the in-doubt step: it fires exactly once in all
    (never re-fired once it had fired) and the final state is the uncrashed one.
    """
    h = harness("reconcile")
    _, step, it = crash
    assert h.child(crash).returncode == KILLED
    final = h.finish()

    execs = Counter(h.execs())
    assert execs[f"reconcile:{step}:{it}"] == 1
    assert sum(n for e, n in execs.items() if e.startswith("reconcile:")) == 1
    assert execs[f"{step}:{it}"] == 1  # ran before the crash, or (not yet fired) after
    ledger_keys(h.ledger_lines(), doubled=None)
    reference, _ = h.reference()
    assert final == reference
    h.assert_completed_and_inert(reference)
