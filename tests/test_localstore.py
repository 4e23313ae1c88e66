"""LocalStore beyond the conformance suite: locks across fork and stopped
processes, versions that never repeat, durability of new directories, and
leftovers of killed writers. Real processes, real signals, the real disk.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds

KEY = "wf/r/checkpoint"

# A child that starts a compare-and-swap of KEY and sends itself SIG (a real
# write, holding the real lock) at the first fsync, i.e. mid-write.
_CHILD_STOPPED_IN_WRITE = """
import os, signal, sys
import durable_steps as ds
real_fsync = os.fsync
def fsync(fd):
    os.kill(os.getpid(), signal.{sig})
    real_fsync(fd)
os.fsync = fsync
{patch}
ds.LocalStore(sys.argv[1]).put("{key}", b"child", match=sys.argv[2])
"""


def _child_in_write(root: Path, match: str, sig: str, patch: str = "") -> subprocess.Popen[bytes]:
    code = _CHILD_STOPPED_IN_WRITE.format(sig=sig, patch=patch, key=KEY)
    return subprocess.Popen([sys.executable, "-c", code, str(root), match])


@contextmanager
def _write_paused(
    monkeypatch: pytest.MonkeyPatch, store: ds.LocalStore, match: str
) -> Iterator[None]:
    """A thread's compare-and-swap of KEY, paused mid-write (holding the lock) until exit."""
    entered, release = threading.Event(), threading.Event()
    real_fsync = os.fsync
    results: list[str] = []

    def fsync(fd: int) -> None:
        if threading.current_thread() is writer and not entered.is_set():
            entered.set()
            release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    writer = threading.Thread(target=lambda: results.append(store.put(KEY, b"two", match=match)))
    writer.start()
    assert entered.wait(10)
    try:
        yield
    finally:
        release.set()
        writer.join(10)
    assert results, "the paused write completed"


def _timed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


_FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


@pytest.mark.filterwarnings(_FORK_WARNING)
def test_fork_during_a_write_leaves_the_lock_with_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child forked while a write holds the lock does not block the parent's next write."""
    store = ds.LocalStore(tmp_path, lock_timeout=3)
    v1 = store.put(KEY, b"one")
    with _write_paused(monkeypatch, store, v1):
        pid = os.fork()
        if pid == 0:  # the child outlives the parent's writes, as a pool worker would
            try:
                time.sleep(30)
            finally:
                os._exit(0)
    try:
        found = store.get(KEY)
        assert found is not None
        assert found[0] == b"two"
        assert _timed(lambda: store.put(KEY, b"three", match=found[1])) < 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.filterwarnings(_FORK_WARNING)
