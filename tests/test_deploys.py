"""Deploys that change the code: real runs SIGKILLed under old code, resumed by new code.

Each version of the workflow is a module ``deployapp`` written to its own
directory under ``tmp_path`` (as a deploy replaces the files). A child
process (``tests/deploychild.py``) imports one version and runs the run;
the steps log ``name:iteration:idempotency key`` (fsynced) and SIGKILL
their process where ``DEPLOY_KILL`` says, so every resume below is a fresh
process running new code on what the old code left in the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._deploys.fingerprints import fingerprint
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget, _target

CHILD = Path(__file__).with_name("deploychild.py")
WORKFLOW = "deploy"
KILLED = -signal.SIGKILL
EXIT_IN_DOUBT, EXIT_CHANGED, EXIT_ERROR = 3, 5, 6

MODULE = """\
import os
import signal

import durable_steps as ds


def _mark(name, state, ctx):
    fd = os.open(os.environ["DEPLOY_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{{name}}:{{ctx.iteration}}:{{ctx.idempotency_key}}\\n".encode())
    os.fsync(fd)
    os.close(fd)
    state["trail"].append(f"{{name}}:{{ctx.iteration}}")
    if os.environ.get("DEPLOY_FAIL") == f"{{name}}:{{ctx.iteration}}":
        raise RuntimeError("failed on purpose")
    if os.environ.get("DEPLOY_KILL") == f"{{name}}:{{ctx.iteration}}":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("DEPLOY_STOP") == f"{{name}}:{{ctx.iteration}}":
        os.kill(os.getpid(), signal.SIGSTOP)


def _note(event):
    if event.kind == "code_changed":
        with open(os.environ["DEPLOY_EVENTS"], "a") as f:
            f.write(event.detail + "\\n")


{migrate}

wf = ds.Workflow(
    "{workflow}",
    store=os.environ["DEPLOY_STORE"],
    on_event=[_note],
    until={until},{versioned}
)
"""

STEP = """
@wf.step(name="{name}", {options})
def step_{index}(state, ctx):
    _mark("{name}", state, ctx)
    {extra}
"""


def app_source(
    steps: list[str],
    *,
    version: str | None = None,
    migrate: str | None = None,
    passes: int = 1,
    extra: dict[str, str] | None = None,
) -> str:
    """A ``deployapp`` module: ``steps`` by name, ``"charge!"`` for a non-idempotent
    step (``"charge?"``: with ``in_doubt="raise"``), ``"bill=charge"`` for step
    ``bill`` with ``renamed_from="charge"``; the last step counts the pass.
    """
    source = MODULE.format(
        workflow=WORKFLOW,
        migrate=textwrap.dedent(migrate or ""),
        # only when given, so that the same module runs on code before version=
        versioned=(f"\n    version={version!r}," if version else "")
        + ("\n    migrate=migrate," if migrate else ""),
        until=f'lambda s: s["passes"] >= {passes}' if passes > 1 else None,
    )
    for index, spec in enumerate(steps):
        name, _, was = spec.rstrip("!?").partition("=")
        options = "idempotent=True"
        if spec.endswith("!"):
            options = "idempotent=False"
        if spec.endswith("?"):
            options = 'idempotent=False, in_doubt="raise"'
        if was:
            options += f", renamed_from={was!r}"
        body = (extra or {}).get(name, "")
        if index == len(steps) - 1:
            body += '\n    state["passes"] += 1'
        source += STEP.format(name=name, options=options, index=index, extra=body or "pass")
    return source


class Deploy:
    """Versions of the workflow on one store, and the children that run them."""

    def __init__(self, target: StoreTarget, tmp: Path) -> None:
        self.target = target
        self.tmp = tmp
        self.store = target.open()
        self.log = tmp / "executions.log"
        self.events = tmp / "events.log"

    def version(self, label: str, steps: list[str], **options: Any) -> Path:
        """Write one version of the code to its own directory; return that directory."""
        root = self.tmp / label
        root.mkdir()
        (root / "deployapp.py").write_text(app_source(steps, **options))
        return root

    def env(self, **extra: str) -> dict[str, str]:
        env = self.target.child_env()
        env.update(
            DEPLOY_STORE=self.target.url, DEPLOY_LOG=str(self.log), DEPLOY_EVENTS=str(self.events)
        )
        env.update({f"DEPLOY_{k.upper()}": v for k, v in extra.items()})
        return env

    def start(self, app: Path, run: str = "r1", **extra: str) -> subprocess.Popen[str]:
        """Start ``run`` under the code in ``app`` without waiting for it."""
        return subprocess.Popen(
            [sys.executable, str(CHILD), str(app), run],
            env=self.env(**extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def child(self, app: Path, run: str = "r1", **extra: str) -> subprocess.CompletedProcess[str]:
        """Run ``run`` under the code in ``app`` in a fresh process."""
        return subprocess.run(
            [sys.executable, str(CHILD), str(app), run],
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def kill(self, app: Path, at: str, run: str = "r1") -> None:
        """Run ``run`` under ``app`` until it SIGKILLs itself inside step ``at`` (name:iter)."""
        proc = self.child(app, run, kill=at)
        assert proc.returncode == KILLED, proc.stderr

    def finish(self, app: Path, run: str = "r1") -> dict[str, Any]:
        """Run ``run`` under ``app`` to completion; its final state."""
        proc = self.child(app, run)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def cli(self, app: Path, *args: str) -> subprocess.CompletedProcess[str]:
        """``durable-steps --store URL ARGS`` in a fresh process, from ``app``'s directory."""
        return subprocess.run(
            [sys.executable, "-m", "durable_steps", "--store", self.target.url, *args],
            env=self.env(),
            cwd=app,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def execs(self) -> list[str]:
        """``name:iteration`` of every step start, in order."""
        return [line.rsplit(":", 1)[0] for line in self.lines()]

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def keys(self, step: str) -> list[str]:
        """The idempotency keys step ``step`` (``name:iteration``) ran with, in order."""
        return [line.rsplit(":", 1)[1] for line in self.lines() if line.startswith(step + ":")]

    def notes(self) -> list[str]:
        """The details of the ``code_changed`` events, in order."""
        return self.events.read_text().splitlines() if self.events.exists() else []

    def header(self, run: str = "r1") -> ckpt.Checkpoint:
        found = self.store.get(ckpt.checkpoint_key(WORKFLOW, run))
        assert found is not None
        return ckpt.decode(found[0], where=run)[0]

    def snapshot(self) -> dict[str, bytes]:
        """Every object in the store, by key: to prove nothing was written."""
        out = {}
        for info in self.store.list(""):
            found = self.store.get(info.key)
            assert found is not None
            out[info.key] = found[0]
        return out


@pytest.fixture
def deploy(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deploy]:
    """Versions of the workflow on a local store."""
    made = Deploy(_target("local", request, tmp_path), tmp_path)
    yield made
    made.store.close()


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def durable_deploy(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deploy]:
    """Versions of the workflow on a local store and on a real S3 server (SeaweedFS)."""
    made = Deploy(_target(request.param, request, tmp_path), tmp_path)
    yield made
    made.store.close()


V1 = ["plan", "draft", "send"]


# --- the resume-by-name rules ---------------------------------------------------


def test_a_step_added_after_the_position_runs(deploy: Deploy) -> None:
    """A step added after a killed run's position runs under the new code; the event says so."""
    old = deploy.version("v1", V1)
    new = deploy.version("v2", ["plan", "draft", "audit", "send"])
    deploy.kill(old, "draft:0")
    final = deploy.finish(new)
    assert deploy.execs() == ["plan:0", "draft:0", "draft:0", "audit:0", "send:0"]
    assert final["trail"] == ["plan:0", "draft:0", "audit:0", "send:0"]
    assert "step 'audit' added after the run's position: it will run" in deploy.notes()
    assert deploy.header().steps == ("plan", "draft", "audit", "send")


def test_a_step_added_before_the_position_runs_from_the_next_pass(deploy: Deploy) -> None:
    """A step added before the position does not run in this pass, and runs in the next one."""
    old = deploy.version("v1", V1, passes=2)
    new = deploy.version("v2", ["plan", "review", "draft", "send"], passes=2)
    deploy.kill(old, "draft:0")
    final = deploy.finish(new)
    assert final["trail"] == [
        "plan:0",
        "draft:0",
        "send:0",
        "plan:1",
        "review:1",
        "draft:1",
        "send:1",
    ]
    assert deploy.notes() == [
        "step 'review' added before the run's position: it does not run in this pass "
        "(it runs from the next pass)"
    ]


def test_a_step_added_before_the_position_of_a_one_pass_run_says_it_will_not_run(
    deploy: Deploy,
) -> None:
    """Without an until loop, the note says the added step does not run in this run."""
    old = deploy.version("v1", V1)
    new = deploy.version("v2", ["intro", "plan", "draft", "send"])
    deploy.kill(old, "draft:0")
    assert deploy.finish(new)["trail"] == ["plan:0", "draft:0", "send:0"]
    assert "intro:0" not in deploy.execs()
    assert deploy.notes() == [
        "step 'intro' added before the run's position: it does not run in this pass "
        "(new runs run it)"
    ]


def test_a_step_removed_before_the_position_needs_nothing(deploy: Deploy) -> None:
    """A step removed before the position: the run resumes at its step; the event says so."""
    old = deploy.version("v1", ["plan", "enrich", "draft", "send"])
    new = deploy.version("v2", V1)
    deploy.kill(old, "draft:0")
    final = deploy.finish(new)
    assert final["trail"] == ["plan:0", "enrich:0", "draft:0", "send:0"]
    assert deploy.notes() == ["step 'enrich' removed before the run's position: nothing to do"]


def test_a_step_removed_after_the_position_is_skipped(deploy: Deploy) -> None:
    """A removed step the run has not reached never runs."""
    old = deploy.version("v1", ["plan", "draft", "enrich", "send"])
    new = deploy.version("v2", V1)
    deploy.kill(old, "draft:0")
    final = deploy.finish(new)
    assert final["trail"] == ["plan:0", "draft:0", "send:0"]
    assert not any(e.startswith("enrich") for e in deploy.execs())
    assert deploy.notes() == ["step 'enrich' removed after the run's position: it is skipped"]


def test_a_step_renamed_after_the_position_runs_under_its_new_name(deploy: Deploy) -> None:
    """A rename the run has not reached is a removal plus an addition: the new name runs."""
    old = deploy.version("v1", V1)
    new = deploy.version("v2", ["plan", "compose", "send"])
    deploy.kill(old, "plan:0")
    assert deploy.finish(new)["trail"] == ["plan:0", "compose:0", "send:0"]
    assert deploy.notes() == [
        "step 'compose' added after the run's position: it will run",
        "step 'draft' removed after the run's position: it is skipped",
    ]


def test_the_next_step_renamed_raises_and_writes_nothing(deploy: Deploy) -> None:
    """The run's next step gone: WorkflowChanged names it and what to do; the run is untouched."""
    old = deploy.version("v1", V1)
    new = deploy.version("v2", ["plan", "compose", "send"])
    deploy.kill(old, "draft:0")
    before = deploy.snapshot()
    proc = deploy.child(new)
    assert proc.returncode == EXIT_CHANGED
    assert "deploy/r1" in proc.stderr
    assert "next step 'draft' is gone" in proc.stderr
    assert "name it in the new step's renamed_from=" in proc.stderr
    assert "else keep (or restore) that step" in proc.stderr
    assert deploy.snapshot() == before
    assert deploy.finish(old)["trail"] == ["plan:0", "draft:0", "send:0"]  # old code finishes it


def test_steps_reordered_before_the_position_resume(deploy: Deploy) -> None:
    """Steps already committed in this pass may be reordered among themselves."""
    old = deploy.version("v1", ["plan", "enrich", "draft", "send"])
    new = deploy.version("v2", ["enrich", "plan", "draft", "send"])
    deploy.kill(old, "draft:0")
    assert deploy.finish(new)["trail"] == ["plan:0", "enrich:0", "draft:0", "send:0"]


@pytest.mark.parametrize(
    ("steps", "named"),
    [
        (["plan", "draft", "review", "send"], "review"),  # a step still to run moved
        (["plan", "draft", "send", "enrich"], "enrich"),  # a committed step moved after
    ],
    ids=["still-to-run-swapped", "committed-step-after-position"],
)
def test_reordering_the_steps_still_to_run_raises(
    deploy: Deploy, steps: list[str], named: str
) -> None:
    """A new order that would skip or repeat a step of this pass raises, writing nothing."""
    old = deploy.version("v1", ["plan", "enrich", "draft", "send", "review"])
    new = deploy.version("v2", steps)
    deploy.kill(old, "draft:0")
    before = deploy.snapshot()
    proc = deploy.child(new)
    assert proc.returncode == EXIT_CHANGED, proc.stderr
    assert "order of the steps still to run changed" in proc.stderr
    assert f"step {named!r}" in proc.stderr
    assert deploy.snapshot() == before


def test_a_pending_intents_step_removed_raises(deploy: Deploy) -> None:
    """A run killed while a non-idempotent step may be firing: removing that step raises."""
    old = deploy.version("v1", ["plan", "charge!", "send"])
    new = deploy.version("v2", ["plan", "send"])
    deploy.kill(old, "charge:0")
    assert deploy.header().intent is not None
    before = deploy.snapshot()
    proc = deploy.child(new)
    assert proc.returncode == EXIT_CHANGED
    assert "pending intent of step 'charge'" in proc.stderr
    assert "resume the run once with code that still has step 'charge'" in proc.stderr
    assert deploy.snapshot() == before


def test_an_in_doubt_run_resumes_by_name_with_its_persisted_key(deploy: Deploy) -> None:
    """An in-doubt run whose step moved to another index re-fires it with the same key."""
    old = deploy.version("v1", ["plan", "charge?", "send"])
    new = deploy.version("v2", ["intro", "plan", "charge!", "audit", "send"])
    deploy.kill(old, "charge:0")
    assert deploy.child(old).returncode == EXIT_IN_DOUBT  # its policy stops the run
    assert deploy.header().status == "in_doubt"
    final = deploy.finish(new)
    assert final["trail"] == ["plan:0", "charge:0", "audit:0", "send:0"]
    first, again = deploy.keys("charge:0")
    assert again == first  # the persisted key, not one derived from the new index


def test_a_failed_run_resumes_by_name(deploy: Deploy) -> None:
    """A run whose step failed resumes under new code by the same rules."""
    old = deploy.version("v1", V1)
    new = deploy.version("v2", ["plan", "draft", "audit", "send"])
    proc = deploy.child(old, fail="draft:0")
    assert proc.returncode == EXIT_ERROR
    assert "StepFailed" in proc.stderr
    assert deploy.finish(new)["trail"] == ["plan:0", "draft:0", "audit:0", "send:0"]


def test_keys_of_steps_not_yet_fired_follow_their_new_index(deploy: Deploy) -> None:
    """A non-idempotent step after the position gets its key from its new place (not fired yet)."""
    old = deploy.version("v1", ["plan", "draft", "charge!"])
    new = deploy.version("v2", ["plan", "draft", "audit", "charge!"])
    deploy.kill(old, "draft:0")
    deploy.finish(new)
    nonce = deploy.header().run_nonce
    assert deploy.keys("charge:0") == [ckpt.idempotency_key(nonce, 0, 3, "charge")]


# --- versions and migrations ------------------------------------------------------

MIGRATE = """
def migrate(state, old):
    _mark("migrate", state, type("C", (), {"iteration": old, "idempotency_key": "-"}))
    state["trail"].remove(f"migrate:{old}")
    state["schema"] = 2
    state["from"] = old
"""
FAILING_MIGRATE = """
def migrate(state, old):
    state["schema"] = 2
    raise KeyError("customer")
"""


def test_a_migration_runs_once_before_the_first_step_of_the_new_version(deploy: Deploy) -> None:
    """migrate(state, old) upgrades the state first; a crash after it does not migrate again."""
    old = deploy.version("v1", V1, version="1")
    new = deploy.version("v2", V1, version="2", migrate=MIGRATE)
    deploy.kill(old, "draft:0")
    deploy.kill(new, "draft:0")  # the new code migrates, then dies in the step
    assert deploy.header().version == "2"
    final = deploy.finish(new)
    assert final["schema"] == 2
    assert final["from"] == "1"
    assert deploy.execs() == ["plan:0", "draft:0", "migrate:1", "draft:0", "draft:0", "send:0"]
    assert "version '1' -> '2': migrate(state, '1') runs first" in deploy.notes()


def test_a_failed_migration_leaves_the_run_byte_identical(deploy: Deploy) -> None:
    """A migration that raises writes nothing and names the run, both versions and what to do."""
    old = deploy.version("v1", V1, version="1")
    new = deploy.version("v2", V1, version="2", migrate=FAILING_MIGRATE)
    deploy.kill(old, "draft:0")
    before = deploy.snapshot()
    proc = deploy.child(new)
    assert proc.returncode == EXIT_ERROR
    assert "run deploy/r1: migrate(state, '1') to version '2' raised KeyError" in proc.stderr
    assert "Nothing was written" in proc.stderr
    assert "resume the run with the code it was made by (version '1')" in proc.stderr
    assert deploy.snapshot() == before
    assert deploy.execs() == ["plan:0", "draft:0"]


def test_a_new_version_without_migrate_records_the_version(deploy: Deploy) -> None:
    """Another version with no migrate= resumes the state as it is and records the new version."""
    old = deploy.version("v1", V1, version="1")
    new = deploy.version("v2", V1, version="2")
    deploy.kill(old, "draft:0")
    deploy.finish(new)
    assert deploy.header().version == "2"
    assert "no migrate= is given" in deploy.notes()[0]


def test_migrate_needs_a_version_and_two_arguments() -> None:
    """migrate= without version=, or of the wrong signature, is refused at definition."""
    with pytest.raises(ds.DefinitionError, match="needs version="):
        ds.Workflow("w", store=ds.MemoryStore(), migrate=lambda s, v: None)
    with pytest.raises(ds.DefinitionError, match=r"taking \(state, from_version\)"):
        ds.Workflow("w", store=ds.MemoryStore(), version="2", migrate=lambda s: None)

    async def later(state: Any, old: str | None) -> None: ...

    with pytest.raises(ds.DefinitionError, match="plain function"):
        ds.Workflow("w", store=ds.MemoryStore(), version="2", migrate=later)
    with pytest.raises(ds.DefinitionError, match="version must be a string"):
        ds.Workflow("w", store=ds.MemoryStore(), version=2)  # type: ignore[arg-type]


def test_a_checkpoint_without_version_and_code_still_decodes() -> None:
    """A header written before version and code existed decodes, both read as None."""
    wf = ds.Workflow("old", store=ds.MemoryStore(), version="1")
    wf.step(name="a")(lambda s: None)
    wf.submit("r1", {})
    found = wf.store.get(ckpt.checkpoint_key("old", "r1"))
    assert found is not None
    line, _, payload = found[0].partition(b"\n")
    record = json.loads(line)
    assert record["version"] == "1"
    assert set(record["code"]) == {"a"}
    del record["version"], record["code"]
    header, _ = ckpt.decode(json.dumps(record).encode() + b"\n" + payload, where="t")
    assert (header.version, header.code) == (None, None)
    bad = {**record, "code": {"a": "not-hex"}}
    with pytest.raises(ds.CorruptCheckpoint, match="code is not a map"):
        ckpt.decode(json.dumps(bad).encode() + b"\n" + payload, where="t")


# --- code fingerprints ----------------------------------------------------------


def _function(source: str, name: str = "f", lines_before: int = 0) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile("\n" * lines_before + source, f"<file{lines_before}>", "exec"), namespace)
    return namespace[name]


def test_a_fingerprint_is_the_code_not_where_it_lives() -> None:
    """Moving a step (file, line) keeps its fingerprint; a changed constant or call changes it."""
    base = "def f(state):\n    state['n'] = {1, 2, 'x'}\n    return g(state, lambda: 'k')\n"
    assert fingerprint(_function(base)) == fingerprint(_function(base, "f", 40))
    changed = base.replace("'k'", "'j'")  # inside a nested lambda
    assert fingerprint(_function(changed)) != fingerprint(_function(base))
    renamed = base.replace("g(", "h(")
    assert fingerprint(_function(renamed)) != fingerprint(_function(base))
    assert len(fingerprint(_function(base))) == 12


def test_a_fingerprint_is_the_same_in_every_process(tmp_path: Path) -> None:
    """A set constant (ordered by string hashing) fingerprints alike under any hash seed."""
    (tmp_path / "fp.py").write_text("def f(state):\n    return state in {'a', 'b', 'c', 'd'}\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import fp; "
        "from durable_steps._deploys.fingerprints import fingerprint; print(fingerprint(fp.f))"
    )
    prints = {
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3, 4)
    }
    assert len(prints) == 1


