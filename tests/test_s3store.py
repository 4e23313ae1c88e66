"""S3Store against real S3-compatible servers (SeaweedFS and moto), with injected faults."""

from __future__ import annotations

import http.client
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import botocore.exceptions
import pytest

from durable_steps.errors import (
    CheckpointConflict,
    ConditionalWritesUnsupported,
    StoreError,
)
from durable_steps.stores.s3 import S3Store
from tests.faultproxy import FaultProxy
from tests.s3servers import S3Server, free_port, start_moto, start_seaweedfs

pytestmark = pytest.mark.s3

SERVERS: dict[str, Callable[[Any], S3Server]] = {
    "seaweedfs": start_seaweedfs,
    "moto": start_moto,
}


# -- fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module", params=list(SERVERS))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Server]:
    """Each real server, once: conftest's session-wide one when it provides it."""
    try:
        shared: S3Server = request.getfixturevalue(request.param)
    except pytest.FixtureLookupError:
        pass
    else:
        yield shared
        return
    srv = SERVERS[request.param](tmp_path_factory.mktemp(request.param))
    yield srv
    srv.stop()


@pytest.fixture
def bucket(server: S3Server) -> str:
    return server.make_bucket()


@pytest.fixture
def client(server: S3Server) -> Iterator[Any]:
    c = server.client()
    yield c
    c.close()


@pytest.fixture
def sleeps() -> list[float]:
    """Records the backoff sleeps a store asked for (and never sleeps)."""
    return []


def probed(store: S3Store, proxy: FaultProxy | None = None) -> S3Store:
    """``store`` after its one-time conditional-write probe, so tests count only their own
    requests and their faults hit their own requests (the probe has tests of its own)."""
    store.check_conditional_writes()
    if proxy is not None:
        proxy.clear()
    return store


@pytest.fixture
def store(bucket: str, client: Any, sleeps: list[float]) -> S3Store:
    return probed(S3Store(bucket, "runs/prod", client=client, sleep=sleeps.append))


