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
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import index as _index
from durable_steps._record import checkpoint as ckpt
from durable_steps.testing import CrashingStore, SimulatedCrash
from tests.conftest import StoreTarget
from tests.forkserver import ForkServer
from tests.storetools import rewrite_header

LOCAL_AND_MOTO = [
    pytest.param("local", id="local"),
    pytest.param("moto", id="moto", marks=pytest.mark.s3),
]
JUNK = {
    "pay/done-1/notes.txt": b"not a checkpoint: keep me",
    "pay/junk/checkpoint": b"hello\nworld",
    "notes/readme/checkpoint": b'{"format": 1}\n',
}


# -- runs in every state -----------------------------------------------------


def _exited_pid() -> int:
    """The pid of a child process that has already exited."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


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
        """Start ``run_id`` and "kill" it right after its ``after_write``-th write.

        The crash happens in this (still living) process, which other processes
        would take for a live owner until its lease ends; so the owner record is
        made to name a process that has exited, as a real SIGKILL leaves it.
        """
        crashing = CrashingStore(self.store, after_write=after_write)
        with pytest.raises(SimulatedCrash):
            self.workflow(crashing, name=name).run(run_id)
        key = ckpt.checkpoint_key(name, run_id)
        found = self.store.get(key)
        assert found is not None
        owner = ckpt.decode(found[0], where=key)[0].owner
        if owner is not None:
            rewrite_header(self.store, key, owner={**owner, "pid": _exited_pid()})

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


_forks = ForkServer("durable_steps.cli")


def cli(target: StoreTarget, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``python -m durable_steps --store URL ARGS`` in a child process: a fresh fork
    of a server that imported the CLI once (the console script has its own tests).
    """
    out = Path(tempfile.gettempdir(), f"durable-steps-cli-{os.getpid()}")
    proc = _forks.run(
        ["--store", target.url, *args],
        cwd=Path.cwd(),
        out=out,
        env={**target.child_env(), **(env or {})},
        timeout=60,
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
    """ls shows each run's status, next step and iteration; filters narrow it down. The
    runs come from the index of runs; objects put beside them by hand (junk, a copy)
    only with --all, which reads every object."""
    indexed = cli(runs.target, "ls")
    assert indexed.returncode == 0, indexed.stderr
    assert sorted(rows(indexed.stdout)) == [
        "mail/fail-1",
        "pay/crash-1",
        "pay/done-1",
        "pay/doubt-1",
    ]
    proc = cli(runs.target, "ls", "--all")
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
    assert re.search(r"owner\s+\S+:\d+ \(gone\)", out), out  # a dead process on this host
    assert "nobody is running it" in out
    assert re.search(r"durable-steps (--store \S+ )?worker --app module:workflow", out)
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
    # A crash after the intent leaves the run 'running' (its owner gone) with the intent:
    # in doubt; only a live owner needs --force (test_live_run_...).
    runs.crash("stop-1", after_write=3, name="refund")
    assert rows(cli(runs.target, "ls", "-w", "refund").stdout)["refund/stop-1"][0] == "in-doubt"
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


# -- a crash with the intent written ----------------------------------------------


def next_line(proc: Any) -> str:
    """The ``next:`` line of ``show``."""
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("next: ")]
    return str(line)


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_a_crash_with_a_pending_intent_is_in_doubt_and_show_follows_the_policy(
    runs: Runs,
) -> None:
    """A run that crashed with its intent written (status running, no live owner) is
    in-doubt in ls, ls --status in-doubt and show; show's advice follows intent["policy"].
    """
    runs.crash("lost-1", after_write=3)  # the intent of 'charge' (in_doubt="raise") is written
    table = rows(cli(runs.target, "ls").stdout)
    assert table["pay/lost-1"][:3] == ["in-doubt", "charge", "(2/3)"]
    assert table["pay/crash-1"][0] == "stopped"  # crashed with nothing in doubt
    doubt = cli(runs.target, "ls", "--status", "in-doubt")
    assert sorted(rows(doubt.stdout)) == ["pay/doubt-1", "pay/lost-1"]
    assert list(rows(cli(runs.target, "ls", "-s", "stopped").stdout)) == ["pay/crash-1"]
    entry = [
        e for e in json.loads(cli(runs.target, "ls", "--json").stdout) if e["run"] == "pay/lost-1"
    ]
    assert entry[0]["status"] == "in_doubt"
    shown = cli(runs.target, "show", "pay/lost-1")
    assert shown.stdout.startswith("pay/lost-1  in-doubt")
    assert "re-fires" not in shown.stdout  # its policy is raise: a rerun stops
    assert "StepInDoubt" in next_line(shown)
    assert cli(runs.target, "rm", "pay/lost-1").returncode == 4

    key = "pay/lost-1/checkpoint"
    found = runs.store.get(key)
    assert found is not None
    intent = {k: v for k, v in ckpt.decode(found[0], where=key)[0].intent.items() if k != "policy"}
    advice = {
        "raise": "a rerun stops with StepInDoubt until you say what happened: ask the service",
        "refire": "a rerun fires it again with the same key (the service can drop a duplicate)",
        "reconcile": "a rerun first asks the step's reconcile hook whether it went through",
    }
    for policy, text in advice.items():
        rewrite_header(runs.store, key, intent={**intent, "policy": policy})
        shown = cli(runs.target, "show", "pay/lost-1")
        assert re.search(rf"policy\s+{policy}\n", shown.stdout), shown.stdout
        hint = next_line(shown)
        assert text in hint
        assert [t for t in advice.values() if t in hint] == [text]
        assert "resolve pay/lost-1 --fired" in hint
    rewrite_header(runs.store, key, intent=intent)  # an older checkpoint: no policy recorded
    shown = cli(runs.target, "show", "pay/lost-1")
    assert "policy           not recorded (an older checkpoint)" in shown.stdout
    hint = next_line(shown)
    assert "depends on the step's policy, which this checkpoint does not record" in hint
    assert all(p in hint for p in ("in_doubt='refire'", "reconcile hook", "in_doubt='raise'"))
    rewrite_header(runs.store, key, intent={**intent, "policy": "raise"})
    with pytest.raises(ds.StepInDoubt):  # what show said: the rerun stops
        runs.workflow().run("lost-1")
    assert runs.charges == []


