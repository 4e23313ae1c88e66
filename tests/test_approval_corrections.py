"""Correcting an approval that decides nothing (issue 36's review, B3, B5, B6).

A payload that is no approval (``"approve"``, ``{"approve": true}``) can reach a
run unchecked: sent before the run waits (its wait's shape is not known yet),
or to a wait an earlier version recorded without ``accepts``. Such a payload
decides nothing, so it must never stand in the way of the approval a person
sends next, nor be counted as sent by ``ls`` or ``show``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.cli._waiting import signal_sent
from tests.storetools import rewrite_header
from tests.test_approvals import cli

ROOT = Path(__file__).resolve().parent.parent


def hold(store: ds.Store) -> ds.Workflow:
    """Workflow ``hold``: one step that waits for signal ``approval`` as an approval."""
    wf = ds.Workflow("hold", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["decision"] = ctx.wait_for("approval", accepts="approval")

    return wf


def waiting(wf: ds.Workflow, run_id: str = "h1") -> None:
    with pytest.raises(ds.RunSuspended):
        wf.run(run_id, {})


def test_a_correction_sent_before_the_run_waits_replaces_the_typo() -> None:
    """Both sent to a queued run: the approval replaces the payload that is none, and
    the run, once it waits, takes the approval (it used to be refused as sent)."""
    wf = hold(ds.MemoryStore())
    wf.submit("h1", {})
    assert wf.signal("h1", "approval", {"approve": True})  # not waiting yet: kept
    assert wf.signal("h1", "approval", {"approved": True})  # the correction replaces it
    assert not wf.signal("h1", "approval", {"approved": False})  # an approval stays: once
    assert wf.run("h1", {}) == {"decision": {"approved": True}}


def test_a_payload_sent_ahead_that_is_an_approval_or_received_is_not_replaced() -> None:
    """Only a payload that is no approval gives way, and only to one that is."""
    store = ds.MemoryStore()
    wf = hold(store)
    wf.submit("h1", {})
    assert wf.signal("h1", "approval", "approve")
    assert not wf.signal("h1", "approval", "still no approval")
    assert wf.signal("h1", "approval", False)
    assert not wf.signal("h1", "approval", True)
    assert wf.run("h1", {}) == {"decision": False}


def test_the_cli_correction_before_the_wait_is_taken_and_kept_does_not_promise(
    tmp_path: Path,
) -> None:
    store = ds.LocalStore(tmp_path / "s")
    wf = hold(store)
    wf.submit("h1", {})
    where = ["--store", str(tmp_path / "s")]
    typo = cli(*where, "signal", "hold/h1", "approval", "--data", '"approve"')
    assert typo.returncode == 0, typo.stderr
    assert "it is kept" in typo.stdout
    assert "unless that wait takes an approval" in typo.stdout  # no promise of delivery
    assert "an approval sent under the same name replaces it" in typo.stdout
    fixed = cli(*where, "signal", "hold/h1", "approval", "--data", '{"approved": true}')
    assert fixed.returncode == 0, fixed.stderr
    assert "unless" not in fixed.stdout  # an approval: returned at once, as said
    assert wf.run("h1", {}) == {"decision": {"approved": True}}


def test_ls_says_sent_only_for_a_signal_that_wakes_the_run(tmp_path: Path) -> None:
    store = ds.LocalStore(tmp_path / "s")
    wf = hold(store)
    wf.submit("h1", {})
    assert wf.signal("h1", "approval", "approve")
    waiting(wf)
    where = ["--store", str(tmp_path / "s")]
    listed = cli(*where, "ls")
    assert listed.returncode == 0, listed.stderr
    assert "signal approval" in listed.stdout
    assert "(sent)" not in listed.stdout
    as_json = json.loads(cli(*where, "ls", "--json").stdout)
    assert [r["waiting_for"] for r in as_json] == ["signal approval"]
    assert wf.signal("h1", "approval", True)
    assert "signal approval (sent)" in cli(*where, "ls").stdout


def test_a_run_of_an_earlier_version_given_no_approval_waits_again(tmp_path: Path) -> None:
    """A wait an earlier version recorded without ``accepts`` takes any payload when it
    is sent; the step's wait, which takes an approval, treats one that is none as not
    received: the run waits again (now saying what it accepts), ``show`` says the
    signal is still to send, and an approval replaces the payload."""
    store = ds.LocalStore(tmp_path / "s")
    wf = hold(store)
    waiting(wf)
    key = "hold/h1/checkpoint"
    found = store.get(key)
    assert found is not None
    wait = json.loads(found[0].partition(b"\n")[0])["wait"]
    del wait["accepts"]
    rewrite_header(store, key, wait=wait)  # as the earlier version wrote
    assert wf.signal("h1", "approval", "approve")  # unchecked: the wait says nothing
    waiting(wf)  # was: the payload recorded, and the step given "approve"
    found = store.get(key)
    assert found is not None
    header, _ = ckpt.decode(found[0], where=key)
    assert header.wait is not None
    assert header.wait["accepts"] == "approval"
    assert signal_sent(store, header) is None
    shown = cli("--store", str(tmp_path / "s"), "show", "hold/h1")
    assert "'approval': not sent yet" in shown.stdout, shown.stderr
    assert wf.signal("h1", "approval", {"approved": True})  # replaces the one received
    assert not wf.signal("h1", "approval", False)  # and that one is delivered: once
    assert wf.run("h1", {}) == {"decision": {"approved": True}}