@pytest.fixture
def proxy(server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(server.endpoint_url).start()
    yield p
    p.stop()


@pytest.fixture
def pclient(server: S3Server, proxy: FaultProxy) -> Iterator[Any]:
    """A client that talks to the server through the fault proxy."""
    c = server.client(endpoint_url=proxy.endpoint_url, read_timeout=10)
    yield c
    c.close()


@pytest.fixture
def pstore(bucket: str, pclient: Any, sleeps: list[float], proxy: FaultProxy) -> S3Store:
    return probed(S3Store(bucket, "runs/prod", client=pclient, sleep=sleeps.append), proxy)


def key() -> str:
    return f"wf/{uuid.uuid4().hex[:12]}"


def raw(client: Any, bucket: str, full_key: str) -> bytes:
    return bytes(client.get_object(Bucket=bucket, Key=full_key)["Body"].read())


# -- what the servers do (pins the notes in s3servers.py) --------------------


def test_server_conditional_semantics(server: S3Server, bucket: str, client: Any) -> None:
    """Each server answers conditional PUTs as recorded in tests/s3servers.py."""

    def status(**kw: Any) -> tuple[int, str]:
        try:
            resp = client.put_object(Bucket=bucket, Body=b"x", **kw)
        except botocore.exceptions.ClientError as exc:
            return exc.response["ResponseMetadata"]["HTTPStatusCode"], exc.response["Error"]["Code"]
        return resp["ResponseMetadata"]["HTTPStatusCode"], resp["ETag"]

    etag = client.put_object(Bucket=bucket, Key="k", Body=b"one", IfNoneMatch="*")["ETag"]
    assert client.get_object(Bucket=bucket, Key="k")["ETag"] == etag
    assert status(Key="k", IfNoneMatch="*") == (412, "PreconditionFailed")
    client.put_object(Bucket=bucket, Key="k", Body=b"two", IfMatch=etag)
    assert status(Key="k", IfMatch=etag) == (412, "PreconditionFailed")
    missing = status(Key="missing", IfMatch=etag)
    expected = {"seaweedfs": (412, "PreconditionFailed"), "moto": (404, "NoSuchKey")}
    assert missing == expected[server.name]


# -- the Store protocol on both servers --------------------------------------


def test_round_trip(store: S3Store) -> None:
    """A create-only put returns the version that get then reports with the bytes."""
    k = key()
    version = store.put(k, b"hello")
    assert store.get(k) == (b"hello", version)


def test_get_missing_returns_none(store: S3Store) -> None:
    """A key that was never written reads as None."""
    assert store.get(key()) is None


def test_compare_and_swap_chain(store: S3Store) -> None:
    """Each If-Match write on the current version succeeds and yields the next version."""
    k = key()
    v = store.put(k, b"0")
    for i in range(1, 4):
        v = store.put(k, str(i).encode(), match=v)
    assert store.get(k) == (b"3", v)


def test_create_only_refused_when_exists(store: S3Store, bucket: str) -> None:
    """A create-only put onto an existing key is a CheckpointConflict and overwrites nothing."""
    k = key()
    v = store.put(k, b"first")
    with pytest.raises(CheckpointConflict) as info:
        store.put(k, b"second")
    assert bucket in str(info.value)
    assert k in str(info.value)
    assert "another writer" in str(info.value)
    assert store.get(k) == (b"first", v)


def test_stale_if_match_refused(store: S3Store) -> None:
    """A compare-and-swap against a stale version is a CheckpointConflict."""
    k = key()
    v1 = store.put(k, b"1")
    v2 = store.put(k, b"2", match=v1)
    with pytest.raises(CheckpointConflict):
        store.put(k, b"3", match=v1)
    assert store.get(k) == (b"2", v2)


def test_if_match_on_deleted_key_refused(store: S3Store) -> None:
    """A compare-and-swap on a key deleted meanwhile is a CheckpointConflict (412 or 404)."""
    k = key()
    v = store.put(k, b"1")
    store.delete(k)
    with pytest.raises(CheckpointConflict):
        store.put(k, b"2", match=v)
    assert store.get(k) is None


def test_delete_idempotent(store: S3Store) -> None:
    """Deleting a key twice, or a key that never existed, is not an error."""
    k = key()
    store.put(k, b"x")
    store.delete(k)
    store.delete(k)
    store.delete(key())
    assert store.get(k) is None


def test_list_returns_only_ours_with_relative_keys(
    store: S3Store, client: Any, bucket: str
) -> None:
    """list() yields only our objects, keys relative to the prefix, with ETag, size, mtime."""
    before = time.time() - 120
    versions = {k: store.put(k, k.encode()) for k in ("a/1", "a/2", "b/1")}
    for outside in ("runs/prodx/a/1", "runs/a/1", "other/a/1"):
        client.put_object(Bucket=bucket, Key=outside, Body=b"not ours")
    found = {info.key: info for info in store.list("")}
    assert set(found) == set(versions)
    for k, info in found.items():
        assert info.version == versions[k]
        assert info.size == len(k)
        assert before < info.modified < time.time() + 120
    assert sorted(i.key for i in store.list("a/")) == ["a/1", "a/2"]
    assert sorted(i.key for i in store.list("a")) == ["a/1", "a/2"]
    assert list(store.list("zzz")) == []


def test_list_follows_continuation_tokens(store: S3Store, client: Any) -> None:
    """list() pages through ListObjectsV2 (forced to 2 keys a page) and yields each key once."""

    def small_pages(params: dict[str, Any], **_: Any) -> None:
        params["MaxKeys"] = 2

    client.meta.events.register("before-parameter-build.s3.ListObjectsV2", small_pages)
    calls: list[int] = []
    client.meta.events.register("before-send.s3.ListObjectsV2", lambda **_: calls.append(1))
    names = [f"p/{i:02d}" for i in range(7)]
    for n in names:
        store.put(n, b"x")
    assert sorted(i.key for i in store.list("p/")) == names
    assert len(calls) == 4


def test_prefix_isolation(bucket: str, client: Any) -> None:
    """Stores on different prefixes of one bucket never see or touch each other's keys."""
    a = S3Store(bucket, "/tenant-a/", client=client)
    b = S3Store(bucket, "tenant-a//b", client=client)
    assert repr(a) == f"S3Store('s3://{bucket}/tenant-a')"
    assert repr(b) == f"S3Store('s3://{bucket}/tenant-a/b')"
    va = a.put("k", b"from a")
    vb = b.put("k", b"from b")
    assert a.get("k") == (b"from a", va)
    assert b.get("k") == (b"from b", vb)
    assert raw(client, bucket, "tenant-a/b/k") == b"from b"
    b.delete("k")
    assert a.get("k") == (b"from a", va)
    assert [i.key for i in b.list("")] == []
    assert sorted(i.key for i in a.list("")) == ["k"]  # a's list sees b's area: it is under a/


def test_every_put_is_conditional(store: S3Store, client: Any) -> None:
    """Every PutObject the store sends carries If-None-Match: * or If-Match: <ETag>."""
    headers: list[dict[str, Any]] = []
    client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: headers.append(dict(request.headers))
    )
    k = key()
    v = store.put(k, b"1")
    v = store.put(k, b"2", match=v)
    with pytest.raises(CheckpointConflict):
        store.put(k, b"3")
    assert len(headers) == 3
    assert [h.get("If-None-Match") for h in headers] == [b"*", None, b"*"]
    assert headers[1].get("If-Match") not in (None, b"")


