"""Titles of journaled calls: what a person and a trace see, while the name replays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds

ROOT = Path(__file__).resolve().parent.parent
TITLE = "refund(order='4411', cents=500)"


def refunding(store: Path, events: list[ds.Event], *, crash: bool) -> ds.Workflow:
    """A step whose effect has an opaque journal name and a readable title."""
    wf = ds.Workflow("desk", store=store, on_event=[events.append])

    @wf.step(in_doubt="raise")
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        def refund(order: str, *, idempotency_key: str) -> str:
            if crash:
                raise ds.testing.SimulatedCrash("killed while refunding")
            return f"refunded {order}"

        state["out"] = ctx._effect("tool:e124ab", refund, (), {"order": "4411"}, title=TITLE)

    return wf


def cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", str(store), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_an_effect_in_doubt_is_shown_by_its_title_everywhere(tmp_path: Path) -> None:
    """show, StepInDoubt, resolve and the events name the effect by its title; the
    journal name still replays it."""
    events: list[ds.Event] = []
    with pytest.raises(ds.testing.SimulatedCrash):
        refunding(tmp_path, events, crash=True).run("t1", {})
    started = [e for e in events if e.kind == "call_started"]
    assert [(e.call, e.title) for e in started] == [("tool:e124ab", TITLE)]

    shown = cli(tmp_path, "show", "desk/t1").stdout
    assert f"effect {TITLE}" in shown
    assert "journal name 'tool:e124ab'" in shown

    events.clear()
    with pytest.raises(ds.StepInDoubt, match=r"refund\(order='4411', cents=500\)"):
        refunding(tmp_path, events, crash=False).run("t1")
    assert [e.title for e in events if e.kind == "effect_in_doubt"] == [TITLE]

    resolved = cli(tmp_path, "resolve", "desk/t1", "--fired", "--result", '"refunded 4411"')
    assert resolved.returncode == 0, resolved.stderr
    assert f"effect {TITLE} (key ds-" in resolved.stdout

    events.clear()
    final = refunding(tmp_path, events, crash=True).run("t1")  # replays: refund never runs
    assert final == {"out": "refunded 4411"}
    assert [(e.call, e.title) for e in events if e.kind == "call_replayed"] == [
        ("tool:e124ab", TITLE)
    ]


def test_a_long_title_is_cut_and_a_hand_made_context_runs_the_call() -> None:
    """Titles are kept to 200 characters; without a run, _call and _effect just call."""
    ctx = ds.Context("r", "wf", "s", 0, 1, "ds-key")
    assert ctx._call("n", lambda x: x + 1, (1,), {}, title="t" * 500) == 2
    assert ctx._effect("n", lambda *, idempotency_key: idempotency_key, (), {}, title=None)
    store = ds.MemoryStore()
    events: list[ds.Event] = []
    wf = ds.Workflow("w", store=store, on_event=[events.append])

    @wf.step()
    def one(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx._call("c", lambda: 1, (), {}, title="x" * 500)

    wf.run("r", {})
    (started,) = [e for e in events if e.kind == "call_started"]
    assert started.title is not None
    assert len(started.title) == 200
    assert started.title.endswith("\u2026")
