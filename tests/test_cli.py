"""The ``durable-steps`` command line, run as a real subprocess against real stores.

Runs in every state are made by real workflows in this process (on
``target.open()``); the command runs in a child process that opens the same
store from its URL and environment, exactly as a user's shell would. A run
genuinely being run is a child process in the middle of a step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps.testing import CrashingStore, SimulatedCrash
from tests.conftest import StoreTarget

LOCAL_AND_MOTO = [
    pytest.param("local", id="local"),
    pytest.param("moto", id="moto", marks=pytest.mark.s3),
]
# A crash in this (still living) process looks owned to other processes until
# the lease ends: crashes get a lease this short, so they show as stopped at once.
CRASH_LEASE = 0.05
JUNK = {
    "pay/done-1/notes.txt": b"not a checkpoint: keep me",
    "pay/junk/checkpoint": b"hello\nworld",
    "notes/readme/checkpoint": b'{"format": 1}\n',
}


# -- runs in every state -----------------------------------------------------


def noop(state: Any) -> None:
    """A step that does nothing."""


@dataclass
class Runs:
    """A store holding one run in each state, plus objects that are not checkpoints."""

    target: StoreTarget
    store: ds.Store
    charges: list[str] = field(default_factory=list)
    doubt_key: str = ""

    def workflow(
        self, store: ds.Store | None = None, *, name: str = "pay", lease: float = 60.0
    ) -> ds.Workflow:
        """The payment workflow: prepare, charge (in_doubt="raise"), receipt."""
        wf = ds.Workflow(name, store=store or self.store, lease=lease)

        @wf.step()
        def prepare(state: dict[str, Any]) -> None:
            state["amount"] = 42

        @wf.step(idempotent=False, in_doubt="raise")
        def charge(state: dict[str, Any], ctx: ds.Context) -> None:
            self.charges.append(ctx.idempotency_key)
            state["charged"] = ctx.idempotency_key

        @wf.step()
        def receipt(state: dict[str, Any]) -> None:
            state["receipt"] = True

        return wf

    def crash(self, run_id: str, after_write: int, *, name: str = "pay") -> None:
        """Start ``run_id`` and "kill" it right after its ``after_write``-th write;
        return once its lease has ended (to other processes, it is stopped).
        """
        crashing = CrashingStore(self.store, after_write=after_write)
        with pytest.raises(SimulatedCrash):
            self.workflow(crashing, name=name, lease=CRASH_LEASE).run(run_id)
        time.sleep(CRASH_LEASE)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is in the store."""
        return self.store.get(key) is not None


@pytest.fixture
def runs(durable_target: StoreTarget) -> Iterator[Runs]:
    """completed pay/done-1, stopped pay/crash-1, in-doubt pay/doubt-1, failed mail/fail-1."""
    store = durable_target.open()
    r = Runs(durable_target, store)
    r.workflow().run("done-1")
    r.crash("crash-1", after_write=2)  # after the commit of 'prepare'
    r.crash("doubt-1", after_write=3)  # after the intent of 'charge': it may have fired
    with pytest.raises(ds.StepInDoubt) as doubt:
        r.workflow().run("doubt-1")
    r.doubt_key = str(doubt.value.key)
    mail = ds.Workflow("mail", store=store)

    @mail.step()
    def send(state: dict[str, Any]) -> None:
        raise ValueError("smtp said no")

    with pytest.raises(ds.StepFailed):
        mail.run("fail-1")
    done = store.get("pay/done-1/checkpoint")
    assert done is not None
    for key, data in {**JUNK, "pay/copy-1/checkpoint": done[0]}.items():
        store.put(key, data)
    r.charges.clear()
    yield r
    store.close()


