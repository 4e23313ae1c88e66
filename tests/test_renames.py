"""Deploys, part 2: a renamed step never strands a run; resume never creates one."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget, _target

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "renamechild.py"


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


def child(
    target: StoreTarget, code: str, scene: str, ledger: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(CHILD),
            "--store",
            target.url,
            "--code",
            code,
            "--run",
            "t1",
            "--scene",
            scene,
            "--ledger",
            str(ledger),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**target.child_env(), "PYTHONPATH": str(ROOT)},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("scene", "killed", "refunds"),
    [
        ("kill-inside", True, 1),  # its call and effect recorded: replayed under the new name
        ("call", True, 1),  # its call recorded, the effect not yet made
        ("doubt", True, 2),  # the effect in doubt: fired again, with its first key
        ("fail", False, 1),  # the step failed: resumes at the renamed step
        ("wait", False, 1),  # suspended at the step: the signal reaches the renamed step
    ],
)
def test_a_run_stopped_at_a_step_resumes_after_the_step_is_renamed(
    target: StoreTarget, tmp_path: Path, scene: str, killed: bool, refunds: int
) -> None:
    """Old code stopped for real at step 'approval' (SIGKILL inside it or inside its
    effect, a failure, a wait); new code, where it is 'approve' with renamed_from, resumes
    it in a fresh process: the recorded draft is not asked again, the refund keeps its key,
    the signal is delivered, and the run ends as an uncrashed one."""
    ledger = tmp_path / "ledger"
    old = child(target, "old", scene, ledger)
    if killed:
        assert old.returncode == -9, old.stderr
    else:
        assert old.returncode == 0, old.stderr
        assert json.loads(old.stdout)["stopped"] in ("StepFailed", "RunSuspended")
    if scene == "wait":
        wf = ds.Workflow("desk", store=target.open())
        assert wf.signal("t1", "go", "approved")
    new = child(target, "new", scene, ledger)
    assert new.returncode == 0, new.stderr
    final = json.loads(new.stdout)
    lines = ledger.read_text().splitlines()
    assert lines.count("draft") == 1, lines
    keys = [line.split()[1] for line in lines if line.startswith("refund")]
    assert len(keys) == refunds
    assert len(set(keys)) == 1, "one refund key, before the rename and after"
    assert final["refund"] == f"re_{keys[0][-6:]}"
    assert final["filed"] is True
    assert final.get("go") == ("approved" if scene == "wait" else None)
    store = target.open()
    header = ckpt.decode(store.get("desk/t1/checkpoint")[0], where="t")[0]  # type: ignore[index]
    assert header.status == "completed"
    assert header.steps == ("prepare", "approval", "finish")  # as stored: see test_rollback


# --- definition-time checks --------------------------------------------------------------


def test_an_old_name_that_is_a_step_or_claimed_twice_is_refused() -> None:
    """renamed_from naming a current step, claimed by two steps, or naming the step itself
    or an invalid name: DefinitionError at definition, naming both steps."""
    wf = ds.Workflow("w", store=ds.MemoryStore())
    wf.step(name="draft")(lambda s: None)
    with pytest.raises(
        ds.DefinitionError, match=r"'approve' has renamed_from='draft'.*'draft' is a step"
    ):
        wf.step(name="approve", renamed_from="draft")(lambda s: None)
    wf.step(name="approve", renamed_from=("approval", "ok"))(lambda s: None)
    with pytest.raises(
        ds.DefinitionError, match=r"'approve' and 'review' both have renamed_from='ok'"
    ):
        wf.step(name="review", renamed_from="ok")(lambda s: None)
    with pytest.raises(
        ds.DefinitionError, match=r"'approval' has renamed_from='approval'|renamed_from names"
    ):
        wf.step(name="approval", renamed_from="approval")(lambda s: None)
    with pytest.raises(ds.DefinitionError, match=r"'approval'.*is a step"):
        ds.Workflow(
            "w2",
            steps=[
                ds.step(lambda s: None, name="approve", renamed_from="approval"),
                ds.step(lambda s: None, name="approval"),
            ],
        )
    with pytest.raises(ds.DefinitionError, match="not a step name"):
        ds.step(lambda s: None, name="x", renamed_from="no/slash")
    assert ds.step(lambda s: None, name="y", renamed_from="a").renamed_from == ("a",)


def test_a_rename_onto_a_step_the_run_still_has_is_refused_on_resume(tmp_path: Path) -> None:
    """A run stored with both 'old' and 'new' (two steps then) cannot take new's
    renamed_from='old': WorkflowChanged, nothing written."""
    store = ds.LocalStore(tmp_path)
    before = ds.Workflow("w", store=store)
    before.step(name="old")(lambda s: None)
    before.step(name="new")(lambda s: None)
    before.step(name="end")(lambda s: s.update(end=True) and None)
    with pytest.raises(ds.testing.SimulatedCrash):
        ds.Workflow(
            "w", store=ds.testing.CrashingStore(store, after_write=2), steps=before.steps
        ).run("r", {})
    stored = store.get("w/r/checkpoint")
    after = ds.Workflow("w", store=store)
    after.step(name="new", renamed_from="old")(lambda s: None)
    after.step(name="end")(lambda s: None)
    with pytest.raises(ds.WorkflowChanged, match=r"both step 'old' and step 'new'"):
        after.resume("r")
    assert store.get("w/r/checkpoint") == stored


def test_a_step_renamed_twice_replays_what_it_recorded_under_its_first_name(
    target: StoreTarget, tmp_path: Path
) -> None:
    """approval -> approve -> approved, the run killed inside the step under the first two
    names: the newest code replays the draft recorded under 'approval' and the call the
    second code recorded under 'approve' (its head still names the step 'approval', for a
    rollback: see tests/test_rollback.py; the journal's ``was`` lists 'approve')."""
    ledger = tmp_path / "ledger"
    assert child(target, "old", "twice", ledger).returncode == -signal.SIGKILL
    assert child(target, "new", "twice", ledger).returncode == -signal.SIGKILL
    done = child(target, "newer", "twice", ledger)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["filed"] is True
    lines = ledger.read_text().split("\n")
    assert lines.count("draft") == 1  # recorded once, replayed by both later codes
    assert lines.count("second") == 1
    assert sum(line.startswith("refund ") for line in lines) == 1


def test_two_stored_steps_merged_into_one_are_refused_on_resume(tmp_path: Path) -> None:
    """A run stored with steps 'a' and 'b' cannot take one step's renamed_from=('a', 'b'):
    the committed 'a' would run again (its effects under new keys). WorkflowChanged,
    nothing written."""
    store = ds.LocalStore(tmp_path)
    before = ds.Workflow("w", store=store)
    before.step(name="a")(lambda s: None)
    before.step(name="b")(lambda s: None)
    with pytest.raises(ds.testing.SimulatedCrash):  # a committed, b not
        ds.Workflow(
            "w", store=ds.testing.CrashingStore(store, after_write=2), steps=before.steps
        ).run("r", {})
    stored = store.get("w/r/checkpoint")
    after = ds.Workflow("w", store=store)
    after.step(name="ab", renamed_from=("a", "b"))(lambda s: None)
    with pytest.raises(ds.WorkflowChanged, match=r"both step 'a' and step 'b'"):
        after.resume("r")
    assert store.get("w/r/checkpoint") == stored


# --- what the tools say -----------------------------------------------------------------

APP = """
import durable_steps as ds
wf = ds.Workflow("desk")
wf.step(name="prepare")(lambda s: None)

@wf.step(renamed_from="approval")
def approve(state, ctx):
    state["ok"] = ctx.wait_for("go")

wf.step(name="audit")(lambda s: None)
wf.step(name="finish")(lambda s: None)
"""


def cli(target: StoreTarget, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", target.url, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**target.child_env(), "PYTHONPATH": f"{ROOT}:{cwd}"},
    )


def test_plan_show_and_fork_say_what_the_rename_does(target: StoreTarget, tmp_path: Path) -> None:
    """plan, show --app and fork --app name the rename and the step added; show --app
    never says 'unchanged' when the steps changed."""
    old = ds.Workflow("desk", store=target.open())
    old.step(name="prepare")(lambda s: None)

    @old.step()
    def approval(state: dict[str, Any], ctx: ds.Context) -> None:
        state["ok"] = ctx.wait_for("go")

    old.step(name="finish")(lambda s: None)
    with pytest.raises(ds.RunSuspended):
        old.run("t1", {})
    (tmp_path / "newdesk.py").write_text(APP)
    planned = cli(target, tmp_path, "plan", "desk/t1", "--app", "newdesk:wf")
    assert planned.returncode == 0, planned.stderr
    assert "resumes at step 'approve'" in planned.stdout
    assert "step 'approval' renamed to 'approve'" in planned.stdout
    assert "step 'audit' added after the run's position: it will run" in planned.stdout
    shown = cli(target, tmp_path, "show", "desk/t1", "--app", "newdesk:wf")
    assert shown.returncode == 0, shown.stderr
    assert "unchanged since the last commit" not in shown.stdout
    assert re.search(r"the steps differ( too)? \(see deploy\)", shown.stdout)
    assert "renamed to 'approve'" in shown.stdout
    forked = cli(target, tmp_path, "fork", "desk/t1", "t2", "--app", "newdesk:wf")
    assert forked.returncode == 0, forked.stderr
    assert "step 'approval' renamed to 'approve'" in forked.stdout


def test_a_worker_reports_a_run_it_cannot_resume_and_goes_on(
    target: StoreTarget, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run parked at a step the new code lacks (no renamed_from): the worker logs it
    with what to do, reports it stranded, and completes the other runs; the CLI worker
    prints no traceback and exits 0."""
    store = target.open()
    old = ds.Workflow("desk", store=store)

    @old.step()
    def gone(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.wait_for("go")

    with pytest.raises(ds.RunSuspended):
        old.run("parked", {})
    assert old.signal("parked", "go")
    new = ds.Workflow("desk", store=store)
    new.step(name="other")(lambda s: None)
    new.submit("fresh", {})
    with caplog.at_level(logging.ERROR, logger="durable_steps"):
        report = ds.Worker(new).run(until_idle=True)
    assert (report.completed, report.stranded, report.errors) == (["fresh"], ["parked"], [])
    assert "run desk/parked cannot be resumed by this code" in caplog.text
    assert f"{ds.stores.command_hint(store)} plan --all --app MODULE:WORKFLOW" in caplog.text
    app = "import durable_steps as ds\nwf = ds.Workflow('desk')\n"
    (tmp_path / "otherdesk.py").write_text(app + "wf.step(name='other')(lambda s: None)\n")
    worker = cli(target, tmp_path, "worker", "--app", "otherdesk:wf", "--until-idle")
    assert worker.returncode == 0, worker.stderr
    assert "Traceback" not in worker.stderr
    assert "1 stranded" in worker.stderr + worker.stdout


# --- resume: never creates -------------------------------------------------------------


def test_resume_of_an_unknown_id_raises_and_writes_nothing(target: StoreTarget) -> None:
    """wf.resume and aresume of a mistyped id: RunNotFound (a LookupError) naming the
    run and the store, and the store is left as it was."""
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    wf.step(name="only")(lambda s: None)
    before = sorted(info.key for info in store.list(""))
    with pytest.raises(ds.RunNotFound, match=r"run desk/tikcet-4411 does not exist in ") as missing:
        wf.resume("tikcet-4411")
    assert isinstance(missing.value, LookupError)
    assert missing.value.run == "desk/tikcet-4411"
    assert missing.value.store
    assert missing.value.store in str(missing.value)
    with pytest.raises(ds.RunNotFound):
        asyncio.run(wf.aresume("tikcet-4411"))
    assert sorted(info.key for info in store.list("")) == before


@pytest.mark.parametrize("asynchronous", [False, True])
def test_resume_of_failed_waiting_and_completed_runs(asynchronous: bool, tmp_path: Path) -> None:
    """resume behaves as run for a run that exists: a failed run retries its step, a
    waiting one raises RunSuspended (or waits with wait=True), a completed one returns
    its final state; takeover passes through."""
    store = ds.LocalStore(tmp_path)
    wf = ds.Workflow("desk", store=store)
    flaky = {"fail": True}

    @wf.step()
    def step(state: dict[str, Any], ctx: ds.Context) -> None:
        if state.get("wait"):
            state["got"] = ctx.wait_for("go")
        if state.get("flaky") and flaky["fail"]:
            raise ValueError("down")
        state["done"] = True

    def resume(run_id: str, **options: Any) -> Any:
        if asynchronous:
            return asyncio.run(wf.aresume(run_id, **options))
        return wf.resume(run_id, **options)

    with pytest.raises(ds.StepFailed):
        wf.run("failed", {"flaky": True})
    flaky["fail"] = False
    assert resume("failed") == {"flaky": True, "done": True}
    with pytest.raises(ds.RunSuspended):
        wf.run("waiting", {"wait": True})
    with pytest.raises(ds.RunSuspended):
        resume("waiting")
    assert wf.signal("waiting", "go", 1)
    assert resume("waiting", wait=True) == {"wait": True, "got": 1, "done": True}
    assert resume("failed", takeover=True) == {"flaky": True, "done": True}  # completed
