"""Waiting runs on the command line: ``signal``, ``ls``'s WAITING FOR, ``show``, and
``examples/approval.py`` driven end to end as a person would, every command a real process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget

APPROVAL = Path(__file__).resolve().parent.parent / "examples" / "approval.py"
RUN = "approval-agent/ticket-7"
SIGNAL_CMD = f"""durable-steps signal {RUN} approval --data '{{"approved": true}}'"""
LOCAL_AND_MOTO = [
    pytest.param("local", id="local"),
    pytest.param("moto", id="moto", marks=pytest.mark.s3),
]


def run(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in ``cwd`` (the default store is ``cwd/.durable_steps``)."""
    base = {k: v for k, v in os.environ.items() if k != "DURABLE_STEPS_STORE"}
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``durable-steps ARGS`` in ``cwd``."""
    return run(cwd, "-m", "durable_steps", *args, env=env)


def row(ls_stdout: str, run_name: str) -> str:
    """The line of ``ls`` output for ``run_name`` (``workflow/run``)."""
    workflow, _, run_id = run_name.partition("/")
    for line in ls_stdout.splitlines()[1:]:
        if line.split()[:2] == [workflow, run_id]:
            return line
    raise AssertionError(f"{run_name} not in:\n{ls_stdout}")


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one ``durable-steps: error:`` line of a failed command."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("durable-steps: error: "), lines[0]
    return lines[0]


def test_approval_example_transcript(tmp_path: Path) -> None:
    """approval.py waits, ls/show say for what and how to unblock it, signal exits 2/3/0/4/3."""
    first = run(tmp_path, str(APPROVAL))
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "draft: refund 3400 cents for order A-2" in out
    assert f"{RUN} waits for signal 'approval': a person must approve the refund." in out
    assert f"  approve:    {SIGNAL_CMD}\n" in out
    assert "then run this again" in out
    again = run(tmp_path, str(APPROVAL))  # still waiting: nothing runs, the same advice
    assert again.returncode == 0, again.stderr
    assert "draft:" not in again.stdout
    assert f"  approve:    {SIGNAL_CMD}\n" in again.stdout
    assert (tmp_path / "approval-model.log").read_text().split() == ["draft"]

    ls = cli(tmp_path, "ls")
    assert ls.returncode == 0, ls.stderr
    assert ls.stdout.split()[:9] == [
        "WORKFLOW", "RUN", "STATUS", "STEP", "ITER", "AGE", "SIZE", "WAITING", "FOR",
    ]  # fmt: skip
    line = row(ls.stdout, RUN)
    assert line.split()[2:5] == ["waiting", "approval", "(2/3)"]
    # The default timeout is a day: the deadline is tomorrow, so it is shown with its date.
    deadline = time.strftime("%Y-%m-%d", time.localtime(time.time() + 86400))
    assert re.search(rf"signal approval \(until {deadline} \d\d:\d\d\)$", line), line
    waiting = cli(tmp_path, "ls", "--status", "waiting")
    assert [r.split()[:3] for r in waiting.stdout.splitlines()[1:]] == [
        ["approval-agent", "ticket-7", "waiting"]
    ]
    assert cli(tmp_path, "ls", "--status", "stopped").stdout == ""
    listed = json.loads(cli(tmp_path, "ls", "--json").stdout)
    assert listed[0]["status"] == "waiting"
    assert listed[0]["waiting_for"].startswith("signal approval (until ")
    assert listed[0]["wait"]["signal"] == "approval"
    assert listed[0]["wait"]["step"] == "approval"

    show = cli(tmp_path, "show", RUN)
    assert show.returncode == 0, show.stderr
    text = show.stdout
    assert text.startswith(f"{RUN}  waiting\n")
    section = text[text.index("waiting for\n") :]
    assert "  step     approval (iteration 0)\n" in section
    assert "  signal   'approval': not sent yet\n" in section
    assert '  accepts  an approval: {"approved": true}, {"approved": false, "message"' in section
    assert re.search(r"  timeout  \S+ \S+ \(in 23h\)\n", section), section
    hint = text[text.index("next: ") :]
    assert "it waits for signal 'approval' (without it, ctx.wait_for raises SignalTimeout" in hint
    assert (
        f"""send it with `durable-steps signal {RUN} approval --data '{{"approved": true}}'`"""
        in (hint)
    )

    bad = cli(tmp_path, "signal", RUN, "approval", "--data", "{approved: yes}")
    assert bad.returncode == 2
    assert "--data: not JSON" in error_line(bad)
    missing = cli(tmp_path, "signal", "approval-agent/ticket-8", "approval")
    assert missing.returncode == 3
    assert "run approval-agent/ticket-8 not found" in error_line(missing)

    sent = cli(tmp_path, "signal", RUN, "approval", "--data", '{"approved": true}')
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.startswith(f"sent signal 'approval' to {RUN}. run {RUN} waits for it")
    twice = cli(tmp_path, "signal", RUN, "approval", "--data", '{"approved": false}')
    assert twice.returncode == 4
    assert f"signal 'approval' was already sent to run {RUN}" in error_line(twice)
    assert row(cli(tmp_path, "ls").stdout, RUN).endswith("signal approval (sent)")
    show = cli(tmp_path, "show", RUN).stdout
    assert "  signal   'approval': sent " in show
    assert "next: signal 'approval' has been sent: rerun the workflow" in show

    done = run(tmp_path, str(APPROVAL))
    assert done.returncode == 0, done.stderr
    assert f"{RUN}: refunded; reply: We refunded 3400 cents (re_1)." in done.stdout
    assert "ledger: 1 refund(s), 1 request(s)" in done.stdout
    assert (tmp_path / "approval-model.log").read_text().split() == ["draft", "reply"]
    line = row(cli(tmp_path, "ls").stdout, RUN)
    assert line.split()[2:4] == ["completed", "done"]
    assert line.endswith("B")  # WAITING FOR is empty
    late = cli(tmp_path, "signal", RUN, "other")
    assert late.returncode == 3
    assert f"run {RUN} has completed" in error_line(late)
    rerun = run(tmp_path, str(APPROVAL))
    assert "ledger: 1 refund(s), 1 request(s)" in rerun.stdout


def test_approval_example_rejected_and_timed_out(tmp_path: Path) -> None:
    """A rejection reaches the step (no refund); with no answer in time the agent escalates."""
    assert run(tmp_path, str(APPROVAL)).returncode == 0
    wrong = cli(tmp_path, "signal", RUN, "approval", "--data", '{"approved": "no"}')
    assert wrong.returncode == 2  # not an approval: refused, nothing sent
    assert "is not one: send {" in error_line(wrong)
    data = '{"approved": false, "message": "delivered on Monday"}'
    assert cli(tmp_path, "signal", RUN, "approval", "--data", data).returncode == 0
    done = run(tmp_path, str(APPROVAL))
    assert f"{RUN}: rejected; reply: We cannot refund this order: delivered on Monday" in (
        done.stdout
    )
    assert "ledger: 0 refund(s), 0 request(s)" in done.stdout

    quick = ("--run", "ticket-9", "--timeout", "1")
    assert run(tmp_path, str(APPROVAL), *quick).returncode == 0
    time.sleep(1.2)
    line = row(cli(tmp_path, "ls").stdout, "approval-agent/ticket-9")
    assert re.search(r"signal approval \(until \d\d:\d\d, due\)$", line), line
    hint = cli(tmp_path, "show", "ticket-9").stdout
    assert "next: its time has come: rerun the workflow" in hint
    late = run(tmp_path, str(APPROVAL), *quick)
    assert "approval-agent/ticket-9: escalated; reply: A colleague will look" in late.stdout


def test_approval_example_wait_blocks_until_the_signal(tmp_path: Path) -> None:
    """--wait (wf.run(wait=True)) blocks after printing the command, and goes on once it is sent."""
    child = subprocess.Popen(
        [sys.executable, str(APPROVAL), "--wait"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "DURABLE_STEPS_STORE"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        lines = [child.stdout.readline() for _ in range(6)]
        assert (
            lines[-1] == "--wait: blocking until the answer comes (the signal's key is polled)...\n"
        )
        assert f"  approve:    {SIGNAL_CMD}\n" in lines
        time.sleep(1)
        assert child.poll() is None  # still blocked
        assert (
            cli(tmp_path, "signal", RUN, "approval", "--data", '{"approved": true}').returncode == 0
        )
        rest = child.communicate(timeout=60)[0]
    finally:
        child.kill()
    assert child.returncode == 0
    assert f"{RUN}: refunded; reply: We refunded 3400 cents (re_1)." in rest


@pytest.mark.parametrize("durable_target", LOCAL_AND_MOTO, indirect=True)
def test_signal_data_from_a_file_and_its_limits(
    durable_target: StoreTarget, tmp_path: Path
) -> None:
    """--data @file is read; an unreadable file, a payload over 256 KB and a bad name exit 2."""
    store = durable_target.open()
    wf = ds.Workflow("inbox", store=store)

    @wf.step()
    def wait(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = ctx.wait_for("letter")

    with pytest.raises(ds.RunSuspended):
        wf.run("r1")

    def signal_cli(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "durable_steps", "--store", durable_target.url, "signal", *args],
            env=durable_target.child_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    (tmp_path / "big.json").write_text(json.dumps("x" * (300 * 1024)))
    big = signal_cli("inbox/r1", "letter", "--data", f"@{tmp_path / 'big.json'}")
    assert big.returncode == 2
    assert "more than the 262144 a signal may carry" in error_line(big)
    gone = signal_cli("inbox/r1", "letter", "--data", f"@{tmp_path / 'nope.json'}")
    assert gone.returncode == 2
    assert "--data: cannot read" in error_line(gone)
    assert signal_cli("inbox/r1", "bad name").returncode == 2
    (tmp_path / "letter.json").write_text('{"dear": ["sir", "madam"]}')
    sent = signal_cli("r1", "letter", "--data", f"@{tmp_path / 'letter.json'}")  # a bare id
    assert sent.returncode == 0, sent.stderr
    assert wf.run("r1") == {"got": {"dear": ["sir", "madam"]}}
    store.close()


def test_signal_is_signed_with_the_key(tmp_path: Path) -> None:
    """The CLI signs with $DURABLE_STEPS_SIGNING_KEY; without it a signed run is refused (2)."""
    store = tmp_path / "runs"
    wf = ds.Workflow("secure", store=str(store), signing_key="k1")

    @wf.step()
    def wait(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = ctx.wait_for("go")

    for run_id in ("signed", "unsigned"):
        with pytest.raises(ds.RunSuspended):
            wf.run(run_id)
    key = {"DURABLE_STEPS_SIGNING_KEY": "k1"}
    signed = cli(
        tmp_path, "--store", str(store), "signal", "secure/signed", "go", "--data", "1", env=key
    )
    assert signed.returncode == 0, signed.stderr
    assert wf.run("signed") == {"got": 1}
    unsigned = cli(
        tmp_path, "--store", str(store), "signal", "secure/unsigned", "go", "--data", "2"
    )
    assert unsigned.returncode == 2  # refused before it takes the name for good
    assert "set DURABLE_STEPS_SIGNING_KEY to its key; nothing was sent" in error_line(unsigned)
    assert ds.Workflow("secure", store=str(store)).signal("unsigned", "go", 2)  # keyless
    with pytest.raises(ds.StepFailed, match="not signed with the workflow's signing key") as bad:
        wf.run("unsigned")
    # What the error says to do works: delete the object, send it with the key, rerun.
    assert "Delete 'secure/unsigned/signals/go' (a name is sent once)" in str(bad.value)
    wf.store.delete("secure/unsigned/signals/go")
    again = cli(
        tmp_path, "--store", str(store), "signal", "secure/unsigned", "go", "--data", "3", env=key
    )
    assert again.returncode == 0, again.stderr
    assert wf.run("unsigned") == {"got": 3}


def test_sleeping_run_in_ls_and_show(tmp_path: Path) -> None:
    """ctx.sleep: ls says 'until HH:MM', show's next: line says when it runs again."""
    store = tmp_path / "runs"
    wf = ds.Workflow("nap", store=str(store))

    @wf.step()
    def rest(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.sleep(600)

    with pytest.raises(ds.RunSuspended) as suspended:
        wf.run("n1")
    until = suspended.value.until
    assert until is not None
    clock = time.strftime("%H:%M", time.localtime(until))
    line = row(cli(tmp_path, "--store", str(store), "ls").stdout, "nap/n1")
    if time.localtime(until)[:3] == time.localtime()[:3]:  # not across midnight
        assert line.endswith(f"until {clock}")
    show = cli(tmp_path, "--store", str(store), "show", "nap/n1").stdout
    assert "  until  " in show
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until))
    assert f"next: it sleeps: it runs again after {when} (rerun the workflow or let" in show


