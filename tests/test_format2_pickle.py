"""Format-2 pickle states that must resume anywhere: classes of the running script
stored by value (as cloudpickle does for format 1), every decode failure a
``CorruptCheckpoint`` naming the run and the record, and a run killed around the
compaction of its transcript ending the size of the same run uncrashed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps import cli
from durable_steps._record import checkpoint as ckpt
from tests.conftest import StoreTarget
from tests.storetools import committed

ONE_S3 = pytest.param("seaweedfs", marks=pytest.mark.s3)
CLI = (sys.executable, "-m", "durable_steps", "--store")

AGENT = textwrap.dedent(
    """
    import os
    import signal
    from dataclasses import dataclass

    import durable_steps as ds

    @dataclass
    class Note:
        text: str

    wf = ds.Workflow(
        "notes", store=os.environ["AGENT_STORE"], serializer="pickle",
        until=lambda s: s["i"] >= 5,
    )

    @wf.step()
    def turn(state):
        state["i"] += 1
        state["notes"].append(Note(f"note {state['i']}"))
        state["last"] = Note("last")
        if state["i"] == 4 and __name__ == "__main__":  # the script dies in its 4th step
            os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        wf.run("r1", {"i": 0, "doc": "d" * 20_000, "notes": [], "last": None})
    """
)


def _agent(tmp_path: Path, target: StoreTarget) -> tuple[Path, dict[str, str]]:
    """The agent script in its own directory, and the environment to run it."""
    home = tmp_path / "app"
    home.mkdir()
    (home / "agent.py").write_text(AGENT)
    env = target.child_env()
    env["AGENT_STORE"] = target.url
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    return home, env


def _started_as_a_script(home: Path, env: dict[str, str]) -> None:
    killed = subprocess.run(
        [sys.executable, "agent.py"],
        cwd=home,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr


@pytest.mark.slow  # two processes, and a worker polling the store
@pytest.mark.parametrize("durable_target", ["local", ONE_S3], indirect=True)
def test_a_run_started_as_a_script_is_resumed_by_a_worker_importing_it(
    durable_target: StoreTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python agent.py`` commits three steps of a big pickle state holding instances of
    a class the script defines (so in ``__main__``), written as change records, then is
    killed. ``durable-steps worker --app agent:wf`` (which imports ``agent``, not
    ``__main__``) resumes it to the end; before, its records named ``__main__.Note``
    and the resume failed with ``AttributeError``.
    """
    home, env = _agent(tmp_path, durable_target)
    _started_as_a_script(home, env)
    store = durable_target.open()
    try:
        header, _ = ckpt.decode(
            store.get(ckpt.checkpoint_key("notes", "r1"))[0],  # type: ignore[index]
            where="test",
        )
        assert (header.committed, header.format) == (3, 2)  # three steps, in format 2
        worker = subprocess.run(
            [*CLI, durable_target.url, "worker", "--app", "agent:wf", "--until-idle"],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert worker.returncode == 0, worker.stderr
        monkeypatch.syspath_prepend(str(home))  # the worker's steps stored agent.Note
        monkeypatch.setenv("AGENT_STORE", durable_target.url)
        monkeypatch.delitem(sys.modules, "agent", raising=False)
        header, state = committed(store, ckpt.checkpoint_key("notes", "r1"))
        assert header.status == "completed", worker.stderr
        assert [n.text for n in state["notes"]] == [f"note {i}" for i in range(1, 6)]
    finally:
        store.close()


def test_show_state_decodes_a_script_s_classes_in_another_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show --state --unsafe-unpickle`` in a process that never imported the script
    decodes the records of its ``__main__`` classes (stored by value).
    """
    target = StoreTarget("local", str(tmp_path / "store"))
    home, env = _agent(tmp_path, target)
    _started_as_a_script(home, env)
    shown = subprocess.run(
        [*CLI, target.url, "show", "notes/r1", "--state", "--unsafe-unpickle"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert "note 3" in shown.stdout


# --- decode failures -------------------------------------------------------------


class Moved:
    """A class a deploy will move (its pickles name ``tests...Moved``)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _notes(store: ds.Store, steps: int) -> ds.Workflow:
    wf = ds.Workflow("moved", store=store, serializer="pickle", until=lambda s: s["i"] >= steps)

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["i"] += 1
        state["notes"].append(Moved(f"note {state['i']}"))

    return wf


@pytest.mark.parametrize("durable_target", ["local", ONE_S3], indirect=True)
@pytest.mark.parametrize("where", ["record", "base"])
def test_a_class_moved_by_a_deploy_fails_a_resume_with_corrupt_checkpoint(
    durable_target: StoreTarget, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A class renamed after the run was saved (in a change record of the tail, or in a
    base part): the resume raises ``CorruptCheckpoint`` naming the run, the object (which
    part or record) and what to do, never a bare ``AttributeError``; the run is untouched.
    """
    store = durable_target.open()
    try:
        initial = {"i": 0, "notes": [Moved("first")], "doc": "d" * 40_000}
        if where == "record":  # the base is the initial state: no Moved after it there...
            initial["notes"] = []
        _notes(store, 3).run("r1", initial)
        key = ckpt.checkpoint_key("moved", "r1")
        before = store.get(key)
        assert before is not None
        monkeypatch.delattr(sys.modules[__name__], "Moved")
        with pytest.raises(ds.CorruptCheckpoint) as caught:
            _notes(store, 6).run("r1", None)
        message = caught.value.message
        assert caught.value.run == "moved/r1"
        assert "Moved" in message
        assert "AttributeError" in message
        assert ("record 0 of the tail" if where == "record" else "its base part") in message
        assert "migrate" in message
        assert "old name" in message
        assert store.get(key) == before, "the run was left untouched"
    finally:
        store.close()


def test_show_state_of_a_moved_class_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show --state`` gives the same error (exit code, no traceback)."""
    url = str(tmp_path / "s")
    _notes(ds.open_store(url), 3).run("r1", {"i": 0, "notes": [], "doc": "d" * 40_000})
    monkeypatch.delattr(sys.modules[__name__], "Moved")
    code = cli.main(["--store", url, "show", "moved/r1", "--state", "--unsafe-unpickle"])
    assert code != 0
    err = capsys.readouterr().err
    for said in ("moved/r1", "record 0 of the tail", "migrate"):
        assert said in err


# --- a crash around the compaction of a transcript ------------------------------------

COMPACT_CHILD = Path(__file__).parent / "compactchild.py"


def _compact_child(target: StoreTarget, run: str, crash: str | None) -> Any:
    cmd = [sys.executable, str(COMPACT_CHILD), "--store", target.url, "--run", run]
    done = subprocess.run(
        cmd + (["--crash", crash] if crash else []),
        env=target.child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if crash:
        assert done.returncode == -9, done.stderr
        return None
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow  # three child runs of 30 steps each
@pytest.mark.parametrize(
    ("durable_target", "crash"),
    [
        ("local", "inside:turn:25"),
        ("local", "before-commit:turn:25"),
        pytest.param("seaweedfs", "inside:turn:25", marks=pytest.mark.s3),
    ],
    indirect=["durable_target"],
)
def test_a_run_killed_while_compacting_ends_the_size_of_an_uncrashed_one(
    durable_target: StoreTarget, crash: str
) -> None:
    """A pickle agent whose 50 KB transcript (each reply a journaled call) is compacted to
    a 4.4 KB summary, SIGKILLed in the compaction's step (after its summary is recorded)
    or just before its commit, then resumed: it ends in the uncrashed run's state and
    size. Before, the resume counted its parts (58 KB, journaled calls included) as the
    state's size, so the compaction did not make it small: 12 times the size.
    """
    uncrashed = _compact_child(durable_target, "u", None)
    _compact_child(durable_target, "c", crash)
    resumed = _compact_child(durable_target, "c", None)
    assert resumed["state"] == uncrashed["state"]
    assert resumed["size"] <= uncrashed["size"] * 1.05, (resumed["size"], uncrashed["size"])