def cli(target: StoreTarget, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``python -m durable_steps --store URL ARGS`` in a child process."""
    proc = subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", target.url, *args],
        env={**target.child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def one_error_line(proc: Any) -> str:
    """The single ``durable-steps: error:`` line a failing command printed."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("durable-steps: error: "), lines[0]
    return str(lines[0])


def rows(stdout: str) -> dict[str, list[str]]:
    """``ls`` output as ``{"workflow/run": columns}`` (header line skipped)."""
    found = {}
    for line in stdout.splitlines()[1:]:
        cells = line.split()
        found[f"{cells[0]}/{cells[1]}"] = cells[2:]
    return found


# -- ls ----------------------------------------------------------------------


def test_ls_lists_runs_in_every_state(runs: Runs) -> None:
    """ls shows each run's status, next step and iteration; filters narrow it down."""
    proc = cli(runs.target, "ls")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:7] == ["WORKFLOW", "RUN", "STATUS", "STEP", "ITER", "AGE", "SIZE"]
    table = rows(proc.stdout)
    assert table["pay/done-1"][:3] == ["completed", "done", "0"]
    assert table["pay/crash-1"][:4] == ["stopped", "charge", "(2/3)", "0"]
    assert table["pay/doubt-1"][:4] == ["in-doubt", "charge", "(2/3)", "0"]
    assert table["mail/fail-1"][:4] == ["failed", "send", "(1/1)", "0"]
    assert table["pay/junk"][0] == table["pay/copy-1"][0] == "corrupt"
    assert "pay/done-1/notes.txt" not in proc.stdout
    assert "\x1b[" not in proc.stdout  # a pipe gets no colour

    doubt = cli(runs.target, "ls", "--status", "in-doubt")
    assert list(rows(doubt.stdout)) == ["pay/doubt-1"]
    stopped = cli(runs.target, "ls", "-s", "stopped")
    assert list(rows(stopped.stdout)) == ["pay/crash-1"]
    running = cli(runs.target, "ls", "--status", "running")
    assert (running.returncode, running.stdout) == (0, "")
    assert "no matching runs" in running.stderr
    mail = cli(runs.target, "ls", "--workflow", "mail", "--json")
    [entry] = json.loads(mail.stdout)
    assert entry["run"] == "mail/fail-1"
    assert entry["status"] == "failed"
    assert entry["next_step"] == "send"
    assert entry["error"]["message"] == "smtp said no"
    assert entry["owner"] is None


