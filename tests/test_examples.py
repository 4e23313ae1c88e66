"""The examples, run as real processes: a clean run, and SIGKILLs at chosen steps.

Each crash test kills ``examples/research_agent.py`` inside a step (for
``send``: after the fake email API accepted the email, before the commit),
reruns it, and checks what it says it skipped and re-fired, that the fake
API delivered exactly one email, and that the report equals a clean run's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import StoreTarget

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RESEARCH = EXAMPLES / "research_agent.py"
S3_AGENT = EXAMPLES / "s3_agent.py"
KILLED = -signal.SIGKILL
OUTBOX = Path(".durable_steps", ".fake-email-outbox.json")
KEY = re.compile(r"ds-[0-9a-f]{40}")


def run(
    script: Path, cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), "--fast", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def without_store_env() -> dict[str, str]:
    """The environment of a newcomer who has set nothing."""
    return {k: v for k, v in os.environ.items() if k != "DURABLE_STEPS_STORE"}


def report(stdout: str) -> str:
    """The final report and summary: what must not depend on crashes."""
    assert "=== report:" in stdout, stdout
    return stdout[stdout.index("=== report:") :]


def emails(outbox: Path) -> list[dict[str, str]]:
    return list(json.loads(outbox.read_text()).values())


@pytest.fixture(scope="module")
def clean_report(tmp_path_factory: pytest.TempPathFactory) -> str:
    cwd = tmp_path_factory.mktemp("clean")
    done = run(RESEARCH, cwd)
    assert done.returncode == 0, done.stderr
    return report(done.stdout)


def test_clean_run_sends_one_email_and_rerun_does_nothing(tmp_path: Path) -> None:
    """A clean run finishes with one email; rerunning the finished run redoes nothing."""
    first = run(RESEARCH, tmp_path, env=without_store_env())
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("new run research-agent/topic-1"), first.stdout
    assert "default local store" not in first.stderr  # the implicit-store warning
    assert first.stdout.count("accepted (key ds-") == 1
    assert "passes: 3\nemails delivered: 1\n" in first.stdout
    assert len(emails(tmp_path / OUTBOX)) == 1

    again = run(RESEARCH, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "already complete: nothing ran again" in again.stdout
    assert "[pass" not in again.stdout
    assert report(again.stdout) == report(first.stdout)
    assert len(emails(tmp_path / OUTBOX)) == 1


@pytest.mark.parametrize(
    ("crash_at", "resumed", "done"),
    [
        ("plan:0", "plan (pass 0)", 0),
        ("draft:1", "draft (pass 1)", 6),
        ("send", "send (pass 2)", 11),
    ],
)
def test_crash_then_resume(
    tmp_path: Path, clean_report: str, crash_at: str, resumed: str, done: int
) -> None:
    """SIGKILL inside a step, rerun: it resumes there, skips the rest, emails exactly once."""
    crashed = run(RESEARCH, tmp_path, "--crash-at", crash_at)
    assert crashed.returncode == KILLED, crashed.stdout + crashed.stderr
    assert "simulated crash (SIGKILL)" in crashed.stdout
    assert "=== report" not in crashed.stdout

    rerun = run(RESEARCH, tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    out = rerun.stdout
    assert f"resumed at {resumed}: {done} steps done, skipped" in out
    assert "new run" not in out
    if crash_at == "send":
        key = KEY.search(crashed.stdout)
        assert key is not None
        assert f"may have fired before the crash: re-firing with same key {key[0]}" in out
        assert "the email API deduplicated it (1 email sent in total)" in out
    else:
        step = crash_at.partition(":")[0]
        assert f"{step} never committed: it runs again from its start" in out
        assert "may have fired" not in out
    sent = emails(tmp_path / OUTBOX)
    assert len(sent) == 1
    assert report(out) == clean_report
    assert "emails delivered: 1" in out


@pytest.mark.s3
@pytest.mark.parametrize("durable_target", ["moto"], indirect=True)
def test_s3_agent_crash_at_send_then_resume(
    tmp_path: Path, durable_target: StoreTarget, clean_report: str
) -> None:
    """s3_agent.py on a real S3 server: killed after sending, the rerun sends nothing new."""
    env = {**durable_target.child_env(), "DURABLE_STEPS_STORE": durable_target.url}
    crashed = run(S3_AGENT, tmp_path, "--crash-at", "send", env=env)
    assert crashed.returncode == KILLED, crashed.stdout + crashed.stderr
    assert "new run research-agent/topic-1 in S3Store" in crashed.stdout

    rerun = run(S3_AGENT, tmp_path, env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed at send (pass 2): 11 steps done, skipped" in rerun.stdout
    assert "the email API deduplicated it (1 email sent in total)" in rerun.stdout
    assert report(rerun.stdout) == clean_report
    assert len(emails(tmp_path / "fake-email-outbox.json")) == 1
    assert not (tmp_path / ".durable_steps").exists()  # the checkpoints went to the bucket
    keys = [o.key for o in durable_target.open().list("")]
    assert any(k.startswith("research-agent/topic-1/") for k in keys), keys


def test_s3_agent_refuses_a_non_s3_store(tmp_path: Path) -> None:
    """s3_agent.py without an s3:// DURABLE_STEPS_STORE exits with a clear message."""
    env = {**os.environ, "DURABLE_STEPS_STORE": str(tmp_path / "ckpt")}
    done = run(S3_AGENT, tmp_path, env=env)
    assert done.returncode == 1
    assert "DURABLE_STEPS_STORE must be an s3://bucket/prefix URL" in done.stderr
    assert not (tmp_path / "ckpt").exists()


