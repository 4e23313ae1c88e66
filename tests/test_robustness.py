"""Robustness: slow renewals, transient store errors, malformed owners and times, prune counts."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps import cli
from durable_steps._fleet.leases import Heartbeat
from durable_steps._record import checkpoint as ckpt
from durable_steps.cli import _cleanup
from durable_steps.errors import StoreError
from tests.storetools import Wrapped, rewrite_header

# --- heartbeat ------------------------------------------------------------------


def test_a_slow_renewal_does_not_starve_other_runs_heartbeats() -> None:
    """One run's hung lease renewal must not stop other runs' renewals (their leases run out)."""
    slow_started, release = threading.Event(), threading.Event()
    fast_beats: list[float] = []
    slow = Heartbeat(0.05, lambda: (slow_started.set(), release.wait(5)), "slow-run")
    fast: Heartbeat | None = None
    try:
        assert slow_started.wait(2)
        fast = Heartbeat(0.05, lambda: fast_beats.append(time.monotonic()), "fast-run")
        time.sleep(0.6)  # 12 beat intervals = 4 whole leases of the fast run
        beats = len(fast_beats)
    finally:
        release.set()
        slow.stop()
        if fast is not None:
            fast.stop()
    assert beats >= 3, f"the other run renewed its lease {beats} times in 4 leases"


# --- worker ---------------------------------------------------------------------


def test_worker_resumes_a_run_after_a_transient_store_error() -> None:
    """A StoreError (store briefly down) mid-run must not park the run for the worker's life."""

    class Outage(Wrapped):
        down = True

        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if self.down and b'"committed":1' in data:  # the step's commit hits the outage
                self.down = False
                raise StoreError("S3 kept failing: SlowDown (HTTP 503) after 5 attempts")
            return super().put(key, data, match=match)

    inner = ds.MemoryStore()
    wf = ds.Workflow("outage", store=Outage(inner))
    wf.step(name="a")(lambda s: s.update(a=1))
    wf.submit("r1", {})
    worker = ds.Worker(wf, poll=0.02)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 2
    done = False
    while time.monotonic() < deadline and not done:
        found = inner.get(ckpt.checkpoint_key("outage", "r1"))
        done = found is not None and ckpt.decode(found[0], where="t")[0].status == "completed"
        time.sleep(0.02)
    worker.stop()
    t.join(10)
    assert done, "the worker never retried the run after the store came back"


# --- CLI --------------------------------------------------------------------------


@pytest.mark.parametrize("owner", ["someone", {"host": "h", "pid": 1, "until": "soon"}])
def test_rm_force_deletes_a_run_with_a_malformed_owner(
    tmp_path: Path, owner: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rm --force` must delete a checkpoint with a malformed header (as errors tell users to)."""
    url = str(tmp_path / "store")
    store = ds.LocalStore(url)
    wf = ds.Workflow("mal", store=store)
    wf.step(name="a")(lambda s: None)
    wf.submit("r1", {})
    key = ckpt.checkpoint_key("mal", "r1")
    rewrite_header(store, key, owner=owner)
    code = cli.main(["--store", url, "rm", "mal/r1", "--force"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert store.get(key) is None


def test_prune_does_not_count_runs_it_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """prune's summary must count only the runs it deleted, not one kept because it changed."""
    url = str(tmp_path / "store")
    store = ds.LocalStore(url)
    wf = ds.Workflow("pr", store=store)
    wf.step(name="a")(lambda s: None)
    wf.run("r1", {})
    wf.run("r2", {})
    real = _cleanup._candidates

    def find_then_change(*args: Any) -> Any:
        runs = real(*args)
        rewrite_header(store, ckpt.checkpoint_key("pr", "r2"), note="changed")  # after listing
        return runs

    monkeypatch.setattr(_cleanup, "_candidates", find_then_change)
    code = cli.main(["--store", url, "prune", "--completed", "--older-than", "0s", "--yes"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "kept pr/r2" in out.err
    assert store.get(ckpt.checkpoint_key("pr", "r2")) is not None
    assert out.out.splitlines()[-1].startswith("deleted 1 run "), out.out


# --- header validation ------------------------------------------------------------


@pytest.mark.parametrize(
    "fields", [{"updated_at": "yesterday"}, {"created_at": None}, {"history": [["a"]]}]
)
def test_malformed_times_and_history_are_corrupt_checkpoint(fields: dict[str, Any]) -> None:
    """updated_at/created_at/history are header fields too: malformed ones are CorruptCheckpoint."""
    header = ckpt.Checkpoint(workflow="w", run_id="r", steps=("a",), serializer="json")
    line, _, payload = ckpt.encode(header, b"{}").partition(b"\n")
    record = {**json.loads(line), **fields}
    with pytest.raises(ds.CorruptCheckpoint):
        ckpt.decode(json.dumps(record).encode() + b"\n" + payload, where="t")
