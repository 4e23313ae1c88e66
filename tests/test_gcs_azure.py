"""GCSStore and AzureBlobStore over the wire: the emulators' answers, faults, whole runs.

Both emulators are real servers on loopback (tests/cloudservers.py); faults
come from tests/faultproxy.py placed between the store's client and the
emulator. The store conformance suite runs on both from
test_store_conformance.py; here are what is particular to these two stores.
"""

from __future__ import annotations

import email.utils
import http.server
import logging
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

import durable_steps as ds
from durable_steps.stores import _remote
from durable_steps.stores._remote import ClockSkew
from tests import test_crash as crash_suite
from tests import test_runner as runner_suite
from tests.cloudservers import AzuriteServer, CloudServer, FakeGCSServer, start_fake_gcs
from tests.conftest import StoreTarget
from tests.faultproxy import FaultProxy
from tests.s3servers import free_port
from tests.test_s3_runner import FINAL, FaultsBeforeWrites, agent

pytestmark = pytest.mark.cloud

KINDS = ["gcs", "azure"]
WRITE = {"gcs": "POST", "azure": "PUT"}  # the HTTP method of an object write
harness = crash_suite.harness  # the SIGKILL suite's fixture, reused below


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(kind: str, request: pytest.FixtureRequest) -> CloudServer:
    found: CloudServer = request.getfixturevalue(kind)
    return found


@pytest.fixture
def bucket(kind: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{kind}_bucket"))


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def sleeps() -> list[float]:
    """Records the backoff sleeps a store asked for (and never sleeps)."""
    return []


@pytest.fixture
def proxy(server: CloudServer) -> Iterator[FaultProxy]:
    p = FaultProxy(server.endpoint_url).start()
    yield p
    p.stop()


@pytest.fixture
def store(server: CloudServer, bucket: str, prefix: str) -> Iterator[Any]:
    """The store under test, talking to the emulator directly."""
    s = server.open(bucket, prefix)
    yield s
    s.close()


@pytest.fixture
def pstore(
    server: CloudServer, bucket: str, prefix: str, proxy: FaultProxy, sleeps: list[float]
) -> Iterator[Any]:
    """The same store (same prefix), talking through the fault proxy."""
    s = server.open(
        bucket, prefix, endpoint_url=proxy.endpoint_url, sleep=sleeps.append, read_timeout=10
    )
    yield s
    s.close()


# -- what the emulators do (pins the table in tests/cloudservers.py) ---------


def _gcs_upload(server: FakeGCSServer, bucket: str, name: str, kind: str, gen: int) -> int:
    """HTTP status of an upload of ``name`` with ifGenerationMatch=gen, by upload kind."""
    from google.api_core import exceptions as gexc

    if kind == "media":
        return requests.post(
            f"{server.endpoint_url}/upload/storage/v1/b/{bucket}/o",
            params={"uploadType": "media", "name": name, "ifGenerationMatch": gen},
            data=b"media",
            timeout=10,
        ).status_code
    size = 9 * 1024 * 1024 if kind == "resumable" else 10  # > 8 MiB goes resumable
    client = server.client()
    try:
        client.bucket(bucket).blob(name).upload_from_string(
            b"r" * size, if_generation_match=gen, retry=None
        )
    except gexc.GoogleAPICallError as exc:
        return int(exc.code or 0)
    finally:
        client.close()
    return 200


@pytest.fixture(scope="module", params=["memory", "filesystem"])
def gcs_backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FakeGCSServer]:
    """fake-gcs-server on each of its backends (the session's memory one is reused)."""
    if request.param == "memory":
        yield request.getfixturevalue("gcs")
        return
    server = start_fake_gcs(tmp_path_factory.mktemp("fake-gcs-fs"), backend="filesystem")
    yield server
    server.stop()


