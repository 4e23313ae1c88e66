"""The web page over plain HTTP (no browser): who may reach it, who may act, what a
form may say, and what each page says. A real uvicorn server in a thread, real
requests over a socket; the in-doubt runs are left by processes that really die.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the ui extra is not installed")

import durable_steps as ds  # noqa: E402
from durable_steps.cli._format import timestamp  # noqa: E402
from durable_steps.errors import StoreError  # noqa: E402
from durable_steps.ui import Config, _listing, create_app  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ui
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``create_app(config)`` served by uvicorn in a thread, bound to ``bind``."""

    def __init__(self, store: ds.Store, bind: str = "127.0.0.1", **options: Any) -> None:
        self.config = Config(store, host=bind, port=free_port(), **options)
        self.port = self.config.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.config),
                host=bind,
                port=self.port,
                log_level="warning",
                ws="none",
                lifespan="off",
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serve() -> Iterator[Any]:
    made: list[Server] = []

    def start(store: ds.Store, bind: str = "127.0.0.1", **options: Any) -> Server:
        made.append(Server(store, bind, **options))
        return made[-1]

    yield start
    for server in made:
        server.stop()


def fetch(
    url: str, data: dict[str, str] | bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    body = urllib.parse.urlencode(data).encode() if isinstance(data, dict) else data
    sent = {**(FORM if body else {}), **(headers or {})}
    request = urllib.request.Request(url, body, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def token_of(html: str) -> str | None:
    found = re.search(r'name="token" value="([^"]+)"', html)
    return found[1] if found else None


def message(html: str) -> str:
    found = re.search(r'id="message">([^<]*)', html)
    assert found, html
    return found[1]


def failed_run(store: ds.Store, workflow: str = "w", run_id: str = "r1") -> None:
    wf = ds.Workflow(workflow, store=store)

    @wf.step()
    def boom(state: dict[str, Any]) -> None:
        raise ValueError("no")

    with pytest.raises(ds.StepFailed):
        wf.run(run_id, {})


APP = textwrap.dedent(
    """
    import json, os, sys
    import durable_steps as ds
    wf = ds.Workflow("pay", store=sys.argv[1])
    @wf.step(in_doubt="raise")
    def pay(state, ctx):
        def charge(name):
            def fire(*, idempotency_key):
                if os.environ.get("CRASH_IN") == name:
                    os._exit(17)
                return {"id": name + "-real"}
            return fire
        state["a"] = ctx.effect("charge-A", charge("A"))
        state["b"] = ctx.effect("charge-B", charge("B"))
    try:
        print(json.dumps(wf.run("o1", {})))
    except ds.StepInDoubt:
        print("IN DOUBT")
    """
)


def pay(tmp_path: Path, crash: str | None = None) -> str:
    """Run the two-effect payment in a process of its own; it dies inside ``crash``."""
    script = tmp_path / "payapp.py"
    script.write_text(APP)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"CRASH_IN": crash} if crash else {})}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "s")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == (17 if crash else 0), proc.stderr
    return proc.stdout.strip()


def test_a_wildcard_bind_answers_only_to_its_own_names(serve: Any) -> None:
    """Listening on 0.0.0.0 keeps the Host check: a rebound name gets 421 (with the
    security headers), loopback and --allow-host names are served, and an Origin is
    compared with those names, not with the request's Host."""
    store = ds.MemoryStore()
    failed_run(store)
    app = serve(store, "0.0.0.0", allow_hosts=("dash.example",))
    host = {"Host": f"rebind.evil.test:{app.port}"}
    code, headers, body = fetch(app.url + "/runs/w/r1", headers=host)
    assert code == 421, body
    assert token_of(body) is None
    assert socket.gethostname() not in body  # a rebinding page learns no name to use
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"
    for name in (f"127.0.0.1:{app.port}", f"localhost:{app.port}", f"dash.example:{app.port}"):
        code, _, body = fetch(app.url + "/runs/w/r1", headers={"Host": name})
        assert code == 200, name
        assert token_of(body) == app.config.token
    fields = {"action": "delete", "workflow": "w", "run_id": "r1", "token": app.config.token}
    code, _, body = fetch(
        app.url + "/actions",
        {**fields, "confirm": "yes"},
        {"Host": f"127.0.0.1:{app.port}", "Origin": f"http://rebind.evil.test:{app.port}"},
    )
    assert code == 403
    assert "another site" in message(body)
    assert store.get("w/r1/checkpoint") is not None


