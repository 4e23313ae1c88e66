"""The web page (``durable-steps ui``) in a real browser: Debian's chromium driven by Playwright.

The runs it shows are made by real processes (``tests/uiapp.py``); the in-doubt
one by a process that dies inside its effect. What the page sends is proven by
resuming the runs in another process afterwards. The server runs in a thread
(uvicorn, on a free loopback port), except for ``--read-only``, which is started
as a user would: ``durable-steps ui`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the ui extra is not installed")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

import durable_steps as ds  # noqa: E402
from durable_steps._record import checkpoint as ckpt  # noqa: E402
from durable_steps.ui import Config, create_app  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
UIAPP = Path(__file__).resolve().parent / "uiapp.py"
ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.ui,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="no /usr/bin/chromium (Debian's chromium package: apt-get install -y chromium)",
    ),
]


def child(store: Path, *args: str, crash_ok: bool = False) -> str:
    """Run ``tests/uiapp.py STORE ARGS`` in a process of its own; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(UIAPP), str(store), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == (17 if crash_ok else 0), proc.stderr
    return proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A page served in a thread: its URL, its config (and token), its store."""

    def __init__(self, path: Path, store: ds.Store | None = None, **options: Any) -> None:
        self.path = path
        self.store = store or ds.LocalStore(path)
        self.config = Config(self.store, port=free_port(), refresh=0.5, **options)
        self.url = f"http://127.0.0.1:{self.config.port}"
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.config),
                host="127.0.0.1",
                port=self.config.port,
                log_level="warning",
                ws="none",
                lifespan="off",
            )
        )
        self.server = server
        self.thread = threading.Thread(target=server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.store.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One chromium per module (each test gets its own context). Not per session: while
    Playwright's sync API runs, its event loop is the running loop of the main thread,
    and every later test calling asyncio.run() would fail."""
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    tab = context.new_page()
    tab.set_default_timeout(10_000)
    yield tab
    context.close()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with a completed, a waiting, a failed and an in-doubt run, made once."""
    path = tmp_path_factory.mktemp("ui") / "store"
    child(path, "populate")
    child(path, "crash", crash_ok=True)
    return path


@pytest.fixture
def runs(made: Path, tmp_path: Path) -> Path:
    """A copy of :func:`made`'s store for one test to change."""
    path = tmp_path / "store"
    shutil.copytree(made, path)
    return path


@pytest.fixture
def served(runs: Path) -> Iterator[Served]:
    app = Served(runs)
    yield app
    app.stop()


