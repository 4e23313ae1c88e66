"""``resolve``: telling an in-doubt run whether its step took effect."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from .._protocol import resolving
from ..serializers import (
    SIGNED_SUFFIX,
    SIGNING_KEY_ENV,
    JSONSerializer,
    SignedSerializer,
    resolve_serializer,
)
from ..stores import Store
from ._base import EXIT_OK, EXIT_REFUSED, RUN_HELP, CommandError, json_argument, run_ref
from ._format import Style, echo, status_label
from ._indexed import locate
from ._runs import FIRED_SKIPS_STEP, effect_label, load, open_effects, run_status

__all__ = ["register"]


def _cmd_resolve(args: argparse.Namespace, store: Store, style: Style) -> int:
    workflow, run_id = locate(store, args.run)
    header, _, _ = load(store, workflow, run_id)
    intent = header.intent
    effects = open_effects(header.journal)
    if intent is None and not effects:
        status = status_label(
            run_status(
                header.status,
                header.owner,
                intent,
                since=header.updated_at,
                journal=header.journal,
                committed=header.committed,
            )
        )
        raise CommandError(
            f"run {header.run} has no step or effect in doubt (status {status}); "
            "nothing to resolve",
            EXIT_REFUSED,
        )
    # A signed run is verified and re-signed with the key (the inner
    # serializer plays no part in signing a header).
    key = os.environ.get(SIGNING_KEY_ENV)
    signer = SignedSerializer(JSONSerializer(), key) if key else None
    result = resolving.NO_RESULT
    serializer = None
    if args.result is not None:
        result = json_argument(args.result, "--result")
        serializer = resolve_serializer(header.serializer.removesuffix(SIGNED_SUFFIX), key)
    resolving.resolve(
        store,
        workflow,
        run_id,
        fired=args.fired,
        force=args.force,
        signer=signer,
        result=result,
        serializer=serializer,
        expect=getattr(args, "expect", None),  # the web page's: what it showed in doubt
    )
    what = (
        "fired: the next run counts it as done without calling it"
        if args.fired
        else "not fired: the next run fires it again with the same idempotency key"
    )
    resolved = []
    if intent:
        where = f"iteration {intent.get('iteration')}, key {intent.get('key')}"
        resolved.append(f"step {intent.get('step')!r} ({where})")
    resolved += [f"effect {effect_label(e)} (key {e.get('key')})" for e in effects]
    if result is not resolving.NO_RESULT:
        shown = json.dumps(result, separators=(",", ":"))
        shown = shown if len(shown) <= 200 else f"{shown[:197]}..."
        what += f"; the result {shown} was recorded: its ctx.effect returns it"
    echo(f"resolved {header.run}: {', '.join(resolved)} {what}. Rerun the workflow.")
    if intent and args.fired:  # said where the person decides, not only in the docs
        echo(f"note: {FIRED_SKIPS_STEP}.")
    return EXIT_OK


def register(command: Callable[..., Any]) -> None:
    """Add the ``resolve`` subcommand through build_parser's ``command`` factory."""
    resolve = command(
        "resolve",
        _cmd_resolve,
        "tell an in-doubt run whether its step took effect",
        "Record whether the pending step of an in-doubt run took effect. Check with the "
        "service it calls, using the idempotency key `show` prints. --fired: the next run "
        "counts the step as done without calling it, so the step's changes to the state are "
        "lost (an effect in doubt inside a step is different: the step runs again and its "
        "ctx.effect returns --result). --not-fired: the next run fires it again with the "
        "same key. The run is not started here: rerun the workflow.",
    )
    resolve.add_argument("run", metavar="RUN", type=run_ref, help=RUN_HELP)
    how = resolve.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--fired", dest="fired", action="store_true", default=None, help="the effect happened"
    )
    how.add_argument("--not-fired", dest="fired", action="store_false", help="it did not")
    resolve.add_argument(
        "--result",
        metavar="JSON",
        help="with --fired, for an effect in doubt: what it returned (JSON, or @file), so the "
        "re-run step gets it from ctx.effect",
    )
    resolve.add_argument(
        "--force",
        action="store_true",
        help="resolve even a run a live process owns (only if that process is surely gone)",
    )
