"""The parser and the entry point: global options, help, errors as one line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from .._version import __version__
from ..errors import CheckpointConflict, DefinitionError, DurableStepsError, RunLocked
from ..stores import DEFAULT_STORE, STORE_ENV, Store, command_hint, open_store
from . import _cleanup, _deploys, _doubt, _inspect, _ls, _reindex, _ui, _waiting, _worker
from ._base import EXIT_ERROR, EXIT_REFUSED, EXIT_USAGE, INVOKED, PROG, CommandError
from ._format import Style, echo, use_color

__all__ = ["build_parser", "main"]

EPILOG = f"""\
statuses:
  running    a live process owns it now (`show` gives its host:pid and lease)
  queued     submitted (wf.submit) and not started yet: a worker starts it
  stopped    nobody is running it: it crashed, was killed or released -- rerun
             the workflow or start a worker to resume it
  waiting    a step waits (ctx.sleep, ctx.wait_for) for a time or a signal; no
             process holds it: `ls` says for what, `show` how to unblock it
  failed     a step raised and used up its retries
  in-doubt   a non-idempotent step may have fired before a crash (its intent is
             pending): `show` says what a rerun does; decide with `resolve`
  completed  finished; the checkpoint holds the final state
  deleted    finished with on_complete="delete": only a tombstone is left (a rerun
             returns None and runs nothing); `rm` frees the id for a new run
  corrupt    (ls only) the checkpoint cannot be read; `show` says why

find a stopped run and see why:
  {PROG} ls                                 the newest runs: status, next step, age
  {PROG} ls --status failed                 runs stopped by a step's error
  {PROG} ls --status stopped                runs nobody is running (crashed, killed)
  {PROG} show support-agent/t-4411          the error, pending intent, recent steps
  {PROG} show t-4411                        the same, if only one run has that id
  {PROG} show support-agent/t-4411 --state  ... and the saved state
  then rerun the workflow (wf.run(run_id)): it resumes at the step shown

an in-doubt step, e.g. a payment that may have gone through before a crash:
  {PROG} ls --status in-doubt
  {PROG} show pay/order-17                  its idempotency key: look it up at the API
  {PROG} resolve pay/order-17 --fired       it happened: the rerun skips the step
  {PROG} resolve pay/order-17 --not-fired   it did not: the rerun fires it, same key

a run waiting for a person (ctx.wait_for("approval")):
  {PROG} ls --status waiting                what each waits for (WAITING FOR)
  {PROG} signal refunds/t-9 approval --data '{{"approved": true}}'
                                                   then rerun it, or a worker resumes it

clean up:
  {PROG} rm pay/order-17                    one run (refuses live or in-doubt runs)
  {PROG} prune --completed --older-than 7d  list what would go; add --yes to delete

before deploying new code (exit 4 if a run would raise WorkflowChanged):
  {PROG} plan --all --app myagent:workflow  where the new code resumes each run
  {PROG} fork pay/order-17 order-17b        a copy of a run to retry under new code

resume many runs, on as many machines as you like:
  {PROG} worker --app myagent:workflow      claim and finish unowned runs; SIGTERM stops
  {PROG} reindex                            once, for a store an earlier version wrote

see it all in a browser (pip install 'durable-steps[ui]'):
  {PROG} ui                                 http://127.0.0.1:8765/ (--read-only: no actions)

store: --store URL, else ${STORE_ENV}, else {DEFAULT_STORE}. A URL is a path,
  file:///path or s3://bucket/prefix (boto3's configuration: AWS_PROFILE,
  AWS_ENDPOINT_URL_S3 for MinIO, R2, Ceph, SeaweedFS, ...).

exit status:
  0 ok   1 error (store failed, unreadable checkpoint)
  2 usage (also: a bare run id that several runs have; a signal's bad JSON)
  3 run not found (signal: also a finished run)
  4 refused (a live process owns the run, the status does not allow it, nothing
    to resolve, not a checkpoint, the run changed meanwhile, or the signal was
    already sent)
colour only on a terminal, never when NO_COLOR is set."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _globals(sub: bool) -> _Parser:
    """The global options, accepted before or after the command."""
    p = _Parser(add_help=False)
    g = p.add_argument_group("global options")
    unset = argparse.SUPPRESS
    g.add_argument(
        "--store",
        metavar="URL",
        default=unset if sub else None,
        help=f"where runs live: a path, file:///path, s3://bucket/prefix, gs://bucket/prefix "
        "or az://container/prefix "
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

    for group in (_ls, _inspect, _waiting, _doubt, _cleanup, _reindex, _worker, _deploys, _ui):
        group.register(command)
    return parser


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
    echo(f"{PROG}: error: {' '.join(text.split())}", stream=sys.stderr)
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
        INVOKED.set(command_hint(store))
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
