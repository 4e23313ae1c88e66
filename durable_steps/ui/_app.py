"""The web application: routes, pages, and what keeps another site from acting through them.

Safety (DESIGN part 3, "A web page"):

Another origin cannot act
    Every action is a POST carrying a *token*: 32 random bytes chosen when
    the server starts, written into the forms of the pages it serves and
    nowhere else. A page from another origin cannot read our pages (the
    same-origin policy), so it cannot learn the token; its forged POST is
    refused (compared in constant time). A POST whose ``Origin`` is not this
    server's, or that the browser marks ``Sec-Fetch-Site: cross-site``, is
    refused too, token or not.
DNS rebinding
    Every request's ``Host`` must name the address the server listens on
    (and, on loopback, ``localhost``/``127.0.0.1``/``[::1]``), so a hostile
    name that resolves to 127.0.0.1 reaches nothing: its pages would be
    same-origin with *that* name, not with ours. Listening on every address
    (``0.0.0.0``, ``::``) does not widen this to any name: the accepted ones
    are the loopback names, this machine's host name, the address literal
    the connection arrived at (a rebinding attack needs a *name*), and each
    ``--allow-host``. An ``Origin`` is compared with those same names, never
    with the request's own ``Host``.
Only this machine acts
    The token keeps other *sites* out, not other *people*: any page served
    carries it. So pages are served with forms (and the token) only to a
    client on loopback, and a POST from any other address is refused: a
    peer on the network may read runs (when ``--host`` lets it reach the
    port) but never act. "On loopback" is the socket's peer, never a header:
    uvicorn is started without proxy headers, as ``X-Forwarded-For`` is
    whatever the client chose to write. A request that a proxy forwarded
    (it carries ``X-Forwarded-For``, ``Forwarded`` or ``X-Real-IP``) comes
    from someone else, so it only reads, unless ``--trust-proxy`` says the
    proxy on this machine authenticates people. Acting from elsewhere goes
    through an SSH tunnel, or such a proxy.
Bodies are bounded
    A POST is refused before its body is read when it is read-only, from
    another machine or site, or says it is longer than 1 MB; a body without
    a length is read only up to that cap.
Run content is text
    Templates are rendered with autoescape on for every template, and no
    run data is ever marked safe; the page's one script sets ``textContent``
    only. The ``Content-Security-Policy`` allows scripts from this server's
    ``/static/`` only (no inline script, no ``eval``), so even markup that got
    through could not run; pages cannot be framed (``frame-ancestors 'none'``,
    ``X-Frame-Options: DENY``), and are not cached.
Read-only
    ``--read-only`` serves no forms and refuses every POST.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._record import checkpoint as ckpt
from ..cli._base import EXIT_NOT_FOUND, CommandError
from ..cli._format import status_label
from ..errors import DurableStepsError, RunNotFound
from ..stores import Store, command_hint
from . import _actions, _detail, _listing

__all__ = ["Config", "create_app"]

_HERE = Path(__file__).resolve().parent
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")
_WILDCARD = ("0.0.0.0", "::", "")  # noqa: S104 - names we compare with, not bind to
MAX_BODY = 1024 * 1024
"""The longest POST body read (a form is a few KB; a payload at most 256 KB)."""
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; object-src 'none'; "
    "frame-ancestors 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make forms send Origin: null
    (b"cache-control", b"no-store"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]


@dataclass
class Config:
    """How the page was started (``durable-steps ui``'s options)."""

    store: Store
    host: str = "127.0.0.1"
    port: int = 8765
    read_only: bool = False
    unsafe_unpickle: bool = False
    refresh: float = 5.0
    """Seconds between the list's refreshes."""
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    allow_hosts: tuple[str, ...] = ()
    """More names the ``Host`` header may give (``--allow-host``): a name a
    reverse proxy or a person uses for this machine, with any port or none
    (a proxy passes on ``ops.example.com``, the name people typed)."""
    trust_proxy: bool = False
    """``--trust-proxy``: a request from loopback that a proxy forwarded may act
    (the proxy on this machine authenticates people). Without it, it reads only."""

    def hosts(self) -> set[str]:
        """The ``Host`` headers accepted, whatever address a connection arrived at.

        Listening on one address: that address (and, on loopback, the loopback
        names). On every address: the loopback names and this machine's host
        name. Either way, each ``--allow-host``. :meth:`accepts` adds the
        address literal a connection arrived at.
        """
        names = {self.host.lower(), *self.allow_hosts}
        if self.host in _WILDCARD:
            names = {*_LOOPBACK, socket.gethostname(), socket.getfqdn(), *self.allow_hosts}
        elif self.host in _LOOPBACK:
            names |= set(_LOOPBACK)
        return _with_port({n.lower() for n in names if n}, self.port)

    def accepts(self, host: str, server: tuple[str, int] | None, allowed: set[str]) -> bool:
        """Whether a request whose ``Host`` is ``host`` (lowercased) is for this server.

        ``server`` is the local address the connection arrived at (the ASGI
        scope's ``server``): with a wildcard bind, that address *as a literal*
        is ours too. A literal cannot be rebound; a name can.
        """
        if host in allowed or host in self.allow_hosts or _name_of(host) in self.allow_hosts:
            return True
        if self.host not in _WILDCARD or server is None:
            return False
        return host in _with_port({str(server[0]).lower()}, int(server[1]))


def _with_port(names: set[str], port: int) -> set[str]:
    bracket = {f"[{n}]" if ":" in n and not n.startswith("[") else n for n in names}
    return {f"{n}:{port}" for n in bracket} | ({*bracket} if port == 80 else set())


def _name_of(host: str) -> str:
    """``host`` without its port: ``ops.example.com:443`` -> ``ops.example.com``."""
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.rpartition(":")[0] if host.count(":") == 1 else host


FORWARDED = ("forwarded", "x-forwarded-for", "x-real-ip")
"""The headers a reverse proxy adds to say whom it forwards (nginx, Caddy, Traefik)."""


def forwarded(request: Request) -> bool:
    """Whether a proxy forwarded ``request`` (it says whom for): its sender is elsewhere."""
    return any(name in request.headers for name in FORWARDED)


def may_act(request: Request, config: Config) -> bool:
    """Whether ``request`` may be served forms and act: from this machine's loopback
    (the socket's peer), and not forwarded by a proxy unless ``--trust-proxy``.
    """
    if config.read_only or not local_client(request):
        return False
    return config.trust_proxy or not forwarded(request)


def local_client(request: Request) -> bool:
    """Whether the connection comes from this machine's loopback: the socket's peer
    (uvicorn runs without proxy headers, so no header can claim it).
    """
    client = request.client
    if client is None:
        return False
    try:
        address = ipaddress.ip_address(client.host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # 127.0.0.1 through a dual-stack "::" socket
    return address.is_loopback


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGI = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class _Guard:
    """ASGI middleware: refuses a foreign ``Host``, adds the security headers."""

    def __init__(self, app: ASGI, config: Config) -> None:
        self.app, self.config, self.allowed = app, config, config.hosts()  # looked up once

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        if not self.config.accepts(host, scope.get("server"), self.allowed):
            # Its names are not listed: whoever sent this Host may be a rebinding page.
            response = PlainTextResponse(
                f"this server does not answer to {host!r} (a name of this machine? start "
                "durable-steps ui with --allow-host NAME)",
                421,
            )
            await response(scope, receive, secured)
            return
        await self.app(scope, receive, secured)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=True,  # every template, whatever its name: run data is always text
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["status_label"] = status_label
    env.filters["q"] = lambda text: urllib.parse.quote(str(text), safe="")
    env.filters["clock"] = _clock
    return env


def _clock(epoch: float, exact: bool = True) -> str:
    """``2026-12-02 14:05:07.250`` (local time): a timeline's times, to the
    millisecond where they are known to it.
    """
    whole = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    return f"{whole}.{int(epoch * 1000) % 1000:03d}" if exact else whole


def create_app(config: Config) -> Starlette:  # noqa: PLR0915 - the routes share its closures
    """The ASGI application of ``durable-steps ui`` over ``config.store``."""
    env = _environment()
    store = config.store
    allowed = config.hosts()  # once: a host name lookup is not for every request
    where = str(getattr(store, "url", None) or command_hint(store))

    def page(request: Request, name: str, code: int = 200, /, **context: Any) -> HTMLResponse:
        # Forms, and the token in them, only for a client that may act.
        acts = may_act(request, config)
        html = env.get_template(name).render(
            token=config.token if acts else "",
            read_only=not acts,
            remote=not config.read_only and not acts,
            proxied=not acts and local_client(request) and forwarded(request),
            store=where,
            **context,
        )
        return HTMLResponse(html, code)

    def problem(request: Request, code: int, message: str, **context: Any) -> HTMLResponse:
        titles = {400: "Not valid", 403: "Refused", 404: "Not found", 413: "Too long"}
        return page(
            request,
            "message.html",
            code,
            title=titles.get(code, "Not done"),
            ok=False,
            message=message,
            **context,
        )

    async def runs(request: Request) -> Response:
        try:
            workflow, status, query = _filters(request)
        except DurableStepsError as exc:
            return problem(request, 400, exc.message)
        listing = await run_in_threadpool(
            _listing.list_runs, store, workflow=workflow, status=status, query=query
        )
        return page(
            request,
            "runs.html",
            listing=listing,
            workflow=workflow or "",
            status=status or "",
            query=query,
            statuses=_listing.STATUSES,
            refresh=config.refresh,
        )

    async def api_runs(request: Request) -> Response:
        try:
            workflow, status, query = _filters(request)
        except DurableStepsError as exc:
            return JSONResponse({"error": exc.message}, 400)
        listing = await run_in_threadpool(
            _listing.list_runs, store, workflow=workflow, status=status, query=query
        )
        return JSONResponse(listing.as_json())

    async def run(request: Request) -> Response:
        workflow, run_id = request.path_params["workflow"], request.path_params["run_id"]
        number = request.query_params.get("page", "1")
        try:
            ckpt.validate_name(workflow, "workflow name")
            ckpt.validate_name(run_id, "run id")
        except DurableStepsError as exc:
            return problem(request, 400, exc.message)
        try:
            shown = await run_in_threadpool(
                _detail.run_page,
                store,
                workflow,
                run_id,
                page=int(number) if re.fullmatch("[0-9]{1,9}", number) else 1,
                unsafe=config.unsafe_unpickle,
            )
        except CommandError as exc:
            return problem(request, 404 if exc.code == EXIT_NOT_FOUND else 409, exc.message)
        except RunNotFound as exc:
            return problem(request, 404, exc.message)
        except DurableStepsError as exc:  # corrupt, forged, unreadable: say so, never a 500
            return problem(request, 409, f"run {workflow}/{run_id} cannot be shown: {exc.message}")
        return page(request, "run.html", run=shown)

    async def action(request: Request) -> Response:  # noqa: PLR0911 - one return a refusal
        # Everything that needs no body is checked before a byte of it is read.
        if config.read_only:
            return problem(
                request, 403, "this page was started with --read-only: it changes nothing"
            )
        if not local_client(request):
            return problem(
                request,
                403,
                "refused: actions are taken only from this machine (loopback); from "
                "elsewhere, use an SSH tunnel or a reverse proxy that authenticates people",
            )
        if not may_act(request, config):
            return problem(
                request,
                403,
                "refused: this request came through a proxy (it carries X-Forwarded-For), "
                "so from someone else than this machine; if the proxy on this machine "
                "authenticates people, start durable-steps ui with --trust-proxy",
            )
        refused = _foreign(request, config, allowed)
        if refused is not None:
            return problem(request, 403, refused)
        form = await _form(request)
        if form is None:
            return problem(request, 413, f"refused: the form is longer than {MAX_BODY // 1024} KB")
        if not hmac.compare_digest(form.get("token", "").encode(), config.token.encode()):
            return problem(
                request,
                403,
                "refused: the form's token is missing or not this server's (a page of an "
                "earlier server? reload the run's page and try again)",
            )
        try:
            asked = _actions.parse(form)
        except _actions.FormError as exc:
            back = _actions.back_of(form)
            return problem(request, 400, str(exc), back=back, typed=_actions.typed(form))
        if form.get("confirm") != "yes":
            try:
                what = await run_in_threadpool(_actions.describe, asked, store)
            except _actions.FormError as exc:
                return problem(request, 409, str(exc), back=asked)
            return page(request, "confirm.html", asked=asked, what=what, fields=asked.fields())
        outcome = await run_in_threadpool(_actions.perform, asked, store)
        title = "Done" if outcome.ok else "Not done"
        return page(
            request,
            "message.html",
            200 if outcome.ok else 409,
            title=title,
            ok=outcome.ok,
            message=outcome.message,
            back=asked,
        )

    routes = [
        Route("/", runs),
        Route("/api/runs", api_runs),
        Route("/runs/{workflow}/{run_id}", run),
        Route("/actions", action, methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(_Guard, config=config)
    return app


def _filters(request: Request) -> tuple[str | None, str | None, str]:
    """The list's filters; a workflow name that is not one is refused (``DefinitionError``):
    it becomes a store prefix.
    """
    params = request.query_params
    status = params.get("status", "").replace("-", "_") or None
    if status not in (*_listing.STATUSES, None):
        status = None
    workflow = params.get("workflow") or None
    if workflow is not None:
        ckpt.validate_name(workflow, "workflow name")
    return workflow, status, params.get("q", "")[:400]


async def _form(request: Request) -> dict[str, str] | None:
    """An ``application/x-www-form-urlencoded`` body, first value of each field;
    None when it is longer than :data:`MAX_BODY` (refused unread when it says so).
    """
    length = request.headers.get("content-length", "")
    if length and (not length.isdigit() or int(length) > MAX_BODY):
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            return None
    parsed = urllib.parse.parse_qs(bytes(body).decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in parsed.items()}


def _foreign(request: Request, config: Config, allowed: set[str]) -> str | None:
    """Why a POST comes from another site (None: it does not).

    The ``Origin`` must name this server as the Host check accepts it, never
    merely match the request's own ``Host``.
    """
    origin = request.headers.get("origin")
    if origin is not None:
        parts = urllib.parse.urlsplit(origin)
        ours = parts.scheme in ("http", "https") and config.accepts(
            parts.netloc.lower(), request.scope.get("server"), allowed
        )
        if not ours:
            return f"refused: this action came from another site ({origin}), not from this page"
    if request.headers.get("sec-fetch-site") == "cross-site":
        return "refused: this action came from another site, not from this page"
    return None
