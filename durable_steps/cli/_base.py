"""What every command shares: exit statuses, the one-line error, argument types."""

from __future__ import annotations

import argparse
import contextvars
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._apps import load_app
from .._record import checkpoint as ckpt
from ..errors import DefinitionError
from ..stores import Store, command_hint

if TYPE_CHECKING:
    from .._workflow import Workflow

__all__ = [
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "PROG",
    "RUN_HELP",
    "CommandError",
    "arg",
    "cmd",
    "json_argument",
    "run_ref",
    "workflow_name",
]

PROG = "durable-steps"
RUN_HELP = (
    "the run, as WORKFLOW/RUN_ID (the first two columns of `ls`), or a bare RUN_ID "
    "that only one run has"
)
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4

INVOKED: contextvars.ContextVar[str] = contextvars.ContextVar("invoked", default=PROG)
"""``durable-steps`` with the global options this invocation needs to reach its
store (``--store URL``), as set by ``main``: what a hint's command starts with."""


APP: contextvars.ContextVar[str] = contextvars.ContextVar("app", default="module:workflow")
"""The ``--app`` this invocation was given (a placeholder without one): what a
hint's ``worker --app`` names."""


def cmd() -> str:
    """The command a hint suggests begins with this: ``durable-steps`` and the
    ``--store`` the invocation was given, so the suggestion works as printed.
    """
    return INVOKED.get()


def app_on_store(args: argparse.Namespace, store: Store) -> Workflow:
    """The ``--app`` workflow, on ``--store`` when one was given explicitly, else
    on the store the app configured (as a worker of that app would use); the
    hints of this invocation then name that store and that app.
    """
    workflow = load_app(args.app)
    if args.store:
        workflow.store = store
    INVOKED.set(command_hint(workflow.store))
    APP.set(args.app)
    return workflow


class CommandError(Exception):
    """A failure to report as one line, with the exit status to return."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` calling ``parse``; its errors become usage errors."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, DefinitionError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


@arg
def run_ref(text: str) -> tuple[str | None, str]:
    """``WORKFLOW/RUN_ID`` as validated names; a bare ``RUN_ID`` as ``(None, RUN_ID)``.

    A bare id is looked up in the store by the command (``_runs.locate``).
    """
    workflow, sep, run_id = text.partition("/")
    if not sep:
        return None, ckpt.validate_name(text, "run id")
    return ckpt.validate_name(workflow, "workflow name"), ckpt.validate_name(run_id, "run id")


@arg
def workflow_name(text: str) -> str:
    """A validated workflow name."""
    return ckpt.validate_name(text, "workflow name")


def json_argument(text: str, option: str) -> Any:
    """A JSON command-line value, given inline or as ``@file``; bad JSON exits 2."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise CommandError(f"{option}: cannot read {text[1:]!r}: {exc}", EXIT_USAGE) from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CommandError(f"{option}: not JSON ({exc})", EXIT_USAGE) from exc