def _own_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is chosen
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def test_a_network_peer_may_read_but_never_act(serve: Any) -> None:
    """A client that is not on loopback gets pages without forms or token, and its POST
    (even with the token) is refused before its body is read."""
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    store = ds.MemoryStore()
    failed_run(store)
    app = serve(store, "0.0.0.0")
    peer = f"http://{address}:{app.port}"
    code, _, body = fetch(peer + "/runs/w/r1")
    assert code == 200
    assert "boom" in body
    assert token_of(body) is None
    assert 'id="remote-note"' in body
    fields = {"action": "delete", "workflow": "w", "run_id": "r1", "token": app.config.token}
    code, _, body = fetch(peer + "/actions", {**fields, "confirm": "yes"})
    assert code == 403
    assert "only from this machine" in message(body)
    assert store.get("w/r1/checkpoint") is not None
    code, _, body = fetch(app.url + "/runs/w/r1")  # the same page from loopback has forms
    assert token_of(body) == app.config.token


def test_yes_resolves_only_what_the_confirmation_named(serve: Any, tmp_path: Path) -> None:
    """The confirmation names the effect in doubt by key; when, before "yes", that one
    was resolved elsewhere and the run went on to be in doubt at another effect, "yes"
    changes nothing and says why."""
    pay(tmp_path, crash="A")
    store = ds.LocalStore(tmp_path / "s")
    app = serve(store)
    _, _, html = fetch(app.url + "/runs/pay/o1")
    doubt = re.search(r'name="doubt" value="([^"]+)"', html)
    assert doubt
    keys = json.loads(doubt[1].replace("&#34;", '"'))
    fields = {
        "action": "resolve",
        "workflow": "pay",
        "run_id": "o1",
        "token": app.config.token,
        "fired": "yes",
        "result": '{"id": "A-real"}',
        "doubt": json.dumps(keys),
    }
    code, _, confirm = fetch(app.url + "/actions", fields)
    assert code == 200
    assert "charge-A" in confirm
    assert keys[0] in confirm
    ds.Workflow("pay", store=store).resolve("o1", fired=True, result={"id": "A-real"})
    assert pay(tmp_path, crash="B") == ""
    code, _, body = fetch(app.url + "/actions", {**fields, "confirm": "yes"})
    assert code == 409
    assert "changed since" in message(body)
    assert pay(tmp_path) == "IN DOUBT"  # B is still in doubt: it was not recorded as fired
    code, _, body = fetch(app.url + "/actions", {**fields, "confirm": "yes"})
    assert code == 409  # and the confirmation step refuses the stale form too


def test_a_name_that_leaves_the_store_is_refused(serve: Any, tmp_path: Path) -> None:
    store = ds.LocalStore(tmp_path / "s")
    failed_run(store)
    app = serve(store)
    for path in ("/?workflow=../../..", "/api/runs?workflow=..", "/runs/w/.hidden"):
        code, _, body = fetch(app.url + path)
        assert code == 400, path
        assert "invalid workflow name" in body or "invalid run id" in body, path
    code, _, body = fetch(app.url + "/runs/w/" + "x" * 201)
    assert code == 400
    assert "1-200 characters" in body
    for prefix in ("../", "a/../", "../../etc/pass", ".index/x", "a/.."):
        with pytest.raises(StoreError, match="unsafe prefix"):
            list(store.list(prefix))


