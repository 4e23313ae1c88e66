"""Resolving an effect of a run that went on to wait keeps the run waiting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget, _target

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


def test_resolve_of_a_waiting_run_leaves_it_waiting(target: StoreTarget) -> None:
    """An effect that raised stays open when the step then waits; resolving it keeps the
    run waiting (ls says so, a worker does not claim it) until its signal comes."""
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    sent: list[str] = []

    def notify(*, idempotency_key: str) -> str:
        sent.append(idempotency_key)
        if len(sent) == 1:
            raise ConnectionError("the mailer hung up (it may have sent)")
        return "sent"

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        try:
            state["mail"] = ctx.effect("notify", notify)
        except ConnectionError:
            state["mail"] = "unknown"
        state["answer"] = ctx.wait_for("approval")

    with pytest.raises(ds.RunSuspended):
        wf.run("t1", {})
    wf.resolve("t1", fired=True)
    found = store.get(ckpt.checkpoint_key("desk", "t1"))
    assert found is not None
    header, _ = ckpt.decode(found[0], where="test")
    assert header.status == "waiting"
    assert header.wait is not None
    assert header.wait["signal"] == "approval"
    listed = subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", target.url, "ls", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=target.child_env(),
    ).stdout
    assert '"status": "waiting"' in listed
    assert ds.Worker(wf).claimable() == []
    assert wf.signal("t1", "approval", "yes")
    assert ds.Worker(wf).claimable() == ["t1"]
    assert wf.run("t1") == {"mail": None, "answer": "yes"}  # resolved fired: no re-send
    assert len(sent) == 1
