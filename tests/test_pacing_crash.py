"""Real crashes of a paced run: a child SIGKILLs itself around every head write.

On a store that paces its head's writes (GCS; here also a local store made
to declare ``min_write_interval``), quick ``ctx.call`` results are deferred
into the next write (see ``durable_steps._fleet.pacing``). ``tests/journalchild.py
jrn-quick`` makes two passes of 8 quick calls, an effect and 3 more calls,
and is killed before or after its N-th head write, inside the effect, or
right after a call returned; a second child finishes the run. Then, whatever
the timing put in which write: every call the killed head recorded ran
once, every call at most twice, each effect fired under its one key (twice
only if the kill left it open), no committed pass ran again, and the final
state equals an uncrashed run's. The local store takes every point (most
``matrix``); the GCS emulator, behind a proxy that answers 429 to a second
write of one object within a second, takes a sample — with no 429 answered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._record import checkpoint as ckpt
from durable_steps._record.format2 import load_state
from tests.cloudservers import FakeGCSServer
from tests.faultproxy import FaultProxy
from tests.forkserver import ForkServer
from tests.journalchild import (
    QUICK,
    QUICK_PASSES,
    quick_names,
    quick_workflow,
    read_lines,
)

CHILD = Path(__file__).with_name("journalchild.py")
RUN = "r1"
KILLED = -signal.SIGKILL
LOCAL_INTERVAL = "0.25"
_forks = ForkServer(CHILD)

# Each pass writes at least its effect's intent, its result and its commit
# (plus a timer's write of deferred calls when they outlast the interval):
# head writes 0 (the creation) to 6 happen whatever the timing.
WRITES = [f"{edge}-write:head:{n}" for n in range(1, 7) for edge in ("before", "after")]
POINTS = [*WRITES, "inside:pay:0", "between:q:3:0", "between:q:9:1"]
SAMPLED = {"after-write:head:1", "before-write:head:4", "between:q:3:0", "inside:pay:0"}
GCS_SAMPLE = ["after-write:head:2", "between:q:9:1"]


@cache
def reference() -> str:
    """An uncrashed run's final state (in-process, a paced memory store)."""
    with tempfile.TemporaryDirectory() as tmp:
        wf = quick_workflow(ds.MemoryStore(), Path(tmp) / "l", Path(tmp) / "g", None, 0.05)
        return json.dumps(wf.run("ref", {"turns": 0, "log": []}), sort_keys=True)


@dataclass
class Child:
    """``jrn-quick`` on one store (URL, environment), with its log files."""

    url: str
    env: dict[str, str]
    store: Any
    tmp: Path
    extra: list[str] = field(default_factory=list)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [QUICK, "--store", self.url, "--run", RUN, "--log", str(self.tmp / "log")]
        argv += ["--ledger", str(self.tmp / "ledger"), *self.extra, *args]
        return _forks.run(argv, cwd=self.tmp, out=self.tmp / "child", env=self.env, timeout=90)

    def head(self) -> ckpt.Checkpoint:
        found = self.store.get(ckpt.checkpoint_key(QUICK, RUN))
        assert found is not None
        return ckpt.decode(found[0], where=RUN)[0]

    def recorded(self) -> list[str]:
        """The calls the journal holds, as ``q:<pass>:<i>`` / ``pay:<pass>``."""
        found = self.store.get(ckpt.checkpoint_key(QUICK, RUN))
        if found is None:
            return []
        header, tail = ckpt.decode(found[0], where=RUN)
        if header.journal is None:
            return []
        loaded = drive_sync(load_state(header, tail, ds.JSONSerializer(), RUN), self.store)
        assert loaded is not None
        it = header.journal["iteration"]
        return [
            f"pay:{it}" if meta[2] == "pay" else f"{meta[2]}".replace("q:", f"q:{it}:")
            for meta, _ in loaded[1].journal
        ]


def check_kill_and_rerun(child: Child, crash: str) -> None:
    proc = child.run("--crash", crash)
    assert proc.returncode == KILLED, (proc.returncode, proc.stderr)
    found = child.store.get(ckpt.checkpoint_key(QUICK, RUN))
    committed = 0 if found is None else child.head().committed
    held = child.recorded()
    left_open = (
        [e["name"] for e in child.head().journal["open"]]
        if found is not None and child.head().journal
        else []
    )
    before = read_lines(child.tmp / "log")
    assert set(held) <= set(before), "recorded means its fn ran"

    final = child.run()
    assert final.returncode == 0, final.stderr
    assert final.stdout.strip() == reference()

    execs = Counter(read_lines(child.tmp / "log"))
    everything = [n for it in range(QUICK_PASSES) for n in quick_names(it)]
    assert set(execs) == set(everything)
    assert max(execs.values()) <= 2, execs
    for it in range(committed):  # a committed pass never runs again
        assert all(execs[n] == 1 for n in quick_names(it)), (it, execs)
    for name in held:  # a recorded call replays
        assert execs[name] == 1, (name, execs)
    # Ran twice: only what ran before the kill and was not recorded by it.
    assert {n for n, c in execs.items() if c == 2} <= set(before) - set(held)

    head = child.head()
    assert head.status == "completed"
    assert head.journal is None
    fired: dict[str, list[str]] = {}
    for line in read_lines(child.tmp / "ledger"):
        name, key = line.rsplit(":", 1)
        fired.setdefault(name, []).append(key)
    for it in range(QUICK_PASSES):
        keys = fired[f"pay:{it}"]
        assert set(keys) == {ckpt.effect_key(head.run_nonce, it, "turn", "pay")}, keys
        # Fired before the kill and not recorded: its intent was durable (left
        # open), and the rerun fired it again, with the same key.
        doubted = f"pay:{it}" in before and f"pay:{it}" not in held and it == committed
        assert len(keys) == (2 if doubted else 1), (it, keys, left_open)
        if doubted:
            assert "pay" in left_open


@pytest.fixture
def local_child(tmp_path: Path) -> Iterator[Child]:
    """``jrn-quick`` on a local store declaring an interval of its own."""
    store = ds.LocalStore(tmp_path / "store")
    yield Child(
        str(tmp_path / "store"), dict(os.environ), store, tmp_path, ["--interval", LOCAL_INTERVAL]
    )
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "crash", [pytest.param(p, marks=() if p in SAMPLED else pytest.mark.matrix) for p in POINTS]
)
def test_sigkill_around_a_paced_write_then_rerun_matches_uncrashed_run(
    local_child: Child, crash: str
) -> None:
    check_kill_and_rerun(local_child, crash)


@pytest.mark.slow
@pytest.mark.cloud
@pytest.mark.parametrize("crash", GCS_SAMPLE)
def test_sigkill_on_gcs_behind_the_rate_limit_then_rerun_matches(
    gcs: FakeGCSServer, gcs_bucket: str, tmp_path: Path, crash: str
) -> None:
    proxy = FaultProxy(gcs.endpoint_url).start()
    proxy.rate_limit(1.0)
    url = f"gs://{gcs_bucket}/t-{uuid.uuid4().hex[:12]}"
    env = gcs.child_env()
    env["STORAGE_EMULATOR_HOST"] = proxy.endpoint_url
    store = gcs.store(url)
    try:
        check_kill_and_rerun(Child(url, env, store, tmp_path), crash)
        assert proxy.limited == 0, (proxy.refused, proxy.writes)
    finally:
        store.close()
        proxy.stop()