# -- a bare run id --------------------------------------------------------------


def test_a_bare_run_id_names_the_one_run_that_has_it(runs: Runs) -> None:
    """show, resolve and rm take a bare RUN_ID that one run has; several: exit 2 naming
    them all (nothing done); none: exit 3.
    """
    shown = cli(runs.target, "show", "doubt-1")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("pay/doubt-1  in-doubt")
    resolved = cli(runs.target, "resolve", "doubt-1", "--not-fired")
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout.startswith("resolved pay/doubt-1: step 'charge'")
    removed = cli(runs.target, "rm", "done-1")
    assert removed.returncode == 0, removed.stderr
    assert "deleted pay/done-1 (completed" in removed.stdout
    assert not runs.exists("pay/done-1/checkpoint")

    ds.Workflow("mail", store=runs.store, steps=[noop]).run("doubt-1")
    for args in (
        ["show", "doubt-1"],
        ["rm", "doubt-1", "--force"],
        ["resolve", "doubt-1", "--fired"],
    ):
        ambiguous = cli(runs.target, *args)
        assert ambiguous.returncode == 2, ambiguous.stderr
        assert "run id 'doubt-1' is ambiguous: 2 runs have it (mail/doubt-1, pay/doubt-1)" in (
            one_error_line(ambiguous)
        )
    assert runs.exists("pay/doubt-1/checkpoint")
    assert runs.exists("mail/doubt-1/checkpoint")
    assert cli(runs.target, "show", "mail/doubt-1").returncode == 0  # the full name still works
    for args in (["show", "nope-1"], ["rm", "nope-1"], ["resolve", "nope-1", "--fired"]):
        missing = cli(runs.target, *args)
        assert missing.returncode == 3, missing.stderr
        assert "no run has the id 'nope-1'" in one_error_line(missing)