def test_show_lists_the_steps_whose_code_changed(deploy: Deploy) -> None:
    """`show --app` names the steps whose code differs from the run's last commit."""
    old = deploy.version("v1", V1)
    new = deploy.version("v2", V1, extra={"draft": 'state["tone"] = "warm"'})
    deploy.kill(old, "draft:0")
    assert set(deploy.header().code or {}) == set(V1)
    shown = deploy.cli(new, "show", "deploy/r1", "--app", "deployapp:wf")
    assert shown.returncode == 0, shown.stderr
    assert "changed since the last commit (by --app): draft" in shown.stdout
    same = deploy.cli(old, "show", "deploy/r1", "--app", "deployapp:wf")
    assert "unchanged since the last commit" in same.stdout
    deploy.finish(new)
    assert "the code of step 'draft' changed since the run's last commit" in deploy.notes()


# --- plan: the pre-deploy check ---------------------------------------------------


def test_plan_reports_every_run_and_exits_4_when_one_would_not_resume(deploy: Deploy) -> None:
    """`plan --all` covers stopped, failed, in-doubt and completed runs, writes nothing, exits 4."""
    old = deploy.version("v1", ["plan", "charge?", "draft", "send"])
    deploy.kill(old, "draft:0", run="stopped")
    assert deploy.child(old, "failed", fail="draft:0").returncode == EXIT_ERROR
    deploy.kill(old, "charge:0", run="doubt")
    assert deploy.child(old, "doubt").returncode == EXIT_IN_DOUBT
    deploy.finish(old, "done")
    new = deploy.version("v2", ["plan", "draft", "audit", "send"])
    before = deploy.snapshot()

    everything = deploy.cli(new, "plan", "--all", "--app", "deployapp:wf")
    assert everything.returncode == 4, everything.stderr
    out = everything.stdout
    assert "deploy/stopped  stopped  resumes at step 'draft' (2 of 4), iteration 0" in out
    assert "deploy/failed  failed  resumes at step 'draft'" in out
    assert "  - step 'audit' added after the run's position: it will run" in out
    assert "  - step 'charge' removed before the run's position: nothing to do" in out
    assert "deploy/doubt  in-doubt  would not resume" in out
    assert "pending intent of step 'charge'" in out
    assert "deploy/done" not in out  # finished runs have nothing to resume
    assert "3 unfinished runs of deploy: 2 resume, 1 would not" in out

    one = deploy.cli(new, "plan", "deploy/stopped", "--app", "deployapp:wf")
    assert one.returncode == 0, one.stderr
    assert deploy.cli(new, "plan", "doubt", "--app", "deployapp:wf").returncode == 4
    done = deploy.cli(new, "plan", "deploy/done", "--app", "deployapp:wf")
    assert (done.returncode, "finished: nothing to run" in done.stdout) == (0, True)
    assert deploy.cli(new, "plan", "deploy/nope", "--app", "deployapp:wf").returncode == 3

    machine = deploy.cli(new, "plan", "--all", "--app", "deployapp:wf", "--json")
    results = {r["run"]: r for r in json.loads(machine.stdout)}
    assert results["deploy/stopped"]["next_step"] == "draft"
    assert results["deploy/doubt"]["resumes"] is False
    assert deploy.snapshot() == before  # plan never writes


