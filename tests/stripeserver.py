"""Start ``stripe-stateful-mock`` on loopback: a Stripe API the real SDK can charge.

The npm package ``stripe-stateful-mock`` (pinned in
``tests/emulators/package-lock.json``, installed by ``npm ci --prefix
tests/emulators``) is an Express server that keeps charges, refunds and
customers in memory and deduplicates POSTs by ``Idempotency-Key`` the way
Stripe does: the same key with the same parameters replays the first answer
(header ``Idempotent-Replayed: true``), the same key with other parameters is
a 400 ``idempotency_error``. It runs as a child process in its own process
group, bound to a free 127.0.0.1 port, is stopped by that group's id, and
is ready once an authenticated ``GET /v1/charges`` answers.

What it does (observed with stripe-stateful-mock 0.0.16 and the ``stripe``
SDK 16.1; test_mock_services.py pins these):

* any API key that starts with ``sk_test_`` is accepted (others: 401), and,
  by its source, every key sees the same data. Isolation comes from Connect:
  each connected account (created with :func:`new_account`, addressed with
  ``Stripe-Account``; the ``stripe_account`` fixture) has charges, refunds
  and idempotency keys of its own.
* charges (``source="tok_visa"`` and Stripe's other test tokens) and refunds
  can be created, listed and retrieved; PaymentIntents are not implemented
  (404 ``No matching path``).
* the server keeps no state on disk: a new server starts empty.

The helpers talk plain HTTP with the standard library, so a test can count
what reached "Stripe" without the SDK and without sharing its configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.s3servers import free_port

__all__ = [
    "STRIPE_TEST_KEY",
    "StripeMock",
    "count_charges",
    "count_refunds",
    "list_objects",
    "new_account",
    "start_stripe_mock",
    "stripe_account",
    "stripe_env",
    "stripe_mock",
]

READY_DEADLINE = 60.0
STRIPE_MOCK_DIR = Path(__file__).with_name("emulators") / "node_modules" / "stripe-stateful-mock"
STRIPE_TEST_KEY = "sk_test_durable_steps"  # the mock accepts any sk_test_ key


@dataclass
class StripeMock:
    """A running stripe-stateful-mock: its process, log and base URL."""

    base_url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path = field(repr=False)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL) and wait."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.process.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the leader is gone; leave nothing of its group behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _request(
    base_url: str,
    method: str,
    path: str,
    params: dict[str, str] | None = None,
    stripe_account: str | None = None,
) -> Any:
    """One API request as the SDK would send it (form-encoded), decoded from JSON."""
    query = urllib.parse.urlencode(params or {})
    url = f"{base_url}{path}"
    data = None
    if method == "GET" and query:
        url = f"{url}?{query}"
    elif query:
        data = query.encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {STRIPE_TEST_KEY}")
    if stripe_account is not None:
        request.add_header("Stripe-Account", stripe_account)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def list_objects(
    base_url: str, resource: str, stripe_account: str | None = None, *, page_size: int = 100
) -> list[dict[str, Any]]:
    """Every object of ``resource`` (e.g. ``"charges"``), newest first, all pages."""
    found: list[dict[str, Any]] = []
    params = {"limit": str(page_size)}
    while True:
        page = _request(base_url, "GET", f"/v1/{resource}", params, stripe_account)
        found.extend(page["data"])
        if not page["has_more"]:
            return found
        params["starting_after"] = page["data"][-1]["id"]


def count_charges(base_url: str, stripe_account: str | None = None) -> int:
    """How many charges the mock holds (for ``stripe_account``, default: the platform's)."""
    return len(list_objects(base_url, "charges", stripe_account))


def count_refunds(base_url: str, stripe_account: str | None = None) -> int:
    """How many refunds the mock holds (for ``stripe_account``, default: the platform's)."""
    return len(list_objects(base_url, "refunds", stripe_account))


def new_account(base_url: str) -> str:
    """Create a connected account and return its id: an empty, private Stripe to test on."""
    account = _request(base_url, "POST", "/v1/accounts", {"type": "custom"})
    return str(account["id"])


def stripe_env(base_url: str, stripe_account: str | None = None) -> dict[str, str]:
    """Variables telling a child process where "Stripe" is.

    The ``stripe`` SDK reads none of these by itself: the scripts under test
    pass them on (``stripe.api_key``, ``stripe.api_base``, ``stripe_account=``).
    """
    env = {"STRIPE_API_KEY": STRIPE_TEST_KEY, "STRIPE_API_BASE": base_url}
    if stripe_account is not None:
        env["STRIPE_ACCOUNT"] = stripe_account
    return env


def _wait_ready(server: StripeMock) -> None:
    """Poll until an authenticated ``GET /v1/charges`` answers."""
    end = time.monotonic() + READY_DEADLINE
    last: BaseException | None = None
    while time.monotonic() < end and server.process.poll() is None:
        try:
            _request(server.base_url, "GET", "/v1/charges", {"limit": "1"})
            return
        except (OSError, ValueError) as exc:  # refused, reset, half-started: not yet
            last = exc
            time.sleep(0.05)
    code = server.process.poll()
    server.stop()
    state = f"exited with {code}" if code is not None else f"not ready after {READY_DEADLINE:.0f}s"
    raise RuntimeError(
        f"stripe-stateful-mock at {server.base_url} {state}; last error: {last!r}\n"
        f"--- tail of {server.log_path} ---\n{server.log_tail()}"
    )


def start_stripe_mock(tmpdir: Path | str) -> StripeMock:
    """Start stripe-stateful-mock on a free loopback port and wait until it answers."""
    if not (STRIPE_MOCK_DIR / "package.json").exists():
        raise RuntimeError(
            f"stripe-stateful-mock is not installed at {STRIPE_MOCK_DIR}: "
            "run `npm ci --prefix tests/emulators`"
        )
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("stripe-stateful-mock needs Node.js: no `node` on PATH")
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # The package's own CLI (PORT=...) listens on every interface; this
    # launcher binds the same Express app to loopback only.
    launcher = (
        f"require({json.dumps(str(STRIPE_MOCK_DIR))}).createExpressApp()"
        f".listen({port}, '127.0.0.1', () => console.log('listening on {port}'))"
    )
    log_path = tmp / "stripe-stateful-mock.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [node, "-e", launcher],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            start_new_session=True,
        )
    server = StripeMock(f"http://127.0.0.1:{port}", process, log_path)
    _wait_ready(server)
    return server


@pytest.fixture(scope="session")
def stripe_mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a stripe-stateful-mock started once per session."""
    server = start_stripe_mock(tmp_path_factory.mktemp("stripe-mock"))
    yield server.base_url
    server.stop()


@pytest.fixture
def stripe_account(stripe_mock: str) -> str:
    """A fresh connected account on the session's mock: charges no other test sees."""
    return new_account(stripe_mock)