def test_fake_gcs_enforces_generations_on_multipart_uploads_only(
    gcs_backend: FakeGCSServer,
) -> None:
    """fake-gcs-server refuses a failed ifGenerationMatch (412) on multipart uploads, ignores it
    on media and resumable uploads and on deletes: on both backends."""
    bucket = gcs_backend.make_bucket()
    client = gcs_backend.client()
    try:
        for kind in ["multipart", "media", "resumable"]:
            name = f"o-{kind}"
            blob = client.bucket(bucket).blob(name)
            blob.upload_from_string(b"first", retry=None)
            expected = 412 if kind == "multipart" else 200
            assert _gcs_upload(gcs_backend, bucket, name, kind, 0) == expected, kind
            assert _gcs_upload(gcs_backend, bucket, name, kind, 1) == expected, kind
        blob = client.bucket(bucket).get_blob("o-multipart")
        assert _gcs_upload(gcs_backend, bucket, "o-multipart", "multipart", blob.generation) == 200
        assert _gcs_upload(gcs_backend, bucket, "never", "multipart", 1) == 412
        stale = client.bucket(bucket).get_blob("o-multipart").generation - 1
        client.bucket(bucket).blob("o-multipart").delete(if_generation_match=stale, retry=None)
        assert client.bucket(bucket).get_blob("o-multipart") is None, "stale delete deleted"
    finally:
        client.close()


def test_azurite_conditional_answers(azure: AzuriteServer) -> None:
    """Azurite: 409 BlobAlreadyExists for create-only, 412 ConditionNotMet for If-Match
    (stale or missing), on uploads and deletes; 404 for a plain delete of a missing blob."""
    from azure.core import MatchConditions
    from azure.core.exceptions import HttpResponseError

    def answer(call: Callable[[], object]) -> tuple[int, str]:
        try:
            call()
        except HttpResponseError as exc:
            return int(exc.status_code or 0), str(exc.response.headers["x-ms-error-code"])
        return 200, ""

    if_match = {"match_condition": MatchConditions.IfNotModified}
    with azure.client() as client:
        container = client.get_container_client(azure.make_bucket())
        blob = container.get_blob_client("k")
        e1 = blob.upload_blob(b"one")["etag"]
        e2 = blob.upload_blob(b"two", overwrite=True, etag=e1, **if_match)["etag"]
        assert answer(lambda: blob.upload_blob(b"x")) == (409, "BlobAlreadyExists")
        stale = (412, "ConditionNotMet")
        assert answer(lambda: blob.upload_blob(b"x", overwrite=True, etag=e1, **if_match)) == stale
        assert answer(lambda: blob.delete_blob(etag=e1, **if_match)) == stale
        assert answer(lambda: blob.delete_blob(etag=e2, **if_match)) == (200, "")
        assert answer(lambda: blob.delete_blob(etag=e2, **if_match)) == stale
        assert answer(lambda: blob.upload_blob(b"x", overwrite=True, etag=e2, **if_match)) == stale
        assert answer(blob.delete_blob) == (404, "BlobNotFound")


def test_conditional_delete_carries_the_version(
    kind: str, pstore: Any, proxy: FaultProxy, store: Any
) -> None:
    """A conditional delete sends the read version as ifGenerationMatch / If-Match."""
    version = pstore.put("wf/r/checkpoint", b"x")
    pstore.delete("wf/r/checkpoint", match=version)
    (delete,) = [seen for seen in proxy.seen if seen.method == "DELETE"]
    if kind == "gcs":
        assert f"ifGenerationMatch={version}" in delete.path
    else:
        assert delete.headers["If-Match"] == version
    assert store.get("wf/r/checkpoint") is None


# -- faults through the proxy -------------------------------------------------


def test_proxy_is_transparent(kind: str, pstore: Any, proxy: FaultProxy) -> None:
    """Without faults: one request per operation (write, read, list, delete)."""
    data = bytes(range(256)) * 300
    v = pstore.put("wf/k", data)
    assert pstore.get("wf/k") == (data, v)
    assert [i.key for i in pstore.list("wf/")] == ["wf/k"]
    pstore.delete("wf/k")
    assert proxy.counts == {WRITE[kind]: 1, "GET": 2, "DELETE": 1}