def test_plan_reads_a_live_run_without_disturbing_it(deploy: Deploy) -> None:
    """A run a live process owns (stopped mid-step) is planned as running; it then finishes."""
    old = deploy.version("v1", V1)
    proc = deploy.start(old, stop="draft:0")
    try:
        deadline = time.monotonic() + 30
        while "draft:0" not in deploy.execs():
            assert time.monotonic() < deadline, "the child never reached draft"
            time.sleep(0.05)
        new = deploy.version("v2", ["plan", "draft", "audit", "send"])
        before = deploy.snapshot()
        planned = deploy.cli(new, "plan", "deploy/r1", "--app", "deployapp:wf")
        assert planned.returncode == 0, planned.stderr
        assert "deploy/r1  running  resumes at step 'draft' (2 of 4)" in planned.stdout
        assert deploy.snapshot() == before
    finally:
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out)["trail"] == ["plan:0", "draft:0", "send:0"]


def test_plan_exits_0_when_every_run_resumes(deploy: Deploy) -> None:
    """The same code, or a compatible change, plans every run to resume: exit 0."""
    old = deploy.version("v1", V1, version="1")
    deploy.kill(old, "draft:0")
    deploy.kill(old, "draft:0", run="broken")  # listed in the index of runs; damaged below
    same = deploy.cli(old, "plan", "--all", "--app", "deployapp:wf")
    assert same.returncode == 0, same.stderr
    assert "the same steps as the code that made it" in same.stdout
    new = deploy.version("v2", V1, version="2", migrate=MIGRATE)
    planned = deploy.cli(new, "plan", "--all", "--app", "deployapp:wf")
    assert planned.returncode == 0, planned.stderr
    assert "version '1' -> '2': migrate(state, '1') runs first" in planned.stdout
    assert "2 unfinished runs of deploy: 2 resume, 0 would not" in planned.stdout
    broken = ckpt.checkpoint_key(WORKFLOW, "broken")
    found = deploy.store.get(broken)
    assert found is not None
    deploy.store.put(broken, b"not a checkpoint", match=found[1])
    damaged = deploy.cli(new, "plan", "--all", "--app", "deployapp:wf")
    assert damaged.returncode == 1  # unreadable: not a WorkflowChanged, but not fine either
    assert "deploy/broken  corrupt  would not resume" in damaged.stdout


