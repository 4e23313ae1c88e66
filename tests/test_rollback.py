"""Rolling a deploy back: runs the new code met, and stopped inside a renamed step, then
the old code again.

A step renamed with ``renamed_from`` is the same step under another name, so the new
code resumes a run stored under the old name. The run's head keeps the names it was
stored with (``_deploy``, "Renames and rollbacks"): a deploy whose new code stops in the
step (in doubt, failed, killed; in the pass it resumed or a later one) is rolled back,
and the old code finds its step, its pending intent (with its key) and its journal (the
calls either code recorded, replayed). Every run below is a real process: SIGKILLed
where a crash is needed, then resumed by another version of the code in a fresh process
(see ``tests/test_deploys.py`` and ``tests/renamechild.py``)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget, _target
from tests.test_deploys import EXIT_ERROR, EXIT_IN_DOUBT, WORKFLOW, Deploy
from tests.test_renames import child


@pytest.fixture
def deploy(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deploy]:
    """Versions of the workflow on a local store."""
    made = Deploy(_target("local", request, tmp_path), tmp_path)
    yield made
    made.store.close()


def test_an_in_doubt_run_the_new_code_stopped_at_rolls_back(deploy: Deploy) -> None:
    """v1 killed inside 'charge' (in_doubt="raise"); v2, where it is 'bill' with
    renamed_from, stops the run in doubt; v1 again stops it in doubt too (not
    WorkflowChanged), and once resolved re-fires it with its first key."""
    old = deploy.version("v1", ["plan", "charge?", "send"])
    new = deploy.version("v2", ["plan", "bill=charge?", "send"])
    deploy.kill(old, "charge:0")
    proc = deploy.child(new)
    assert proc.returncode == EXIT_IN_DOUBT, proc.stderr
    header = deploy.header()
    assert header.status == "in_doubt"
    assert header.steps == ("plan", "charge", "send")  # as the old code wrote them
    assert (header.intent or {}).get("step") == "charge"
    back = deploy.child(old)
    assert back.returncode == EXIT_IN_DOUBT, back.stderr
    assert "step 'charge'" in back.stderr
    ds.Workflow(WORKFLOW, store=deploy.store).resolve("r1", fired=False)
    assert deploy.finish(old)["trail"] == ["plan:0", "charge:0", "send:0"]
    first, again = deploy.keys("charge:0")
    assert again == first  # the key the intent persisted, through both deploys


def test_a_re_fire_the_new_code_was_killed_in_rolls_back(deploy: Deploy) -> None:
    """v1 killed inside the non-idempotent 'charge'; v2 ('bill', renamed_from, and a
    step added) re-fires it and is killed inside; v1 again re-fires it with the same
    key and finishes."""
    old = deploy.version("v1", ["plan", "charge!", "send"])
    new = deploy.version("v2", ["plan", "bill=charge!", "audit", "send"])
    deploy.kill(old, "charge:0")
    deploy.kill(new, "bill:0")
    header = deploy.header()
    assert "bill" not in header.steps
    assert (header.intent or {}).get("step") == "charge"
    assert deploy.finish(old)["trail"] == ["plan:0", "charge:0", "send:0"]
    keys = deploy.keys("charge:0") + deploy.keys("bill:0")
    assert len(keys) == 3, keys
    assert len(set(keys)) == 1, keys


def test_a_step_the_new_code_failed_in_rolls_back(deploy: Deploy) -> None:
    """v1 killed inside 'draft'; v2, where it is 'write' with renamed_from, fails in it
    (the bug the rollback is for); v1 again resumes at 'draft' and finishes."""
    old = deploy.version("v1", ["plan", "draft", "send"])
    new = deploy.version("v2", ["plan", "write=draft", "send"])
    deploy.kill(old, "draft:0")
    proc = deploy.child(new, fail="write:0")
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert "StepFailed" in proc.stderr
    assert deploy.header().steps == ("plan", "draft", "send")
    assert deploy.finish(old)["trail"] == ["plan:0", "draft:0", "send:0"]


def test_a_run_the_new_code_took_past_the_step_keeps_its_names_and_rolls_back(
    deploy: Deploy,
) -> None:
    """The new code commits the renamed step and is killed after it: the head still
    names the step as the run was stored, and the old code resumes after it (the step
    is not fired again)."""
    old = deploy.version("v1", ["plan", "charge!", "send"])
    new = deploy.version("v2", ["plan", "bill=charge!", "send"])
    deploy.kill(old, "charge:0")
    deploy.kill(new, "send:0")
    assert deploy.header().steps == ("plan", "charge", "send")
    assert deploy.finish(old)["trail"] == ["plan:0", "bill:0", "send:0"]
    assert len(deploy.keys("charge:0") + deploy.keys("bill:0")) == 2  # not fired a third time


def test_a_later_pass_the_new_code_was_killed_in_rolls_back(deploy: Deploy) -> None:
    """An until loop stored before the rename: the new code reaches the renamed step
    fresh, commits it, and is killed inside it in the next pass; the old code re-fires
    it with that pass's key and finishes both passes."""
    old = deploy.version("v1", ["plan", "charge!", "send"], passes=2)
    new = deploy.version("v2", ["plan", "bill=charge!", "send"], passes=2)
    deploy.kill(old, "plan:0")
    deploy.kill(new, "bill:1")
    assert (deploy.header().intent or {}).get("step") == "charge"
    assert deploy.finish(old)["trail"] == [
        *("plan:0", "bill:0", "send:0"),
        *("plan:1", "charge:1", "send:1"),
    ]
    assert deploy.keys("charge:1") == deploy.keys("bill:1")  # the key its intent persisted