def test_missing_bucket_is_store_error(server: S3Server, client: Any) -> None:
    """A nonexistent bucket gives a StoreError naming the bucket, chained to botocore's error."""
    name = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    store = S3Store(name, "p", client=client, sleep=lambda _: None)
    for op in (lambda: store.get("k"), lambda: store.put("k", b"x")):
        with pytest.raises(StoreError) as info:
            op()
        assert not isinstance(info.value, CheckpointConflict)
        assert name in str(info.value)
        assert "does not exist" in str(info.value)
        assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)


def test_create_race_has_one_winner(server: S3Server, bucket: str, client: Any) -> None:
    """Eight threads racing a create-only put on one key: exactly one wins, seven conflict."""
    store = S3Store(bucket, "race", client=client, sleep=lambda _: None)
    k = key()
    barrier = threading.Barrier(8)
    results: dict[int, str | BaseException] = {}

    def writer(i: int) -> None:
        barrier.wait()
        try:
            results[i] = store.put(k, f"writer {i}".encode())
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    winners = [i for i, r in results.items() if isinstance(r, str)]
    losers = [r for r in results.values() if not isinstance(r, str)]
    assert len(results) == 8
    assert len(winners) == 1, results
    assert all(isinstance(r, CheckpointConflict) for r in losers), losers
    assert store.get(k) == (f"writer {winners[0]}".encode(), results[winners[0]])


def test_env_configuration_without_client(
    server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without client=, boto3's own config (AWS_ENDPOINT_URL_S3) is used, botocore retries off."""
    for var, value in server.child_env().items():
        if var.startswith("AWS_"):
            monkeypatch.setenv(var, value)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "9")  # our explicit Config must win
    store = S3Store(bucket, "env")
    try:
        assert store._client.meta.endpoint_url == server.endpoint_url
        config: Any = store._client.meta.config
        assert config.retries["total_max_attempts"] == 1
        v = store.put("k", b"via env")
        assert store.get("k") == (b"via env", v)
    finally:
        store.close()


# -- providers without conditional writes ------------------------------------


