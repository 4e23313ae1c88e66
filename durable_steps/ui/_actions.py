"""The page's actions are the command line's: signal, resolve, fork, delete.

Each is carried out by the very command the CLI runs (``_cmd_signal``,
``_cmd_resolve``, ``_cmd_fork``, ``_cmd_rm``), given the arguments the form
holds, so the page refuses what the command refuses (a live-owned or
in-doubt run is not deleted, a signal is delivered once, a finished run is
not forked) and says what it says. A command prints its result: it runs
under a lock with its output taken, one action at a time (actions are a
person's clicks, never a hot path).

What a form may say is checked before the command sees it: the values are
JSON parsed here (so ``@file``, the command line's way to read a payload
from a file, can never be given through the page), names are validated,
and ``--force`` is never passed: a person who needs it uses the CLI.

:func:`describe` is the confirmation page's text: what will happen, in the
words of the command's own help.

Every action is pinned to the run its page showed: each form carries the
run's nonce, the confirmation reads the run again and refuses another one,
and "yes" passes the nonce to the command (``expect_nonce``: ``rm`` deletes
only if its conditional delete finds that run; ``signal`` and ``fork`` check
it on the head they read before writing). An id deleted and created again
between "confirm" and "yes" is another run: nothing is done to it.

A resolution names what it resolves. The run page's form carries the keys of
what it showed in doubt; the confirmation reads the run again and names each
(refusing when it is no longer that), and the resolution itself is written
only if what is in doubt is still exactly those keys (``resolve(expect=)``,
checked and written as one conditional write). Without this, "yes" would
resolve whatever is in doubt when it is pressed: another effect, after the
run was resolved elsewhere and went on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import threading
from dataclasses import dataclass, replace
from typing import Any

from .._fleet.signals import refuse_unaccepted
from .._protocol.resolving import doubt_keys
from .._record import checkpoint as ckpt
from ..cli._base import INVOKED, CommandError
from ..cli._cleanup import _cmd_rm
from ..cli._deploys import _cmd_fork
from ..cli._doubt import _cmd_resolve
from ..cli._format import Style
from ..cli._runs import FIRED_SKIPS_STEP, effect_label, load, open_effects
from ..cli._waiting import _cmd_signal
from ..errors import DefinitionError, DurableStepsError, SignalRefused
from ..stores import Store, command_hint

__all__ = ["ACTIONS", "Outcome", "Request", "describe", "parse", "perform"]

ACTIONS = ("signal", "resolve", "fork", "delete")
_LOCK = threading.Lock()
_MAX_JSON = 256 * 1024


class FormError(ValueError):
    """What a form holds cannot be acted on; the message says why."""


@dataclass(frozen=True)
class Request:
    """An action as a form asked for it, checked."""

    action: str
    workflow: str
    run_id: str
    signal: str = ""
    payload: Any = None
    fired: bool | None = None
    result: Any = None
    has_result: bool = False
    new_run: str = ""
    doubt: tuple[str, ...] = ()
    """resolve: the keys of what the page showed in doubt (what "yes" resolves)."""
    nonce: str = ""
    """The nonce of the run the page showed: the action is for that run only."""

    @property
    def run(self) -> str:
        """``workflow/run_id``."""
        return f"{self.workflow}/{self.run_id}"

    def fields(self) -> dict[str, str]:
        """The form fields that ask for this action again (the confirmation's hidden fields)."""
        out = {"action": self.action, "workflow": self.workflow, "run_id": self.run_id}
        out["nonce"] = self.nonce
        if self.action == "signal":
            out.update(signal=self.signal, payload=json.dumps(self.payload))
        elif self.action == "resolve":
            out["fired"] = "yes" if self.fired else "no"
            out["doubt"] = json.dumps(list(self.doubt))
            if self.has_result:
                out["result"] = json.dumps(self.result)
        elif self.action == "fork":
            out["new_run"] = self.new_run
        return out


@dataclass(frozen=True)
class Outcome:
    """What an action did: its message, and whether it succeeded."""

    ok: bool
    message: str


def _json(text: str, what: str) -> Any:
    if len(text) > _MAX_JSON:
        raise FormError(f"{what} is longer than {_MAX_JSON // 1024} KB")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FormError(f"{what} is not JSON ({exc})") from exc
    except RecursionError as exc:  # "[[[[…" deeper than the interpreter's stack
        raise FormError(f"{what} is nested too deeply to be read") from exc


def _name(text: str, what: str) -> str:
    try:
        return ckpt.validate_name(text, what)
    except DefinitionError as exc:
        raise FormError(exc.message) from exc


def parse(form: dict[str, str]) -> Request:
    """The action a form asks for (``FormError`` when it cannot be done as asked)."""
    action = form.get("action", "")
    if action not in ACTIONS:
        raise FormError(f"unknown action {action!r}")
    workflow = _name(form.get("workflow", ""), "workflow name")
    run_id = _name(form.get("run_id", ""), "run id")
    request = _parse(action, workflow, run_id, form)
    nonce = form.get("nonce", "")
    if not nonce and action != "resolve":  # a resolution is pinned by its keys already
        raise FormError(
            "the form does not say which run it was shown for: reload the run's page and act "
            "from there"
        )
    return replace(request, nonce=nonce)


def _parse(action: str, workflow: str, run_id: str, form: dict[str, str]) -> Request:
    if action == "signal":
        text = form.get("payload", "").strip() or "null"
        signal = _name(form.get("signal", "").strip(), "signal name")
        return Request(action, workflow, run_id, signal=signal, payload=_json(text, "the payload"))
    if action == "resolve":
        fired = {"yes": True, "no": False}.get(form.get("fired", ""))
        if fired is None:
            raise FormError("say whether it fired: choose 'it fired' or 'it did not fire'")
        text = form.get("result", "").strip()
        if text and not fired:
            raise FormError(
                "a result says what a fired effect returned; it cannot go with 'it did not fire'"
            )
        result = _json(text, "the result") if text else None
        keys = (
            _json(form.get("doubt", ""), "what the page showed in doubt")
            if form.get("doubt")
            else None
        )
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise FormError(
                "the form does not say what is in doubt: reload the run's page and resolve "
                "from there"
            )
        return Request(
            action,
            workflow,
            run_id,
            fired=fired,
            result=result,
            has_result=bool(text),
            doubt=tuple(sorted(keys)),
        )
    if action == "fork":
        new_run = _name(form.get("new_run", "").strip(), "new run id")
        return Request(action, workflow, run_id, new_run=new_run)
    return Request(action, workflow, run_id)


def back_of(form: dict[str, str]) -> Request | None:
    """The run a refused form was about (for a link back to it), if its names are valid."""
    try:
        workflow = _name(form.get("workflow", ""), "workflow name")
        run_id = _name(form.get("run_id", ""), "run id")
    except FormError:
        return None
    return Request(str(form.get("action", "")), workflow, run_id)


def typed(form: dict[str, str]) -> dict[str, str]:
    """What a person typed into a refused form (its error page offers it again)."""
    return {k: form[k] for k in ("signal", "payload", "result", "new_run") if form.get(k)}


def in_doubt(store: Store, workflow: str, run_id: str) -> dict[str, str]:
    """What is in doubt in the run now: key → what it is (``step 'pay'``)."""
    try:
        header, _, _ = load(store, workflow, run_id)
    except CommandError as exc:
        raise FormError(exc.message) from exc
    out = {}
    intent = header.intent
    if intent is not None and intent.get("resolution") is None:
        out[str(intent.get("key"))] = f"step {intent.get('step')!r}"
    for effect in open_effects(header.journal):
        out[str(effect.get("key"))] = f"effect {effect_label(effect)}"
    assert sorted(out) == doubt_keys(header), "the page and resolve name the same keys"
    return out


def _header(store: Store, request: Request) -> ckpt.Checkpoint:
    try:
        return load(store, request.workflow, request.run_id)[0]
    except CommandError as exc:
        raise FormError(exc.message) from exc


def describe(request: Request, store: Store) -> list[str]:
    """What the action will do, for the confirmation page (one paragraph a line).

    A resolution reads the run: it names what it resolves, and is refused
    (``FormError``) when that is no longer what the page showed.
    """
    run = request.run
    if request.nonce:
        header = _header(store, request)
        if header.run_nonce != request.nonce:
            raise FormError(
                f"run {run} changed since its page was shown: it was deleted and created "
                "again (another run under that id). Nothing was changed: reload the run's page."
            )
    if request.action == "signal":
        header = _header(store, request)
        try:  # refused now, not after the person confirmed
            refuse_unaccepted(header.status, header.wait, run, request.signal, request.payload)
        except SignalRefused as exc:
            raise FormError(exc.message) from exc
        return [
            f"Send signal {request.signal!r} to run {run}, with the payload "
            f"{json.dumps(request.payload)}.",
            "The signal is a create-only object beside the run's checkpoint: it never "
            "conflicts with the process that owns the run. ctx.wait_for("
            f"{request.signal!r}) in a step returns the payload; the run goes on when it is "
            "run again or a worker resumes it.",
            "A signal name is delivered once per run: this cannot be sent again or undone.",
        ]
    if request.action == "resolve":
        now = in_doubt(store, request.workflow, request.run_id)
        if sorted(now) != list(request.doubt):
            shown = ", ".join(request.doubt)
            current = "; ".join(f"{v} (key {k})" for k, v in now.items()) or "nothing"
            raise FormError(
                f"what is in doubt in run {run} changed since its page was shown (shown: "
                f"key {shown}; now: {current}). Nothing was changed: reload the run's page."
            )
        named = "; ".join(f"{now[k]} (key {k})" for k in request.doubt)
        if request.fired:
            lines = [
                f"Record that {named} in run {run} took effect: the next run counts "
                "it as done without calling it again."
            ]
            if any(now[k].startswith("step ") for k in request.doubt):
                lines.append(f"Note: {FIRED_SKIPS_STEP}.")
            if request.has_result:
                lines.append(
                    f"The result {json.dumps(request.result)} is recorded as what the effect "
                    "returned: ctx.effect returns it when the step runs again."
                )
            lines.append(
                "If what is in doubt is no longer exactly this when you confirm, nothing is "
                "changed."
            )
            return lines
        return [
            f"Record that {named} in run {run} did not take effect: the next run "
            "fires it again, with the same idempotency key (the service can drop a duplicate).",
            "If what is in doubt is no longer exactly this when you confirm, nothing is changed.",
        ]
    if request.action == "fork":
        return [
            f"Create run {request.workflow}/{request.new_run} from the last committed state "
            f"and position of {run}, with a new nonce (so its non-idempotent steps get new "
            "idempotency keys).",
            f"{run} is left as it is. The new run is not started: rerun the workflow or let "
            "a worker resume it. Refused if the new id exists or the run has finished.",
        ]
    return [
        f"Delete run {run}: its checkpoint and the parts it references, for good. A rerun "
        "of that id starts a new run.",
        "Refused for a run a live process owns, and for one with a step or effect in doubt "
        "(deleting it would forget the idempotency key): resolve it first.",
    ]


def _namespace(request: Request, store: Store) -> tuple[Any, argparse.Namespace]:
    ref = (request.workflow, request.run_id)
    base = {"run": ref, "store_url": command_hint(store), "color": "never", "debug": False}
    base["expect_nonce"] = request.nonce or None
    if request.action == "signal":
        data = json.dumps(request.payload)
        return _cmd_signal, argparse.Namespace(**base, name=request.signal, data=data)
    if request.action == "resolve":
        result = json.dumps(request.result) if request.has_result else None
        return _cmd_resolve, argparse.Namespace(
            **base, fired=request.fired, result=result, force=False, expect=list(request.doubt)
        )
    if request.action == "fork":
        return _cmd_fork, argparse.Namespace(**base, new_run=request.new_run, app=None)
    return _cmd_rm, argparse.Namespace(**base, force=False)


def perform(request: Request, store: Store) -> Outcome:
    """Carry out ``request`` with the CLI's command; what it said."""
    handler, args = _namespace(request, store)
    out = io.StringIO()
    with _LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        token = INVOKED.set(command_hint(store))
        try:
            code = handler(args, store, Style(False))
        except CommandError as exc:
            return Outcome(False, exc.message)
        except DurableStepsError as exc:
            return Outcome(False, exc.message)
        finally:
            INVOKED.reset(token)
    text = " ".join(out.getvalue().split())
    return Outcome(code == 0, text or "done")
