"""Edge cases found in review: malformed headers, forks, fencing during retries, worker loops."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import NoCredentialsError

import durable_steps as ds
from durable_steps import cli
from durable_steps._record import checkpoint as ckpt
from tests.storetools import Wrapped, rewrite_header

# --- runner -------------------------------------------------------------------


def test_finish_called_by_a_failed_attempt_does_not_end_the_run() -> None:
    """ctx.finish() from an attempt that raised must be discarded like its other changes."""
    ran: list[str] = []
    wf = ds.Workflow("finleak", store=ds.MemoryStore())

    @wf.step(retry=ds.Retry(attempts=2, wait=0))
    def first(state: dict[str, Any], ctx: ds.Context) -> None:
        if ctx.attempt == 1:
            ctx.finish()
            raise TimeoutError("flaky")

    @wf.step()
    def second(state: dict[str, Any]) -> None:
        ran.append("second")
        state["second"] = True

    assert wf.run("r1", {}) == {"second": True}
    assert ran == ["second"]


def test_no_retry_after_the_heartbeat_lost_the_run() -> None:
    """Once the heartbeat is refused (run taken over) no further attempt of the step may start."""
    store = ds.MemoryStore()
    key = ckpt.checkpoint_key("hb", "r1")
    attempts: list[int] = []
    wf = ds.Workflow("hb", store=store, lease=0.3)  # heartbeat every 0.1 s

    @wf.step(retry=ds.Retry(attempts=3, wait=0, on=TimeoutError))
    def slow(state: dict[str, Any], ctx: ds.Context) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            found = store.get(key)  # another process takes the run over
            assert found is not None
            header, payload = ckpt.decode(found[0], where="test")
            assert header.owner is not None
            rival = header.replace(owner={**header.owner, "token": "another-process"})
            store.put(key, ckpt.encode(rival, payload), match=found[1])
            time.sleep(0.5)  # the heartbeat is refused meanwhile
            raise TimeoutError("upstream slow")

    with pytest.raises(ds.CheckpointConflict):
        wf.run("r1", {})
    assert attempts == [1], "attempts kept firing after the run was lost"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_heartbeat_survives_an_unexpected_store_exception() -> None:
    """One renewal failing with a non-DurableStepsError must not end lease renewal for good."""
    in_step = threading.Event()
    renewals: list[str] = []

    class Flaky(Wrapped):
        failed = False

        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if in_step.is_set():
                if not self.failed:
                    self.failed = True
                    raise NoCredentialsError()  # what S3Store lets through (see below)
                renewals.append(key)
            return super().put(key, data, match=match)

    wf = ds.Workflow("hbdie", store=Flaky(ds.MemoryStore()), lease=0.3)

    @wf.step()
    def slow(state: dict[str, Any]) -> None:
        in_step.set()
        time.sleep(0.8)
        in_step.clear()

    wf.run("r1", {})
    assert renewals, "the heartbeat thread died on the first unexpected error"


def test_s3_store_maps_botocore_errors_to_store_error() -> None:
    """Errors derive from DurableStepsError: a botocore NoCredentialsError must be a StoreError."""

    class Client:
        class meta:  # mimics boto3's client.meta
            endpoint_url = "https://s3.amazonaws.com"

        def put_object(self, **kwargs: Any) -> Any:
            raise NoCredentialsError()

        def close(self) -> None:
            pass

    store = ds.S3Store("bucket", client=Client(), sleep=lambda _: None)  # type: ignore[arg-type]
    with pytest.raises(ds.StoreError):
        store.put("wf/r1/checkpoint", b"x")


@pytest.mark.parametrize(
    "fields",
    [
        {"next_step": 7},
        {"next_step": -1},
        {"next_step": "1"},
        {"intent": "oops"},
        {"owner": "someone"},
        {"committed": "3"},
    ],
)
def test_malformed_header_fields_are_corrupt_checkpoint(fields: dict[str, Any]) -> None:
    """A header with a field of the wrong type/range is CorruptCheckpoint, before any step runs."""
    store = ds.MemoryStore()
    ran: list[str] = []
    wf = ds.Workflow("malformed", store=store)
    wf.step(name="a", idempotent=False)(lambda s: ran.append("a"))
    wf.step(name="b")(lambda s: ran.append("b"))
    wf.submit("r1", {})
    rewrite_header(store, ckpt.checkpoint_key("malformed", "r1"), **fields)
    with pytest.raises(ds.CorruptCheckpoint):
        wf.run("r1")
    assert ran == []


def test_worker_survives_a_malformed_checkpoint() -> None:
    """One checkpoint with a malformed owner must not crash the worker's scan."""
    store = ds.MemoryStore()
    wf = ds.Workflow("wmal", store=store)
    wf.step(name="a")(lambda s: s.update(a=1))
    wf.submit("bad", {})
    wf.submit("good", {})
    rewrite_header(store, ckpt.checkpoint_key("wmal", "bad"), owner="someone")
    report = ds.Worker(wf).run(until_idle=True)
    assert report.completed == ["good"]


