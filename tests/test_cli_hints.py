"""The commands a message suggests work as printed: they name the store they need."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds

ROOT = Path(__file__).resolve().parent.parent


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_steps", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def waiting_run(store: Path) -> ds.Workflow:
    wf = ds.Workflow("support-desk", store=ds.LocalStore(store))

    @wf.step()
    def approval(state: dict[str, Any], ctx: ds.Context) -> None:
        state["ok"] = ctx.wait_for("approval")

    with pytest.raises(ds.RunSuspended) as waiting:
        wf.run("r1", {})
    assert f"--store {store}" in str(waiting.value)  # the library's own hint, too
    return wf


def suggested(text: str, verb: str) -> list[str]:
    """The backticked ``durable-steps <verb> ...`` command in ``text``, as argv."""
    found = re.search(rf"`(durable-steps [^`]*?{verb} [^`]*)`", text)
    assert found, text
    return shlex.split(found.group(1).replace("--data JSON", "--data true"))[1:]


def test_a_hint_after_store_repeats_it_and_works(tmp_path: Path) -> None:
    """`durable-steps --store ./store show ...` suggests `... --store <it> signal ...`,
    and running the suggestion as printed delivers the signal (exit 0)."""
    store = tmp_path / "store"
    wf = waiting_run(store)
    shown = cli("--store", "./store", "show", "support-desk/r1", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    argv = suggested(shown.stdout, "signal")
    assert argv[:2] == ["--store", str(store)]
    sent = cli(*argv, cwd=ROOT)  # from another directory: the path is absolute
    assert sent.returncode == 0, sent.stderr
    assert wf.run("r1") == {"ok": True}


def test_a_hint_leaves_out_the_store_a_command_finds_by_itself(tmp_path: Path) -> None:
    """With $DURABLE_STEPS_STORE naming the store, hints are the bare command."""
    store = tmp_path / "store"
    waiting_run(store)
    shown = cli("show", "support-desk/r1", env={"DURABLE_STEPS_STORE": str(store)})
    assert shown.returncode == 0, shown.stderr
    assert suggested(shown.stdout, "signal")[0] == "signal"
    missing = cli("--store", str(store), "signal", "support-desk/nope", "approval")
    assert missing.returncode == 3
    assert f"durable-steps --store {store} ls" in missing.stderr
