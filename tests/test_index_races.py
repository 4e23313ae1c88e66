"""The index of runs under races a hostile review found: each driven in its bad order.

Every test here fails without its fix: a reader's repair that met a run changing class,
a scan that met a run created under a reused id, a scan that met a creation between its
marker and its head, a crash that left a done entry stale (or none), a deleted run's
marker judged by its name forever, a partial workflow with no runs left.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import index as _index
from durable_steps._fleet import listing
from durable_steps._record import checkpoint as ckpt
from durable_steps.cli._indexed import covered
from durable_steps.stores import ObjectInfo
from tests.conftest import StoreTarget, _target
from tests.test_index import CHILD, ROOT, cli, consistent, entries, head


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


class Hooked:
    """A store that calls ``hook(kind, key, result)`` after each request: a race
    injected between two requests of the code under test."""

    def __init__(self, inner: ds.Store) -> None:
        self.inner = inner
        self.hook: Any = None

    def _call(self, kind: str, key: str, result: Any) -> Any:
        """The hook, until it says it ran (True); never from inside itself."""
        hook, self.hook = self.hook, None
        if hook is not None and not hook(kind, key, result):
            self.hook = hook
        return result

    def get(self, key: str) -> tuple[bytes, str] | None:
        return self._call("get", key, self.inner.get(key))  # type: ignore[no-any-return]

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self._call("before-put", key, match)
        return self.inner.put(key, data, match=match)

    def delete(self, key: str, *, match: str | None = None) -> None:
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def sweep(self, prefix: str) -> None:
        sweep = getattr(self.inner, "sweep", None)
        if sweep is not None:
            sweep(prefix)

    def close(self) -> None:
        self.inner.close()


def markers(store: ds.Store, run_id: str) -> set[str]:
    return {k for k in entries(store) if f"/{run_id}~" in k and "~signal-" not in k}


def later() -> float:
    """Now on the store's clock, as it will be once every entry of now is older than GRACE."""
    return time.time() + 2 * _index.GRACE


# --- 1. a repair that meets a class change never leaves a live run without a marker ---


def test_a_repair_racing_a_release_leaves_the_run_its_marker(target: StoreTarget) -> None:
    """A stale `stopped` marker (a claim SIGKILLed before deleting it) outlives GRACE while
    the new owner runs the run; a scan reads the head (running), the owner releases the run
    (into that same `stopped` key), then the scan's repair deletes `stopped` as stale: the
    head is read again and its marker written back, so the released run stays findable."""
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    gate = threading.Event()
    wf.step(name="first")(lambda state: None)

    @wf.step()
    def block(state: dict[str, Any]) -> None:
        gate.wait(20)

    wf.step(name="last")(lambda state: None)
    wf.submit("r", {})
    owner = ds.Worker(wf)
    runner = threading.Thread(target=owner.run, kwargs={"until_idle": True})
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while head(store, "desk", "r").committed < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        running = head(store, "desk", "r")
        assert running.owner is not None
        nonce = running.run_nonce[:16]
        store.put(_index.live_prefix("desk", "r") + f"stopped-{nonce}", b"")  # the stale hint
        (live,) = drive_sync(listing.live_runs("desk"), store)
        assert len(live.markers) == 2
    finally:
        owner.stop()
        gate.set()
        runner.join()
    released = head(store, "desk", "r")
    assert released.owner is None
    assert released.status == "running"
    drive_sync(listing.repair(live, running, later()), store)  # the scan's repair, late
    assert markers(store, "r") == {_index.marker_of(released)}
    assert ds.Worker(wf).claimable() == ["r"]


def test_a_repair_between_a_resolve_marker_and_its_head_loses_no_marker(
    target: StoreTarget,
) -> None:
    """resolve writes the run's new marker before its head (leaving in_doubt); a reader whose
    listing holds that marker as old (a reused key) and whose head is still in doubt deletes
    it right then: resolve writes it again after its head, so the run is still found."""
    from tests.indexchild import desk

    store = target.open()
    try:
        desk(ds.testing.CrashingStore(store, after_write=3)).run("r", {})
    except ds.testing.SimulatedCrash:
        pass
    with pytest.raises(ds.StepInDoubt):
        desk(store).run("r")
    doubt = head(store, "desk", "r")
    stopped = _index.live_prefix("desk", "r") + f"stopped-{doubt.run_nonce[:16]}"
    store.put(stopped, b"")  # an old stopped hint of the run, reused by resolve
    hooked = Hooked(store)

    def reader(kind: str, key: str, match: Any) -> bool:
        if kind != "before-put" or key != ckpt.checkpoint_key("desk", "r"):
            return False
        (live,) = drive_sync(listing.live_runs("desk"), store)  # resolve's marker is listed
        drive_sync(listing.repair(live, head(store, "desk", "r"), later()), store)
        assert stopped not in markers(store, "r")  # the race happened
        return True

    hooked.hook = reader
    desk(hooked).resolve("r", fired=False)  # type: ignore[arg-type]
    assert markers(store, "r") == {_index.marker_of(head(store, "desk", "r"))}
    consistent(store)


