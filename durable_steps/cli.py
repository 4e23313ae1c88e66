"""The ``durable-steps`` command: find, inspect, resolve and clean up runs.

Works on any store: ``--store URL`` (a path, ``file:///path``,
``s3://bucket/prefix`` with boto3's standard configuration), else
``$DURABLE_STEPS_STORE``, else ``./.durable_steps`` -- the library's default::

    durable-steps ls [--workflow W] [--status STATUS] [--json]
    durable-steps show WORKFLOW/RUN_ID [--state [--unsafe-unpickle]] [--json]
    durable-steps resolve WORKFLOW/RUN_ID (--fired | --not-fired) [--force]
    durable-steps rm WORKFLOW/RUN_ID [--force]
    durable-steps prune (--completed | --failed) --older-than 7d [--workflow W] [--yes]

A ``running`` run that no live process owns is shown as ``stopped``. ``rm``
and ``prune`` delete only checkpoint objects (``<workflow>/<run_id>/checkpoint``
whose first line is a durable_steps header of that run), never anything else
under the prefix. ``rm`` and ``resolve`` refuse without ``--force`` a run a
live process owns; ``rm`` also one with a pending intent (deleting it forgets
the idempotency key, so a new run under that id would fire the step again with
a new key). ``prune`` is a dry run unless ``--yes``.

Exit status: 0 success; 1 error (the store failed, a checkpoint cannot be
read); 2 usage (bad arguments, store URL, run name or duration, a pickle
state without ``--unsafe-unpickle`` or its signing key); 3 the run does not
exist; 4 refused (a live process owns the run, its status does not allow it
without ``--force``, nothing is in doubt, the object is not a checkpoint, or
the run changed meanwhile). Errors are one line on stderr (``durable-steps: error: ...``);
``--debug`` adds the traceback and the library's debug log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from . import _checkpoint as ckpt
from . import _cli_worker, _resolve
from ._cli_format import (
    EPILOG,
    PROG,
    RunInfo,
    Style,
    describe,
    find_runs,
    human_age,
    human_size,
    ls_row,
    owner_text,
    parse_duration,
    peek_header,
    run_status,
    state_text,
    status_label,
    summary,
    table,
    use_color,
)
from ._version import __version__
from .errors import (
    CheckpointConflict,
    CorruptCheckpoint,
    DefinitionError,
    DurableStepsError,
    RunLocked,
)
from .serializers import SIGNING_KEY_ENV, PickleSerializer, Serializer, resolve_serializer
from .stores import DEFAULT_STORE, STORE_ENV, Store, open_store

__all__ = ["EXIT_ERROR", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4
_SIGNED = "+hmac-sha256"


class CommandError(Exception):
    """A failure to report as one line, with the exit status to return."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# --- reading the store ---------------------------------------------------------


def _load(store: Store, workflow: str, run_id: str) -> tuple[ckpt.Checkpoint, bytes, bytes]:
    """A run's decoded header and payload, and the stored bytes; exit 3 when missing."""
    name, key = f"{workflow}/{run_id}", ckpt.checkpoint_key(workflow, run_id)
    found = store.get(key)
    if found is None:
        raise CommandError(
            f"run {name} not found (no checkpoint at {key!r}); list runs with `{PROG} ls`",
            EXIT_NOT_FOUND,
        )
    header, payload = ckpt.decode(found[0], where=f"run {name}: checkpoint {key!r}")
    if (header.workflow, header.run_id) != (workflow, run_id):
        raise CorruptCheckpoint(f"{key!r} holds the checkpoint of another run ({header.run})")
    return header, payload, found[0]


def _decode_state(header: ckpt.Checkpoint, payload: bytes, unsafe: bool) -> Any:
    name = header.serializer
    inner = name.removesuffix(_SIGNED)
    if inner not in ("json", "pickle"):
        raise CommandError(f"run {header.run} uses a custom serializer {name!r}; cannot decode it")
    if inner == "pickle" and not unsafe:
        raise CommandError(
            f"the state of run {header.run} is a pickle, and unpickling runs code chosen by "
            "whoever wrote it: pass --unsafe-unpickle if you trust everyone who can write "
            "to this store",
            EXIT_USAGE,
        )
    serializer: Serializer
    if name.endswith(_SIGNED):
        key = os.environ.get(SIGNING_KEY_ENV)
        if not key:
            raise CommandError(
                f"the state of run {header.run} is signed ({name}): set {SIGNING_KEY_ENV} "
                "to the key it was written with",
                EXIT_USAGE,
            )
        serializer = resolve_serializer(inner, key)
    elif inner == "pickle" and os.environ.get(SIGNING_KEY_ENV):
        raise CommandError(
            f"the state of run {header.run} is an unsigned pickle, but {SIGNING_KEY_ENV} is "
            "set: refusing to unpickle it (anyone who can write the store could have made "
            "it), as the workflow itself would",
            EXIT_REFUSED,
        )
    else:  # unsigned JSON, or unsigned pickle with no key in play
        serializer = PickleSerializer() if inner == "pickle" else resolve_serializer("json")
    try:
        return serializer.loads(payload)
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"run {header.run}: cannot decode the state: {exc}") from exc