def test_plan_says_what_a_run_would_raise_and_is_right(deploy: Deploy) -> None:
    """What plan predicts for a run is what resuming it does."""
    old = deploy.version("v1", V1)
    deploy.kill(old, "draft:0")
    new = deploy.version("v2", ["plan", "compose", "send"])
    planned = deploy.cli(new, "plan", "deploy/r1", "--app", "deployapp:wf")
    assert planned.returncode == 4
    assert "next step 'draft' is gone" in planned.stdout
    assert deploy.child(new).returncode == EXIT_CHANGED


# --- fork ---------------------------------------------------------------------------


def test_fork_starts_a_new_run_from_the_last_commit(durable_deploy: Deploy) -> None:
    """A fork resumes under new code from the source's state and position, with new keys;
    the source is left byte for byte as it was.
    """
    deploy = durable_deploy
    old = deploy.version("v1", ["plan", "draft", "charge!"])
    deploy.kill(old, "charge:0")
    source_key = deploy.keys("charge:0")[0]
    source = {k: v for k, v in deploy.snapshot().items() if k.startswith(f"{WORKFLOW}/r1/")}
    new = deploy.version("v2", ["plan", "draft", "charge!", "audit"])
    forked = deploy.cli(new, "fork", "deploy/r1", "r2", "--app", "deployapp:wf")
    assert forked.returncode == 0, forked.stderr
    assert "may have fired" in forked.stderr  # the source's intent is not carried over
    header = deploy.header("r2")
    assert header.run_nonce != deploy.header("r1").run_nonce
    assert (header.next_step, header.intent, header.owner) == (2, None, None)
    final = deploy.finish(new, "r2")
    assert final["trail"] == ["plan:0", "draft:0", "charge:0", "audit:0"]
    assert deploy.keys("charge:0")[1] != source_key
    after = {k: v for k, v in deploy.snapshot().items() if k.startswith(f"{WORKFLOW}/r1/")}
    assert after == source
    assert deploy.header("r2").status == "completed"


