"""``show --json`` and ``ls --json`` give one run the same shape (issue 36): a script
that reads ``.intent.key`` from one reads it from the other. ``show``'s old
``header`` (the stored line, ``.header.intent.key``) is kept for one release.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps.cli import _main

SHOW_ONLY = {"head_size", "trace_id", "header", "state"}


def _json(where: Path, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    assert _main.main(["--store", str(where), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _same(where: Path, capsys: pytest.CaptureFixture[str], run: str) -> dict[str, Any]:
    shown = _json(where, capsys, "show", run, "--state")
    (listed,) = [r for r in _json(where, capsys, "ls") if r["run"] == run]
    assert set(shown) - SHOW_ONLY == set(listed)
    assert abs(shown.pop("age_seconds") - listed.pop("age_seconds")) < 60
    assert {k: v for k, v in shown.items() if k not in SHOW_ONLY} == listed
    return dict(shown)


def test_show_and_ls_give_one_run_the_same_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An in-doubt run (a crashed non-idempotent step) and a waiting run whose signal
    was sent: every field ls --json gives, show --json gives alike."""
    where = tmp_path / "s"
    store = ds.LocalStore(where)
    wf = ds.Workflow("pay", store=ds.testing.CrashingStore(store, after_write=2))

    @wf.step(idempotent=False, in_doubt="raise")
    def charge(state: dict[str, Any]) -> None:
        state["paid"] = True

    with pytest.raises(ds.testing.SimulatedCrash):  # after the intent, before the commit
        wf.run("o1", {})
    desk = ds.Workflow("desk", store=store)

    @desk.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["answer"] = ctx.wait_for("approval")

    with pytest.raises(ds.RunSuspended):
        desk.run("r", {})
    desk.signal("r", "approval", {"approved": True})

    doubt = _same(where, capsys, "pay/o1")
    assert doubt["status"] == "in_doubt"
    assert doubt["intent"]["key"].startswith("ds-")
    assert doubt["intent"]["key"] == doubt["header"]["intent"]["key"]  # the old key, kept
    assert doubt["state"] == {}
    waiting = _same(where, capsys, "desk/r")
    assert waiting["waiting_for"] == "signal approval (sent)"
    assert waiting["next_step"] == "ask"
