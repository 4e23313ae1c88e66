"""A signal's nudge with no signal behind it: a sender SIGKILLed between the two.

``wf.signal`` writes the index's nudge before the signal object (``_signals.send``),
so that a scan listing the waiting run sees its signal came. A sender killed between
the two writes leaves the nudge alone; a worker trusting it would resume the run at
every scan for ever (``run(until_idle=True)`` never returning). A resume that finds no
signal behind its nudge deletes it; a signal sent later still wakes the run, and one
landing just after the worker's look is not lost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import durable_steps as ds
from durable_steps._fleet import index as _index
from durable_steps._fleet.signals import signal_key
from tests.conftest import StoreTarget, _target
from tests.test_index import entries, head
from tests.test_index_races import Hooked, killed


@pytest.fixture(params=["local", pytest.param("seaweedfs", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The local store and one S3 server over the wire."""
    return _target(request.param, request, tmp_path)


def nudges(store: ds.Store) -> set[str]:
    return {k for k in entries(store) if "signal-" in k.rpartition("/")[2].rpartition("~")[2]}


def until_idle(worker: ds.Worker, within: float = 30.0) -> ds.WorkerReport:
    """``worker.run(until_idle=True)``, which must return within ``within`` seconds."""
    got: list[ds.WorkerReport] = []
    thread = threading.Thread(target=lambda: got.append(worker.run(until_idle=True)))
    thread.start()
    thread.join(within)
    if thread.is_alive():
        worker.stop()
        thread.join(30)
        pytest.fail(f"Worker.run(until_idle=True) still running after {within} s")
    return got[0]


def test_a_sender_killed_between_nudge_and_signal_does_not_make_workers_spin(
    target: StoreTarget,
) -> None:
    from tests.indexchild import desk, prepare

    store = target.open()
    prepare(store, "signal")  # desk/r, waiting for "approval"
    killed(target, "signal", "put:/signals/")  # after the nudge, before the signal
    assert nudges(store), "the child should have left its nudge"
    assert store.get(signal_key("desk", "r", "approval")) is None

    report = until_idle(ds.Worker(desk(store), poll=0.05))
    assert len(report.waiting) <= 2, report  # resumed once (maybe twice), not for ever
    assert not nudges(store), "the orphan nudge should be gone"
    assert head(store, "desk", "r").status == "waiting"

    assert desk(store).signal("r", "approval", "ok")  # a real signal still wakes it
    report = until_idle(ds.Worker(desk(store), poll=0.05))
    assert report.completed == ["r"]
    assert head(store, "desk", "r").status == "completed"


def test_a_signal_landing_just_after_the_workers_look_keeps_its_nudge(
    target: StoreTarget,
) -> None:
    """The worst order: the worker finds no signal, the sender's signal lands, then the
    worker deletes the nudge. The run is still woken (by the worker's second look, or
    the sender's second nudge)."""
    from tests.indexchild import desk, prepare

    store = target.open()
    prepare(store, "signal")
    killed(target, "signal", "put:/signals/")
    hooked = Hooked(store)
    sent: list[bool] = []

    def send_now(kind: str, key: str, result: object) -> bool:
        if kind == "get" and key == signal_key("desk", "r", "approval"):
            sent.append(desk(store).signal("r", "approval", "late"))
            return True
        return False

    worker = ds.Worker(desk(hooked), poll=0.05)
    original = worker._finder._orphaned

    def orphaned(*args: object) -> None:
        hooked.hook = send_now  # the signal lands right after the worker's first look
        original(*args)  # type: ignore[arg-type]

    worker._finder._orphaned = orphaned  # type: ignore[method-assign]
    report = until_idle(worker)
    assert sent == [True]
    assert report.completed == ["r"], report
    assert desk(store).run("r")["answer"] == "late"  # completed: its final state


def test_a_worker_deleting_a_nudge_its_sender_is_about_to_follow_loses_no_wake(
    target: StoreTarget,
) -> None:
    """The other order: a sender alive between its nudge and its signal while a
    worker's look finds no signal (both its looks) and deletes the nudge. The sender
    writes the nudge again after the signal, so the next scan wakes the run."""
    from tests.indexchild import desk, prepare

    store = target.open()
    prepare(store, "signal")
    worker = ds.Worker(desk(store), poll=0.05)
    sender = Hooked(store)

    def worker_looks(kind: str, key: str, result: object) -> bool:
        if kind == "before-put" and key == signal_key("desk", "r", "approval"):
            assert worker.claimable() == ["r"]  # nudged: as if resumed, came back waiting
            worker._finder.recheck("r")  # no signal yet: the nudge is deleted
            assert not nudges(store)
            return True
        return False

    sender.hook = worker_looks
    assert desk(sender).signal("r", "approval", "on time")
    assert nudges(store)
    report = until_idle(worker)
    assert report.completed == ["r"], report


@pytest.fixture(autouse=True)
def _forget_registrations() -> Iterator[None]:
    _index._REGISTERED.clear()
    yield
    _index._REGISTERED.clear()


def test_a_wrong_shaped_approval_sent_before_the_wait_does_not_make_workers_spin(
    target: StoreTarget,
) -> None:
    """A payload the wait does not accept, sent while the run was queued (nothing could
    check it then), decides nothing: its nudge must not wake the run at every scan.
    A payload of the right shape sent afterwards replaces it and wakes the run."""
    store = target.open()
    wf = ds.Workflow("hold", store=store)
    executions: list[int] = []

    @wf.step()
    def ask(state: dict[str, object], ctx: ds.Context) -> None:
        executions.append(1)
        state["decision"] = ctx.wait_for("approval", accepts="approval")

    wf.submit("h1", {})
    assert wf.signal("h1", "approval", {"approve": True})  # queued: not checked yet
    report = until_idle(ds.Worker(wf, poll=0.05), within=20)
    assert report.waiting == ["h1"]
    assert len(executions) <= 3
    assert not nudges(store), "the nudge of a payload that decides nothing is deleted"
    assert wf.signal("h1", "approval", {"approved": True})
    report = until_idle(ds.Worker(wf, poll=0.05), within=20)
    assert wf.resume("h1") == {"decision": {"approved": True}}
    assert len(report.completed) == 1