def test_pages_say_what_is_wrong_instead_of_a_bare_500(serve: Any, tmp_path: Path) -> None:
    store = ds.LocalStore(tmp_path / "s")
    failed_run(store)
    failed_run(store, run_id="r2")
    (tmp_path / "s" / "w" / "r2" / "checkpoint").write_bytes(b"not a checkpoint")
    app = serve(store)
    code, _, body = fetch(app.url + "/runs/w/r1?page=%C2%B2")  # "²": isdigit, not int
    assert code == 200
    code, _, body = fetch(app.url + "/runs/w/r2")
    assert code == 409
    assert "cannot be shown" in body
    code, _, body = fetch(app.url + "/runs/w/nope")
    assert code == 404


def test_a_long_body_is_refused_before_it_is_read(serve: Any) -> None:
    app = serve(ds.MemoryStore())
    with socket.create_connection(("127.0.0.1", app.port), timeout=10) as conn:
        conn.sendall(
            f"POST /actions HTTP/1.1\r\nHost: 127.0.0.1:{app.port}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n"
            "Content-Length: 50000000\r\n\r\n".encode()
        )
        reply = conn.recv(4096).decode()  # answered with no body sent
    assert reply.startswith("HTTP/1.1 413"), reply


def test_a_deeply_nested_payload_is_refused_clearly(serve: Any) -> None:
    store = ds.MemoryStore()
    failed_run(store)
    app = serve(store)
    fields = {"action": "signal", "workflow": "w", "run_id": "r1", "token": app.config.token}
    code, _, body = fetch(app.url + "/actions", {**fields, "signal": "s", "payload": "[" * 100000})
    assert code == 400
    assert "nested too deeply" in message(body)


def test_invalid_json_keeps_what_was_typed_and_links_back(serve: Any) -> None:
    store = ds.MemoryStore()
    failed_run(store)
    app = serve(store)
    fields = {"action": "signal", "workflow": "w", "run_id": "r1", "token": app.config.token}
    code, _, body = fetch(app.url + "/actions", {**fields, "signal": "go", "payload": "{oops"})
    assert code == 400
    assert "not JSON" in message(body)
    assert 'href="/runs/w/r1"' in body
    assert ">{oops</textarea>" in body
    assert 'value="go"' in body