# --- 2. a scan never deletes the parts of a run being created under a reused id --------


def test_a_scan_clearing_a_gone_run_spares_a_new_run_under_its_id(
    target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An rm stopped after the head left the run's marker and parts for longer than GRACE;
    a scan reads no head, and right then the id is used again (marker, base part, head):
    the scan deletes no part of the new run, which resumes to its end."""
    monkeypatch.setattr(_index, "GRACE", 2.0)
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    wf.step(name="one")(lambda state: state.update(done=True))
    wf.run("warmup", {})
    wf.submit("r", {"doc": "x" * 100_000})
    (queued,) = markers(store, "r")  # as a crashed owner leaves it: running
    store.put(queued.replace("~queued-", "~running-"), b"")
    store.delete(queued)
    store.delete(ckpt.checkpoint_key("desk", "r"))  # rm --force, killed after its head delete
    time.sleep(3.2)  # the leftovers are older than GRACE (whole seconds on S3)
    hooked = Hooked(store)

    def reuse(kind: str, key: str, result: Any) -> bool:
        if kind == "get" and key == ckpt.checkpoint_key("desk", "r") and result is None:
            wf.submit("r", {"doc": "y" * 100_000})
            return True
        return False

    hooked.hook = reuse
    scanner = ds.Workflow("desk", store=hooked)  # type: ignore[arg-type]
    scanner.step(name="one")(lambda state: None)
    ds.Worker(scanner).claimable()
    assert hooked.hook is None, "the race did not happen"
    assert wf.resume("r")["doc"] == "y" * 100_000
    time.sleep(3.2)
    ds.Worker(wf).claimable()  # later: the old run's entries are cleaned up
    consistent(store)


def test_a_new_store_whose_first_run_has_a_big_state_is_indexed(target: StoreTarget) -> None:
    """The first run of a new store writes its base part before its head (and its
    registration): that part is no earlier version's run, so the workflow is indexed."""
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    wf.step(name="one")(lambda state: None)
    wf.submit("r", {"doc": "x" * 100_000})
    assert list(store.list("desk/r/parts/"))
    assert covered(store, "desk")
    assert covered(store, None)


# --- 6. a creation caught between its marker and its head is seen by the next scan ----


def test_a_run_whose_head_was_missing_for_a_scan_is_found_by_the_next(
    target: StoreTarget,
) -> None:
    """A worker's claim fails on a run whose marker landed and whose head has not (it
    reads the head: missing); once the head lands, the very next scan finds the run."""
    store = target.open()
    wf = ds.Workflow("desk", store=store)
    wf.step(name="one")(lambda state: None)
    wf.run("warmup", {})
    worker = ds.Worker(wf)
    hooked = Hooked(store)

    def scan(kind: str, key: str, match: Any) -> bool:
        if kind == "before-put" and key == ckpt.checkpoint_key("desk", "r1"):
            assert worker.claimable() == ["r1"]  # by its queued marker
            worker._finder.recheck("r1")  # what the worker does when the claim fails
            return True
        return False

    hooked.hook = scan
    submitter = ds.Workflow("desk", store=hooked)  # type: ignore[arg-type]
    submitter.step(name="one")(lambda state: None)
    submitter.submit("r1", {})
    assert hooked.hook is None, "the race did not happen"
    assert worker.claimable() == ["r1"]


# --- 7, 8. ls and prune see each finished run once, whatever a crash left ------------


def killed(target: StoreTarget, op: str, at: str) -> None:
    """tests/indexchild.py does ``op`` and is SIGKILLed before its first write at ``at``."""
    done = subprocess.run(
        [sys.executable, str(CHILD), "--store", target.url, "--op", op, "--at", at],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**target.child_env(), "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == -9, (done.stdout, done.stderr)


def shown(target: StoreTarget, *args: str) -> list[str]:
    """The run ids `ls` shows, in order."""
    done = cli(target, "ls", *args)
    assert done.returncode == 0, done.stderr
    return [line.split()[1] for line in done.stdout.splitlines()[1:]]


def test_ls_shows_a_tombstoned_run_once_after_a_sigkill_left_its_old_entry(
    target: StoreTarget,
) -> None:
    """SIGKILL in on_complete="delete" after the tombstone's done entry, before the
    completed one's delete: ls shows the run once (as the tombstone it is)."""
    from tests.indexchild import desk, prepare

    store = target.open()
    desk(store).run("seed", {})
    prepare(store, "tombstone")
    killed(target, "tombstone", "delete:-completed-")
    assert any("-completed-r" in k for k in entries(store))  # the stale entry is there
    assert shown(target).count("r") == 1
    assert shown(target, "--status", "deleted") == ["r"]
    assert shown(target, "--status", "completed") == ["seed"]


def test_ls_skips_the_entry_an_interrupted_rm_left_and_fills_its_limit(
    target: StoreTarget,
) -> None:
    """rm of a completed run SIGKILLed before its done entry's delete: `ls --limit 2`
    still shows the 2 newest runs there are (and says there are more); once the id
    is used again, ls shows the new live run once."""
    from tests.indexchild import desk, prepare

    store = target.open()
    for name in ("old0", "old1", "old2"):
        desk(store).run(name, {})
    prepare(store, "rm")  # desk/r, completed: the newest
    killed(target, "rm", "delete:_index/")
    assert any("-completed-r" in k for k in entries(store))
    more = cli(target, "ls", "--limit", "2")
    assert [line.split()[1] for line in more.stdout.splitlines()[1:]] == ["old2", "old1"]
    assert "the newest 2 shown" in more.stderr
    assert shown(target, "--status", "completed", "--limit", "2") == ["old2", "old1"]
    with pytest.raises(ds.RunSuspended):
        desk(store).run("r", {"wait": True})  # the id starts a new run
    assert shown(target) == ["r", "old2", "old1", "old0"]


def test_a_run_killed_before_its_done_entry_is_listed_and_pruned(target: StoreTarget) -> None:
    """SIGKILL after a run's completed head, before its done entry: ls, ls --status
    completed show it, and prune --completed deletes it and every entry it had."""
    from tests.indexchild import prepare

    store = target.open()
    prepare(store, "wake")  # a waiting run, signalled: resumed to its end by the child
    killed(target, "wake", "put:_index/done/")
    assert head(store, "desk", "r").status == "completed"
    assert not [k for k in entries(store) if "/done/" in k]
    assert shown(target) == ["r"]
    assert shown(target, "--status", "completed") == ["r"]
    pruned = cli(target, "prune", "--completed", "--older-than", "0s", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert "deleted desk/r" in pruned.stdout
    assert store.get(ckpt.checkpoint_key("desk", "r")) is None
    assert entries(store) == set()


# --- 9. a deleted run's marker does not outlive it ------------------------------------


def test_the_marker_an_interrupted_rm_left_of_a_waiting_run_is_cleaned_up(
    target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rm --force of a waiting run SIGKILLed before its entries' deletes: once they are
    older than GRACE, a worker's scan reads the head once (gone) and removes the marker
    and what is left of the run; a later scan reads nothing."""
    from tests.indexchild import desk

    store = target.open()
    with pytest.raises(ds.RunSuspended):
        desk(store).run("r", {"wait": True})
    killed(target, "rm", "delete:_index/")
    assert store.get(ckpt.checkpoint_key("desk", "r")) is None
    assert markers(store, "r")
    monkeypatch.setattr(_index, "GRACE", 1.0)
    time.sleep(2.2)  # (whole seconds on S3)
    worker = ds.Worker(desk(store))
    assert worker.claimable() == []
    assert entries(store) == set()
    assert not list(store.list("desk/r/"))


def test_prune_removes_what_an_interrupted_rm_left_of_a_waiting_run(
    target: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same leftovers, found by prune (no worker ran): prune reads the heads of runs
    whose entries did not change in GRACE, and removes a gone one's."""
    from durable_steps.cli import _cleanup, _main
    from tests.indexchild import desk

    store = target.open()
    with pytest.raises(ds.RunSuspended):
        desk(store).run("r", {"wait": True})
    with pytest.raises(ds.RunSuspended):
        desk(store).run("alive", {"wait": True})
    killed(target, "rm", "delete:_index/")
    monkeypatch.setattr(_index, "GRACE", 1.0)
    monkeypatch.setattr(_cleanup, "LEFTOVER_AGE", 1.0)
    time.sleep(2.2)
    monkeypatch.setattr(_main, "open_store", lambda _url: store)
    prune = ["prune", "--completed", "--older-than", "0s", "--yes"]
    assert _main.main(["--store", target.url, *prune]) == 0
    assert {k.split("/")[3].partition("~")[0] for k in entries(store)} == {"alive"}
    assert not list(store.list("desk/r/"))


# --- 10. a whole-store reindex leaves no workflow partial -----------------------------


def test_a_whole_store_reindex_marks_a_partial_workflow_with_no_runs(
    target: StoreTarget,
) -> None:
    """A workflow registered partial (it had runs of an earlier version) whose runs are all
    gone: `reindex` marks it indexed too, and ls no longer says to reindex."""
    store = target.open()
    wf = ds.Workflow("v", store=store)
    wf.step(name="one")(lambda state: None)
    wf.run("x", {})
    store.put(_index.registry_key("old") + "/partial", b"")
    assert not covered(store, None)
    done = cli(target, "reindex")
    assert done.returncode == 0, done.stderr
    assert covered(store, None)
    shown = cli(target, "ls")
    assert "reindex" not in shown.stderr


@pytest.fixture(autouse=True)
def _forget_registrations() -> Iterator[None]:
    _index._REGISTERED.clear()
    yield
    _index._REGISTERED.clear()