EFFECT_SCRIPT = """
import os, signal, sys
import durable_steps as ds
wf = ds.Workflow("tool", store=sys.argv[1])

@wf.step(in_doubt="raise")
def act(state, ctx):
    def lookup(city, *, idempotency_key):
        os.kill(os.getpid(), signal.SIGKILL)  # it went through; the result is never recorded
    state["weather"] = ctx.effect("weather", lookup, "Oslo")

print(wf.run("t1"))
"""


def test_resolve_fired_with_a_result_says_it_was_recorded(tmp_path: Path) -> None:
    """resolve --fired --result JSON names the recorded result, and the rerun step gets it."""
    script = tmp_path / "tool.py"
    script.write_text(EFFECT_SCRIPT)
    store = str(tmp_path / "runs")
    assert run(tmp_path, str(script), store).returncode == -signal.SIGKILL
    resolved = cli(
        tmp_path, "--store", store, "resolve", "tool/t1", "--fired", "--result", '{"sky": "grey"}'
    )
    assert resolved.returncode == 0, resolved.stderr
    assert "effect 'weather' (key ds-" in resolved.stdout
    assert 'the result {"sky":"grey"} was recorded: its ctx.effect returns it' in resolved.stdout
    wf = ds.Workflow("tool", store=store)

    @wf.step(in_doubt="raise")
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["weather"] = ctx.effect("weather", lambda city, *, idempotency_key: "fired!", "Oslo")

    assert wf.run("t1") == {"weather": {"sky": "grey"}}


