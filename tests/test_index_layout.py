"""The flat layout of the live index (``_index/live2/<workflow>/<run_id>~<entry>``).

No folder per run: a store that keeps a directory per key prefix (SeaweedFS's filer)
would keep one, empty, for every run that ever lived, and the scan's LIST would walk
them all. A store in the earlier layout (a folder per run under ``_index/live/``) is
still found — by listing every run — until ``reindex`` moves it, reading only the
runs that were live. A long run id keeps a folder; a long signal name is hashed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._fleet import index as _index
from durable_steps.cli._indexed import covered
from durable_steps.stores import ObjectInfo
from tests.conftest import StoreTarget, _target
from tests.test_index import Counting, cli, consistent, desk, entries, head


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


def to_earlier_layout(store: ds.Store) -> None:
    """The store as the release before the flat layout leaves it: a folder per run
    under ``_index/live/``, the registry saying ``indexed`` and ``_index/complete``."""
    for info in list(store.list(_index.LIVE)):
        entry = _index.parse(info)
        assert entry is not None, info.key
        name = info.key.rpartition("/")[2].partition("~")[2]
        store.put(f"{_index.OLD_LIVE}{entry.workflow}/{entry.run_id}/{name}", b"")
        store.delete(info.key)
    for info in list(store.list(_index.registry_key())):
        if info.key.endswith("/flat"):
            store.put(info.key.removesuffix("/flat") + "/indexed", b"")
            store.delete(info.key)
    store.delete(_index.COMPLETE)
    store.put(_index.OLD_COMPLETE, b"")


def test_a_store_in_the_earlier_layout_is_found_and_reindex_reads_only_its_live_runs(
    target: StoreTarget, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from durable_steps.cli import _main

    store = target.open()
    wf = desk(store)
    for i in range(4):
        wf.run(f"done-{i}", {})
    wf.submit("r-queued", {})
    for run_id in ("r-wait", "r-hold"):
        with pytest.raises(ds.RunSuspended):
            wf.run(run_id, {"wait": True})
    assert wf.signal("r-wait", "approval", "go")  # its nudge moves with it
    to_earlier_layout(store)
    assert any(k.startswith(_index.OLD_LIVE) for k in entries(store))
    assert not covered(store, None)
    assert not covered(store, "desk")

    with caplog.at_level(logging.WARNING, logger="durable_steps"):
        assert sorted(ds.Worker(desk(store)).claimable()) == ["r-queued", "r-wait"]
    assert "reindex --workflow desk" in caplog.text  # found by listing every run
    shown = cli(target, "ls")
    assert "reindex" in shown.stderr
    assert len(shown.stdout.splitlines()) == 1 + 7

    counting = Counting(store)
    monkeypatch.setattr(_main, "open_store", lambda _url: counting)
    assert _main.main(["--store", target.url, "reindex"]) == 0
    assert counting.calls["get"] == 3, counting.calls  # the live runs' heads, no other
    assert not [k for k in entries(store) if k.startswith(_index.OLD_LIVE)]
    assert _index.OLD_COMPLETE not in {i.key for i in store.list(_index.ROOT)}
    assert covered(store, None)
    consistent(store)

    report = ds.Worker(desk(store), poll=0.05).run(until_idle=True)
    assert sorted(report.completed) == ["r-queued", "r-wait"]
    assert head(store, "desk", "r-hold").status == "waiting"
    consistent(store)


def test_reindex_of_one_workflow_in_the_earlier_layout_moves_it(target: StoreTarget) -> None:
    store = target.open()
    wf = desk(store)
    wf.run("done", {})
    wf.submit("queued", {})
    to_earlier_layout(store)
    done = cli(target, "reindex", "--workflow", "desk")
    assert done.returncode == 0, done.stderr
    assert "1 moved from the earlier layout" in done.stdout
    assert covered(store, "desk")
    assert ds.Worker(desk(store)).claimable() == ["queued"]
    consistent(store)


def test_runs_live_and_finished_leave_no_folder_per_run_under_live(
    target: StoreTarget, tmp_path: Path
) -> None:
    """Every live entry is a name directly under its workflow's prefix, whatever class
    the run is in; once the runs finish nothing is left under live at all (on the
    local store: not even a folder)."""
    store = target.open()
    wf = desk(store)
    for i in range(12):
        wf.submit(f"r-{i}", {"wait": i % 3 == 0})
    with pytest.raises(ds.RunSuspended):
        wf.run("held", {"wait": True})
    assert wf.signal("held", "approval", "go")

    def shapes() -> set[int]:
        return {len(i.key.split("/")) for i in store.list(_index.LIVE)}

    assert shapes() == {4}
    ds.Worker(desk(store), poll=0.05).run(until_idle=True)
    assert shapes() == {4}  # the ones waiting now
    for i in range(0, 12, 3):
        assert wf.signal(f"r-{i}", "approval", "go")
    report = ds.Worker(desk(store), poll=0.05).run(until_idle=True)
    assert len(report.completed) == 4
    assert not list(store.list(_index.LIVE))
    assert not list(store.list(_index.OLD_LIVE))
    if target.kind == "local":
        live = Path(target.url) / "_index" / "live2"
        assert not [d for d, _, _ in os.walk(live) if Path(d) != live and Path(d).parent != live]


def test_a_long_run_id_keeps_a_folder_and_a_long_signal_name_is_hashed(tmp_path: Path) -> None:
    """File names stay within 255 bytes on the local store: a run id over LONG_RUN_ID
    characters keeps a folder, a 190-character signal name appears as its token; both
    runs are woken. (170: a done entry, whose name holds the run id, fits in 255 bytes
    with the local store's data file prefix only up to about 178.)"""
    store = ds.LocalStore(tmp_path)
    wf = ds.Workflow("desk", store=store)
    signal = "s" * 190  # about the longest wait_for takes

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = ctx.wait_for(signal)

    long_id, flat_id = "L" * 170, "F" * _index.LONG_RUN_ID
    for run_id in (long_id, flat_id):
        with pytest.raises(ds.RunSuspended):
            wf.run(run_id, {})
        assert wf.signal(run_id, signal, run_id[0])
    keys = [i.key for i in store.list(_index.LIVE)]
    token = _index.signal_token(signal)
    assert token.startswith("_")
    assert len(token) == 13
    assert all(token in k and signal not in k for k in keys)
    assert {len(k.split("/")) for k in keys if long_id in k} == {5}  # a folder
    assert {len(k.split("/")) for k in keys if flat_id in k} == {4}
    assert all(len(k.rpartition("/")[2].encode()) <= 255 - len(".v--") - 32 for k in keys)
    for key in keys:
        entry = _index.parse(ObjectInfo(key, "v", 0, 0))
        assert entry is not None
        assert entry.run_id in (long_id, flat_id)
    report = ds.Worker(wf, poll=0.05).run(until_idle=True)
    assert sorted(report.completed) == sorted([long_id, flat_id])
    assert wf.run(long_id) == {"got": "L"}
    assert not list(store.list(_index.LIVE))


@pytest.mark.parametrize("workflow", ["parts", "signals", "history"])
def test_prune_takes_no_index_entry_for_a_leftover_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workflow: str
) -> None:
    """A flat entry is ``_index/live2/<workflow>/<name>``: with a workflow named like a
    run's folder of parts, prune's whole-store listing (a store the index does not
    cover) must not take it for the part of a run with no head."""
    from durable_steps.cli import _cleanup, _main

    store = ds.LocalStore(tmp_path)
    wf = ds.Workflow(workflow, store=store)
    wf.step(name="one")(lambda state: None)
    wf.submit("r", {})
    store.delete(_index.COMPLETE)  # not covered: prune lists every key
    before = sorted(entries(store))
    assert before
    monkeypatch.setattr(_cleanup, "LEFTOVER_AGE", 0.0)
    prune = ["--store", str(tmp_path), "prune", "--completed", "--older-than", "0s", "--yes"]
    assert _main.main(prune) == 0
    assert sorted(entries(store)) == before
    assert ds.Worker(wf).claimable() == ["r"]


@pytest.fixture(autouse=True)
def _forget_registrations() -> Iterator[None]:
    _index._REGISTERED.clear()
    yield
    _index._REGISTERED.clear()
