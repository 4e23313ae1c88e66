"""The web page against what issue 36's review reproduced: a run a SIGKILL left with
only its ``running`` marker is listed as ``ls`` lists it, and a confirmation acts only
on the run it was shown for. A real uvicorn server, real requests, a real SIGKILL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")
pytest.importorskip("uvicorn", reason="the ui extra is not installed")

import durable_steps as ds
from durable_steps.cli import _main
from durable_steps.ui import _listing
from tests.test_ui_http import fetch, serve  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "indexchild.py"
pytestmark = pytest.mark.ui
DIE_BEFORE_DONE = ("--at", "put:_index/done/")


def _ls(store: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert _main.main(["--store", str(store), "ls", "--json", *args]) == 0
    return list(json.loads(capsys.readouterr().out))


def test_a_run_killed_before_its_done_entry_is_listed_as_ls_lists_it(
    serve: Any,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGKILL after a run's completed head, before its done entry (tests/indexchild.py
    dies before its PUT under _index/done/): only its `running` marker is left. The
    page lists it as completed, as `ls` does: in the list, under ?status=completed,
    and in the counts."""
    from tests.indexchild import prepare

    where = tmp_path / "s"
    store = ds.LocalStore(where)
    prepare(store, "wake")  # a waiting run, signalled: the child resumes it to its end
    killed = subprocess.run(
        [sys.executable, str(CHILD), "--store", str(where), "--op", "wake", *DIE_BEFORE_DONE],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )
    assert killed.returncode == -9, killed.stderr
    assert not list(store.list("_index/done/"))
    left = [i.key.rsplit("/", 1)[1] for i in store.list("_index/live/desk/r/")]
    assert sorted(k.split("-")[0] for k in left) == ["running", "signal"]  # its nudge too
    assert [(r["run_id"], r["status"]) for r in _ls(where, capsys=capsys)] == [("r", "completed")]

    listing = _listing.list_runs(store)
    assert [(r.run_id, r.status) for r in listing.rows] == [("r", "completed")]
    assert listing.counts == {"completed": "1"}
    app = serve(store)
    _, _, body = fetch(app.url + "/api/runs?status=completed")
    shown = json.loads(body)
    assert [(r["run_id"], r["status"]) for r in shown["rows"]] == [("r", "completed")]
    assert shown["counts"] == {"completed": "1"}
    _, _, body = fetch(app.url + "/api/runs?status=running")
    assert json.loads(body)["rows"] == []
    _, _, html = fetch(app.url + "/")
    assert "/runs/desk/r" in html
