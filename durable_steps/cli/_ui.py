"""``ui``: serve the web page (:mod:`durable_steps.ui`, the ``ui`` extra)."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Callable
from typing import Any

from ..serializers import SIGNING_KEY_ENV
from ..stores import Store, extra_hint
from ._base import EXIT_OK, EXIT_USAGE, PROG, CommandError
from ._format import Style, echo

__all__ = ["register"]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _cmd_ui(args: argparse.Namespace, store: Store, style: Style) -> int:
    try:
        import uvicorn

        from ..ui import Config, create_app
    except ImportError as exc:
        raise CommandError(
            f"the web page needs the ui extra ({exc.name} is missing): {extra_hint('ui')}",
            EXIT_USAGE,
        ) from exc
    config = Config(
        store,
        host=args.host,
        port=args.port,
        read_only=args.read_only,
        unsafe_unpickle=args.unsafe_unpickle,
        allow_hosts=tuple(h.lower() for h in args.allow_host or ()),
        trust_proxy=args.trust_proxy,
    )
    shown = f"[{args.host}]" if ":" in args.host else args.host
    mode = " (read-only)" if args.read_only else ""
    echo(f"{PROG} ui: serving {args.store_url} on http://{shown}:{args.port}/{mode}")
    if not _loopback(args.host):
        echo(
            f"{PROG} ui: warning: listening on {args.host}, not loopback: anyone who can reach "
            "it can read every run (there is no login). Actions are taken only from this "
            "machine. To expose the page on a network, keep it on loopback and put a reverse "
            "proxy that authenticates people in front of it (--allow-host NAME for the name "
            "it uses).",
            stream=sys.stderr,
        )
    if args.trust_proxy and not _loopback(args.host):
        echo(
            f"{PROG} ui: warning: --trust-proxy with --host {args.host}: only requests from "
            "this machine's loopback may act, so the proxy must be on this machine; keep the "
            "page on loopback (the default --host) behind it",
            stream=sys.stderr,
        )
    # proxy_headers=False: "this machine" is the socket's peer. uvicorn's default
    # takes the client from X-Forwarded-For for peers in $FORWARDED_ALLOW_IPS
    # (``*`` in many container images): anyone could then say 127.0.0.1.
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level="warning",
        ws="none",
        proxy_headers=False,
    )
    return EXIT_OK


def _port(text: str) -> int:
    number = int(text)
    if not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}")
    return number


def register(command: Callable[..., Any]) -> None:
    """Add the ``ui`` subcommand through build_parser's ``command`` factory."""
    ui = command(
        "ui",
        _cmd_ui,
        "serve a web page over the store: runs, timelines, state, actions",
        "Serve a dashboard of the store's runs in a browser: live runs first, then recent "
        "ones, by workflow and status; a run's status and why, its timeline (steps by pass, "
        "journaled calls and effects with their keys, waits, failures), its owner and lease, "
        "its state; and the actions of signal, resolve, fork and rm, each confirmed first. "
        "Listens on loopback unless --host says otherwise; actions are taken only from "
        "loopback (the connection's address, never a header), and every action needs a token "
        "only the page it served holds; a request a proxy forwarded (X-Forwarded-For) only "
        "reads unless --trust-proxy. "
        f"Needs the ui extra: {extra_hint('ui')}.",
    )
    ui.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)"
    )
    ui.add_argument(
        "--allow-host",
        action="append",
        metavar="NAME",
        help="another name the page may be reached by (the Host header; repeatable): "
        "a reverse proxy's or this machine's DNS name",
    )
    ui.add_argument(
        "--trust-proxy",
        action="store_true",
        help="let requests forwarded by a reverse proxy on this machine act (they carry "
        "X-Forwarded-For): only when that proxy authenticates people; without it, they read only",
    )
    ui.add_argument("--port", type=_port, default=8765, help="the port (default: %(default)s)")
    ui.add_argument(
        "--read-only", action="store_true", help="show runs only: no actions, every POST refused"
    )
    ui.add_argument(
        "--unsafe-unpickle",
        action="store_true",
        help="decode pickle states to show them (runs code chosen by whoever wrote them; "
        f"a signed one also needs ${SIGNING_KEY_ENV}); without it, an outline only",
    )