# --- ownership ----------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads, Python >= 3.12
def test_owner_forked_after_import_is_live(tmp_path: Path) -> None:
    """A run owned by a live process forked after import is RunLocked, not taken over."""
    parent = os.getpid()
    mp = multiprocessing.get_context("fork")
    started, release = mp.Event(), mp.Event()
    url = str(tmp_path / "store")
    ran_in_parent: list[bool] = []

    def make() -> ds.Workflow:
        wf = ds.Workflow("forked", store=url)

        @wf.step()
        def work(state: dict[str, Any]) -> None:
            if os.getpid() == parent:
                ran_in_parent.append(True)
                return
            started.set()
            release.wait(20)

        return wf

    child = mp.Process(target=lambda: make().run("r1", {}))
    child.start()
    try:
        assert started.wait(20)
        with pytest.raises(ds.RunLocked):
            make().run("r1")
    finally:
        release.set()
        child.join(20)
    assert ran_in_parent == []


def test_resolve_refuses_a_run_a_live_process_is_running() -> None:
    """wf.resolve on a run whose step is firing right now must refuse, not fence the owner."""
    store = ds.MemoryStore()
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    wf = ds.Workflow("resolvelive", store=store)

    @wf.step(idempotent=False)
    def charge(state: dict[str, Any]) -> None:
        entered.set()
        release.wait(20)
        state["charged"] = True

    def owner() -> None:
        try:
            wf.run("r1", {})
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert entered.wait(20)
        with pytest.raises(ds.DurableStepsError):
            wf.resolve("r1", fired=True)
    finally:
        release.set()
        t.join(20)
    assert errors == [], f"the live owner was fenced off: {errors}"


# --- worker -------------------------------------------------------------------


def test_worker_does_not_recreate_a_run_deleted_after_its_scan() -> None:
    """A run completed and deleted by another worker after the scan must not start over."""
    inner = ds.MemoryStore()
    keys: list[str] = []

    def charge(state: dict[str, Any], ctx: ds.Context) -> None:
        keys.append(ctx.idempotency_key)

    def make(store: ds.Store) -> ds.Workflow:
        return ds.Workflow(
            "resurrect",
            steps=[ds.step(charge, idempotent=False)],
            store=store,
            on_complete="delete",
        )

    class Racy(Wrapped):
        gets = 0

        def get(self, key: str) -> tuple[bytes, str] | None:
            self.gets += 1
            if self.gets == 2:  # between this worker's scan and its resume,
                make(inner).run("r1")  # another worker completes the run (and deletes it)
            return super().get(key)

    wf = make(Racy(inner))
    wf.submit("r1", {"amount": 5})
    ds.Worker(wf).run(until_idle=True)
    assert len(keys) == 1, f"charged {len(keys)} times with different keys: {keys}"


def test_worker_until_idle_ends_when_a_run_cannot_commit(caplog: pytest.LogCaptureFixture) -> None:
    """A run whose commit fails (unserializable state) must not be re-fired in a hot loop."""
    caplog.set_level(logging.CRITICAL, logger="durable_steps")  # one traceback per re-fire
    calls: list[int] = []
    wf = ds.Workflow("hot", store=ds.MemoryStore())

    @wf.step()
    def bad(state: dict[str, Any]) -> None:
        calls.append(1)
        state["when"] = object()  # not JSON

    wf.submit("r1", {})
    worker = ds.Worker(wf, poll=0.05)
    t = threading.Thread(target=worker.run, kwargs={"until_idle": True}, daemon=True)
    t.start()
    t.join(3)
    stuck = t.is_alive()
    worker.stop()
    t.join(20)
    assert not stuck, f"until_idle never returned; the step ran {len(calls)} times"
    assert len(calls) == 1