# --- commands ------------------------------------------------------------------


def _cmd_ls(args: argparse.Namespace, store: Store, style: Style) -> int:
    runs = find_runs(store, args.workflow)
    if args.status:
        runs = [r for r in runs if r.status == args.status.replace("-", "_")]
    now = time.time()
    if args.json:
        print(json.dumps([summary(r, now) for r in runs], indent=2))
        return EXIT_OK
    if not runs:
        print(f"{PROG}: no matching runs in {args.store_url}", file=sys.stderr)
        return EXIT_OK
    rows = [ls_row(r, now) for r in runs]

    def paint(row: int, column: int, text: str) -> str:
        return style.status(runs[row].status, text) if column == 2 else text

    headers = ["WORKFLOW", "RUN", "STATUS", "STEP", "ITER", "AGE", "SIZE"]
    print("\n".join(table(headers, rows, style=style, color=paint, right=(4, 6))))
    return EXIT_OK


def _cmd_show(args: argparse.Namespace, store: Store, style: Style) -> int:
    header, payload, data = _load(store, *args.run)
    state = _decode_state(header, payload, args.unsafe_unpickle) if args.state else None
    if args.json:
        raw = peek_header(data, header.workflow, header.run_id)
        doc: dict[str, Any] = {"run": header.run, "size": len(data), "header": raw}
        if args.state:
            doc["state"] = state
        print(json.dumps(doc, indent=2, ensure_ascii=False, default=repr))
        return EXIT_OK
    lines = describe(header, payload, len(data), style)
    if args.state:
        lines += ["", style.bold("state"), state_text(state, header.serializer)]
    print("\n".join(lines))
    return EXIT_OK


def _cmd_resolve(args: argparse.Namespace, store: Store, style: Style) -> int:
    workflow, run_id = args.run
    header, _, _ = _load(store, workflow, run_id)
    intent = header.intent
    if intent is None:
        raise CommandError(
            f"run {header.run} has no step in doubt (status "
            f"{status_label(run_status(header.status, header.owner))}); nothing to resolve",
            EXIT_REFUSED,
        )
    _resolve.resolve(store, workflow, run_id, fired=args.fired, force=args.force)
    what = (
        "fired: the next run counts it as done without calling it"
        if args.fired
        else "not fired: the next run fires it again with the same idempotency key"
    )
    print(
        f"resolved {header.run}: step {intent.get('step')!r} (iteration "
        f"{intent.get('iteration')}, key {intent.get('key')}) {what}. Rerun the workflow."
    )
    return EXIT_OK


def _cmd_rm(args: argparse.Namespace, store: Store, style: Style) -> int:
    workflow, run_id = args.run
    name, key = f"{workflow}/{run_id}", ckpt.checkpoint_key(workflow, run_id)
    found = store.get(key)
    if found is None:
        raise CommandError(f"run {name} not found (no checkpoint at {key!r})", EXIT_NOT_FOUND)
    header = peek_header(found[0], workflow, run_id)
    if header is None:
        raise CommandError(
            f"{key!r} is not a durable_steps checkpoint of run {name}; refusing to delete it "
            "(remove it with your storage's own tools if it is not needed)",
            EXIT_REFUSED,
        )
    status = run_status(str(header.get("status")), header.get("owner"))
    intent = header.get("intent")
    if not args.force and status == "running":
        raise CommandError(
            f"run {name} is being run by {owner_text(header['owner'], status)}: wait for it "
            "(or stop that process); pass --force to delete it anyway",
            EXIT_REFUSED,
        )
    if not args.force and isinstance(intent, dict):
        raise CommandError(
            f"run {name} has step {intent.get('step')!r} in doubt (key {intent.get('key')}): "
            "deleting the run forgets the key, so a new run would fire it again with a new "
            f"one. Resolve it (`{PROG} resolve {name} --fired|--not-fired`) or pass --force",
            EXIT_REFUSED,
        )
    store.delete(key, match=found[1])  # refused if the run changed since we looked
    print(f"deleted {name} ({status_label(status)}, {human_size(len(found[0]))})")
    return EXIT_OK