def test_gcs_endpoint_refused_at_construction(server: S3Server) -> None:
    """A client for GCS's S3 interop endpoint is refused when the store is made."""
    for url in (
        "https://storage.googleapis.com",
        "https://storage.europe-west1.rep.googleapis.com",
    ):
        gcs = server.client(endpoint_url=url)
        try:
            with pytest.raises(
                ConditionalWritesUnsupported, match="unsafe_unconditional_writes=True"
            ):
                S3Store("bucket", client=gcs)
        finally:
            gcs.close()


def test_gcs_endpoint_from_env_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS_ENDPOINT_URL_S3 pointing at GCS is refused too (and the store's own client is closed)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://storage.googleapis.com")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "auto")
    with pytest.raises(ConditionalWritesUnsupported):
        S3Store("bucket")


def test_b2_not_implemented_is_unsupported(
    pstore: S3Store, proxy: FaultProxy, sleeps: list[float]
) -> None:
    """B2's 501 NotImplemented to a conditional PUT is ConditionalWritesUnsupported, not retried."""
    proxy.not_implemented()
    with pytest.raises(ConditionalWritesUnsupported, match="unsafe_unconditional_writes=True"):
        pstore.put(key(), b"x")
    assert proxy.counts["PUT"] == 1
    assert sleeps == []


def test_unsafe_mode_warns_and_writes_unconditionally(bucket: str, client: Any) -> None:
    """unsafe_unconditional_writes=True warns at construction and sends no condition headers."""
    headers: list[dict[str, Any]] = []
    client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: headers.append(dict(request.headers))
    )
    with pytest.warns(RuntimeWarning, match="WITHOUT conditions"):
        store = S3Store(bucket, "unsafe", client=client, unsafe_unconditional_writes=True)
    k = key()
    store.put(k, b"1")
    v = store.put(k, b"2")  # would be a conflict in safe mode
    store.put(k, b"3", match='"stale"')
    assert store.get(k)[0] == b"3"  # type: ignore[index]
    assert v
    assert all("If-None-Match" not in h and "If-Match" not in h for h in headers)


def test_unsafe_mode_allows_gcs(server: S3Server) -> None:
    """With the explicit opt-out, a GCS endpoint is accepted (with a warning)."""
    gcs = server.client(endpoint_url="https://storage.googleapis.com")
    try:
        with pytest.warns(RuntimeWarning):
            S3Store("bucket", client=gcs, unsafe_unconditional_writes=True)
    finally:
        gcs.close()


# -- faults through the proxy -------------------------------------------------


def test_proxy_is_transparent(pstore: S3Store, proxy: FaultProxy) -> None:
    """Without faults the proxy passes signed requests and bodies through unchanged."""
    k = key()
    data = bytes(range(256)) * 300
    v = pstore.put(k, data)
    assert pstore.get(k) == (data, v)
    assert [i.key for i in pstore.list(k)] == [k]
    pstore.delete(k)
    assert proxy.counts == {"PUT": 1, "GET": 2, "DELETE": 1}


def test_drop_before_is_retried(pstore: S3Store, proxy: FaultProxy, sleeps: list[float]) -> None:
    """A PUT whose connection dies before reaching the server is retried and succeeds."""
    k = key()
    proxy.drop_before()
    v = pstore.put(k, b"data")
    assert pstore.get(k) == (b"data", v)
    assert proxy.counts["PUT"] == 2
    assert len(sleeps) == 1


def test_lost_response_on_create_is_not_a_conflict(
    pstore: S3Store, proxy: FaultProxy, client: Any, bucket: str
) -> None:
    """A create-only PUT that landed but lost its response: the 412 retry is recognised as ours."""
    k = key()
    proxy.drop_after()
    v = pstore.put(k, b"ours")
    assert proxy.counts == {"PUT": 2, "GET": 1}
    assert raw(client, bucket, f"runs/prod/{k}") == b"ours"
    assert pstore.get(k) == (b"ours", v)