def post(
    url: str, fields: dict[str, str], headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """POST a form outside any browser: status and body."""
    body = urllib.parse.urlencode(fields).encode()
    request = urllib.request.Request(url, body, method="POST", headers=headers or {})
    request.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def signal_object(store: Path, run: str, name: str) -> Path:
    workflow, _, run_id = run.partition("/")
    return store / workflow / run_id / "signals" / name


def test_the_list_shows_live_runs_first_filters_and_refreshes(served: Served, page: Any) -> None:
    """Live runs come before finished ones, with counts per status; the filters and the
    search find runs; a run made later appears without a reload."""
    page.goto(served.url + "/")
    rows = page.locator("#runs tbody tr")
    assert rows.count() == 4
    statuses = [rows.nth(i).locator("td").nth(2).inner_text() for i in range(4)]
    assert statuses[-1] == "completed"
    assert set(statuses[:3]) == {"in-doubt", "failed", "waiting"}
    assert page.locator('[data-count="waiting"]').inner_text() == "1"
    assert page.locator('[data-count="completed"]').inner_text() == "1"

    page.select_option("select[name=status]", "waiting")
    page.get_by_role("button", name="Show runs").click()
    assert page.locator("#runs tbody tr").count() == 1
    assert "ticket-4411" in page.locator("#runs tbody").inner_text()
    assert "signal approval" in page.locator("#runs tbody").inner_text()

    page.goto(served.url + "/")
    page.get_by_label("Run id").fill("order-17")
    page.get_by_role("button", name="Show runs").click()
    assert page.locator("#runs tbody tr").count() == 1
    page.get_by_role("link", name="order-17").click()
    assert page.locator("h1").inner_text().startswith("refunds/order-17")

    page.goto(served.url + "/?status=completed")
    assert page.locator("#runs tbody tr").count() == 1

    def finish(state: dict[str, Any]) -> None:
        state["n"] += 1

    ds.Workflow("research", store=ds.LocalStore(served.path), steps=[finish]).run(
        "r-2", {"n": 3, "notes": []}
    )
    page.locator("#runs tbody tr").nth(1).wait_for()  # the refresh brought it in
    assert "r-2" in page.locator("#runs tbody").inner_text()
    assert page.locator('[data-count="completed"]').inner_text() == "2"


def test_a_run_page_shows_its_timeline_calls_and_keys(served: Served, page: Any) -> None:
    """The in-doubt refund: why it stopped, its owner gone, the effect in doubt with the
    very key the run derives, the committed step before it; a looping run's passes."""
    header, _ = ckpt.decode(
        (served.path / "refunds/order-17/checkpoint").read_bytes(), where="test"
    )
    key = ckpt.effect_key(header.run_nonce, 0, "pay", "refund")
    page.goto(served.url + "/runs/refunds/order-17")
    assert page.locator("#status").inner_text() == "in-doubt"
    assert "may have fired" in page.locator("#hint").inner_text()
    assert "(gone)" in page.locator("dl.pairs").first.inner_text()
    journal = page.locator("#journal").inner_text()
    assert "'refund'" in journal
    assert key in journal
    timeline = page.locator("#timeline")
    assert "plan" in timeline.inner_text()
    assert "committed" in timeline.inner_text()
    effect = timeline.locator("tr.kind-effect")
    assert key in effect.inner_text()
    assert "in doubt" in effect.inner_text()
    assert page.locator("#resolve-form").count() == 1

    page.goto(served.url + "/runs/research/r-1")
    headings = page.locator("#timeline h3").all_inner_texts()
    assert headings[-3:] == ["Pass 0", "Pass 1", "Pass 2"]
    assert page.locator("#timeline tr.kind-step").count() == 6
    assert page.locator("#timeline tr.kind-step").first.inner_text().count("1 call") == 1

    tree = page.locator("#state .tree")
    assert "result 2" in tree.inner_text()
    assert page.locator("#signal-form").count() == 0  # a finished run waits for nothing

    page.goto(served.url + "/runs/support-agent/ticket-4411")
    think = page.locator("#timeline tr.kind-step", has_text="think")
    assert "2 calls" in think.inner_text()  # the journal it committed: llm, tool:orders


@pytest.mark.slow
def test_a_long_runs_timeline_is_paginated(page: Any, tmp_path: Path) -> None:
    """230 commits (7 history chunks): two pages of the timeline, the last one reached
    from the first, each entry once."""
    store = ds.MemoryStore()
    long = ds.Workflow("long", store=store, until=lambda s: s["n"] >= 230)

    @long.step()
    def count(state: dict[str, Any]) -> None:
        state["n"] += 1

    long.run("l-1", {"n": 0})
    app = Served(tmp_path, store)
    try:
        page.goto(app.url + "/runs/long/l-1")
        assert "Page 1 of 2" in page.locator("nav.pages").inner_text()
        assert page.locator("#timeline tr.kind-step").count() == 199  # and its creation
        assert page.locator("#timeline h3").nth(1).inner_text() == "Pass 0"
        page.get_by_role("link", name="last").click()
        assert page.locator("#timeline h3").first.inner_text() == "Pass 199"
        assert page.locator("#timeline h3").last.inner_text() == "Pass 229"
        assert page.locator("#timeline tr.kind-step").count() == 31
    finally:
        app.stop()


def test_a_signal_sent_from_the_page_reaches_the_run(served: Served, page: Any) -> None:
    """Signal form → confirmation that says what happens → sent; the run, resumed in
    another process, gets the payload from ctx.wait_for."""
    page.goto(served.url + "/runs/support-agent/ticket-4411")
    assert page.get_by_label("Signal name").input_value() == "approval"
    page.get_by_label("payload (JSON; empty sends null)").fill('{"approved": true, "by": "ana"}')
    page.get_by_role("button", name="Send signal…").click()
    assert "Send signal 'approval' to run support-agent/ticket-4411" in page.inner_text("main")
    assert not signal_object(served.path, "support-agent/ticket-4411", "approval").exists()
    page.get_by_role("button", name="Yes, send signal approval").click()
    assert "sent signal 'approval'" in page.locator("#message").inner_text()
    final = json.loads(child(served.path, "resume", "support-agent/ticket-4411"))
    assert final["approval"] == {"approved": True, "by": "ana"}

    page.goto(served.url + "/runs/support-agent/ticket-4411")  # the page sees it finished
    assert page.locator("#status").inner_text() == "completed"


def test_a_resolution_sent_from_the_page_reaches_the_run(served: Served, page: Any) -> None:
    """The refund that may have fired: resolved as fired with its result; the resumed run
    takes that result from ctx.effect instead of refunding again."""
    page.goto(served.url + "/runs/refunds/order-17")
    page.get_by_label("It fired: count it as done").check()
    page.get_by_label("Its result, if it fired (JSON, optional)").fill('{"id": "re_1"}')
    page.get_by_role("button", name="Resolve…").click()
    assert "took effect" in page.inner_text("main")
    page.get_by_role("button", name="Yes, record the resolution").click()
    assert "resolved refunds/order-17" in page.locator("#message").inner_text()
    final = json.loads(child(served.path, "resume", "refunds/order-17"))
    assert final["refund"] == {"id": "re_1"}  # not "re_new": it was not fired again


def test_markup_in_a_run_is_shown_as_text_and_never_runs(served: Served, page: Any) -> None:
    """A transcript and an error holding <script> and onerror= show as those characters;
    no script of theirs runs, no element of theirs exists; the CSP forbids inline script."""
    response = page.goto(served.url + "/runs/support-agent/ticket-4411")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["x-frame-options"] == "DENY"
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    assert hostile in page.locator("#state").inner_text()
    assert page.locator("main img").count() == 0
    assert page.locator("main script").count() == 0
    assert page.evaluate("window.__pwned") is None
    page.goto(served.url + "/runs/support-agent/ticket-4410")
    assert hostile in page.locator("#error").inner_text()
    assert page.locator("main img").count() == 0
    assert page.evaluate("window.__pwned") is None


class _Attacker(BaseHTTPRequestHandler):
    """Another site: a page whose script posts a signal to the dashboard at once."""

    target = ""

    def do_GET(self) -> None:
        fields = {
            "action": "signal",
            "workflow": "support-agent",
            "run_id": "ticket-4411",
            "signal": "approval",
            "payload": '{"approved": true}',
            "confirm": "yes",
            "token": "guessed",
        }
        inputs = "".join(f"<input name=\"{k}\" value='{v}'>" for k, v in fields.items())
        html = (
            f'<form id="f" method="post" action="{self.target}/actions">{inputs}</form>'
            '<script>document.getElementById("f").submit()</script>'
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(html.encode())

    def log_message(self, *args: Any) -> None:
        pass


def test_another_origin_cannot_act(served: Served, page: Any) -> None:
    """A form another site submits, a POST without the token, one with the token from
    another Origin, one to another Host name: each refused, and no signal is sent."""
    signal = signal_object(served.path, "support-agent/ticket-4411", "approval")
    _Attacker.target = served.url
    evil = HTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
        page.wait_for_url(served.url + "/actions")
        assert "refused" in page.locator("#message").inner_text()
    finally:
        evil.shutdown()
        evil.server_close()
    found = served.store.get(ckpt.checkpoint_key("support-agent", "ticket-4411"))
    assert found is not None
    fields = {
        "action": "signal",
        "workflow": "support-agent",
        "run_id": "ticket-4411",
        "nonce": ckpt.decode(found[0], where="test")[0].run_nonce,
        "signal": "approval",
        "payload": "true",
        "confirm": "yes",
    }
    status, body = post(served.url + "/actions", fields)
    assert status == 403
    assert "token" in body
    status, body = post(
        served.url + "/actions",
        {**fields, "token": served.config.token},
        {"Origin": "http://evil.example"},
    )
    assert status == 403
    assert "another site" in body
    status, _ = post(
        served.url + "/actions",
        {**fields, "token": served.config.token},
        {"Host": "evil.example:80"},
    )
    assert status == 421  # a rebinding name reaches nothing
    assert not signal.exists()
    status, body = post(served.url + "/actions", {**fields, "token": served.config.token})
    assert status == 200
    assert signal.exists()


@pytest.mark.slow
def test_read_only_serves_no_actions_and_refuses_every_post(runs: Path, page: Any) -> None:
    """`durable-steps ui --read-only`, started as a user would: pages without forms, and a
    POST refused even with a well-formed request."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "durable_steps",
            "--store",
            str(runs),
            "ui",
            "--port",
            str(port),
            "--read-only",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "(read-only)" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(url + "/", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
        page.goto(url + "/runs/refunds/order-17")
        assert "read-only" in page.locator("header").inner_text()
        assert page.locator("form[method=post]").count() == 0
        assert page.locator("#actions").count() == 0
        status, body = post(
            url + "/actions",
            {"action": "delete", "workflow": "refunds", "run_id": "order-17", "confirm": "yes"},
        )
        assert status == 403
        assert "read-only" in body
        assert (runs / "refunds/order-17/checkpoint").exists()
    finally:
        proc.terminate()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
