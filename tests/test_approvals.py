"""The one approval payload (``durable_steps._fleet.approval``): what a wait for an approval
accepts, and where another shape is refused — ``wf.signal``, the command line (a real
process), the web page (real HTTP) — with the run still waiting and nothing sent.
Runs whose waits say nothing about what they accept (earlier versions) take anything.
The page's refusal is in tests/test_ui_http.py, DurableRunner's in
tests/test_openai_agents.py and tests/test_tool_call_names.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._fleet.approval import approval
from durable_steps._fleet.signals import signal_key
from durable_steps._record import checkpoint as ckpt
from durable_steps.cli._waiting import signal_sent
from tests.storetools import Wrapped, rewrite_header

ROOT = Path(__file__).resolve().parent.parent
SHAPE = '{"approved": true}, {"approved": false, "message": "why"}'
WRONG = [{"approve": True}, "approve", None, {"approved": "yes"}, {"approved": True, "mesage": "x"}]


def hold(store: ds.Store, accepts: Any = "approval") -> ds.Workflow:
    """Workflow ``hold``: one step that waits for signal ``approval`` (as an approval)."""
    wf = ds.Workflow("hold", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["decision"] = ctx.wait_for("approval", accepts=accepts)

    return wf


class Counted(Wrapped):
    """A store that counts its GETs."""

    gets = 0

    def get(self, key: str) -> tuple[bytes, str] | None:
        self.gets += 1
        return self.inner.get(key)


def waiting(wf: ds.Workflow, run_id: str = "h1") -> ds.RunSuspended:
    with pytest.raises(ds.RunSuspended) as suspended:
        wf.run(run_id, {})
    return suspended.value


@pytest.mark.parametrize(
    ("payload", "decided"),
    [
        (True, (True, None)),
        (False, (False, None)),
        ({"approved": True}, (True, None)),
        ({"approved": False}, (False, None)),
        ({"approved": False, "message": "why"}, (False, "why")),
        ({"approved": True, "message": "fine"}, (True, None)),
        *((wrong, None) for wrong in WRONG),
        ({"approved": False, "message": 3}, None),
        (1, None),
        ("true", None),
    ],
)
def test_only_the_documented_shape_decides(payload: Any, decided: Any) -> None:
    assert approval(payload) == decided


def test_wf_signal_refuses_another_shape_and_the_run_keeps_waiting() -> None:
    store = ds.MemoryStore()
    wf = hold(store)
    suspended = waiting(wf)
    assert '{"approved": true}' in suspended.message  # what to send, in the RunSuspended
    for wrong in WRONG:
        with pytest.raises(ds.SignalRefused) as refused:
            wf.signal("h1", "approval", wrong)
        assert refused.value.run == "hold/h1"
        assert refused.value.signal == "approval"
        assert "run hold/h1 waits at step 'ask' for signal 'approval'" in refused.value.message
        assert SHAPE in refused.value.message
        assert "Nothing was sent" in refused.value.message
        assert isinstance(refused.value, ValueError)
    assert store.get(signal_key("hold", "h1", "approval")) is None  # nothing delivered
    waiting(wf)  # still waiting
    assert wf.signal("h1", "approval", {"approved": False, "message": "too much"})
    assert wf.run("h1", {}) == {"decision": {"approved": False, "message": "too much"}}


def test_a_wait_recorded_without_accepts_takes_any_payload() -> None:
    """A wait written before waits said what they accept (no ``accepts`` in the record),
    or a plain ctx.wait_for, takes whatever is sent, as it always did."""
    store = ds.MemoryStore()
    plain = hold(store, accepts=None)
    waiting(plain, "p1")
    assert plain.signal("p1", "approval", {"approve": True})
    assert plain.run("p1", {}) == {"decision": {"approve": True}}
    wf = hold(store)
    waiting(wf, "old")
    key = "hold/old/checkpoint"
    found = store.get(key)
    assert found is not None
    header = json.loads(found[0].partition(b"\n")[0])
    assert header["wait"]["accepts"] == "approval"
    rewrite_header(store, key, wait={k: v for k, v in header["wait"].items() if k != "accepts"})
    assert wf.signal("old", "approval", "approve")


def test_a_wrong_payload_sent_before_the_wait_decides_nothing_and_may_be_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Sent ahead, a payload cannot be checked; when the run waits it is not received:
    the run waits on (a worker would not wake it for it), and the right one replaces it."""
    store = ds.MemoryStore()
    wf = hold(store)
    wf.submit("h1", {})
    assert wf.signal("h1", "approval", {"approve": True})  # not waiting yet: kept
    with caplog.at_level(logging.WARNING, logger="durable_steps"):
        suspended = waiting(wf)
    assert suspended.signal == "approval"
    assert 'the payload {"approve": true} is not one' in caplog.text
    waiting(wf)  # not woken by it
    found = store.get("hold/h1/checkpoint")
    assert found is not None
    header, _ = ckpt.decode(found[0], where="hold/h1")
    assert signal_sent(store, header) is None  # show and the page: not sent, send one
    assert wf.signal("h1", "approval", True)  # replaces it
    assert signal_sent(store, header) is not None
    assert not wf.signal("h1", "approval", False)  # and that one was delivered: once
    assert wf.run("h1", {}) == {"decision": True}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DURABLE_STEPS_SIGNING_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "durable_steps", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
        timeout=60,
    )


