"""ls/prune sizes and rm/prune of format-2 runs (a head and its parts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps import cli
from durable_steps._fleet.signals import signal_key
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import format2 as f2
from durable_steps.cli import _cleanup
from durable_steps.cli._base import EXIT_NOT_FOUND
from durable_steps.cli._format import human_size


def grown(url: str, run_id: str, steps: int = 60) -> ds.Store:
    """A completed format-2 run of ``steps`` 2 KB messages (so it has parts)."""
    store = ds.open_store(url)
    wf = ds.Workflow("chat", store=store, until=lambda s: len(s["messages"]) >= steps)

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["messages"].append({"content": f"{len(state['messages']):06d}" + "x" * 2042})

    wf.run(run_id, {"messages": []})
    return store


def objects(store: ds.Store, run_id: str) -> dict[str, int]:
    return {i.key: i.size for i in store.list(f"chat/{run_id}/")}


def test_ls_and_prune_sizes_count_the_head_and_its_parts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A format-2 run's SIZE is its head plus the parts the head lists (sizes
    the head holds), not the head alone: here every byte of the run.
    """
    url = str(tmp_path / "s")
    store = grown(url, "r")
    stored = objects(store, "r")
    assert len(stored) >= 2  # the head and at least one part
    assert cli.main(["--store", url, "ls", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["size"] == sum(stored.values())
    assert cli.main(["--store", url, "show", "chat/r", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    # The same total as ls, and the head's own bytes beside it.
    head = stored["chat/r/checkpoint"]
    assert (shown["size"], shown["head_size"]) == (sum(stored.values()), head)
    assert cli.main(["--store", url, "prune", "--completed", "--older-than", "0s"]) == 0
    assert human_size(sum(stored.values())) in capsys.readouterr().out


def test_rm_counts_parts_not_signals_of_a_run_whose_head_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """rm of a run with no head and no parts, only a signal left: the signal is
    deleted, and the run is reported not found (exit 3), not as parts deleted.
    """
    url = str(tmp_path / "s")
    store = ds.open_store(url)
    wf = ds.Workflow("chat", store=store, until=lambda s: "answer" in s)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["answer"] = ctx.wait_for("approval")

    with pytest.raises(ds.RunSuspended):
        wf.run("r", {})
    assert wf.signal("r", "approval", True)
    store.delete(ckpt.checkpoint_key("chat", "r"))  # small state: no parts
    assert list(objects(store, "r")) == [signal_key("chat", "r", "approval")]
    assert cli.main(["--store", url, "rm", "chat/r"]) == EXIT_NOT_FOUND
    assert "part(s)" not in capsys.readouterr().out
    assert objects(store, "r") == {}


KILLED_RM = """
import os, signal, sys
import durable_steps as ds
from durable_steps import cli
from durable_steps.cli import _cleanup
from durable_steps.cli._format import human_size
from durable_steps.stores import local
delete = local.LocalStore.delete
def dying(self, key, *, match=None):
    if "/parts/" in key:  # the head is deleted: die before its first part is
        os.kill(os.getpid(), signal.SIGKILL)
    delete(self, key, match=match)
local.LocalStore.delete = dying
sys.exit(cli.main(sys.argv[1:]))
"""


def killed_while_deleting(url: str, *argv: str) -> None:
    """Run the CLI in a child that is SIGKILLed between a run's head and its parts."""
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RM, "--store", url, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def age(store_dir: Path, seconds: float) -> None:
    """Make every object under ``store_dir`` look ``seconds`` old."""
    then = time.time() - seconds
    for path in store_dir.rglob("*"):
        os.utime(path, (then, then), follow_symlinks=False)


@pytest.mark.parametrize("command", ["rm", "prune", "prune-unindexed"])
def test_a_delete_killed_between_the_head_and_its_parts_leaves_nothing_unreadable(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """rm and prune delete the head first: SIGKILLed before the parts, they
    leave no head that lists missing parts, and the parts they leave are found
    and deleted by the next rm of that run or the next prune (through the index
    entry they delete last).
    """
    url = str(tmp_path / "s")
    store = grown(url, "r")
    if command == "prune-unindexed":  # a store written before the index: prune lists all
        store.delete("_index/workflows/chat/flat")
        store.delete("_index/flat-complete")
    argv = ["rm", "chat/r"] if command == "rm" else ["prune", "--completed"]
    killed_while_deleting(url, *argv, *(["--older-than", "0s", "--yes"] * (command != "rm")))
    assert store.get(ckpt.checkpoint_key("chat", "r")) is None
    left = objects(store, "r")
    assert left
    assert all(f2.parts_prefix("chat", "r") in k for k in left)
    assert cli.main(["--store", url, "ls"]) == 0  # no run shown: nothing half-readable
    assert "chat" not in capsys.readouterr().out

    if command == "rm":
        assert cli.main(["--store", url, "rm", "chat/r"]) == 0
        assert f"deleted {len(left)} part(s) left of run chat/r" in capsys.readouterr().out
    elif command == "prune-unindexed":
        prune = ["--store", url, "prune", "--completed", "--older-than", "0s", "--yes"]
        assert cli.main(prune) == 0  # too young: may be a run being created
        assert objects(store, "r") == left
        age(tmp_path / "s", 2 * _cleanup.LEFTOVER_AGE)
        assert cli.main(prune) == 0
        assert f"deleted {len(left)} part(s) left of 1 deleted run(s)" in capsys.readouterr().out
    else:
        # The run's done entry, deleted last, leads prune to what the kill left —
        # once its parts are LEFTOVER_AGE old: a new run created under the id after
        # prune's GET would write parts that young before its head.
        prune = ["--store", url, "prune", "--completed", "--older-than", "0s", "--yes"]
        assert cli.main(prune) == 0
        assert "kept what is left of 1 deleted run(s) for now: chat/r" in capsys.readouterr().err
        assert objects(store, "r") == left
        age(tmp_path / "s", 2 * _cleanup.LEFTOVER_AGE)
        assert cli.main(prune) == 0
        assert "deleted what was left of 1 deleted run(s): chat/r" in capsys.readouterr().out
        assert not list(store.list("_index/done/"))
    assert objects(store, "r") == {}


_KILL_AT_PART_LINK = r"""
import os, re, sys
import durable_steps as ds
from tests.test_format2_cleanup import chat_workflow

real = os.symlink
def symlink(src, dst, *args, **kwargs):
    if re.fullmatch(r"\.tmp-\d+-[0-9a-f]{16}-[0-9a-f]{12}", dst):  # a part's temporary link
        os.kill(os.getpid(), 9)
    return real(src, dst, *args, **kwargs)
os.symlink = symlink
chat_workflow(ds.LocalStore(sys.argv[1]), 60, sys.argv[3]).run(sys.argv[2], {"messages": []})
"""


def chat_workflow(store: ds.Store, steps: int, on_complete: str) -> ds.Workflow:
    """:func:`grown`'s workflow, for a child process."""
    wf = ds.Workflow(
        "chat", store=store, until=lambda s: len(s["messages"]) >= steps, on_complete=on_complete
    )

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["messages"].append({"content": f"{len(state['messages']):06d}" + "x" * 2042})

    return wf


@pytest.mark.parametrize("cleanup", ["rm", "prune", "on_complete=delete"])
def test_a_part_killed_before_its_link_leaves_no_file_after_cleanup(
    tmp_path: Path, cleanup: str
) -> None:
    """SIGKILL between a part's data file and its link leaves a file no key names:
    rm, prune and the tombstone of on_complete="delete" remove it and the run's
    directories with it.
    """
    root = tmp_path / "store"
    on_complete = "delete" if cleanup == "on_complete=delete" else "mark"
    child = subprocess.run(
        [sys.executable, "-c", _KILL_AT_PART_LINK, str(root), "r1", on_complete],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    leftovers = [p.name for p in (root / "chat" / "r1" / "parts").iterdir()]
    assert leftovers
    assert all(name.startswith(".") for name in leftovers)  # files no key lists
    store = ds.LocalStore(root)
    chat_workflow(store, 60, on_complete).run("r1")
    if cleanup == "rm":
        assert cli.main(["--store", str(root), "rm", "chat/r1"]) == 0
    elif cleanup == "prune":
        assert (
            cli.main(["--store", str(root), "prune", "--completed", "--older-than", "0s", "--yes"])
            == 0
        )
    parts = root / "chat" / "r1" / "parts"
    assert not parts.exists(), sorted(p.name for p in parts.iterdir())
    if cleanup != "on_complete=delete":
        assert not (root / "chat" / "r1").exists()


@pytest.mark.parametrize(
    "crash",
    [
        "after-part:1:0",
        "before-drop:1:0",
        pytest.param("after-part:4:0", marks=pytest.mark.matrix),
        pytest.param("after-part:7:0", marks=pytest.mark.matrix),
        pytest.param("before-drop:3:0", marks=pytest.mark.matrix),
        pytest.param("after-commit:send:2", marks=pytest.mark.matrix),
    ],
)
@pytest.mark.parametrize(
    "durable_target", ["local", pytest.param("seaweedfs", marks=pytest.mark.s3)], indirect=True
)
def test_a_run_that_completes_after_a_crash_leaves_only_what_its_head_lists(
    durable_target: Any, tmp_path: Path, crash: str
) -> None:
    """SIGKILL at a part, a drop or a commit, then the run resumed to completion: the
    store holds the head and the parts it lists, nothing else (on local, no file of a
    killed write either)."""
    from tests.test_format2 import child, workflow_name

    assert child(durable_target, tmp_path, crash).returncode == -signal.SIGKILL
    assert child(durable_target, tmp_path, None).returncode == 0
    store = durable_target.open()
    try:
        name = workflow_name("plain")
        found = store.get(ckpt.checkpoint_key(name, "r1"))
        assert found is not None
        header, _ = ckpt.decode(found[0], where="test")
        assert header.status == "completed"
        listed = {f"{name}/r1/checkpoint"} | {
            f2.parts_prefix(name, "r1") + part["name"] for part in header.parts
        }
        assert {info.key for info in store.list(f"{name}/r1/")} == listed
    finally:
        store.close()
    if durable_target.kind == "local":
        root = Path(durable_target.url) / name / "r1"
        on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        hidden = {p for p in on_disk if p.rpartition("/")[2].startswith(".")}
        links = {os.readlink(root / k.split("/", 2)[2]) for k in listed}
        assert {h.rpartition("/")[2] for h in hidden} == links  # each link's own file only