def _cmd_prune(args: argparse.Namespace, store: Store, style: Style) -> int:
    wanted = {s for s, on in (("completed", args.completed), ("failed", args.failed)) if on}
    if not wanted:
        raise CommandError("say what to prune: --completed and/or --failed", EXIT_USAGE)
    now, kept = time.time(), 0
    chosen: list[tuple[RunInfo, float]] = []
    for run in find_runs(store, args.workflow):
        h = run.header
        if run.problem is not None or h is None or run.status not in wanted:
            continue
        age = now - float(h.get("updated_at", now))
        if age < args.older_than:
            continue
        if h.get("intent"):  # deleting it would forget the idempotency key
            kept += 1
        else:
            chosen.append((run, age))
    if kept:
        print(
            f"{PROG}: keeping {kept} run(s) with a step in doubt; see `{PROG} ls`", file=sys.stderr
        )
    if not chosen:
        print(f"{PROG}: nothing to prune in {args.store_url}", file=sys.stderr)
        return EXIT_OK
    total = human_size(sum(r.size for r, _ in chosen))
    rows = [
        [r.workflow, r.run_id, status_label(r.status), human_age(a), human_size(r.size)]
        for r, a in chosen
    ]
    if not args.yes:
        print(f"would delete {len(chosen)} run{'s' * (len(chosen) != 1)} ({total}):")
        print("\n".join(table(["WORKFLOW", "RUN", "STATUS", "AGE", "SIZE"], rows, style=style)))
        print(style.dim("dry run: nothing was deleted; add --yes to delete them"))
        return EXIT_OK
    deleted = []
    for run, _ in chosen:
        try:
            store.delete(run.key, match=run.version)
        except CheckpointConflict:
            print(f"{PROG}: kept {run.name}: it changed since it was listed", file=sys.stderr)
            continue
        deleted.append(run)
        print(f"deleted {run.name} ({status_label(run.status)}, {human_size(run.size)})")
    size = human_size(sum(r.size for r in deleted))
    print(f"deleted {len(deleted)} run{'s' * (len(deleted) != 1)} ({size})")
    return EXIT_OK


# --- the parser ----------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` calling ``parse``; its errors become usage errors."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, DefinitionError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


@_arg
def _run_ref(text: str) -> tuple[str, str]:
    workflow, sep, run_id = text.partition("/")
    if not sep:
        raise ValueError(f"{text!r} is not WORKFLOW/RUN_ID (e.g. support-agent/ticket-4411)")
    return ckpt.validate_name(workflow, "workflow name"), ckpt.validate_name(run_id, "run id")


@_arg
def _workflow_name(text: str) -> str:
    return ckpt.validate_name(text, "workflow name")