def test_dropped_request_is_retried_and_logged(
    kind: str, pstore: Any, proxy: FaultProxy, sleeps: list[float], caplog: Any
) -> None:
    """A write whose connection dies before reaching the server is retried, logged at WARNING."""
    proxy.drop_before(method=WRITE[kind])
    with caplog.at_level(logging.WARNING, "durable_steps.stores"):
        v = pstore.put("wf/k", b"data")
    assert pstore.get("wf/k") == (b"data", v)
    assert proxy.counts[WRITE[kind]] == 2
    assert len(sleeps) == 1
    (line,) = [r for r in caplog.records if r.name == "durable_steps.stores"]
    assert line.levelno == logging.WARNING
    assert "wf/k: attempt 1 of 4 failed" in line.getMessage()


def test_lost_response_on_create_is_not_a_conflict(
    kind: str, pstore: Any, proxy: FaultProxy, store: Any
) -> None:
    """A create that landed but lost its response: the refused retry is recognised as ours."""
    proxy.drop_after(method=WRITE[kind])
    v = pstore.put("wf/k", b"ours")
    assert proxy.counts == {WRITE[kind]: 2, "GET": 1}  # the retry was refused, then read back
    assert store.get("wf/k") == (b"ours", v)


def test_lost_response_on_replace_is_not_a_conflict(
    kind: str, pstore: Any, proxy: FaultProxy
) -> None:
    """A compare-and-swap that landed but lost its response is ours; the chain goes on."""
    v1 = pstore.put("wf/k", b"one")
    proxy.drop_after(method=WRITE[kind])
    v2 = pstore.put("wf/k", b"two", match=v1)
    assert v2 != v1
    assert pstore.get("wf/k") == (b"two", v2)
    v3 = pstore.put("wf/k", b"three", match=v2)
    assert pstore.get("wf/k") == (b"three", v3)


@pytest.mark.parametrize("status", [500, 503])
def test_transient_answers_are_retried(
    kind: str, pstore: Any, proxy: FaultProxy, sleeps: list[float], status: int
) -> None:
    """500 and 503 answers to a write are retried with backoff and then succeed."""
    proxy.status(status, method=WRITE[kind], times=2)
    v = pstore.put("wf/k", b"data")
    assert pstore.get("wf/k") == (b"data", v)
    assert proxy.counts[WRITE[kind]] == 3
    assert len(sleeps) == 2
    assert all(0 <= s <= 5.0 for s in sleeps)


def test_reads_lists_and_deletes_are_retried(pstore: Any, proxy: FaultProxy) -> None:
    """Reads, listings and deletes survive dropped connections, lost answers and 503s."""
    v = pstore.put("wf/k", b"x")
    proxy.drop_after(method="GET")
    proxy.status(503, method="GET")
    assert pstore.get("wf/k") == (b"x", v)
    proxy.drop_before(method="GET")
    assert [i.key for i in pstore.list("wf/")] == ["wf/k"]
    proxy.status(500, method="DELETE")
    proxy.drop_after(method="DELETE")  # deleted, answer lost: the retry finds it gone
    pstore.delete("wf/k", match=v)
    assert pstore.get("wf/k") is None
    assert proxy.pending() == 0


def test_genuine_conflict_after_lost_response(
    kind: str, pstore: Any, proxy: FaultProxy, store: Any
) -> None:
    """Ours landed, its response was lost, then another writer replaced it: CheckpointConflict."""
    v1 = pstore.put("wf/k", b"one")

    def other_writer(_: float) -> None:  # acts during our backoff
        current = store.get("wf/k")
        assert current is not None
        assert current[0] == b"ours"
        store.put("wf/k", b"theirs", match=current[1])

    proxy.drop_after(method=WRITE[kind])
    pstore._retry.sleep = other_writer
    with pytest.raises(ds.CheckpointConflict, match="no longer version"):
        pstore.put("wf/k", b"ours", match=v1)
    assert store.get("wf/k")[0] == b"theirs"