def test_pool_started_during_a_write_leaves_the_lock_with_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multiprocessing pool forked mid-write (a step's pool during a heartbeat) blocks nothing."""
    store = ds.LocalStore(tmp_path, lock_timeout=3)
    v1 = store.put(KEY, b"one")
    with _write_paused(monkeypatch, store, v1):
        pool = multiprocessing.get_context("fork").Pool(2)
    try:
        found = store.get(KEY)
        assert found is not None
        assert _timed(lambda: store.put(KEY, b"three", match=found[1])) < 1
        assert pool.map(abs, [-1, -2]) == [1, 2]  # the workers are alive meanwhile
    finally:
        pool.terminate()
        pool.join()


def test_a_stopped_lock_holder_gives_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    """A writer SIGSTOPped mid-write makes a taker-over fail after lock_timeout, saying why."""
    assert ds.LocalStore(tmp_path).lock_timeout == 30  # the default
    store = ds.LocalStore(tmp_path, lock_timeout=0.5)
    v1 = store.put(KEY, b"one")
    child = _child_in_write(tmp_path, v1, "SIGSTOP")
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        started = time.monotonic()
        with pytest.raises(ds.StoreError) as caught:
            store.put(KEY, b"taker-over", match=v1)
        assert 0.5 <= time.monotonic() - started < 3
        message = str(caught.value)
        assert str(tmp_path / "wf" / "r") in message
        assert "waited 0.5 s" in message
        assert "stopped" in message
        assert "kill it" in message
        assert "lock_timeout" in message
    finally:
        child.kill()
        child.wait()
    # The dead holder's lock is gone with it; nothing it began was committed.
    assert store.get(KEY) == (b"one", v1)
    store.put(KEY, b"taker-over", match=v1)


def test_version_never_repeats_when_the_old_inputs_do(tmp_path: Path) -> None:
    """Re-created with the same inode, mtime and size: a new version; the straggler is refused.

    This is what a 1-second-timestamp filesystem (ext4, 128-byte inodes) does
    by itself; here the mtime is set back by hand on any filesystem.
    """
    store = ds.LocalStore(tmp_path)
    path = tmp_path / "wf" / "r" / "checkpoint"
    repeats = 0
    for _ in range(20):
        old = store.put(KEY, b"run one")
        before = os.stat(path)
        store.delete(KEY)
        store.put(KEY, b"run two")
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        repeats += (after.st_ino, after.st_mtime_ns, after.st_size) == (
            before.st_ino,
            before.st_mtime_ns,
            before.st_size,
        )
        found = store.get(KEY)
        assert found is not None
        assert found[1] != old
        with pytest.raises(ds.CheckpointConflict):
            store.put(KEY, b"straggler of run one", match=old)
        assert store.get(KEY) == found
        store.delete(KEY)
    assert repeats > 0, "the filesystem reused an inode, so the old inputs did repeat"


def test_get_pairs_bytes_with_their_version_during_writes(tmp_path: Path) -> None:
    """Readers racing a writer's swaps always get the version of exactly the bytes they read."""
    store = ds.LocalStore(tmp_path)
    written = {store.put(KEY, b"0"): b"0"}
    seen: list[tuple[bytes, str]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            found = store.get(KEY)
            assert found is not None
            seen.append(found)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    version = next(iter(written))
    for i in range(1, 300):
        data = str(i).encode()
        version = store.put(KEY, data, match=version)
        written[version] = data
    stop.set()
    for t in readers:
        t.join()
    assert len(seen) > 100
    assert all(written[v] == data for data, v in seen)


def test_killed_writers_leftovers_are_removed_by_the_next_writer(tmp_path: Path) -> None:
    """A writer SIGKILLed before its rename leaves files; the next process's write removes them."""
    v1 = ds.LocalStore(tmp_path).put(KEY, b"one")
    run_dir = tmp_path / "wf" / "r"
    before = set(os.listdir(run_dir))
    child = _child_in_write(
        tmp_path, v1, "SIGCONT", patch="os.replace = lambda *a, **k: os.kill(os.getpid(), 9)"
    )
    assert child.wait(30) == -signal.SIGKILL
    left = set(os.listdir(run_dir)) - before
    assert any(n.startswith(".tmp-checkpoint-") for n in left), left  # the killed write's
    store = ds.LocalStore(tmp_path)  # the process that resumes the run
    v2 = store.put(KEY, b"two", match=v1)
    assert not left & set(os.listdir(run_dir)), os.listdir(run_dir)
    assert store.get(KEY) == (b"two", v2)
    assert (run_dir / "checkpoint").read_bytes() == b"two"  # `cat` shows the checkpoint


def test_leftover_sweep_spares_another_key_with_a_longer_name(tmp_path: Path) -> None:
    """Removing the leftovers of key ``x`` never touches the files of key ``x-1`` beside it."""
    writer = ds.LocalStore(tmp_path)
    v = writer.put("wf/r/x-1", b"other key")
    ds.LocalStore(tmp_path).put("wf/r/x", b"first write sweeps")
    assert writer.get("wf/r/x-1") == (b"other key", v)


def test_created_directories_are_fsynced_into_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each directory level a first write creates is made durable by an fsync of its parent."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "store"
    ds.LocalStore(root).put(KEY, b"one")
    for created in [root, root / "wf", root / "wf" / "r"]:
        assert str(created.parent) in synced, (created, synced)
    assert str(root / "wf" / "r") in synced  # the rename itself


def test_a_plain_file_at_a_key_reads_and_is_replaced(tmp_path: Path) -> None:
    """A checkpoint copied in by hand as a plain file reads, swaps and deletes like any object."""
    store = ds.LocalStore(tmp_path)
    path = tmp_path / "wf" / "r" / "checkpoint"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"copied in")
    found = store.get(KEY)
    assert found is not None
    assert found[0] == b"copied in"
    assert [o.version for o in store.list("")] == [found[1]]
    with pytest.raises(ds.CheckpointConflict):
        store.put(KEY, b"x")
    v2 = store.put(KEY, b"next", match=found[1])
    assert store.get(KEY) == (b"next", v2)
    assert path.is_symlink()


def test_a_hand_edit_changes_the_version(tmp_path: Path) -> None:
    """Editing the file in place (a repair by hand) gives a new version that list() shows."""
    store = ds.LocalStore(tmp_path)
    v1 = store.put(KEY, b"broken")
    (tmp_path / "wf" / "r" / "checkpoint").write_bytes(b"repaired by hand")
    [info] = store.list("wf/")
    assert info.version != v1
    assert info.size == len(b"repaired by hand")
    assert store.get(KEY) == (b"repaired by hand", info.version)


def test_a_missing_data_file_reads_as_an_empty_object_and_is_deletable(tmp_path: Path) -> None:
    """A link whose file was removed by hand reads and lists as an empty object (so the
    run is reported corrupt, never raises a store error), and a delete at its version works."""
    store = ds.LocalStore(tmp_path)
    v1 = store.put(KEY, b"one")
    run_dir = tmp_path / "wf" / "r"
    for name in os.listdir(run_dir):
        if name.startswith(".v-"):
            os.unlink(run_dir / name)
    data, version = store.get(KEY)  # type: ignore[misc]
    assert data == b""
    assert version != v1
    [info] = store.list("")
    assert (info.key, info.version, info.size) == (KEY, version, 0)
    with pytest.raises(ds.CheckpointConflict):
        store.put(KEY, b"two", match=v1)
    store.delete(KEY, match=version)
    assert store.get(KEY) is None
    assert not run_dir.exists()


def test_a_dangling_run_is_corrupt_and_rm_force_removes_it(tmp_path: Path) -> None:
    """A run whose data file was removed by hand: wf.run says CorruptCheckpoint, ls shows
    it as corrupt, and `durable-steps rm --force` removes it (it used to be stuck)."""
    from durable_steps import cli

    store = ds.LocalStore(tmp_path)
    wf = ds.Workflow("wf", store=store)
    wf.step(name="a")(lambda s: None)
    wf.submit("r", {})
    run_dir = tmp_path / "wf" / "r"
    for name in os.listdir(run_dir):
        if name.startswith(".v-"):
            os.unlink(run_dir / name)
    with pytest.raises(ds.CorruptCheckpoint):
        wf.run("r")
    assert cli.main(["--store", str(tmp_path), "rm", "wf/r", "--force"]) == 0
    assert store.get(KEY) is None


def test_an_interrupt_just_after_the_swap_keeps_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt landing right after the rename leaves a readable checkpoint."""
    store = ds.LocalStore(tmp_path)
    v1 = store.put(KEY, b"one")
    real_replace = os.replace

    def replace_then_interrupt(*args: Any, **kwargs: Any) -> None:
        real_replace(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        store.put(KEY, b"two", match=v1)
    found = store.get(KEY)
    assert found is not None
    assert found[0] == b"two"
