"""A run's whole history (``_record.history``): what the timeline draws, a few bytes a step.

Proven with real runs: every commit, retry, failure and resolution is kept in
order; a SIGKILL between a history chunk and the head that would name it loses
no entry; a chunk edited in the store is left out, never believed; ``rm``
removes the history with the run; a head without a log (an older store) reads
as before; and the PUTs stay within format 2's budget.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import history
from durable_steps.cli import main as cli

CHILD = Path(__file__).resolve().parent / "historychild.py"
ROOT = Path(__file__).resolve().parent.parent


def head(store: ds.Store, workflow: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


def kept(store: ds.Store, workflow: str, run_id: str) -> list[history.Commit]:
    """Every entry the run's history holds, read as the web page reads it."""
    header = head(store, workflow, run_id)
    prefix = history.history_prefix(workflow, run_id)
    found = {}
    for info in store.list(prefix):
        got = store.get(info.key)
        assert got is not None
        found[info.key] = got[0]
    segments = history.chain(header, found)
    assert segments is not None
    return [c for s in segments for c in history.decode(s, header.created_at)]


def test_every_commit_retry_failure_and_resolution_is_kept_in_order() -> None:
    """100 passes (chunks written), a retried step, a failure that stopped the run, and
    a step resolved as fired: each entry in order, with its pass, attempts and calls."""
    store = ds.MemoryStore()
    flaky = {"left": 1}
    wf = ds.Workflow("hist", store=store, until=lambda s: s["n"] >= 100)

    @wf.step(retry=ds.Retry(attempts=3, wait=0, on=(ValueError,)))
    def think(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.call("model", lambda: 1)
        ctx.effect("tool", lambda idempotency_key: idempotency_key)
        if state["n"] == 7 and flaky["left"]:
            flaky["left"] -= 1
            raise ValueError("flaky")

    @wf.step()
    def count(state: dict[str, Any]) -> None:
        state["n"] += 1

    wf.run("r", {"n": 0})
    entries = kept(store, "hist", "r")
    assert [(e.step, e.iteration) for e in entries] == [
        (s, i) for i in range(100) for s in ("think", "count")
    ]
    assert head(store, "hist", "r").log["last"]  # type: ignore[index]  # chunks were written
    assert [e.attempts for e in entries if e.step == "think"][7] == 2
    assert all((e.calls, e.effects) == (1, 1) for e in entries if e.step == "think")
    starts = [e.start for e in entries]  # to the millisecond, each rounded on its own
    assert all(b >= a - 0.002 for a, b in itertools.pairwise(starts))
    assert all(e.kind == "committed" and e.duration >= 0 for e in entries)

    stuck = ds.Workflow("stuck", store=store)

    @stuck.step(idempotent=False, in_doubt="raise")
    def pay(state: dict[str, Any]) -> None:
        raise RuntimeError("card declined")

    with pytest.raises(ds.StepFailed):
        stuck.run("s", {})
    assert [(e.kind, e.step, e.attempts) for e in kept(store, "stuck", "s")] == [
        ("failed", "pay", 1)
    ]


def child(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(CHILD), str(store), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_kill_between_a_chunk_and_its_head_loses_no_entry(tmp_path: Path) -> None:
    """SIGKILL right after the second chunk lands, before the head names it; the resumed
    run's history holds every commit exactly once, in order, and rm removes it all."""
    path = tmp_path / "store"
    died = child(path, "r", "60", "--kill-after-chunk", "2")
    assert died.returncode == -9, died.stderr
    done = child(path, "r", "60")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["n"] == 60
    store = ds.LocalStore(path)
    entries = kept(store, "long", "r")
    assert [(e.step, e.iteration) for e in entries] == [
        (s, i) for i in range(60) for s in ("tick", "tock")
    ]
    chunks = list(store.list(history.history_prefix("long", "r")))
    assert len(chunks) == 1 + len(entries) // history.SPILL_AT  # one the kill left unnamed
    assert cli(["--store", str(path), "rm", "long/r"]) == 0
    assert not list(store.list("long/r/"))


def test_an_edited_chunk_is_left_out_not_believed(tmp_path: Path) -> None:
    """A chunk changed in the store breaks the chain at it: the entries it and those before
    it held are left out, and the rest still read."""
    store = ds.LocalStore(tmp_path)
    wf = ds.Workflow("edit", store=store, until=lambda s: s["n"] >= 70)

    @wf.step()
    def count(state: dict[str, Any]) -> None:
        state["n"] += 1

    wf.run("r", {"n": 0})
    assert len(kept(store, "edit", "r")) == 70
    first = tmp_path / sorted(i.key for i in store.list(history.history_prefix("edit", "r")))[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))
    entries = kept(store, "edit", "r")
    assert len(entries) == 70 - history.SPILL_AT
    assert entries[0].iteration == history.SPILL_AT


def test_a_head_without_a_log_reads_as_before() -> None:
    """An older store's head (no log field) decodes, and its history reads as none."""
    store = ds.MemoryStore()

    def once(state: dict[str, Any]) -> None:
        state["done"] = True

    ds.Workflow("old", store=store, steps=[once]).run("r", {})
    key = ckpt.checkpoint_key("old", "r")
    found = store.get(key)
    assert found is not None
    header, payload = ckpt.decode(found[0], where="test")
    assert header.log is not None
    older = ckpt.encode(header.replace(log=None), payload)
    assert b'"log"' not in older
    assert history.chain(ckpt.decode(older, where="test")[0], {}) is None


def test_history_costs_stay_within_the_put_budget() -> None:
    """A tiny state chunks every 32 commits (at most 1/32 more PUTs); every chunk is a
    create-only write."""
    writes: list[tuple[str, str | None]] = []

    class Watching(ds.MemoryStore):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            writes.append((key, match))
            return super().put(key, data, match=match)

    store = Watching()
    wf = ds.Workflow("tiny", store=store, until=lambda s: s["n"] >= 320)

    @wf.step()
    def count(state: dict[str, Any]) -> None:
        state["n"] += 1

    wf.run("r", {"n": 0})
    chunks = [(k, m) for k, m in writes if "/history/" in k]
    assert len(chunks) == 320 // history.SPILL_AT
    assert all(m is None for _, m in chunks)
    heads = [k for k, _ in writes if k.endswith("/checkpoint")]
    assert len(chunks) <= len(heads) / 32 + 1


def test_a_signed_runs_history_is_bound_to_its_signed_head() -> None:
    """With a signing key the head names its last chunk by digest, under the signature: an
    edit of the head's log is refused before anything is read, and the chain verifies."""
    store = ds.MemoryStore()
    wf = ds.Workflow("signed", store=store, signing_key="k" * 32, until=lambda s: s["n"] >= 40)

    @wf.step()
    def count(state: dict[str, Any]) -> None:
        state["n"] += 1

    wf.run("r", {"n": 0})
    assert len(kept(store, "signed", "r")) == 40
    key = ckpt.checkpoint_key("signed", "r")
    found = store.get(key)
    assert found is not None
    edited = found[0].replace(b'"n":32', b'"n":31', 1)
    assert edited != found[0]
    store.put(key, edited, match=found[1])
    with pytest.raises(ds.CorruptCheckpoint, match="signature"):
        wf.run("r")