def test_lost_response_on_if_match_is_not_a_conflict(pstore: S3Store, proxy: FaultProxy) -> None:
    """An If-Match PUT that landed but lost its response: the refused retry is known as ours."""
    k = key()
    v1 = pstore.put(k, b"one")
    proxy.drop_after()
    v2 = pstore.put(k, b"two", match=v1)
    assert v2 != v1
    assert pstore.get(k) == (b"two", v2)
    # and the chain continues from the recovered version
    v3 = pstore.put(k, b"three", match=v2)
    assert pstore.get(k) == (b"three", v3)


@pytest.mark.parametrize("fault", ["status500", "status503", "slowdown", "conflict409"])
def test_transient_answers_are_retried(
    pstore: S3Store, proxy: FaultProxy, sleeps: list[float], fault: str
) -> None:
    """500, 503, 503 SlowDown and 409 ConditionalRequestConflict are retried and then succeed."""
    injectors: dict[str, Callable[[], None]] = {
        "status500": lambda: proxy.status(500),
        "status503": lambda: proxy.status(503),
        "slowdown": proxy.slowdown,
        "conflict409": proxy.conflict409,
    }
    inject = injectors[fault]
    k = key()
    inject()
    inject()
    v = pstore.put(k, b"data")
    assert pstore.get(k) == (b"data", v)
    assert proxy.counts["PUT"] == 3
    assert len(sleeps) == 2
    assert all(0 <= s <= 5.0 for s in sleeps)


def test_reads_lists_and_deletes_are_retried(pstore: S3Store, proxy: FaultProxy) -> None:
    """GET, LIST and DELETE survive dropped connections and 503s too."""
    k = key()
    v = pstore.put(k, b"x")
    proxy.drop_after(method="GET")
    proxy.slowdown(method="GET")
    assert pstore.get(k) == (b"x", v)
    proxy.drop_before(method="GET")
    assert [i.key for i in pstore.list(k)] == [k]
    proxy.status(500, method="DELETE")
    pstore.delete(k)
    assert pstore.get(k) is None
    assert proxy.pending() == 0


def test_delay_past_read_timeout_is_retried(
    server: S3Server, proxy: FaultProxy, bucket: str, sleeps: list[float]
) -> None:
    """A PUT stuck past the read timeout (then landing late) is retried without a false conflict."""
    c = server.client(endpoint_url=proxy.endpoint_url, read_timeout=0.5)
    try:
        store = probed(S3Store(bucket, "slow", client=c, sleep=sleeps.append), proxy)
        k = key()
        proxy.delay(1.5)
        v1 = store.put(k, b"one")
        proxy.delay(1.5)
        v2 = store.put(k, b"two", match=v1)
        proxy.wait_idle()  # the delayed originals reach the server late and are refused
        assert store.get(k) == (b"two", v2)
        assert proxy.counts["PUT"] == 4
    finally:
        c.close()


def test_genuine_conflict_after_dropped_request(
    pstore: S3Store, proxy: FaultProxy, store: S3Store
) -> None:
    """Another writer creating the key while our PUT is retried gives CheckpointConflict."""
    k = key()
    proxy.drop_before()

    def other_writer(_: float) -> None:  # the other writer acts during our backoff
        store.put(k, b"theirs")

    pstore._sleep = other_writer
    with pytest.raises(CheckpointConflict):
        pstore.put(k, b"ours")
    assert store.get(k) is not None
    assert store.get(k)[0] == b"theirs"  # type: ignore[index]


def test_genuine_conflict_after_lost_response(
    pstore: S3Store, proxy: FaultProxy, store: S3Store
) -> None:
    """Ours landed, its response was lost, then another writer replaced it: CheckpointConflict."""
    k = key()
    v1 = pstore.put(k, b"one")

    def other_writer(_: float) -> None:
        current = store.get(k)
        assert current is not None
        assert current[0] == b"ours"
        store.put(k, b"theirs", match=current[1])

    proxy.drop_after()
    pstore._sleep = other_writer
    with pytest.raises(CheckpointConflict):
        pstore.put(k, b"ours", match=v1)
    assert store.get(k)[0] == b"theirs"  # type: ignore[index]


