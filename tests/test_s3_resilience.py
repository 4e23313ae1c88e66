"""S3Store's options, retry log, clock skew, conditional-write probe and error mapping.

Against the real servers (SeaweedFS and moto), with faults from tests/faultproxy.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import botocore.exceptions
import pytest

import durable_steps as ds
from durable_steps.errors import (
    CheckpointConflict,
    ConditionalWritesUnsupported,
    DefinitionError,
    StoreError,
)
from durable_steps.stores.s3 import PROBE_PREFIX, S3Store
from tests.faultproxy import FaultProxy
from tests.s3servers import S3Server

pytestmark = pytest.mark.s3

FAST = "retry_wait=0.01&retry_max_wait=0.05"


@pytest.fixture(params=["seaweedfs", "moto"])
def server(request: pytest.FixtureRequest) -> S3Server:
    server: S3Server = request.getfixturevalue(request.param)
    return server


@pytest.fixture
def bucket(server: S3Server) -> str:
    return server.make_bucket()


@pytest.fixture
def env(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """boto3's environment configuration points at ``server`` (as for a child process)."""
    for var, value in server.child_env({}).items():
        monkeypatch.setenv(var, value)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    return server


@pytest.fixture
def proxy(server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(server.endpoint_url, (server.access_key, server.secret_key, server.region))
    yield p.start()
    p.stop()


def via(proxy: FaultProxy, bucket: str, query: str = "") -> S3Store:
    """A store made from an s3:// URL, talking to the server through ``proxy``."""
    url = f"s3://{bucket}/p?endpoint_url={proxy.endpoint_url}&{FAST}"
    store = ds.open_store(url + (f"&{query}" if query else ""))
    assert isinstance(store, S3Store)
    return store


# -- 1. timeouts and retries: URL, environment, defaults, the retry log --------


def test_url_parameters_configure_the_store(env: S3Server, bucket: str) -> None:
    """s3://...?read_timeout=&connect_timeout=&retry_attempts=&endpoint_url= reach the client."""
    url = (
        f"s3://{bucket}/q?read_timeout=7.5&connect_timeout=3&retry_attempts=2"
        f"&retry_wait=0.25&retry_max_wait=1&endpoint_url={env.endpoint_url}"
    )
    store = ds.open_store(url)
    assert isinstance(store, S3Store)
    try:
        config: Any = store._client.meta.config
        assert (config.read_timeout, config.connect_timeout) == (7.5, 3)
        assert store.options.retry_attempts == 2
        assert (store.options.retry_wait, store.options.retry_max_wait) == (0.25, 1.0)
        assert store._client.meta.endpoint_url == env.endpoint_url
        assert store.prefix == "q"
        version = store.put("k", b"via url")
        assert store.get("k") == (b"via url", version)
    finally:
        store.close()


def test_url_wins_over_env_which_wins_over_defaults(
    env: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL parameter beats DURABLE_STEPS_S3_*, which beats the default."""
    monkeypatch.setenv("DURABLE_STEPS_S3_READ_TIMEOUT", "9")
    monkeypatch.setenv("DURABLE_STEPS_S3_RETRY_ATTEMPTS", "2")
    monkeypatch.setenv("DURABLE_STEPS_S3_VERIFY_CONDITIONAL_WRITES", "false")
    store = ds.open_store(f"s3://{bucket}/e?read_timeout=4")
    assert isinstance(store, S3Store)
    config: Any = store._client.meta.config
    assert config.read_timeout == 4  # URL
    assert store.options.retry_attempts == 2  # environment
    assert store.options.verify_conditional_writes is False  # environment
    assert config.connect_timeout == 5  # default
    store.close()
    plain = S3Store(bucket, "e", retry_attempts=3)  # an argument wins over env too
    assert plain.options.retry_attempts == 3
    assert plain._client.meta.config.read_timeout == 9  # type: ignore[attr-defined]
    plain.close()


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("read_timout=10", "'read_timout'"),
        ("read_timeout=abc", "read_timeout='abc'"),
        ("read_timeout=0", "read_timeout='0'"),
        ("connect_timeout=nan", "connect_timeout='nan'"),
        ("retry_attempts=0", "retry_attempts='0'"),
        ("retry_attempts=2.5", "retry_attempts='2.5'"),
        ("retry_wait=-1", "retry_wait='-1'"),
        ("verify_conditional_writes=maybe", "verify_conditional_writes='maybe'"),
        ("read_timeout", "'read_timeout' has no value"),
        ("read_timeout=1&read_timeout=2", "'read_timeout' is given twice"),
        ("endpoint_url=ftp://host", "endpoint_url='ftp://host'"),
    ],
)
def test_bad_url_parameter_is_a_definition_error(query: str, named: str) -> None:
    """An unknown or malformed URL parameter is a DefinitionError naming it."""
    with pytest.raises(DefinitionError) as info:
        ds.open_store(f"s3://bucket/prefix?{query}")
    assert named in str(info.value)
    if "timout" in query:
        assert "connect_timeout, endpoint_url, read_timeout, retry_attempts" in str(info.value)


@pytest.mark.parametrize(
    ("var", "value", "named"),
    [
        ("DURABLE_STEPS_S3_READ_TIMEOUT", "soon", "DURABLE_STEPS_S3_READ_TIMEOUT"),
        ("DURABLE_STEPS_S3_RETRIES", "3", "DURABLE_STEPS_S3_RETRY_ATTEMPTS"),
    ],
)
def test_bad_environment_variable_is_a_definition_error(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, named: str
) -> None:
    """A malformed or unknown DURABLE_STEPS_S3_* variable is a DefinitionError naming it."""
    monkeypatch.setenv(var, value)
    with pytest.raises(DefinitionError, match=var) as info:
        S3Store("bucket")
    assert named in str(info.value)


def test_timeouts_for_a_clients_own_config_are_refused(server: S3Server) -> None:
    """Timeouts or an endpoint with client= would be ignored, so they are an error."""
    client = server.client()
    with pytest.raises(DefinitionError, match="read_timeout"):
        S3Store("b", client=client, read_timeout=3)
    client.close()


def test_defaults_give_up_within_a_documented_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults: 5 s connect, 20 s read, 4 attempts; a silent service costs ≤ 103.5 s."""
    for var in [v for v in os.environ if v.startswith("DURABLE_STEPS_S3_")]:
        monkeypatch.delenv(var)
    store = S3Store("bucket", verify_conditional_writes=False)
    config: Any = store._client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (5, 20)
    assert store.options.retry_attempts == 4
    assert store.worst_case_seconds == 4 * (5 + 20) + 0.5 + 1 + 2 == 103.5
    store.close()


def test_silent_endpoint_gives_up_in_bound_and_logs_every_retry(
    env: S3Server, bucket: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A service that never answers: each retry logged (key, n of N, cause, wait), then a
    StoreError within worst_case_seconds."""
    store = via(proxy, bucket, "read_timeout=0.5&connect_timeout=0.5&retry_attempts=3")
    proxy.delay(30, method="GET", times=3)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="durable_steps"),
        pytest.raises(StoreError) as info,
    ):
        store.get("wf/run/checkpoint")
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed <= store.worst_case_seconds + 1.0
    retries = [r for r in caplog.records if r.name == "durable_steps"]
    assert [r.levelno for r in retries] == [logging.WARNING] * 2
    for n, record in enumerate(retries, 1):
        text = record.getMessage()
        assert f"s3://{bucket}/p/wf/run/checkpoint" in text
        assert f"attempt {n} of 3" in text
        assert "ReadTimeoutError" in text
        assert "retrying in" in text
    assert "after 3 attempts" in str(info.value)
    store.close()


# -- 2. botocore's text inside our sentences ----------------------------------


def test_embedded_botocore_text_has_no_doubled_punctuation(
    env: S3Server, bucket: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """'Connection was closed ... "url".' inside our message does not end in '..'."""
    store = via(proxy, bucket, "retry_attempts=2")
    proxy.drop_before(method="GET", times=2)
    with (
        caplog.at_level(logging.WARNING, logger="durable_steps"),
        pytest.raises(StoreError) as info,
    ):
        store.get("k")
    message = str(info.value)
    assert "Connection was closed before we received a valid response" in message
    assert isinstance(info.value.__cause__, botocore.exceptions.ConnectionClosedError)
    for text in (message, *(r.getMessage() for r in caplog.records)):
        assert ".." not in text.replace("...", ""), text
    store.close()


def test_botocore_error_before_sending_has_no_doubled_punctuation(server: S3Server) -> None:
    """A BotoCoreError raised before the request is sent ('...: v9.') is embedded cleanly."""
    client = server.client(signature_version="v9")
    store = S3Store("bucket", client=client, verify_conditional_writes=False)
    with pytest.raises(StoreError, match="Unknown Signature Version") as info:
        store.get("k")
    assert ".." not in str(info.value)
    client.close()


# -- 3. clock skew ----------------------------------------------------------------


def test_clock_skew_is_none_then_near_zero_on_this_host(env: S3Server, bucket: str) -> None:
    """None before any answer; a server on this host is measured within 2 s of our clock."""
    store = S3Store(bucket, "clock")
    assert store.clock_skew() is None
    assert store.get("missing") is None  # a 404 carries a Date too
    skew = store.clock_skew()
    assert skew is not None
    assert abs(skew) < 2.0
    store.close()


@pytest.mark.parametrize("offset", [120.0, -120.0])
def test_clock_skew_of_a_skewed_service_is_measured(
    env: S3Server, bucket: str, proxy: FaultProxy, offset: float
) -> None:
    """A service whose Date is 120 s ahead (or behind) is measured within 2 s, from any thread."""
    store = via(proxy, bucket)
    proxy.date_offset = offset
    version = store.put("k", b"x")
    threads = [threading.Thread(target=store.get, args=("k",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    skew = store.clock_skew()
    assert skew is not None
    assert abs(skew - -offset) < 2.0, skew
    assert store.get("k") == (b"x", version)
    store.close()


# -- 4. the conditional-write probe -----------------------------------------------


def test_probe_passes_on_real_servers_and_leaves_nothing(
    env: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """On a real server the probe is 2 create-only PUTs (the second refused) and 1 DELETE."""
    store = via(proxy, bucket)
    assert proxy.counts == {}  # not at construction
    store.put("wf/r/checkpoint", b"first write")
    probe = [s for s in proxy.seen if PROBE_PREFIX in s.path]
    assert [(s.method, s.headers.get("If-None-Match")) for s in probe] == [
        ("PUT", "*"),
        ("PUT", "*"),
        ("DELETE", None),
    ]
    assert [i.key for i in store.list("")] == ["wf/r/checkpoint"]
    proxy.clear()
    again = via(proxy, bucket)  # same endpoint and bucket, same process: no second probe
    again.put("wf/r2/checkpoint", b"x")
    assert proxy.counts == {"PUT": 1}
    store.close()
    again.close()


def test_service_ignoring_conditions_is_refused(
    env: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """A service that drops If-None-Match/If-Match is refused before the first write, for
    every store on that bucket; the opt-outs still write."""
    proxy.strip_conditions()
    store = via(proxy, bucket)
    with pytest.raises(ConditionalWritesUnsupported) as info:
        store.put("wf/r/checkpoint", b"never written")
    message = str(info.value)
    assert "accepted a second create-only write" in message
    assert "unsafe_unconditional_writes=True" in message
    assert proxy.endpoint_url in message
    assert list(store.list("")) == []  # the probe object was deleted, nothing else written
    proxy.clear()
    with pytest.raises(ConditionalWritesUnsupported):
        via(proxy, bucket).put("wf/r/checkpoint", b"x")
    assert proxy.counts == {}  # the verdict is cached: no second probe
    unverified = via(proxy, bucket, "verify_conditional_writes=false")
    unverified.put("wf/r/checkpoint", b"written")
    with pytest.warns(RuntimeWarning, match="WITHOUT conditions"):
        unsafe = S3Store(
            bucket,
            "p",
            endpoint_url=proxy.endpoint_url,
            unsafe_unconditional_writes=True,
        )
    unsafe.put("wf/r2/checkpoint", b"written")
    assert sorted(i.key for i in store.list("")) == ["wf/r/checkpoint", "wf/r2/checkpoint"]
    for s in (store, unverified, unsafe):
        s.close()


# -- 5. every failure is one of ours ---------------------------------------------


def test_truncated_bodies_are_retried_then_store_errors(
    env: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """A GET or LIST body cut short is retried; if it keeps happening, a StoreError."""
    store = via(proxy, bucket, "retry_attempts=2")
    version = store.put("k", b"0123456789" * 100)
    proxy.truncate(method="GET", key="/k")
    assert store.get("k") == (b"0123456789" * 100, version)
    proxy.truncate(method="GET", key="/k", times=2)
    with pytest.raises(StoreError, match="after 2 attempts"):
        store.get("k")  # urllib3's ProtocolError, which botocore does not wrap here
    proxy.truncate(method="GET", key="list-type", times=2)
    with pytest.raises(StoreError):
        list(store.list(""))
    assert proxy.pending() == 0
    store.close()


def test_list_failures_are_store_errors(env: S3Server, proxy: FaultProxy) -> None:
    """LIST on a missing bucket, or through connections that keep dropping, is a StoreError."""
    missing = via(proxy, f"no-such-bucket-{uuid.uuid4().hex[:8]}")
    with pytest.raises(StoreError, match="does not exist"):
        list(missing.list(""))
    proxy.drop_before(method="GET", times=2)
    with pytest.raises(StoreError, match="cannot reach"):
        list(via(proxy, env.make_bucket(), "retry_attempts=2").list(""))
    missing.close()


def test_lost_write_then_5xx_is_a_store_error(
    env: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """A PUT that landed but lost its answer, then 503s on every retry: StoreError, no conflict."""
    store = via(proxy, bucket, "retry_attempts=3")
    store.check_conditional_writes()
    proxy.drop_after()
    proxy.status(503, times=2)
    with pytest.raises(StoreError, match="ServiceUnavailable") as info:
        store.put("wf/r/checkpoint", b"ours")
    assert not isinstance(info.value, CheckpointConflict)
    assert store.get("wf/r/checkpoint") is not None  # it had landed
    store.close()


def test_write_kept_after_a_lost_response_is_logged(
    env: S3Server, bucket: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A PUT that landed but lost its answer: the refused retry is read back, kept, and
    logged at WARNING (as GCSStore and AzureBlobStore do)."""
    store = via(proxy, bucket)
    store.check_conditional_writes()
    proxy.drop_after(method="PUT")
    with caplog.at_level(logging.WARNING, logger="durable_steps"):
        version = store.put("wf/r/checkpoint", b"ours")
    assert store.get("wf/r/checkpoint") == (b"ours", version)
    (kept,) = [r for r in caplog.records if "refused by our own earlier attempt" in r.getMessage()]
    assert kept.name == "durable_steps"
    assert f"s3://{bucket}/p/wf/r/checkpoint" in kept.getMessage()
    assert version in kept.getMessage()
    store.close()