def waiting_run(store: ds.Store) -> None:
    wf = ds.Workflow("hold", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["ok"] = ctx.wait_for("approval", timeout=86400)

    with pytest.raises(ds.RunSuspended):
        wf.run("h1", {})


def test_a_wait_shows_its_timeout_ahead_in_words(serve: Any) -> None:
    """The timeout a day away reads "in 23h" (not "just now"); wait_for's deadline
    record reads as the wait's timeout, not as a raw sleep call; the signal form
    says what an empty payload sends and has no example filled in."""
    store = ds.MemoryStore()
    waiting_run(store)
    app = serve(store)
    _, _, body = fetch(app.url + "/runs/hold/h1")
    assert re.search(r"\(in 23h\)", body), body
    assert "timeout of wait for &#39;approval&#39; at " in body
    assert "deadline:approval" not in body
    assert "payload (JSON; empty sends null)" in body
    assert "placeholder=" not in body
    assert timestamp(1000.0, 1000.0 - 90).endswith("(in 1m)")
    assert timestamp(1000.0, 1000.0 + 90).endswith("(1m ago)")


def test_forms_are_offered_only_where_the_command_would_act(serve: Any, tmp_path: Path) -> None:
    """A run not waiting gets no signal form, a run with a step in doubt no delete button:
    each says why instead."""
    pay(tmp_path, crash="A")
    store = ds.LocalStore(tmp_path / "s")
    failed_run(store)
    app = serve(store)
    _, _, body = fetch(app.url + "/runs/pay/o1")
    assert 'id="delete-form"' not in body
    assert 'id="delete-note"' in body
    assert 'id="signal-form"' not in body
    assert "not waiting for a signal" in body
    _, _, body = fetch(app.url + "/runs/w/r1")
    assert 'id="delete-form"' in body


def test_an_empty_store_says_it_has_no_runs(serve: Any, tmp_path: Path) -> None:
    app = serve(ds.LocalStore(tmp_path / "never-made"))
    _, _, body = fetch(app.url + "/")
    assert "This store has no runs" in body
    assert "reindex" not in body


def test_the_deleted_filter_looks_at_one_page_of_done_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """status=deleted among many completed runs stops after COUNT_UP_TO done entries."""

    class Counting(ds.MemoryStore):
        listed = 0

        def list(self, prefix: str) -> Any:
            for info in super().list(prefix):
                self.listed += 1
                yield info

    store = Counting()
    wf = ds.Workflow("w", store=store)

    @wf.step()
    def a(state: dict[str, Any]) -> None:
        pass

    for i in range(30):
        wf.run(f"d{i}", {})
    monkeypatch.setattr(_listing, "COUNT_UP_TO", 5)
    store.listed = 0
    runs, capped = _listing._finished(store, "w", "deleted", 101)
    assert runs == []
    assert capped
    assert store.listed <= 6


def test_a_step_of_many_calls_shows_63_plus(serve: Any) -> None:
    """The history keeps each count in 6 bits: 70 calls read "63+ calls", not "63 calls"."""
    store = ds.MemoryStore()
    wf = ds.Workflow("many", store=store)

    @wf.step()
    def lots(state: dict[str, Any], ctx: ds.Context) -> None:
        for i in range(70):
            ctx.call(f"c{i}", lambda i=i: i)

    wf.run("m1", {})
    app = serve(store)
    _, _, body = fetch(app.url + "/runs/many/m1")
    assert "63+ calls" in body


def test_a_resolution_is_on_the_timeline(serve: Any, tmp_path: Path) -> None:
    """resolve() records what a person decided in the run's history (the head it
    rewrites anyway): the timeline shows it, and the commit after it, marked as the
    step run again."""
    pay(tmp_path, crash="A")
    store = ds.LocalStore(tmp_path / "s")
    ds.Workflow("pay", store=store).resolve("o1", fired=True, result={"id": "A-real"})
    assert json.loads(pay(tmp_path)) == {"a": {"id": "A-real"}, "b": {"id": "B-real"}}
    app = serve(store)
    _, _, body = fetch(app.url + "/runs/pay/o1")
    assert "resolved by a person: fired" in body
    assert "1 effect in doubt" in body
    # The commit after it: the step ran again once its effect was resolved, and says so.
    again = '<td>committed <span class="rerun">ran again after a person resolved it (fired)'
    assert body.index("resolved by a person") < body.index(again)


def test_the_page_refuses_another_shape_and_says_what_is_accepted(serve: Any) -> None:
    """{"approve": true} is refused by the confirmation and by the act itself (a form
    posted with confirm=yes), nothing is sent; the page says what the run accepts."""
    from tests.test_approvals import hold, waiting

    store = ds.MemoryStore()
    wf = hold(store)
    waiting(wf)
    app = serve(store)
    _, _, page = fetch(app.url + "/runs/hold/h1")
    assert 'id="signal-accepts"' in page
    assert "an approval: {&#34;approved&#34;: true}" in page
    nonce = re.search(r'name="nonce" value="([^"]+)"', page)  # the form is for this run
    assert nonce
    fields = {
        "action": "signal",
        "workflow": "hold",
        "run_id": "h1",
        "token": app.config.token,
        "signal": "approval",
        "payload": '{"approve": true}',
        "nonce": nonce[1],
    }
    code, _, body = fetch(app.url + "/actions", fields)  # the confirmation refuses it
    assert code == 409
    assert "waits at step &#39;ask&#39; for signal &#39;approval&#39;" in message(body)
    code, _, body = fetch(app.url + "/actions", {**fields, "confirm": "yes"})  # and the act
    assert code == 409
    assert "is not one" in message(body)
    assert store.get("hold/h1/signals/approval") is None
    waiting(wf)
    code, _, body = fetch(app.url + "/actions", {**fields, "payload": "true", "confirm": "yes"})
    assert code == 200, body
    assert wf.run("h1", {}) == {"decision": True}