def test_a_journal_the_new_code_wrote_to_rolls_back(tmp_path: Path) -> None:
    """Old code killed inside 'approval' after a recorded call; new code ('approve',
    renamed_from) records another call and is killed; the old code redeployed replays
    both calls (neither is made again), fires the refund once, and finishes."""
    target = StoreTarget("local", str(tmp_path / "store"))
    ledger = tmp_path / "ledger"
    assert child(target, "old", "twice", ledger).returncode == -signal.SIGKILL
    assert child(target, "new", "twice", ledger).returncode == -signal.SIGKILL
    head = ckpt.decode(target.open().get("desk/t1/checkpoint")[0], where="t")[0]  # type: ignore[index]
    assert head.steps == ("prepare", "approval", "finish")
    assert head.journal is not None
    assert (head.journal["step"], head.journal["was"]) == ("approval", ["approve"])
    back = child(target, "back", "twice", ledger)
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["filed"] is True
    lines = ledger.read_text().splitlines()
    assert lines.count("draft") == 1, lines
    assert lines.count("second") == 1, lines
    assert sum(line.startswith("refund ") for line in lines) == 1


def test_a_signal_the_new_code_was_killed_receiving_rolls_back(tmp_path: Path) -> None:
    """Old code suspended in 'approval' for signal 'go'; new code ('approve') receives it
    and is killed before recording it (the signal is marked received, and by which
    step); the old code redeployed finds it received by its own step and finishes."""
    target = StoreTarget("local", str(tmp_path / "store"))
    ledger = tmp_path / "ledger"
    old = child(target, "old", "signal-kill", ledger)
    assert json.loads(old.stdout) == {"stopped": "RunSuspended"}, old.stderr
    assert ds.Workflow("desk", store=target.open()).signal("t1", "go", "approved")
    assert child(target, "new", "signal-kill", ledger).returncode == -signal.SIGKILL
    sent = json.loads(target.open().get("desk/t1/signals/go")[0])  # type: ignore[index]
    assert sent["consumed"] == ["approval", 0]  # the name the run's head keeps
    back = child(target, "back", "signal-kill", ledger)
    assert back.returncode == 0, back.stderr
    final = json.loads(back.stdout)
    assert (final["go"], final["filed"]) == ("approved", True)