def test_first_attempt_412_is_never_retried(
    pstore: S3Store, proxy: FaultProxy, sleeps: list[float]
) -> None:
    """A 412 on the first attempt is a conflict at once: one PUT, no read-back, no sleep."""
    k = key()
    pstore.put(k, b"1")
    proxy.clear()
    with pytest.raises(CheckpointConflict):
        pstore.put(k, b"2")
    assert proxy.counts == {"PUT": 1}
    assert sleeps == []


def test_retries_are_bounded(bucket: str, server: S3Server, proxy: FaultProxy) -> None:
    """A service that keeps answering 503 gives StoreError after retry_attempts attempts."""
    c = server.client(endpoint_url=proxy.endpoint_url)
    sleeps: list[float] = []
    try:
        store = S3Store(bucket, client=c, retry_attempts=3, retry_max_wait=0.5, sleep=sleeps.append)
        probed(store, proxy)
        proxy.slowdown(times=3)
        with pytest.raises(StoreError, match="SlowDown") as info:
            store.put(key(), b"x")
        assert not isinstance(info.value, CheckpointConflict)
        assert proxy.counts["PUT"] == 3
        assert len(sleeps) == 2
        assert all(s <= 0.5 for s in sleeps)
    finally:
        c.close()


def test_unreachable_endpoint_is_store_error(server: S3Server) -> None:
    """Nothing listening at the endpoint: bounded retries, then a StoreError naming the endpoint."""
    url = f"http://127.0.0.1:{free_port()}"
    c = server.client(endpoint_url=url, connect_timeout=1)
    sleeps: list[float] = []
    try:
        store = S3Store("b", client=c, retry_attempts=4, sleep=sleeps.append)
        with pytest.raises(StoreError, match="cannot reach") as info:
            store.get("k")
        assert url in str(info.value)
        assert len(sleeps) == 3
    finally:
        c.close()


def test_proxy_forwards_chunked_bodies(
    server: S3Server, proxy: FaultProxy, pclient: Any, client: Any, bucket: str
) -> None:
    """A Transfer-Encoding: chunked PUT (presigned, through the proxy) arrives intact."""
    url = pclient.generate_presigned_url(
        "put_object", Params={"Bucket": bucket, "Key": "chunked"}, ExpiresIn=300
    )
    parsed = urlsplit(url)
    data = b"0123456789abcdef" * 5000
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        conn.request(
            "PUT",
            f"{parsed.path}?{parsed.query}",
            body=iter([data[:30000], data[30000:]]),
            encode_chunked=True,
        )
        resp = conn.getresponse()
        resp.read()
    finally:
        conn.close()
    assert resp.status == 200
    assert "chunked" in proxy.seen[-1].headers.get("Transfer-Encoding", "")
    assert raw(client, bucket, "chunked") == data


def test_lost_response_behind_botocore_retries_is_not_a_conflict(
    server: S3Server, bucket: str, proxy: FaultProxy, client: Any
) -> None:
    """With a user's client that retries inside botocore, a refusal after a lost response is
    checked against the object, so our own landed write is not taken for a conflict."""
    retrying = server.client(
        endpoint_url=proxy.endpoint_url,
        read_timeout=10,
        retries={"total_max_attempts": 3, "mode": "standard"},
    )
    store = probed(S3Store(bucket, "runs/prod", client=retrying, sleep=lambda _: None), proxy)
    k = key()
    proxy.drop_after()
    v1 = store.put(k, b"ours")
    assert proxy.counts == {"PUT": 2, "GET": 1}  # botocore resent it; we read it back
    assert store.get(k) == (b"ours", v1)
    client.put_object(Bucket=bucket, Key=f"runs/prod/{k}", Body=b"theirs")
    with pytest.raises(CheckpointConflict):
        store.put(k, b"mine", match=v1)  # a genuine conflict is still one
    retrying.close()
