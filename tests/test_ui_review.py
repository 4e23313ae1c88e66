"""The web page against what issue 36's review reproduced: a run a SIGKILL left with
only its ``running`` marker is listed as ``ls`` lists it, and a confirmation acts only
on the run it was shown for. A real uvicorn server, real requests, a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")
pytest.importorskip("uvicorn", reason="the ui extra is not installed")

import durable_steps as ds
from durable_steps._fleet import index as _index
from durable_steps.cli import _main
from durable_steps.cli._runs import load
from durable_steps.ui import _listing
from tests.test_ui_http import fetch, message, serve  # noqa: F401 (a fixture)

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
    left = [i.key.rsplit("~", 1)[1] for i in store.list(_index.live_prefix("desk", "r"))]
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


def _waiting(store: ds.Store, run_id: str = "r") -> str:
    """A run of desk waiting for 'approval'; its nonce."""
    from tests.indexchild import desk

    with pytest.raises(ds.RunSuspended):
        desk(store).run(run_id, {"wait": True})
    return load(store, "desk", run_id)[0].run_nonce


def _recreated(store: ds.LocalStore) -> str:
    """desk/r deleted and created again under the same id (another nonce)."""
    assert _main.main(["--store", str(store.root), "rm", "desk/r", "--force"]) == 0
    return _waiting(store)


@pytest.mark.parametrize("action", ["delete", "fork", "signal"])
def test_yes_acts_only_on_the_run_it_was_confirmed_for(
    serve: Any,  # noqa: F811
    tmp_path: Path,
    action: str,
) -> None:
    """The run page's delete, fork and signal forms carry the run's nonce. An id
    deleted and created again between "confirm" and "yes": "yes" does nothing to the
    new run and says the run changed since you confirmed; a confirmation asked for the
    old page's form is refused too."""
    store = ds.LocalStore(tmp_path / "s")
    old = _waiting(store)
    app = serve(store)
    _, _, html = fetch(app.url + "/runs/desk/r")
    assert f'name="nonce" value="{old}"' in html
    fields = {"action": action, "workflow": "desk", "run_id": "r", "token": app.config.token}
    fields.update(nonce=old, signal="approval", payload='{"approved": true}', new_run="f")
    code, _, confirm = fetch(app.url + "/actions", fields)
    assert code == 200
    assert 'name="confirm" value="yes"' in confirm
    new = _recreated(store)
    assert new != old
    code, _, body = fetch(app.url + "/actions", {**fields, "confirm": "yes"})
    assert code == 409, body
    assert "changed since you confirmed" in message(body)
    assert load(store, "desk", "r")[0].run_nonce == new
    assert store.get("desk/f/checkpoint") is None
    assert not list(store.list("desk/r/signals/"))
    code, _, body = fetch(app.url + "/actions", fields)  # the old page's form, again
    assert code == 409
    assert "changed since its page was shown" in message(body)
    code, _, body = fetch(app.url + "/actions", {**fields, "nonce": "", "confirm": "yes"})
    assert code == 400
    assert "which run it was shown for" in message(body)
    code, _, body = fetch(app.url + "/actions", {**fields, "nonce": new, "confirm": "yes"})
    assert code == 200, body  # the new run's own page acts on it


REPLY = """
import os, sys
import durable_steps as ds
wf = ds.Workflow("support", store=sys.argv[1])
@wf.step(idempotent=False, in_doubt="raise")
def reply(state):
    state["sent"] = True  # the email went out
    if os.environ.get("CRASH"):
        os._exit(17)  # killed after the send, before the commit
    state["done"] = True
try:
    wf.run("t1", {})
except ds.StepInDoubt:
    print("IN DOUBT")
"""


def test_resolving_a_step_as_fired_says_its_changes_to_the_state_are_lost(
    serve: Any,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A step (idempotent=False, in_doubt="raise") killed after its side effect: where
    the person decides whether it fired -- show's hint, the page's resolve form and its
    confirmation, resolve's own message -- it is said that --fired drops the step's
    changes to the state, pointing to ctx.effect and reconcile=."""
    script = tmp_path / "reply.py"
    script.write_text(REPLY)
    where = str(tmp_path / "s")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for crash in ("1", ""):
        done = subprocess.run(
            [sys.executable, str(script), where],
            env={**env, "CRASH": crash},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == (17 if crash else 0), done.stderr
    assert done.stdout.strip() == "IN DOUBT"

    def said(text: str) -> None:
        flat = " ".join(text.split())
        for words in ("changes to the state are lost", "ctx.effect", "reconcile="):
            assert words in flat, flat

    assert _main.main(["--store", where, "show", "support/t1"]) == 0
    said(capsys.readouterr().out)
    store = ds.LocalStore(tmp_path / "s")
    app = serve(store)
    _, _, html = fetch(app.url + "/runs/support/t1")
    note = re.search(r'id="fired-note">(.*?)</p>', html, re.S)
    assert note, html
    said(note[1])
    keys = re.search(r'name="doubt" value="([^"]+)"', html)
    assert keys
    nonce = load(store, "support", "t1")[0].run_nonce
    fields = {"action": "resolve", "workflow": "support", "run_id": "t1", "fired": "yes"}
    fields.update(token=app.config.token, nonce=nonce, doubt=keys[1].replace("&#34;", '"'))
    code, _, confirm = fetch(app.url + "/actions", fields)
    assert code == 200
    said(confirm)
    assert _main.main(["--store", where, "resolve", "support/t1", "--fired"]) == 0
    said(capsys.readouterr().out)


def test_an_effect_in_doubt_gets_no_such_note(serve: Any, tmp_path: Path) -> None:  # noqa: F811
    """Resolving an effect as fired re-runs its step (ctx.effect returns the result):
    nothing is lost, and the form says nothing of it."""
    from tests.test_ui_http import pay

    pay(tmp_path, crash="A")
    app = serve(ds.LocalStore(tmp_path / "s"))
    _, _, html = fetch(app.url + "/runs/pay/o1")
    assert 'id="resolve-form"' in html
    assert 'id="fired-note"' not in html