def test_first_attempt_refusal_is_a_conflict_at_once(
    kind: str, pstore: Any, proxy: FaultProxy, sleeps: list[float]
) -> None:
    """A refusal on the first attempt is a conflict: one request, no read-back, no sleep."""
    pstore.put("wf/k", b"1")
    proxy.clear()
    with pytest.raises(ds.CheckpointConflict, match="already exists"):
        pstore.put("wf/k", b"2")
    assert proxy.counts == {WRITE[kind]: 1}
    assert sleeps == []


def test_retries_are_bounded(
    kind: str, server: CloudServer, bucket: str, proxy: FaultProxy
) -> None:
    """A service that keeps answering 503 gives StoreError (not a conflict) after N attempts."""
    sleeps: list[float] = []
    s = server.open(
        bucket, "bounded", endpoint_url=proxy.endpoint_url, retry_attempts=3, sleep=sleeps.append
    )
    proxy.status(503, method=WRITE[kind], times=3)
    with pytest.raises(ds.StoreError, match=r"kept failing .* after 3 attempts") as info:
        s.put("wf/k", b"x")
    assert not isinstance(info.value, ds.CheckpointConflict)
    assert proxy.counts[WRITE[kind]] == 3
    assert len(sleeps) == 2
    s.close()


def test_list_pages_by_token(pstore: Any, proxy: FaultProxy) -> None:
    """list() follows page tokens (2 objects a page), each page retried on its own."""
    names = [f"p/{i:02d}" for i in range(5)]
    for n in names:
        pstore.put(n, b"x")
    pstore.put("q/other", b"x")
    pstore._page_size = 2
    proxy.clear()
    listing = pstore.list("p/")
    first = [next(listing).key, next(listing).key]
    proxy.drop_after(method="GET")  # the second page's answer is lost once
    assert first + [i.key for i in listing] == names
    assert proxy.counts == {"GET": 4}  # 3 pages, one of them twice


def test_unreachable_endpoint_is_store_error(server: CloudServer, bucket: str) -> None:
    """Nothing listening at the endpoint: StoreError naming the object, after the retries."""
    s = server.open(
        bucket,
        "p",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        retry_attempts=2,
        sleep=lambda _: None,
    )
    with pytest.raises(ds.StoreError, match=r"cannot reach .* after 2 attempts") as info:
        s.get("wf/k")
    assert "/p/wf/k" in str(info.value)
    s.close()


def test_missing_bucket_is_store_error(kind: str, server: CloudServer) -> None:
    """A missing bucket/container: a clear StoreError on the run's first write, naming it."""
    s = server.open("no-such-bucket", "p")
    if kind == "gcs":
        assert s.get("wf/k") is None  # GCS answers 404 for both; the write says which
    with pytest.raises(ds.StoreError, match="'no-such-bucket' does not exist"):
        s.put("wf/k", b"x")
    s.close()