def test_payment_example_in_doubt_then_resolved(tmp_path: Path) -> None:
    """payment.py: crash after the charge, StepInDoubt, resolve --fired, done; one charge."""
    script = str(EXAMPLES / "payment.py")
    env = {k: v for k, v in os.environ.items() if k != "DURABLE_STEPS_STORE"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            check=False,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    crashed = run(script, "order-17", "--crash")
    assert crashed.returncode == -signal.SIGKILL
    assert crashed.stdout.count("charging 4200") == 1
    asked = run(script, "order-17")
    assert asked.returncode == 3
    assert "may have fired" in asked.stderr
    assert "charging" not in asked.stdout
    resolved = run("-m", "durable_steps", "resolve", "pay/order-17", "--fired")
    assert resolved.returncode == 0, resolved.stderr
    done = run(script, "order-17")
    assert done.returncode == 0, done.stderr
    assert "charging" not in done.stdout
    assert "'receipt': 'sent'" in done.stdout


TOOL_AGENT = EXAMPLES / "tool_agent.py"


def test_the_tool_agent_killed_after_a_refund_pays_each_refund_once(tmp_path: Path) -> None:
    """SIGKILL right after the 2nd refund: the rerun replays the model and refund 1,
    re-sends refund 2 with its key (deduplicated), pays refund 3; the model is asked
    once per turn, and `show` pointed at the cut-short turn lists its journal.
    """
    env = {
        **os.environ,
        "PAYMENTS_LEDGER": str(tmp_path / "payments.json"),
        "MODEL_LOG": str(tmp_path / "model.log"),
    }
    store = str(tmp_path / "runs")

    def agent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(TOOL_AGENT), "--store", store, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    killed = agent("--crash-after-refund", "2")
    assert killed.returncode == KILLED, killed.stderr
    keys = KEY.findall(killed.stdout)
    assert len(keys) == 2
    show = subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", store, "show", "tool-agent/ticket-4411"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "in-doubt" in show.stdout
    assert "2 results (replayed when the step runs again)" in show.stdout
    assert f"effect 'tool:call_2'  in doubt (it may have fired), idempotency key {keys[1]}" in (
        show.stdout
    )
    assert "fires it again with the same key" in show.stdout  # the policy is recorded
    resumed = agent()
    assert resumed.returncode == 0, resumed.stderr
    assert "refund re_1" not in resumed.stdout  # replayed, not sent again
    assert f"refund re_2 for A-2 (key {keys[1]})" in resumed.stdout
    assert "done: 6 messages; 3 refunds in the ledger (4 requests)" in resumed.stdout
    assert (tmp_path / "model.log").read_text().split() == ["1", "5"]
    again = agent()
    assert "3 refunds in the ledger (4 requests)" in again.stdout
    assert (tmp_path / "model.log").read_text().split() == ["1", "5"]


OPENAI_AGENTS_SUPPORT = EXAMPLES / "openai_agents_support.py"


@pytest.mark.openai_agents
def test_the_agents_sdk_support_agent_killed_after_a_refund_refunds_each_order_once(
    tmp_path: Path,
) -> None:
    """examples/openai_agents_support.py, offline: SIGKILL right after refund 1; the
    rerun sends refund 1 again with its first key (the payments API answers with the
    first refund), makes refund 2, and answers; the ledger holds one refund per order.
    """
    pytest.importorskip("agents", reason="the openai-agents extra is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}  # offline
    store = str(tmp_path / "runs")

    def example(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(OPENAI_AGENTS_SUPPORT), "--store", store, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    killed = example("--crash-after-refund", "1")
    assert killed.returncode == KILLED, killed.stderr
    # The refunds of one response run in parallel: refund 2 may land before the kill too.
    first = re.search(r"for order 1001 \(key (ds-[0-9a-f]{40})", killed.stdout)
    assert first is not None, killed.stdout
    key = first.group(1)
    resumed = example()
    assert resumed.returncode == 0, resumed.stderr
    assert f"for order 1001 (key {key}, a repeat" in resumed.stdout
    assert "for order 1002 (key " in resumed.stdout
    assert "agent (refunds): Here is what I did" in resumed.stdout
    assert "done: 2 refunds in the ledger" in resumed.stdout
    ledger = json.loads((tmp_path / "runs" / "payments.json").read_text())
    assert sorted(r["order"] for r in ledger.values()) == ["1001", "1002"]