def test_fork_refuses_an_existing_run_or_a_finished_source(durable_deploy: Deploy) -> None:
    """Forking onto an existing run, or from a finished one, is refused: exit 4, nothing written."""
    deploy = durable_deploy
    old = deploy.version("v1", V1)
    deploy.kill(old, "draft:0")
    deploy.finish(old, "done")
    before = deploy.snapshot()
    taken = deploy.cli(old, "fork", "deploy/r1", "done")
    assert taken.returncode == 4
    assert "run deploy/done already exists" in taken.stderr
    finished = deploy.cli(old, "fork", "deploy/done", "r9")
    assert finished.returncode == 4
    assert "completed" in finished.stderr
    assert deploy.snapshot() == before
    copy = deploy.cli(old, "fork", "deploy/r1", "r3")  # a JSON run needs no --app
    assert copy.returncode == 0, copy.stderr
    assert deploy.finish(old, "r3")["trail"] == ["plan:0", "draft:0", "send:0"]


def test_wf_fork_in_process(tmp_path: Path) -> None:
    """wf.fork copies a failed run's committed state; the source stays failed and intact."""
    store = ds.LocalStore(tmp_path / "s")
    wf = ds.Workflow("f", store=store)
    wf.step(name="a")(lambda s: s.update(a=1))
    wf.step(name="b")(lambda s: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ds.StepFailed):
        wf.run("src", {"big": "x" * 50_000})  # large enough to flush into a format-2 part
    key = ckpt.checkpoint_key("f", "src")
    before = store.get(key)
    fixed = ds.Workflow("f", store=store)
    fixed.step(name="a")(lambda s: s.update(a=2))
    fixed.step(name="b")(lambda s: s.update(b=1))
    fixed.fork("src", "copy")
    assert fixed.run("copy") == {"big": "x" * 50_000, "a": 1, "b": 1}
    assert store.get(key) == before
    with pytest.raises(ds.DurableStepsError, match="already exists"):
        fixed.fork("src", "copy")
    with pytest.raises(ds.DurableStepsError, match="does not exist"):
        fixed.fork("nope", "other")