def test_clock_skew_from_the_date_header(
    server: CloudServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clock_skew() is None before any response, then this host's lead over the service."""
    s = server.open(bucket, "skew")
    assert s.clock_skew() is None
    s.get("wf/k")
    skew = s.clock_skew()
    assert skew is not None
    assert -2 < skew < 2  # same machine; the Date header has one-second resolution
    # This host's clock is stepped 300 s ahead: once the readings from before the
    # step are older than the window, the estimate follows.
    clock = ds.stores._remote.time  # type: ignore[attr-defined]
    real_time, real_monotonic = clock.time, clock.monotonic
    monkeypatch.setattr(clock, "time", lambda: real_time() + 300)
    monkeypatch.setattr(clock, "monotonic", lambda: real_monotonic() + ClockSkew.WINDOW + 1)
    s.get("wf/k")
    assert 298 < s.clock_skew() < 302
    s.close()
    reading = ClockSkew()
    for bad in (None, "", "yesterday", "Tue, 01 Dec 2026 09:00:00 -0000"):
        reading.observe(bad)
    assert reading.value is None, "an unusable Date header is no reading"


def test_gcs_without_credentials_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """gs:// with no Application Default Credentials: StoreError naming the ways to get them."""
    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud ADC file
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # not on Google Cloud: no metadata server
    with pytest.raises(ds.StoreError, match="application-default login"):
        ds.open_store("gs://bucket/prefix")


def test_store_urls_and_configuration_from_the_environment(
    server: CloudServer, bucket: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gs:// and az:// open the stores from STORAGE_EMULATOR_HOST / the connection string."""
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    scheme = {"gcs": "gs", "azure": "az"}[kind]
    s = ds.open_store(f"{scheme}://{bucket}/env/prefix")
    assert type(s).__name__ == {"gcs": "GCSStore", "azure": "AzureBlobStore"}[kind]
    assert repr(s) == f"{type(s).__name__}('{scheme}://{bucket}/env/prefix')"
    v = s.put("k", b"x")
    assert s.get("k") == (b"x", v)
    s.close()


def _sdk_default_client(kind: str, server: CloudServer, endpoint_url: str) -> Any:
    """A client as a user would make it, with the SDK's default retries on."""
    if kind == "gcs":
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="test",
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
            client_options={"api_endpoint": endpoint_url},
        )
    from azure.storage.blob import BlobServiceClient

    assert isinstance(server, AzuriteServer)
    return BlobServiceClient.from_connection_string(server.connection_string(endpoint_url))


def test_sdk_retries_never_resend_behind_our_back(
    kind: str, server: CloudServer, bucket: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's own client (from the environment) and a client with the SDK's default
    retries both send exactly one object request per attempt of ours."""
    for name, value in server.child_env({}).items():
        monkeypatch.setenv(name, value.replace(server.endpoint_url, proxy.endpoint_url))
    scheme = {"gcs": "gs", "azure": "az"}[kind]
    own = ds.open_store(f"{scheme}://{bucket}/own")
    theirs = type(own)(
        bucket, "theirs", client=_sdk_default_client(kind, server, proxy.endpoint_url)
    )
    for s in (own, theirs):
        slept: list[float] = []
        s._retry.sleep = slept.append
        proxy.clear()
        proxy.status(503, method=WRITE[kind])
        v = s.put("k", b"x")
        assert s.get("k") == (b"x", v)
        # (a user's GCS client may also fetch the bucket's metadata once, for tracing)
        objects = [r.method for r in proxy.seen if not r.path.split("?")[0].endswith(bucket)]
        assert sorted(objects) == ["GET", WRITE[kind], WRITE[kind]], s
        assert len(slept) == 1, "the retry was ours"
        if s is own:
            assert len(proxy.seen) == 3, "the store's own client sends nothing else"
        s.close()


def test_azure_rejected_key_is_store_error(azure: AzuriteServer, azure_bucket: str) -> None:
    """A wrong account key: a StoreError naming the 403, not retried. (Azurite answers
    AuthorizationFailure where Azure says AuthenticationFailed.)"""
    from azure.storage.blob import BlobServiceClient

    sleeps: list[float] = []
    wrong = azure.connection_string().replace(azure.key, "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXk=")
    client = BlobServiceClient.from_connection_string(wrong)
    s = ds.AzureBlobStore(azure_bucket, "p", client=client, sleep=sleeps.append)
    with pytest.raises(ds.StoreError, match=r"AuthorizationFailure \(HTTP 403\); access denied"):
        s.put("wf/k", b"x")
    assert sleeps == []
    client.close()


def test_azure_without_an_account_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """az:// without AZURE_STORAGE_CONNECTION_STRING or a client: StoreError saying so."""
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    with pytest.raises(ds.StoreError, match="set AZURE_STORAGE_CONNECTION_STRING"):
        ds.open_store("az://container/prefix")


def test_import_loads_no_cloud_sdk() -> None:
    """`import durable_steps` imports neither SDK; the store names resolve lazily."""
    code = (
        "import sys, durable_steps as ds\n"
        "loaded = [m for m in sys.modules if m.startswith(('google.cloud', 'azure', 'boto3'))]\n"
        "assert not loaded, loaded\n"
        "assert ds.GCSStore.__name__ == 'GCSStore' and 'google.cloud.storage' in sys.modules\n"
        "assert ds.AzureBlobStore.__name__ == 'AzureBlobStore'\n"
        "assert {'GCSStore', 'AzureBlobStore'} <= set(ds.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_extra_is_named() -> None:
    """Without google-cloud-storage installed, ds.GCSStore says which extra to install."""
    code = (
        "import sys\n"
        "sys.modules['google.cloud.storage'] = None  # as if not installed\n"
        "import durable_steps as ds\n"
        "try:\n"
        "    ds.GCSStore\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True
    ).stdout
    assert "pip install 'durable-steps[gcs]'" in out


# -- whole runs ------------------------------------------------------------------


def test_request_budget_and_faults_on_every_kind_of_write(
    kind: str, server: CloudServer, bucket: str, proxy: FaultProxy, prefix: str
) -> None:
    """A run costs 1 read and 1 write per idempotent step (2 per non-idempotent); with
    lost responses, 5xx, drops and timeouts on its writes it completes, each payment once."""
    s = server.open(bucket, prefix, endpoint_url=proxy.endpoint_url, sleep=lambda _: None)
    ledger: list[tuple[int, str]] = []
    assert agent(s, ledger, set()).run("clean", {"log": [], "passes": 0}) == FINAL
    # the run's GET and its writes, with the index's: the registry (2 LISTs, which are
    # GETs here, and 2 writes: a new store), the marker, the done entry, the marker's DELETE
    assert proxy.counts == {"GET": 1 + 2, WRITE[kind]: 4 + 2 * 4 + 1, "DELETE": 1}
    proxy.clear()
    method = WRITE[kind]
    schedule: dict[int, Callable[[], None]] = {
        1: lambda: proxy.drop_after(method=method),  # the create landed, its answer was lost
        3: lambda: proxy.drop_after(method=method),  # the intent landed, its answer was lost
        4: lambda: proxy.status(503, method=method),
        5: lambda: proxy.status(500, method=method),
        7: lambda: proxy.drop_before(method=method),
        9: lambda: proxy.drop_after(method=method),  # the final commit, terminal marker
    }
    final = agent(FaultsBeforeWrites(s, schedule), ledger, set()).run(  # type: ignore[arg-type]
        "faulty", {"log": [], "passes": 0}
    )
    assert final == FINAL
    assert proxy.pending() == 0, "every scheduled fault was hit"
    assert [it for it, _ in ledger] == [0, 1, 0, 1], "each payment fired exactly once"
    s.close()
    fresh = server.open(bucket, prefix)
    assert agent(fresh, ledger, set()).run("faulty") == FINAL  # completed: runs nothing
    assert len(ledger) == 4
    fresh.close()


@pytest.mark.slow
def test_write_outliving_the_read_timeout_is_retried(
    kind: str, server: CloudServer, bucket: str, proxy: FaultProxy
) -> None:
    """A write stuck past the read timeout (then landing late) is retried, no false conflict."""
    s = server.open(
        bucket, "slow", endpoint_url=proxy.endpoint_url, read_timeout=0.5, sleep=lambda _: None
    )
    proxy.delay(1.5, method=WRITE[kind])
    v1 = s.put("wf/k", b"one")
    proxy.delay(1.5, method=WRITE[kind])
    v2 = s.put("wf/k", b"two", match=v1)
    proxy.wait_idle()  # the delayed originals reach the server late and are refused
    assert s.get("wf/k") == (b"two", v2)
    s.close()


RUNNER_TESTS = [
    runner_suite.test_in_doubt_refires_with_same_key_by_default,
    runner_suite.test_straggler_is_fenced,
    runner_suite.test_key_is_stable_across_retries_and_resume,
    runner_suite.test_resume_claims_with_its_first_write,
]


@pytest.mark.parametrize("check", RUNNER_TESTS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_runner_guarantees(check: Callable[..., None], store: Any, caplog: Any) -> None:
    """test_runner.py's checks of resume, in-doubt re-fire, fencing and claims, on these stores."""
    wanted = check.__code__.co_varnames[: check.__code__.co_argcount]
    given = {"store": store, "run": lambda wf, run_id, state=None: wf.run(run_id, state)}
    given["caplog"] = caplog
    check(**{name: given[name] for name in wanted})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("durable_target", "crash"),
    [
        pytest.param(k, c, id=f"{k}-{':'.join(map(str, c))}")
        for k in KINDS
        for c in [("after-intent", "charge", 0), ("after-commit", "send", 2)]
    ],
    indirect=["durable_target"],
)
def test_sigkill_then_resume(
    durable_target: StoreTarget, harness: Callable[[str], Any], crash: tuple[str, str, int]
) -> None:
    """test_crash.py's SIGKILL check (a child killed at a write boundary, then resumed)."""
    crash_suite.test_sigkill_then_resume_matches_uncrashed_run(harness, crash)


# -- what the shared retry loop (_remote.py) says and measures ------------------


class _Busy(http.server.BaseHTTPRequestHandler):
    """Answers 503 (a body of several lines) to everything, dated an hour behind us."""

    def date_time_string(self, timestamp: float | None = None) -> str:
        return email.utils.formatdate(time.time() - 3600, usegmt=True)

    def do_GET(self) -> None:
        body = b'<?xml version="1.0"?>\n<Error>\n<Code>ServerBusy</Code>\n</Error>'
        self.send_response(503)
        self.send_header("x-ms-error-code", "ServerBusy")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def busy() -> Iterator[str]:
    """The URL of a real HTTP server that is always busy (see _Busy)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def test_busy_service_is_logged_on_one_line_and_not_read_for_the_clock(
    kind: str, server: CloudServer, bucket: str, busy: str, caplog: Any
) -> None:
    """503s: each retry is one log line naming service, op and object; the StoreError counts
    attempts and seconds; the Date of a 5xx answer (an hour off) is no clock reading."""
    s = server.open(bucket, "busy", endpoint_url=busy, retry_attempts=2, sleep=lambda _: None)
    with (
        caplog.at_level(logging.WARNING, "durable_steps.stores"),
        pytest.raises(ds.StoreError) as info,
    ):
        s.get("wf/k")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "durable_steps.stores"]
    service = {"gcs": "GCS", "azure": "Azure Blob Storage"}[kind]
    assert line.startswith(f"{service} GET "), line
    assert "/busy/wf/k: attempt 1 of 2 failed" in line
    assert "HTTP 503" in line
    assert "\n" not in line
    assert re.search(
        r"kept failing for GET \S+/busy/wf/k: .*HTTP 503\)? after 2 attempts in \d+\.\d s\.",
        str(info.value),
    ), info.value
    assert s.clock_skew() is None
    s.close()


def test_a_single_attempt_is_counted_as_one(server: CloudServer, bucket: str) -> None:
    """retry_attempts=1 at a dead endpoint: 'after 1 attempt in N s', not '1 attempts'."""
    s = server.open(bucket, "p", endpoint_url=f"http://127.0.0.1:{free_port()}", retry_attempts=1)
    with pytest.raises(ds.StoreError, match=r"cannot reach .* after 1 attempt in \d+\.\d s: "):
        s.get("wf/k")
    s.close()


def test_clock_skew_reads_the_middle_of_the_dated_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Date of this very second reads as half a second ahead of us (its midpoint); a 5xx
    answer's Date is not read."""
    now = 1_800_000_000.0
    monkeypatch.setattr(_remote.time, "time", lambda: now)
    reading = ClockSkew()
    reading.observe(email.utils.formatdate(now, usegmt=True), 200)
    assert reading.value == -0.5
    reading.observe(email.utils.formatdate(now - 60, usegmt=True), 503)
    assert reading.value == -0.5