def test_the_cli_refuses_another_shape_and_show_says_what_is_accepted(tmp_path: Path) -> None:
    store = ds.LocalStore(tmp_path / "s")
    wf = hold(store)
    waiting(wf)
    where = ["--store", str(tmp_path / "s")]
    shown = cli(*where, "show", "hold/h1")
    assert shown.returncode == 0, shown.stderr
    assert "accepts" in shown.stdout
    assert f"an approval: {SHAPE}" in shown.stdout
    assert """--data '{"approved": true}'""" in shown.stdout  # the next: hint
    sent = cli(*where, "signal", "hold/h1", "approval", "--data", '{"approve": true}')
    assert sent.returncode == 2, sent.stderr
    assert "run hold/h1 waits at step 'ask' for signal 'approval'" in sent.stderr
    assert SHAPE in sent.stderr
    assert "Traceback" not in sent.stderr
    assert store.get(signal_key("hold", "h1", "approval")) is None
    waiting(wf)
    sent = cli(*where, "signal", "hold/h1", "approval", "--data", "false")
    assert sent.returncode == 0, sent.stderr
    assert wf.run("h1", {}) == {"decision": False}


def test_off_the_event_loop_and_with_wait_true_a_wrong_payload_wakes_nothing() -> None:
    """An async step's wait (its signal looked for by the runner, off the loop) and
    ``wf.arun(wait=True)``'s polling both pass over a payload sent ahead in another
    shape; the right one, sent later, replaces it and the run goes on."""
    store = Counted(ds.MemoryStore())
    wf = ds.Workflow("later", store=store)

    @wf.step()
    async def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["decision"] = ctx.wait_for("approval", accepts="approval")

    wf.submit("a1", {})
    assert wf.signal("a1", "approval", "yes")
    with pytest.raises(ds.RunSuspended):
        asyncio.run(wf.arun("a1", {}))
    done: list[Any] = []
    blocked = threading.Thread(
        target=lambda: done.append(asyncio.run(wf.arun("a1", {}, wait=True)))
    )
    store.gets = 0
    blocked.start()
    blocked.join(1.5)
    assert blocked.is_alive()  # still polling: "yes" decides nothing
    assert done == []
    assert store.gets < 20  # polling at 0.5 s, 1 s...: not resuming the run again and again
    assert wf.signal("a1", "approval", {"approved": True})
    blocked.join(30)
    assert done == [{"decision": {"approved": True}}]
