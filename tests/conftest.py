"""Fixtures shared by the suite: every store kind, including real S3 servers.

``store`` runs a test once per store: memory, local, and a fresh bucket on each
real S3-compatible server (SeaweedFS and moto, started once per session on
loopback by :mod:`tests.s3servers`). The GCS and Azure emulators
(:mod:`tests.cloudservers`) are kinds too, ``CLOUD_KINDS``, which the tests
that cover them ask for by name. ``store_target`` gives the same stores as
a URL plus the environment a child process needs to open it, for tests that
crash a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from tests import forkserver
from tests.budget import FULL_ENV
from tests.cloudservers import (
    AzuriteServer,
    CloudServer,
    FakeGCSServer,
    start_azurite,
    start_fake_gcs,
)
from tests.openaiserver import openai_fake  # noqa: F401 (a fixture)
from tests.s3servers import S3Server, start_moto, start_seaweedfs
from tests.stripeserver import stripe_account, stripe_mock  # noqa: F401 (fixtures)

S3_KINDS = ["seaweedfs", "moto"]
CLOUD_KINDS = ["gcs", "azure"]  # emulators: fake-gcs-server, Azurite
STORE_KINDS = ["memory", "local", *S3_KINDS]
PERSISTENT_KINDS = ["local", *S3_KINDS]  # those a second process can open
_SCHEMES = {"gcs": "gs", "azure": "az"}


def one_s3_kind_each(cases: list[Any]) -> list[tuple[str, Any]]:
    """Each case paired with ONE real S3 server, alternating in list order.

    A crash matrix proves its kill points on the local store; over the wire,
    running every point on both servers doubles the cost and proves the same
    code path twice. Alternating keeps every point over the wire once per run
    and every server exercised by about half of them, the same ones each run.
    """
    return [(S3_KINDS[i % len(S3_KINDS)], case) for i, case in enumerate(cases)]


def _kind_params(kinds: list[str]) -> list[object]:
    marks = {
        **dict.fromkeys(S3_KINDS, pytest.mark.s3),
        **dict.fromkeys(CLOUD_KINDS, pytest.mark.cloud),
    }
    return [pytest.param(k, marks=marks[k]) if k in marks else k for k in kinds]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run every case of the crash-point and server matrices (tests marked matrix), "
        "not only the sample a plain run takes; CI runs with --full",
    )


def pytest_configure(config: pytest.Config) -> None:
    """--full also runs every example of the property tests (see ``tests/budget.py``)."""
    if config.getoption("--full"):
        os.environ[FULL_ENV] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --full, leave out the matrix cases beyond each matrix's sample."""
    if config.getoption("--full"):
        return
    kept = [item for item in items if item.get_closest_marker("matrix") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(autouse=True)
def _close_the_event_loop_left_open(request: pytest.FixtureRequest) -> Iterator[None]:
    """Close the event loop a test left set on this thread (not running).

    ``run_sync`` of pydantic-ai and of the Agents SDK keep the thread's loop open,
    as they would until a program exits. A later ``asyncio.run()`` drops it, and
    its garbage collection then warns (unclosed loop, its self-pipe) inside some
    other test, which ``filterwarnings = error`` fails. The browser tests keep
    Playwright's loop for their module: they are left alone.
    """
    yield
    if request.node.get_closest_marker("ui") is not None:
        return
    local = getattr(asyncio.get_event_loop_policy(), "_local", None)  # CPython's default policy
    loop = getattr(local, "_loop", None)
    if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_running():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            if not loop.is_closed():
                loop.close()
            asyncio.set_event_loop(None)


@pytest.fixture(scope="session", autouse=True)
def _fork_servers() -> Iterator[None]:
    """Stops the fork servers (``tests/forkserver.py``) the suite's modules started."""
    yield
    forkserver.close_all()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_moto(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCSServer]:
    server = start_fake_gcs(tmp_path_factory.mktemp("fake-gcs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    server = start_azurite(tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_bucket(gcs: FakeGCSServer) -> str:
    return gcs.make_bucket()


@pytest.fixture(scope="session")
def azure_bucket(azure: AzuriteServer) -> str:
    return azure.make_bucket()


@dataclass
class StoreTarget:
    """A store as a child process would open it: a URL and environment."""

    kind: str
    url: str
    env: dict[str, str] = field(default_factory=dict)
    server: S3Server | CloudServer | None = None

    def open(self) -> ds.Store:
        """Open the store in this process (same configuration as the child)."""
        if self.server is None:
            return ds.open_store(self.url)
        if isinstance(self.server, CloudServer):
            return self.server.store(self.url)
        bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
        return ds.S3Store(bucket, prefix, client=self.server.client())

    def child_env(self) -> dict[str, str]:
        """``os.environ`` plus what the child needs for this store."""
        if self.server is not None:
            return self.server.child_env(dict(os.environ))
        return {**os.environ, **self.env}


def _target(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    if kind == "memory":
        return StoreTarget(kind, "memory://")
    if kind == "local":
        return StoreTarget(kind, str(tmp_path / "store"))
    server: S3Server | CloudServer = request.getfixturevalue(kind)
    # One bucket per server, a fresh prefix per test: on SeaweedFS every new
    # bucket costs volume allocation, and prefixes isolate tests just as well.
    bucket = request.getfixturevalue(f"{kind}_bucket")
    url = f"{_SCHEMES.get(kind, 's3')}://{bucket}/t-{uuid.uuid4().hex[:12]}"
    return StoreTarget(kind, url, server.env(), server)


@pytest.fixture(scope="session")
def seaweedfs_bucket(seaweedfs: S3Server) -> str:
    return seaweedfs.make_bucket()


@pytest.fixture(scope="session")
def moto_bucket(moto: S3Server) -> str:
    return moto.make_bucket()


@pytest.fixture(params=_kind_params(STORE_KINDS))
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """Every kind of store, as a target (URL + environment)."""
    return _target(request.param, request, tmp_path)


@pytest.fixture(params=_kind_params(PERSISTENT_KINDS))
def durable_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The stores a second process can open: local and each real S3 server."""
    return _target(request.param, request, tmp_path)


@pytest.fixture
def store(store_target: StoreTarget) -> Iterator[ds.Store]:
    """Every kind of store, opened, and closed after the test."""
    opened = store_target.open()
    yield opened
    opened.close()


@pytest.fixture(autouse=True)
def _isolated_default_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No test may write ./.durable_steps in the checkout or inherit a store or
    # signing key from the developer's shell.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DURABLE_STEPS_STORE", raising=False)
    monkeypatch.delenv("DURABLE_STEPS_SIGNING_KEY", raising=False)
