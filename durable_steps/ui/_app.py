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
    same-origin with *that* name, not with ours.
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
import secrets
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

from ..cli._base import EXIT_NOT_FOUND, CommandError
from ..cli._format import status_label
from ..stores import Store, command_hint
from . import _actions, _detail, _listing

__all__ = ["Config", "create_app"]

_HERE = Path(__file__).resolve().parent
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")
_WILDCARD = ("0.0.0.0", "::", "")  # noqa: S104 - names we compare with, not bind to
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

    def hosts(self) -> set[str] | None:
        """The ``Host`` headers accepted; None: any (listening on every address)."""
        if self.host in _WILDCARD:
            return None
        names = {self.host, *(_LOOPBACK if self.host in _LOOPBACK else ())}
        bracket = {f"[{n}]" if ":" in n and not n.startswith("[") else n for n in names}
        return {f"{n}:{self.port}" for n in bracket} | ({*bracket} if self.port == 80 else set())


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGI = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class _Guard:
    """ASGI middleware: refuses a foreign ``Host``, adds the security headers."""

    def __init__(self, app: ASGI, config: Config) -> None:
        self.app, self.allowed = app, config.hosts()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        if self.allowed is not None and host not in self.allowed:
            response = PlainTextResponse(
                f"this server answers to {', '.join(sorted(self.allowed))}, not {host!r}", 421
            )
            await response(scope, receive, send)
            return

        async def secured(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

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


def create_app(config: Config) -> Starlette:
    """The ASGI application of ``durable-steps ui`` over ``config.store``."""
    env = _environment()
    store = config.store
    where = str(getattr(store, "url", None) or command_hint(store))

    def page(name: str, code: int = 200, /, **context: Any) -> HTMLResponse:
        html = env.get_template(name).render(
            token=config.token, read_only=config.read_only, store=where, **context
        )
        return HTMLResponse(html, code)

    async def runs(request: Request) -> Response:
        workflow, status, query = _filters(request)
        listing = await run_in_threadpool(
            _listing.list_runs, store, workflow=workflow, status=status, query=query
        )
        return page(
            "runs.html",
            listing=listing,
            workflow=workflow or "",
            status=status or "",
            query=query,
            statuses=_listing.STATUSES,
            refresh=config.refresh,
        )

    async def api_runs(request: Request) -> Response:
        workflow, status, query = _filters(request)
        listing = await run_in_threadpool(
            _listing.list_runs, store, workflow=workflow, status=status, query=query
        )
        return JSONResponse(listing.as_json())

    async def run(request: Request) -> Response:
        workflow, run_id = request.path_params["workflow"], request.path_params["run_id"]
        number = request.query_params.get("page", "1")
        try:
            shown = await run_in_threadpool(
                _detail.run_page,
                store,
                workflow,
                run_id,
                page=int(number) if number.isdigit() else 1,
                unsafe=config.unsafe_unpickle,
            )
        except CommandError as exc:
            code = 404 if exc.code == EXIT_NOT_FOUND else 400
            return page("message.html", code, title="Not found", ok=False, message=exc.message)
        return page("run.html", run=shown)

    async def action(request: Request) -> Response:
        if config.read_only:
            return page(
                "message.html",
                403,
                title="Read-only",
                ok=False,
                message="this page was started with --read-only: it changes nothing",
            )
        form = await _form(request)
        refused = _refused(request, form, config.token)
        if refused is not None:
            return page("message.html", 403, title="Refused", ok=False, message=refused)
        try:
            asked = _actions.parse(form)
        except _actions.FormError as exc:
            return page("message.html", 400, title="Not done", ok=False, message=str(exc))
        if form.get("confirm") != "yes":
            return page(
                "confirm.html", asked=asked, what=_actions.describe(asked), fields=asked.fields()
            )
        outcome = await run_in_threadpool(_actions.perform, asked, store)
        title = "Done" if outcome.ok else "Not done"
        return page(
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
    params = request.query_params
    status = params.get("status", "").replace("-", "_") or None
    if status not in (*_listing.STATUSES, None):
        status = None
    return params.get("workflow") or None, status, params.get("q", "")[:400]


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body, first value of each field."""
    body = await request.body()
    if len(body) > 1024 * 1024:
        return {}
    parsed = urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in parsed.items()}


def _refused(request: Request, form: dict[str, str], token: str) -> str | None:
    """Why a POST may not act (None: it may): another origin, or no valid token."""
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        return f"refused: this action came from another site ({origin}), not from this page"
    if request.headers.get("sec-fetch-site") == "cross-site":
        return "refused: this action came from another site, not from this page"
    if not hmac.compare_digest(form.get("token", "").encode(), token.encode()):
        return (
            "refused: the form's token is missing or not this server's (a page of an "
            "earlier server? reload the run's page and try again)"
        )
    return None