def test_plan_calls_a_run_with_an_effect_in_doubt_in_doubt_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan` shows a stopped run whose journal holds an effect with an intent and no result
    as in-doubt (as `ls` does), and names the effect, its step, and who decides.
    """
    from durable_steps import cli

    (tmp_path / "doubtapp.py").write_text(
        textwrap.dedent(
            f"""
            import durable_steps as ds
            wf = ds.Workflow("doubt", store=ds.LocalStore({str(tmp_path / "s")!r}))

            @wf.step()
            def turn(state):
                raise RuntimeError("stop here")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import doubtapp  # type: ignore[import-not-found]

    with pytest.raises(ds.StepFailed):
        doubtapp.wf.run("r1", {})
    store = doubtapp.wf.store
    key = ckpt.checkpoint_key("doubt", "r1")
    data, version = store.get(key)
    header, payload = ckpt.decode(data, where=key)
    journal = {"step": "turn", "iteration": 0, "calls": 0, "open": []}
    journal["open"] = [{"name": "refund", "key": "ds-" + "0" * 40, "at": 1.0, "policy": "refire"}]
    stopped = header.replace(status="running", owner=None, error=None, journal=journal)
    store.put(key, ckpt.encode(stopped, payload), match=version)  # a killed owner's last write

    assert cli.main(["--store", str(tmp_path / "s"), "plan", "--all", "--app", "doubtapp:wf"]) == 0
    out = capsys.readouterr().out
    assert "doubt/r1  in-doubt  resumes at step 'turn'" in out
    assert "effect 'refund' of step 'turn' may have fired" in out