def test_a_bare_run_id_costs_one_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Finding a bare run id reads the index (the registry, the live runs) and one head
    per registered workflow, never a LIST of every run; show then reads the one it found."""
    from durable_steps.cli import _main
    from tests.storetools import Wrapped

    store = ds.LocalStore(tmp_path / "store")
    for name in ("a", "b", "c"):
        ds.Workflow(name, store=store, steps=[noop]).run(f"{name}-1")
    calls: list[str] = []

    class Counting(Wrapped):
        def get(self, key: str) -> tuple[bytes, str] | None:
            calls.append(f"GET {key}")
            return super().get(key)

        def list(self, prefix: str) -> Any:
            calls.append(f"LIST {prefix!r}")
            return super().list(prefix)

    monkeypatch.setattr(_main, "open_store", lambda url: Counting(store))
    assert _main.main(["show", "b-1"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("b/b-1  completed")
    assert calls[:3] == [
        "LIST '_index/workflows/'",
        "LIST '_index/flat-complete'",
        "LIST '_index/live2/'",
    ]
    assert sorted(calls[3:6]) == [f"GET {w}/b-1/checkpoint" for w in "abc"]
    assert calls[6:] == ["GET b/b-1/checkpoint"]


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

    assert rows(cli(durable_target, "ls").stdout)["live/l-1"][0] == "in-doubt"
    shown = cli(durable_target, "show", "live/l-1").stdout
    assert shown.startswith("live/l-1  in-doubt")
    assert re.search(rf"owner\s+{re.escape(who)} \(gone\)", shown), shown
    assert "nobody is running it and 'charge' may have fired" in shown
    assert re.search(r"`durable-steps (--store \S+ )?resolve live/l-1 --fired`", shown)
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


# -- tombstones ---------------------------------------------------------------------


def put_tombstone(store: ds.Store, workflow: str, run_id: str, completed_at: float) -> None:
    """What on_complete="delete" leaves of a completed run: status deleted, no state."""
    steps = ("prepare", "charge", "receipt")
    header = ckpt.Checkpoint(
        workflow,
        run_id,
        steps,
        "json",
        status="deleted",
        next_step=len(steps),
        committed=3,
        created_at=completed_at - 60,
        updated_at=completed_at,
    )
    store.put(ckpt.checkpoint_key(workflow, run_id), ckpt.encode(header, b""))
    drive_sync(_index.moved(None, header), store)  # its done entry, as the runner leaves it


@pytest.mark.parametrize("durable_target", LOCAL_AND_MOTO, indirect=True)
def test_tombstones_are_listed_explained_removed_and_pruned(runs: Runs) -> None:
    """A tombstone lists as deleted, show explains it, rm removes it without --force, and
    prune --completed removes the ones older than --older-than.
    """
    now = time.time()
    put_tombstone(runs.store, "pay", "gone-old", now - 3 * 86400)
    put_tombstone(runs.store, "pay", "gone-new", now)
    table = rows(cli(runs.target, "ls").stdout)
    assert table["pay/gone-old"][:3] == ["deleted", "done", "0"]
    assert table["pay/gone-new"][:3] == ["deleted", "done", "0"]
    listed = cli(runs.target, "ls", "--status", "deleted")
    assert sorted(rows(listed.stdout)) == ["pay/gone-new", "pay/gone-old"]
    entries = json.loads(cli(runs.target, "ls", "-s", "deleted", "--json").stdout)
    assert {(e["status"], e["next_step"]) for e in entries} == {("deleted", None)}

    shown = cli(runs.target, "show", "pay/gone-old", "--state")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert out.startswith("pay/gone-old  deleted")
    assert "finished in iteration 0" in out
    assert "a tombstone: the state was deleted when the run completed" in out
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(now - 3 * 86400))
    assert f"next: completed and its state deleted at {when}" in out
    assert "a rerun of this id returns None and runs nothing" in out
    assert re.search(
        r"`durable-steps (--store \S+ )?rm pay/gone-old` frees the id for a new run", out
    )
    assert "state\nnone: deleted when the run completed" in out
    doc = json.loads(cli(runs.target, "show", "pay/gone-old", "--json", "--state").stdout)
    assert (doc["header"]["status"], doc["header"]["size"], doc["state"]) == ("deleted", 0, None)
    nothing = cli(runs.target, "resolve", "pay/gone-old", "--fired")
    assert nothing.returncode == 4
    assert "(status deleted); nothing to resolve" in one_error_line(nothing)

    dry = cli(runs.target, "prune", "--completed", "--older-than", "1d")
    assert dry.returncode == 0, dry.stderr
    assert [line.split()[:3] for line in dry.stdout.splitlines()[2:-1]] == [
        ["pay", "gone-old", "deleted"]
    ]
    pruned = cli(runs.target, "prune", "--completed", "--older-than", "1d", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines()[0].startswith("deleted pay/gone-old (deleted")
    assert not runs.exists("pay/gone-old/checkpoint")
    assert runs.exists("pay/gone-new/checkpoint")  # younger than a day
    assert runs.exists("pay/done-1/checkpoint")
    failed_only = cli(runs.target, "prune", "--failed", "--older-than", "0s", "--yes")
    assert "gone-new" not in failed_only.stdout  # a tombstone is a completed run's
    assert runs.exists("pay/gone-new/checkpoint")

    removed = cli(runs.target, "rm", "pay/gone-new")  # no --force: nothing is lost
    assert removed.returncode == 0, removed.stderr
    assert "deleted the tombstone of pay/gone-new" in removed.stdout
    assert "the id is free for a new run" in removed.stdout
    assert not runs.exists("pay/gone-new/checkpoint")


# -- errors, usage, configuration --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_errors_are_one_line_with_meaningful_exit_codes(runs: Runs, tmp_path: Path) -> None:
    """Bad input exits 2, a missing run 3, an unreadable checkpoint 1: one line each."""
    cases = [
        (["show", "no-slash"], 3, "no run has the id 'no-slash'"),
        (["show", ".hidden"], 2, "invalid run id"),
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
    # Colour never shifts the columns: stripped of escapes, the text is the plain one.
    plain = cli(runs.target, "ls", "--color", "never").stdout
    ages = re.compile(r"just now|\d+[smhdw] ago")  # a second may pass between the two
    assert ages.sub("AGE", _strip_ansi(painted.stdout)).split() == ages.sub("AGE", plain).split()
    env = {"NO_COLOR": "1"}
    assert "\x1b[" not in cli(runs.target, "show", "mail/fail-1", env=env).stdout


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_ls_age_and_size_are_human(runs: Runs) -> None:
    """Ages read like '3m ago' and sizes like '2.1 KB'."""
    big = ds.Workflow("big", store=runs.store, steps=[noop])
    written = time.time()
    big.run("b-1", {"blob": "x" * 3000})
    path = Path(runs.target.url, "big", "b-1", "checkpoint")
    old = time.time() - 3 * 3600
    os.utime(path, (old, old))  # the header's updated_at decides the age, not the mtime
    table = rows(cli(runs.target, "ls", "-w", "big").stdout)
    # Under load the child may start seconds later: the age is at most the time that passed.
    elapsed = int(time.time() - written)
    fresh = {"just now", *(f"{n}s ago" for n in range(1, elapsed + 1))}
    cells = table["big/b-1"]
    assert " ".join(cells[-4:-2]) in fresh, (cells, elapsed)
    assert re.fullmatch(r"3\.\d", cells[-2])
    assert cells[-1] == "KB"


# -- stored text never reaches the terminal raw ---------------------------------

# Clear screen, 8-bit CSI, CR, BEL, DEL, NUL, and a lone surrogate (which cannot be encoded).
HOSTILE = "x\x1b[2J\x9b31m\rgotcha\x07\x7f\x00\ud800"
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # every control but the newline


def hostile_checkpoint(workflow: str, run_id: str, **fields: Any) -> bytes:
    """A decodable checkpoint whose step names, error, owner host, intent and state hold
    terminal escapes (as a buggy or malicious writer could store them).
    """
    now = time.time()
    step = f"charge{HOSTILE}"
    error = {"step": step, "iteration": 0, "type": f"E{HOSTILE}", "message": HOSTILE}
    values: dict[str, Any] = {
        "next_step": 1,
        "intent": {"step": step, "index": 1, "iteration": 0, "key": "ds-" + "0" * 40, "at": now},
        "error": {**error, "attempts": 1, "at": now},
        "history": ((f"prepare{HOSTILE}", 0, 1, 5, int(now)),),
        **fields,
    }
    header = ckpt.Checkpoint(workflow, run_id, ("prepare", step), "json", format=1, **values)
    return ckpt.encode(header, json.dumps({"note": HOSTILE, "multi": "a\nb"}).encode())


@pytest.mark.parametrize("durable_target", ["local"], indirect=True)
def test_stored_control_characters_are_escaped_in_human_output(
    durable_target: StoreTarget,
) -> None:
    """Escapes stored in headers, states and keys are printed escaped by every command
    (the terminal never obeys them); --json keeps them exact.
    """
    store = durable_target.open()
    live = {"host": f"elsewhere{HOSTILE}", "pid": 7, "token": "t", "until": time.time() + 600}
    store.put("evil/live-1/checkpoint", hostile_checkpoint("evil", "live-1", owner=live))
    store.put("evil/doubt-1/checkpoint", hostile_checkpoint("evil", "doubt-1", status="in_doubt"))
    store.put("evil/other/checkpoint", hostile_checkpoint("evil", f"other{HOSTILE}"))
    # A header whose status is garbage: corrupt, but rm --force must still name it.
    bad = hostile_checkpoint("evil", "bad-1").replace(b'"running"', b'"\\u001b[2J"', 1)
    store.put("evil/bad-1/checkpoint", bad)
    # A key (here: directory names) holding escapes, with a completed run inside.
    odd_wf, odd_run = "w\x1b[2J", "r\r\x9b"
    done = hostile_checkpoint(odd_wf, odd_run, status="completed", next_step=2, intent=None)
    odd = Path(durable_target.url, odd_wf, odd_run)
    odd.mkdir(parents=True)
    (odd / "checkpoint").write_bytes(done)
    store.close()

    outputs = {
        "ls": cli(durable_target, "ls"),
        "show": cli(durable_target, "show", "evil/live-1", "--state", "--color", "always"),
        "show-doubt": cli(durable_target, "show", "evil/doubt-1"),
        "show-other": cli(durable_target, "show", "evil/other"),
        "rm-live": cli(durable_target, "rm", "evil/live-1"),
        "resolve-live": cli(durable_target, "resolve", "evil/live-1", "--fired"),
        "rm-doubt": cli(durable_target, "rm", "evil/doubt-1"),
        "resolve": cli(durable_target, "resolve", "evil/doubt-1", "--fired"),
        "rm-bad": cli(durable_target, "rm", "evil/bad-1", "--force"),
        "prune-dry": cli(durable_target, "prune", "--completed", "--older-than", "0s"),
        "prune": cli(durable_target, "prune", "--completed", "--older-than", "0s", "--yes"),
    }
    for what, proc in outputs.items():
        # --color always: the only escapes left are the colours the CLI adds itself.
        text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
        assert not RAW_CONTROL.search(text), (what, text)
    assert [outputs[w].returncode for w in outputs] == [0, 0, 0, 1, 4, 4, 4, 0, 0, 0, 0]

    escaped = r"x\x1b[2J\x9b31m\rgotcha\x07\x7f\x00\ud800"
    show = _strip_ansi(outputs["show"].stdout)
    assert f"elsewhere{escaped}:7 (lease ends in" in show
    assert f"E{escaped}: {escaped}" in show
    assert f"prepare -> charge{escaped}" in show
    assert f"idempotency key  ds-{'0' * 40}" in show  # a hostile key is refused by decode
    # The state stays JSON (all escaped the JSON way) laid out on several lines.
    state = json.loads(show.partition("\nstate\n")[2])
    assert state == {"note": HOSTILE, "multi": "a\nb"}
    assert f"prepare{escaped}" in outputs["show-doubt"].stdout
    one_line = escaped.replace(r"\r", " ")  # an error is one line: its whitespace is collapsed
    assert f"(evil/other{one_line})" in one_error_line(outputs["show-other"])
    assert f"elsewhere{one_line}" in one_error_line(outputs["rm-live"])
    assert f"elsewhere{one_line}" in one_error_line(outputs["resolve-live"])
    assert f"charge{escaped}" in one_error_line(outputs["rm-doubt"])
    assert f"step 'charge{escaped}'" in outputs["resolve"].stdout
    assert r"deleted evil/bad-1 (\x1b[2J" in outputs["rm-bad"].stdout
    assert r"w\x1b[2J  r\r\x9b" in outputs["ls"].stdout
    assert r"deleted w\x1b[2J/r\r\x9b (completed" in outputs["prune"].stdout

    # --json is exact: the same strings come back, escaped only as JSON escapes them.
    for args in (("show", "evil/doubt-1", "--json", "--state"), ("ls", "--json")):
        proc = cli(durable_target, *args)
        assert not RAW_CONTROL.search(proc.stdout), args
        doc = json.loads(proc.stdout)
        header = doc["header"] if args[0] == "show" else doc[0]
        assert header["error"]["message"] == HOSTILE
        assert header["intent"]["step"] == f"charge{HOSTILE}"
    doc = json.loads(cli(durable_target, "show", "evil/live-1", "--json", "--state").stdout)
    assert doc["header"]["owner"]["host"] == f"elsewhere{HOSTILE}"
    assert doc["state"] == {"note": HOSTILE, "multi": "a\nb"}