def _keys(store: ds.Store, prefix: str) -> list[str]:
    return sorted(info.key for info in store.list(prefix))


def test_rm_and_prune_remove_a_runs_signals(tmp_path: Path) -> None:
    """rm of a waiting run, prune of a completed one, on_complete='delete': its signals go too."""
    store_dir = tmp_path / "runs"
    store = ds.open_store(str(store_dir))

    def workflow(on_complete: Any = "mark") -> ds.Workflow:
        wf = ds.Workflow("hold", store=store, on_complete=on_complete)

        @wf.step()
        def hold(state: dict[str, Any], ctx: ds.Context) -> None:
            state["got"] = ctx.wait_for("go")

        return wf

    wf = workflow()
    for run_id in ("waiting", "done"):
        with pytest.raises(ds.RunSuspended):
            wf.run(run_id)
        assert wf.signal(run_id, "go", run_id)
        assert wf.signal(run_id, "spare")  # never waited for
    assert wf.run("done") == {"got": "done"}
    assert _keys(store, "hold/done/signals/") == ["hold/done/signals/go", "hold/done/signals/spare"]

    def durable_steps(*args: str) -> subprocess.CompletedProcess[str]:
        proc = cli(tmp_path, "--store", str(store_dir), *args)
        assert proc.returncode == 0, proc.stderr
        return proc

    durable_steps("rm", "hold/waiting")
    assert _keys(store, "hold/waiting/") == []
    durable_steps("prune", "--completed", "--older-than", "0s", "--yes")
    assert _keys(store, "hold/") == []

    deleting = workflow("delete")
    with pytest.raises(ds.RunSuspended):
        deleting.run("gone")
    assert deleting.signal("gone", "go", 1)
    assert deleting.run("gone") == {"got": 1}
    assert _keys(store, "hold/gone/") == ["hold/gone/checkpoint"]  # the tombstone only
    header = ckpt.decode(store.get("hold/gone/checkpoint")[0], where="gone")[0]  # type: ignore[index]
    assert header.status == "deleted"
    store.close()