def _globals(sub: bool) -> _Parser:
    """The global options, accepted before or after the command."""
    p = _Parser(add_help=False)
    g = p.add_argument_group("global options")
    unset = argparse.SUPPRESS
    g.add_argument(
        "--store",
        metavar="URL",
        default=unset if sub else None,
        help=f"where runs live: a path, file:///path or s3://bucket/prefix "
        f"(default: ${STORE_ENV}, else {DEFAULT_STORE})",
    )
    g.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default=unset if sub else "auto",
        help="colour output: auto (default: a terminal without NO_COLOR), always, never",
    )
    g.add_argument(
        "--debug",
        action="store_true",
        default=unset if sub else False,
        help="on errors, show the traceback; log what the library does",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``durable-steps`` (exposed for docs and tests)."""
    parser = _Parser(
        prog=PROG,
        description="Find, inspect, resolve and clean up durable_steps runs in a store.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_globals(False)],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_globals(True)]

    def command(name: str, handler: Callable[..., int], summary: str, text: str) -> Any:
        sub = commands.add_parser(name, help=summary, description=text, parents=common)
        sub.set_defaults(handler=handler)
        return sub

    run_help = "the run, as WORKFLOW/RUN_ID (the first two columns of `ls`)"
    ls = command(
        "ls",
        _cmd_ls,
        "list runs: status, step reached, age, size",
        "List runs, one per line: workflow, run id, status, the next step to run (or "
        "'done'), iteration, time since the last checkpoint, size. Statuses: running (a "
        "live process owns it), stopped (nobody runs it: crashed, killed or released), "
        "failed, in-doubt, completed; 'corrupt' for a checkpoint that cannot be read.",
    )
    ls.add_argument("--workflow", "-w", type=_workflow_name, help="only runs of this workflow")
    ls.add_argument(
        "--status",
        "-s",
        type=lambda s: s.replace("_", "-"),
        choices=("running", "stopped", "completed", "failed", "in-doubt", "corrupt"),
        help="only runs with this status",
    )
    ls.add_argument("--json", action="store_true", help="a JSON array, for machines")

    show = command(
        "show",
        _cmd_show,
        "why a run stopped: position, owner, pending intent, last error, history",
        "Show a run: status; where it stopped (next step, iteration, commits); its owner "
        "(host:pid and lease, or none); the pending intent of a non-idempotent step and its "
        "idempotency key; the last error and its attempts; recent steps with durations; and "
        "what to do next.",
    )
    show.add_argument("run", metavar="RUN", type=_run_ref, help=run_help)
    show.add_argument("--state", action="store_true", help="also print the saved state")
    show.add_argument(
        "--unsafe-unpickle",
        action="store_true",
        help="allow --state to unpickle a pickle state (runs code chosen by whoever wrote "
        f"it; a signed one also needs ${SIGNING_KEY_ENV})",
    )
    show.add_argument("--json", action="store_true", help="the header (and state) as JSON")

    resolve = command(
        "resolve",
        _cmd_resolve,
        "tell an in-doubt run whether its step took effect",
        "Record whether the pending step of an in-doubt run took effect. Check with the "
        "service it calls, using the idempotency key `show` prints. --fired: the next run "
        "counts the step as done without calling it. --not-fired: the next run fires it "
        "again with the same key. The run is not started here: rerun the workflow.",
    )
    resolve.add_argument("run", metavar="RUN", type=_run_ref, help=run_help)
    how = resolve.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--fired", dest="fired", action="store_true", default=None, help="the effect happened"
    )
    how.add_argument("--not-fired", dest="fired", action="store_false", help="it did not")
    resolve.add_argument(
        "--force",
        action="store_true",
        help="resolve even a run a live process owns (only if that process is surely gone)",
    )

    rm = command(
        "rm",
        _cmd_rm,
        "delete one run's checkpoint",
        "Delete a run's checkpoint object (nothing else). Refused without --force for a "
        "run a live process owns (status running) or with a step in doubt (the new run "
        "would fire it with a new idempotency key). A stopped run can be deleted.",
    )
    rm.add_argument("run", metavar="RUN", type=_run_ref, help=run_help)
    rm.add_argument("--force", action="store_true", help="delete even a live-owned or in-doubt run")

    prune = command(
        "prune",
        _cmd_prune,
        "delete old completed (or failed) runs; dry run unless --yes",
        "Delete the checkpoints of completed (--completed) and/or failed (--failed) runs "
        "whose last checkpoint is older than --older-than. Lists them without deleting "
        "unless --yes. Runs with a pending intent and objects that are not durable_steps "
        "checkpoints are never deleted.",
    )
    prune.add_argument("--completed", action="store_true", help="prune completed runs")
    prune.add_argument("--failed", action="store_true", help="prune failed runs")
    prune.add_argument(
        "--older-than",
        type=_arg(parse_duration),
        required=True,
        metavar="AGE",
        help="only runs last written this long ago or more: 30m, 12h, 7d, 2w, 0s",
    )
    prune.add_argument("--workflow", "-w", type=_workflow_name, help="only runs of this workflow")
    prune.add_argument("--yes", "-y", action="store_true", help="really delete them")
    _cli_worker.register(command)
    return parser


# --- entry point ---------------------------------------------------------------


def _report(exc: BaseException, debug: bool) -> int:
    """Print ``exc`` as one line on stderr (after its traceback with --debug); its exit status."""
    code, text = EXIT_ERROR, str(exc)
    if isinstance(exc, CommandError):
        code = exc.code
    elif isinstance(exc, (CheckpointConflict, RunLocked)):
        code = EXIT_REFUSED
    elif isinstance(exc, DefinitionError):
        code = EXIT_USAGE
    elif not isinstance(exc, (DurableStepsError, OSError)):
        text = f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)"
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    print(f"{PROG}: error: {' '.join(text.split())}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run ``durable-steps`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
    args.store_url = args.store or os.environ.get(STORE_ENV) or DEFAULT_STORE
    store: Store | None = None
    try:
        store = open_store(args.store_url)
        return int(args.handler(args, store, Style(use_color(args.color, sys.stdout))))
    except BrokenPipeError:  # `durable-steps ls | head`: stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # never a traceback without --debug
        return _report(exc, args.debug)
    finally:
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
