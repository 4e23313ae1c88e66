"""Who the page takes for "this machine": the socket's peer, never a header.

``durable-steps ui`` itself runs in a child process (the real command, its real
uvicorn options), with ``FORWARDED_ALLOW_IPS=*`` as common container images
preset it. A peer on the network that says ``X-Forwarded-For: 127.0.0.1`` must
get no token and act on nothing; a reverse proxy on this machine (the documented
setup) works with ``--trust-proxy``, and without it its requests only read.

The proxy is played by requests from 127.0.0.1 carrying exactly the headers
nginx (``proxy_set_header Host $host``, ``X-Forwarded-For``), Caddy and Traefik
send, and the browser's ``Origin`` of the public name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")
pytest.importorskip("uvicorn", reason="the ui extra is not installed")

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from tests.test_ui_http import _own_address, failed_run, fetch, free_port, message, token_of

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ui
PROXIED = {
    "Host": "ops.example.com",
    "X-Forwarded-For": "203.0.113.9",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Host": "ops.example.com",
    "X-Real-IP": "203.0.113.9",
}


class Ui:
    """``durable-steps ui`` in a child process."""

    def __init__(self, store: Path, *options: str) -> None:
        self.store, self.port = store, free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FORWARDED_ALLOW_IPS": "*"}
        command = [sys.executable, "-m", "durable_steps", "--store", str(store), "ui"]
        self.proc = subprocess.Popen(
            [*command, "--port", str(self.port), *options],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                code, _, _ = fetch(f"http://127.0.0.1:{self.port}/api/runs")
                if code == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out, err = self.proc.communicate(timeout=5)
                raise AssertionError(f"the ui did not start: {out}{err}")
            time.sleep(0.1)
        self.token = self.page("/runs/w/r1")[1]

    def page(self, path: str, host: str = "127.0.0.1", **headers: str) -> tuple[int, str | None]:
        code, _, body = fetch(f"http://{host}:{self.port}{path}", headers=headers or None)
        return code, token_of(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.communicate(timeout=10)


@pytest.fixture
def ui(tmp_path: Path) -> Iterator[Any]:
    made: list[Ui] = []
    failed_run(ds.LocalStore(tmp_path / "s"))

    def start(*options: str) -> Ui:
        made.append(Ui(tmp_path / "s", *options))
        return made[-1]

    yield start
    for one in made:
        one.stop()


def _delete(ui: Ui, host: str, token: str, **headers: str) -> tuple[int, str]:
    found = ds.LocalStore(ui.store).get("w/r1/checkpoint")
    nonce = "" if found is None else ckpt.decode(found[0], where="test")[0].run_nonce
    fields = {"action": "delete", "workflow": "w", "run_id": "r1", "token": token, "nonce": nonce}
    code, _, body = fetch(
        f"http://{host}:{ui.port}/actions", {**fields, "confirm": "yes"}, headers or None
    )
    return code, body


def test_a_spoofed_forwarded_for_from_the_network_gets_no_token(ui: Any, tmp_path: Path) -> None:
    """With FORWARDED_ALLOW_IPS=* and --host 0.0.0.0, a network peer saying
    X-Forwarded-For: 127.0.0.1 is still a network peer: no token, its POST refused."""
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    app = ui("--host", "0.0.0.0")
    assert app.token is not None  # loopback, no proxy header: this machine
    spoof = {"X-Forwarded-For": "127.0.0.1", "Forwarded": "for=127.0.0.1", "X-Real-IP": "127.0.0.1"}
    code, token = app.page("/runs/w/r1", address, **spoof)
    assert code == 200
    assert token is None
    code, body = _delete(app, address, app.token, **spoof)
    assert code == 403, body
    assert "only from this machine" in message(body)
    assert ds.LocalStore(tmp_path / "s").get("w/r1/checkpoint") is not None


def test_trust_proxy_gives_no_network_peer_the_token(ui: Any, tmp_path: Path) -> None:
    """--trust-proxy trusts a proxy on this machine only: a network peer that sends
    the proxy's headers is still a network peer."""
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    app = ui("--host", "0.0.0.0", "--trust-proxy", "--allow-host", "ops.example.com")
    code, token = app.page("/runs/w/r1", address, **PROXIED)
    assert code == 200
    assert token is None
    code, body = _delete(app, address, app.token, **PROXIED)
    assert code == 403, body
    assert ds.LocalStore(tmp_path / "s").get("w/r1/checkpoint") is not None


def test_a_proxy_on_this_machine_acts_only_with_trust_proxy(ui: Any, tmp_path: Path) -> None:
    """The documented setup: `durable-steps ui --allow-host ops.example.com --trust-proxy`
    on loopback behind nginx/Caddy/Traefik (Host without a port, X-Forwarded-*, the
    browser's Origin https://ops.example.com). Without --trust-proxy the proxied page
    reads only and says which option acts; with it, the delete goes through."""
    app = ui("--allow-host", "ops.example.com")
    code, token = app.page("/runs/w/r1", **PROXIED)
    assert code == 200  # the Host without a port is the allowed name
    assert token is None
    code, body = _delete(app, "127.0.0.1", app.token, **PROXIED, Origin="https://ops.example.com")
    assert code == 403, body
    assert "--trust-proxy" in message(body)
    assert ds.LocalStore(tmp_path / "s").get("w/r1/checkpoint") is not None
    app.stop()

    app = ui("--allow-host", "ops.example.com", "--trust-proxy")
    code, token = app.page("/runs/w/r1", **PROXIED)
    assert code == 200
    assert token == app.token
    code, body = _delete(app, "127.0.0.1", app.token, **PROXIED, Origin="https://ops.example.com")
    assert code == 200, body
    assert ds.LocalStore(tmp_path / "s").get("w/r1/checkpoint") is None
    code, _, body = fetch(f"http://127.0.0.1:{app.port}/", headers={**PROXIED, "Host": "evil.test"})
    assert code == 421  # the Host check still holds behind a proxy