APP = """
import durable_steps as ds

workflow = ds.Workflow("desk", store={store!r})


@workflow.step()
def ask(state, ctx):
    state["answer"] = ctx.wait_for("answer")
"""


def test_the_worker_command_resumes_a_run_once_signalled(tmp_path: Path) -> None:
    """durable-steps worker leaves a waiting run waiting and finishes it once signalled."""
    store = str(tmp_path / "runs")
    (tmp_path / "deskapp.py").write_text(APP.format(store=store))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    wf = ds.Workflow("desk", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["answer"] = ctx.wait_for("answer")

    assert wf.submit("q1")
    worker = ("--store", store, "worker", "--app", "deskapp:workflow", "--until-idle")
    first = cli(tmp_path, *worker, env=env)
    assert first.returncode == 0, first.stderr
    assert "1 waiting" in first.stdout
    assert "0 completed" in first.stdout
    assert row(cli(tmp_path, "--store", store, "ls").stdout, "desk/q1").endswith("signal answer")
    sent = cli(tmp_path, "--store", store, "signal", "desk/q1", "answer", "--data", '"42"')
    assert sent.returncode == 0, sent.stderr
    second = cli(tmp_path, *worker, env=env)
    assert second.returncode == 0, second.stderr
    assert "1 completed" in second.stdout
    assert wf.run("q1") == {"answer": "42"}