# --- serializers and CLI ------------------------------------------------------


def test_json_error_names_the_unencodable_string() -> None:
    """A string JSON cannot encode (lone surrogate) gives SerializationError naming its path."""
    wf = ds.Workflow("surrogate", store=ds.MemoryStore())

    @wf.step()
    def read_dir(state: dict[str, Any]) -> None:
        state["files"] = ["ok.txt", b"caf\xe9".decode("utf-8", "surrogateescape")]

    with pytest.raises(ds.SerializationError) as raised:
        wf.run("r1", {})
    assert raised.value.path == "state['files'][1]"


def test_cli_show_refuses_unsigned_pickle_when_signing_key_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the signing key set, `show --state` refuses a header downgraded to unsigned pickle."""
    url = str(tmp_path / "store")
    wf = ds.Workflow("signed", store=url, serializer="pickle", signing_key="k")
    wf.step(name="a")(lambda s: None)
    wf.run("r1", {"x": 1})
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.mkdir, (str(marker),))

    store = ds.LocalStore(url)
    key = ckpt.checkpoint_key("signed", "r1")
    found = store.get(key)
    assert found is not None
    header, _ = ckpt.decode(found[0], where=key)
    evil = pickle.dumps(Evil())
    store.put(key, ckpt.encode(header.evolve(serializer="pickle"), evil), match=found[1])

    monkeypatch.setenv("DURABLE_STEPS_SIGNING_KEY", "k")
    with pytest.raises(ds.CorruptCheckpoint):  # what wf.run says of the same checkpoint
        ds.Workflow("signed", store=url, serializer="pickle", steps=wf.steps).run("r1")
    code = cli.main(["--store", url, "show", "signed/r1", "--state", "--unsafe-unpickle"])
    assert not marker.exists(), "the CLI unpickled an unsigned payload despite the signing key"
    assert code != 0


def test_retry_default_retries_only_timeouts() -> None:
    """DESIGN's signature Retry(..., on=(TimeoutError,)): by default other errors fail at once."""
    attempts: list[int] = []
    wf = ds.Workflow("retrydefault", store=ds.MemoryStore())

    @wf.step(retry=ds.Retry(attempts=3, wait=0))
    def parse(state: dict[str, Any], ctx: ds.Context) -> None:
        attempts.append(ctx.attempt)
        raise ValueError("a bug, not a transient fault")

    with pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    assert attempts == [1]


def test_local_delete_removes_a_killed_writers_temp_files(tmp_path: Path) -> None:
    """Temp files left by a writer killed mid-write go with the run; the directory goes too."""
    store = ds.LocalStore(tmp_path)
    store.put("wf/r1/checkpoint", b"data")
    run_dir = tmp_path / "wf" / "r1"
    (run_dir / ".tmp-checkpoint-0123456789ab").write_bytes(b"half a checkpoi")
    assert [o.key for o in store.list("")] == ["wf/r1/checkpoint"]  # never listed
    store.delete("wf/r1/checkpoint")
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://[::1/p", "is malformed"),
        ("file:///tmp/x?read_timeout=1", "take no parameters"),
        ("memory://?y=1", "take no parameters"),
        ("s3://b/p?retry_attempts=99999999999999999999", "from 1 to 100"),
        ("s3://b/p?read_timeout=86400", "at most 3600"),
    ],
)
def test_store_urls_that_cannot_mean_what_they_say_are_refused(url: str, message: str) -> None:
    """A malformed URL, parameters a store would ignore, or absurd bounds: DefinitionError."""
    with pytest.raises(ds.DefinitionError, match=message):
        ds.open_store(url)


def test_signed_serializer_wants_a_serializer_object() -> None:
    """SignedSerializer("json", key) says what to pass instead of an AttributeError later."""
    with pytest.raises(ds.DefinitionError, match="wraps a Serializer object"):
        ds.SignedSerializer("json", key="k")  # type: ignore[arg-type]