def test_show_stopped_run_says_nobody_runs_it(runs: Runs) -> None:
    """A crashed run is stopped: its dead owner is shown, and how to resume it."""
    proc = cli(runs.target, "show", "pay/crash-1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("pay/crash-1  stopped")
    assert re.search(r"owner\s+\S+:\d+ \(lease ended (just now|\d+s ago)\)", out), out
    assert "nobody is running it" in out
    assert "durable-steps worker --app module:workflow" in out
    assert "resume at step 'charge'" in out
    assert "rm pay/crash-1\n" in out  # no --force needed
    assert re.search(r"owner\s+none\n", cli(runs.target, "show", "mail/fail-1").stdout)


# -- show --------------------------------------------------------------------


def test_show_explains_a_failed_run(runs: Runs) -> None:
    """show names the failed step, the error and its attempts, and what to do next."""
    proc = cli(runs.target, "show", "mail/fail-1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("mail/fail-1  failed")
    assert "next step 'send' (1 of 1), iteration 0" in out
    assert "builtins.ValueError: smtp said no" in out
    assert "attempts  1" in out
    assert "rerun the workflow: it resumes at step 'send'" in out


def test_show_in_doubt_run_gives_its_key(runs: Runs) -> None:
    """show prints the pending intent's idempotency key; --json carries the header."""
    proc = cli(runs.target, "show", "pay/doubt-1")
    assert proc.returncode == 0, proc.stderr
    assert "pending intent" in proc.stdout
    assert f"idempotency key  {runs.doubt_key}" in proc.stdout
    assert "resolve pay/doubt-1 --fired" in proc.stdout
    assert "STEP     ITER  ATTEMPTS  DURATION  COMMITTED" in proc.stdout
    assert "prepare     0         1" in proc.stdout

    doc = json.loads(cli(runs.target, "show", "pay/doubt-1", "--json", "--state").stdout)
    assert doc["header"]["status"] == "in_doubt"
    assert doc["header"]["intent"]["key"] == runs.doubt_key
    assert doc["header"]["intent"]["step"] == "charge"
    assert [h[0] for h in doc["header"]["history"]] == ["prepare"]
    assert doc["state"] == {"amount": 42}


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_show_state_pretty_json(runs: Runs) -> None:
    """--state prints a JSON state indented; a completed run shows its whole history."""
    proc = cli(runs.target, "show", "pay/done-1", "--state")
    assert proc.returncode == 0, proc.stderr
    head, _, text = proc.stdout.partition("\nstate\n")
    state = json.loads(text)
    assert state["amount"] == 42
    assert state["receipt"] is True
    assert state["charged"].startswith("ds-")
    assert '\n  "amount": 42,' in text
    assert "finished in iteration 0" in head
    assert "3 step commits" in head
    assert "nothing left to do" in head


@pytest.mark.slow
@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_pickle_state_needs_unsafe_unpickle_and_signing_key(runs: Runs) -> None:
    """Pickle states are shown only with --unsafe-unpickle; signed ones need their key."""
    plain = ds.Workflow("pickled", store=runs.store, serializer="pickle", steps=[noop])
    plain.run("p-1", {"when": {1, 2}})
    signed = ds.Workflow(
        "signed", store=runs.store, serializer="pickle", signing_key="k1", steps=[noop]
    )
    signed.run("s-1", {"when": (3, 4)})

    refused = cli(runs.target, "show", "pickled/p-1", "--state")
    assert refused.returncode == 2
    assert "--unsafe-unpickle" in one_error_line(refused)
    assert refused.stdout == ""
    shown = cli(runs.target, "show", "pickled/p-1", "--state", "--unsafe-unpickle")
    assert shown.returncode == 0, shown.stderr
    assert "{'when': {1, 2}}" in shown.stdout
    # With a signing key set, an unsigned pickle is refused unread, as the
    # workflow itself refuses it: anyone who can write the store made it.
    also = cli(
        runs.target,
        "show",
        "pickled/p-1",
        "--state",
        "--unsafe-unpickle",
        env={"DURABLE_STEPS_SIGNING_KEY": "k1"},
    )
    assert also.returncode == 4, also.stderr
    assert "unsigned pickle" in one_error_line(also)

    no_key = cli(runs.target, "show", "signed/s-1", "--state", "--unsafe-unpickle")
    assert no_key.returncode == 2
    assert "DURABLE_STEPS_SIGNING_KEY" in one_error_line(no_key)
    wrong = cli(
        runs.target,
        "show",
        "signed/s-1",
        "--state",
        "--unsafe-unpickle",
        env={"DURABLE_STEPS_SIGNING_KEY": "other"},
    )
    assert wrong.returncode == 1
    assert "signature does not verify" in one_error_line(wrong)
    good = cli(
        runs.target,
        "show",
        "signed/s-1",
        "--state",
        "--unsafe-unpickle",
        env={"DURABLE_STEPS_SIGNING_KEY": "k1"},
    )
    assert good.returncode == 0, good.stderr
    assert "{'when': (3, 4)}" in good.stdout
    assert cli(runs.target, "show", "signed/s-1").returncode == 0  # header only: no key needed


# -- resolve -----------------------------------------------------------------


def test_resolve_fired_then_rerun_completes_without_firing(runs: Runs) -> None:
    """After resolve --fired, rerunning completes the run and never calls the step."""
    proc = cli(runs.target, "resolve", "pay/doubt-1", "--fired")
    assert proc.returncode == 0, proc.stderr
    assert runs.doubt_key in proc.stdout
    assert "fired" in proc.stdout
    final = runs.workflow().run("doubt-1")
    assert runs.charges == []
    assert final == {"amount": 42, "receipt": True}
    shown = cli(runs.target, "show", "pay/doubt-1")
    assert shown.stdout.startswith("pay/doubt-1  completed")
    assert "not run (resolved)" in shown.stdout


@pytest.mark.parametrize("durable_target", LOCAL_AND_MOTO, indirect=True)
def test_resolve_not_fired_refires_with_the_same_key(runs: Runs) -> None:
    """After resolve --not-fired, the rerun fires the step once, with the persisted key."""
    proc = cli(runs.target, "resolve", "pay/doubt-1", "--not-fired")
    assert proc.returncode == 0, proc.stderr
    assert runs.workflow().run("doubt-1")["charged"] == runs.doubt_key
    assert runs.charges == [runs.doubt_key]


@pytest.mark.slow
@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_resolve_refusals(runs: Runs) -> None:
    """resolve: 3 for a missing run, 4 with nothing in doubt; a stopped run needs no --force."""
    missing = cli(runs.target, "resolve", "pay/nope", "--fired")
    assert missing.returncode == 3
    assert "not found" in one_error_line(missing)
    for run, status in (("pay/done-1", "completed"), ("pay/crash-1", "stopped")):
        nothing = cli(runs.target, "resolve", run, "--fired")
        assert nothing.returncode == 4
        assert f"(status {status}); nothing to resolve" in one_error_line(nothing)
    # The default in_doubt="refire" policy leaves a crashed run 'running' (stopped: its
    # owner is gone) with its intent; only a live owner needs --force (test_live_run_...).
    runs.crash("stop-1", after_write=3, name="refund")
    assert rows(cli(runs.target, "ls", "-w", "refund").stdout)["refund/stop-1"][0] == "stopped"
    resolved = cli(runs.target, "resolve", "refund/stop-1", "--fired")
    assert resolved.returncode == 0, resolved.stderr
    assert runs.workflow(name="refund").run("stop-1")["receipt"] is True
    assert runs.charges == []
    usage = cli(runs.target, "resolve", "pay/doubt-1")
    assert usage.returncode == 2
    assert "--fired" in one_error_line(usage)


# -- rm and prune ------------------------------------------------------------


@pytest.mark.slow
def test_rm_deletes_only_checkpoints_and_guards_in_doubt_runs(runs: Runs) -> None:
    """rm deletes checkpoints only; an in-doubt run needs --force (live ones: see below)."""
    refused = cli(runs.target, "rm", "pay/doubt-1")
    assert refused.returncode == 4
    assert "in doubt" in one_error_line(refused)
    assert runs.exists("pay/doubt-1/checkpoint")
    for junk in ("pay/junk", "pay/copy-1"):
        refused = cli(runs.target, "rm", junk, "--force")
        assert refused.returncode == 4
        assert "not a durable_steps checkpoint" in one_error_line(refused)
    missing = cli(runs.target, "rm", "pay/nope")
    assert missing.returncode == 3

    done = cli(runs.target, "rm", "pay/done-1")
    assert done.returncode == 0, done.stderr
    assert "deleted pay/done-1 (completed" in done.stdout
    stopped = cli(runs.target, "rm", "pay/crash-1")  # nobody runs it: no --force needed
    assert stopped.returncode == 0, stopped.stderr
    assert "deleted pay/crash-1 (stopped" in stopped.stdout
    assert not runs.exists("pay/done-1/checkpoint")
    assert not runs.exists("pay/crash-1/checkpoint")
    assert all(runs.exists(key) for key in [*JUNK, "pay/copy-1/checkpoint"])
    assert runs.exists("pay/doubt-1/checkpoint")
    assert runs.exists("mail/fail-1/checkpoint")


# -- a run a live process owns ----------------------------------------------

LIVE_CHILD = """
import pathlib, sys, time
import durable_steps as ds

wf = ds.Workflow("live", store=sys.argv[1])

@wf.step()
def prepare(state):
    state["n"] = 1

@wf.step(idempotent=False)
def charge(state):
    pathlib.Path(sys.argv[2]).touch()  # the intent is written: we are mid-step
    time.sleep(120)

wf.run("l-1")
"""


@pytest.mark.slow
@pytest.mark.parametrize("durable_target", LOCAL_AND_MOTO, indirect=True)
def test_live_run_is_running_until_its_process_dies(
    durable_target: StoreTarget, tmp_path: Path
) -> None:
    """A run a live child process owns is running: show names it, rm and resolve refuse;
    once the child is SIGKILLed, the same run is stopped and resolves without --force.
    """
    ready = tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", LIVE_CHILD, durable_target.url, str(ready)],
        env=durable_target.child_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert child.poll() is None, child.communicate()[1]
            assert time.monotonic() < deadline, "the child never reached its step"
            time.sleep(0.02)
        who = f"{socket.gethostname()}:{child.pid}"

        table = rows(cli(durable_target, "ls").stdout)
        assert table["live/l-1"][:3] == ["running", "charge", "(2/2)"]
        [entry] = json.loads(cli(durable_target, "ls", "--json").stdout)
        assert (entry["status"], entry["owner"]["pid"]) == ("running", child.pid)
        shown = cli(durable_target, "show", "live/l-1").stdout
        assert shown.startswith("live/l-1  running")
        assert re.search(rf"owner\s+{re.escape(who)} \(lease ends in \d+s\)", shown), shown
        assert "pending intent" in shown
        assert f"next: it is being run by {who}" in shown

        rm = cli(durable_target, "rm", "live/l-1")
        assert rm.returncode == 4
        assert f"is being run by {who}" in one_error_line(rm)
        resolve = cli(durable_target, "resolve", "live/l-1", "--fired")
        assert resolve.returncode == 4
        assert f"is being run by {who}" in one_error_line(resolve)  # the library's RunLocked
        assert rows(cli(durable_target, "ls").stdout)["live/l-1"][0] == "running"
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()

    assert rows(cli(durable_target, "ls").stdout)["live/l-1"][0] == "stopped"
    shown = cli(durable_target, "show", "live/l-1").stdout
    assert shown.startswith("live/l-1  stopped")
    assert re.search(rf"owner\s+{re.escape(who)} \(gone\)", shown), shown
    assert "nobody is running it" in shown
    assert "if it did fire, first `durable-steps resolve live/l-1 --fired`" in shown
    rm = cli(durable_target, "rm", "live/l-1")
    assert rm.returncode == 4
    assert "in doubt" in one_error_line(rm)  # stopped, but its step may have fired
    resolve = cli(durable_target, "resolve", "live/l-1", "--not-fired")
    assert resolve.returncode == 0, resolve.stderr


def test_prune_is_a_dry_run_until_yes_and_deletes_only_old_completed_runs(runs: Runs) -> None:
    """prune lists without deleting; --yes deletes completed runs past the age, nothing else."""
    keep = [
        *JUNK,
        "pay/copy-1/checkpoint",
        "pay/crash-1/checkpoint",
        "pay/doubt-1/checkpoint",
        "mail/fail-1/checkpoint",
    ]
    dry = cli(runs.target, "prune", "--completed", "--older-than", "0s")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].startswith("would delete 1 run (")
    assert lines[1].split() == ["WORKFLOW", "RUN", "STATUS", "AGE", "SIZE"]
    assert lines[2].split()[:3] == ["pay", "done-1", "completed"]
    assert lines[3] == "dry run: nothing was deleted; add --yes to delete them"
    assert len(lines) == 4
    assert runs.exists("pay/done-1/checkpoint")

    young = cli(runs.target, "prune", "--completed", "--older-than", "2w", "--yes")
    assert young.returncode == 0, young.stderr
    assert "nothing to prune" in young.stderr
    assert runs.exists("pay/done-1/checkpoint")

    pruned = cli(runs.target, "prune", "--completed", "--older-than", "0d", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines()[0].startswith("deleted pay/done-1 (completed")
    assert not runs.exists("pay/done-1/checkpoint")
    assert all(runs.exists(key) for key in keep)


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_prune_failed_keeps_runs_with_a_pending_intent(runs: Runs) -> None:
    """prune --failed deletes failed runs, but never one whose step may have fired."""
    wf = ds.Workflow("ship", store=runs.store)

    @wf.step(idempotent=False)
    def post(state: dict[str, Any]) -> None:
        raise TimeoutError("carrier API timed out")

    with pytest.raises(ds.StepFailed):
        wf.run("ship-1")
    proc = cli(runs.target, "prune", "--failed", "--older-than", "0s", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert "deleted mail/fail-1 (failed" in proc.stdout
    assert "keeping 1 run(s) with a step in doubt" in proc.stderr
    assert runs.exists("ship/ship-1/checkpoint")
    assert runs.exists("pay/done-1/checkpoint")


# -- errors, usage, configuration --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_errors_are_one_line_with_meaningful_exit_codes(runs: Runs, tmp_path: Path) -> None:
    """Bad input exits 2, a missing run 3, an unreadable checkpoint 1: one line each."""
    cases = [
        (["show", "no-slash"], 2, "WORKFLOW/RUN_ID"),
        (["show", "pay/../x"], 2, "invalid run id"),
        (["prune", "--completed", "--older-than", "7 days"], 2, "invalid duration"),
        (["prune", "--older-than", "7d"], 2, "--completed and/or --failed"),
        (["ls", "--status", "sleeping"], 2, "invalid choice"),
        (["frobnicate"], 2, "invalid choice"),
        (["show", "pay/nope"], 3, "run pay/nope not found"),
        (["show", "pay/junk"], 1, "not a durable_steps checkpoint"),
        (["--store", "ftp://x/y", "ls"], 2, "unknown scheme"),
    ]
    for args, code, text in cases:
        proc = cli(runs.target, *args)
        assert proc.returncode == code, (args, proc.stderr)
        assert text in one_error_line(proc), args
    path = Path(runs.target.url, "pay", "done-1", "checkpoint")
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    truncated = cli(runs.target, "show", "pay/done-1")
    assert truncated.returncode == 1
    assert "truncated or damaged" in one_error_line(truncated)
    assert rows(cli(runs.target, "ls").stdout)["pay/done-1"][0] == "corrupt"
    debug = subprocess.run(
        [
            sys.executable,
            "-m",
            "durable_steps",
            "show",
            "pay/done-1",
            "--debug",
            "--store",
            runs.target.url,
        ],
        capture_output=True,
        text=True,
        check=False,
        env=runs.target.child_env(),
    )
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1].startswith("durable-steps: error: ")


@pytest.mark.s3
def test_s3_store_failure_is_one_line(moto: Any) -> None:
    """A missing bucket is reported as one error line with exit status 1."""
    target = StoreTarget("moto", "s3://no-such-bucket-here/x", moto.env(), moto)
    proc = cli(target, "ls")
    assert proc.returncode == 1
    assert "no-such-bucket-here" in one_error_line(proc)


def test_store_comes_from_env_then_default(tmp_path: Path) -> None:
    """Without --store: $DURABLE_STEPS_STORE, else ./.durable_steps in the working directory."""
    ds.Workflow("env", store=str(tmp_path / "from-env"), steps=[noop]).run("e-1")
    ds.Workflow("dflt", steps=[noop]).run("d-1")  # cwd is tmp_path (conftest)
    base = [sys.executable, "-m", "durable_steps", "ls"]
    env = {**os.environ, "DURABLE_STEPS_STORE": str(tmp_path / "from-env")}
    from_env = subprocess.run(base, env=env, capture_output=True, text=True, check=False)
    assert list(rows(from_env.stdout)) == ["env/e-1"]
    default = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert list(rows(default.stdout)) == ["dflt/d-1"]
    elsewhere = subprocess.run(
        base, cwd=tmp_path / "from-env", capture_output=True, text=True, check=False
    )
    assert elsewhere.returncode == 0
    assert elsewhere.stdout == ""
    assert "no matching runs in ./.durable_steps" in elsewhere.stderr


@pytest.mark.slow
def test_console_script_help_documents_commands_and_exit_codes() -> None:
    """The installed console script's --help covers every command and the exit codes."""
    script = Path(sys.executable).with_name("durable-steps")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0
    for text in (
        "ls",
        "show",
        "resolve",
        "rm",
        "prune",
        "--store",
        "DURABLE_STEPS_STORE",
        "exit status",
        "3 run not found",
        "resolve pay/order-17 --fired",
        "--status in-doubt",
        "stopped    nobody is running it",
        "NO_COLOR",
    ):
        assert text in proc.stdout, text
    for command in ("ls", "show", "resolve", "rm", "prune"):
        sub = subprocess.run(
            [str(script), command, "--help"], capture_output=True, text=True, check=False
        )
        assert sub.returncode == 0
        assert "--store URL" in sub.stdout


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_colour_only_when_asked_and_never_with_no_color(runs: Runs) -> None:
    """--color always paints statuses; NO_COLOR and pipes get plain text."""
    painted = cli(runs.target, "ls", "--color", "always")
    assert "\x1b[31mfailed" in painted.stdout
    assert "\x1b[33min-doubt" in painted.stdout
    assert "\x1b[35mstopped" in painted.stdout
    # Colour never shifts the columns: stripped of escapes, the text is the plain one
    # (the ages aside: a second may pass between the two commands on a busy machine).
    plain = cli(runs.target, "ls", "--color", "never").stdout
    ages = re.compile(r"just now|\d+[smhdw] ago")
    assert ages.sub("AGE", _strip_ansi(painted.stdout)).split() == ages.sub("AGE", plain).split()
    env = {"NO_COLOR": "1"}
    assert "\x1b[" not in cli(runs.target, "show", "mail/fail-1", env=env).stdout


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_ls_age_and_size_are_human(runs: Runs) -> None:
    """Ages read like '3m ago' and sizes like '2.1 KB'."""
    big = ds.Workflow("big", store=runs.store, steps=[noop])
    big.run("b-1", {"blob": "x" * 3000})
    path = Path(runs.target.url, "big", "b-1", "checkpoint")
    old = time.time() - 3 * 3600
    os.utime(path, (old, old))  # the header's updated_at decides the age, not the mtime
    table = rows(cli(runs.target, "ls", "-w", "big").stdout)
    cells = table["big/b-1"]
    assert cells[-4:-2] == ["just", "now"]
    assert re.fullmatch(r"3\.\d", cells[-2])
    assert cells[-1] == "KB"
