"""A run's page: status and why, owner and lease, wait, intent, error, journal, timeline, state.

What ``show`` says, laid out for a page: the same computations
(``cli._inspect.next_hint``, ``cli._runs.status_of`` and ``owner_text``,
``cli._waiting.signal_sent``), so the page and the command line never
disagree about a run. Every value here is plain text: the template escapes it.

What ``show`` prints of a head it cannot verify, the page marks (or, for a
head that says it is signed and carries no signature, refuses): see
:mod:`durable_steps.ui._signed`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from .._fleet.leases import is_live, lease_end
from .._protocol.resolving import doubt_keys
from .._record import checkpoint as ckpt
from ..cli._format import human_size, run_size, timestamp
from ..cli._inspect import next_hint
from ..cli._runs import (
    FIRED_SKIPS_STEP,
    effect_label,
    load,
    open_effects,
    owner_text,
    peek_header,
    status_of,
)
from ..cli._waiting import accepts, signal_sent
from ..stores import Store
from . import _history, _signed, _state, _timeline

__all__ = ["RunPage", "run_page"]

_FINISHED = ("completed", "deleted")
_PREVIEW = 300


@dataclass
class RunPage:
    """Everything the run page shows (all text; the template escapes it)."""

    workflow: str
    run_id: str
    status: str
    hint: str
    fields: list[tuple[str, str]]
    wait: list[tuple[str, str]] = field(default_factory=list)
    intent: list[tuple[str, str]] = field(default_factory=list)
    error: list[tuple[str, str]] = field(default_factory=list)
    journal: list[dict[str, str]] = field(default_factory=list)
    journal_step: str = ""
    timeline: _timeline.Timeline | None = None
    state: _state.Decoded | None = None
    tree: _state.Node | None = None
    change: list[str] = field(default_factory=list)
    waits_for: str | None = None
    """The signal name a waiting run waits for (prefills the signal form)."""
    accepts: str = ""
    """What payload that signal accepts, in words (the signal form says it)."""
    doubt: list[str] = field(default_factory=list)
    """What is in doubt, one line each (the resolve form is shown when there is)."""
    effect_in_doubt: bool = False
    fired_note: str = ""
    """What resolving the step in doubt as fired drops (its changes to the state),
    shown on the resolve form; empty when no step is in doubt."""
    doubt_keys: str = "[]"
    """The keys of what is in doubt, as JSON: the resolve form carries them, so
    "yes" resolves exactly what was shown (``_actions``)."""
    finished: bool = False
    signal_note: str = ""
    """Why there is no signal form (empty: there is one)."""
    delete_note: str = ""
    """Why there is no delete button (empty: there is one): what ``rm`` would refuse."""
    signature: _signed.Signature | None = None
    """Whether the head was verified; its warning is shown above everything else."""
    nonce: str = ""
    """The run's nonce: every form carries it, so "yes" acts only on this run, not on
    one created under its id since (``_actions``)."""

    @property
    def name(self) -> str:
        """``workflow/run_id``."""
        return f"{self.workflow}/{self.run_id}"


def _preview(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= _PREVIEW else f"{text[: _PREVIEW - 1]}…"


def _at(value: Any, now: float) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timestamp(float(value), now)
    return _preview(value)


def _change_lines(decoded: _state.Decoded) -> list[str]:
    """The last commit's change, one op a line: ``set messages.3 = {...}``."""
    if decoded.whole:
        return [
            "the last commit wrote the state whole (a small state is written whole at every "
            "commit), so its change is not recorded apart"
        ]
    if decoded.last_change is None:
        return []
    lines = []
    for op in decoded.last_change:
        path = ".".join(str(p) for p in op[1]) or "(the root)"
        if op[0] == "set":
            lines.append(f"set {path} = {_preview(op[2])}")
        elif op[0] == "del":
            lines.append(f"removed {path}")
        elif op[0] == "ext":
            n = len(op[2]) if isinstance(op[2], list) else 1
            lines.append(f"appended {n} item{'s' * (n != 1)} to {path}: {_preview(op[2])}")
        elif op[0] == "cut":
            lines.append(f"cut {path} to {op[2]} items")
    return lines


def run_page(
    store: Store, workflow: str, run_id: str, *, page: int = 1, unsafe: bool = False
) -> RunPage:
    """Read a run and lay it out (``CommandError`` EXIT_NOT_FOUND when it does not exist)."""
    header, payload, data = load(store, workflow, run_id)
    signature = _signed.check(header, data)  # before anything of the head is laid out
    now = time.time()
    status = status_of(header)
    sent_at = signal_sent(store, header)
    n = len(header.steps)
    if header.status in _FINISHED:
        where = f"finished in pass {header.iteration}"
    else:
        step = header.steps[header.next_step] if header.next_step < n else "?"
        where = f"next step {step!r} ({header.next_step + 1} of {n}), pass {header.iteration}"
    raw = peek_header(data, workflow, run_id)
    fields = [
        ("position", where),
        ("owner", owner_text(header.owner, header.status, since=header.updated_at)),
        ("committed", f"{header.committed} step commit{'s' * (header.committed != 1)}"),
        ("steps", " → ".join(header.steps)),
        ("serializer", header.serializer),
        ("signature", signature.text),
        ("version", str(header.version) if header.version is not None else "none"),
        ("size", human_size(run_size(len(data), raw))),
        ("created", timestamp(header.created_at, now)),
        ("updated", timestamp(header.updated_at, now)),
    ]
    if header.owner and is_live(header.owner, since=header.updated_at):
        end = lease_end(header.owner, since=header.updated_at)
        fields.insert(2, ("lease", f"ends {timestamp(end, now)}"))
    out = RunPage(workflow, run_id, status, next_hint(header, sent_at), fields)
    out.signature = signature
    out.nonce = header.run_nonce
    out.finished = header.status in _FINISHED
    _sections(out, header, sent_at, now)
    out.doubt_keys = json.dumps(doubt_keys(header))
    _offers(out, header, status, sent_at)
    decoded = _state.decode_run(store, header, payload, unsafe)
    out.state = decoded
    if decoded.decoded:
        out.tree = _state.tree(decoded.state)
    out.change = _change_lines(decoded)
    if header.journal:
        out.journal_step = f"{header.journal['step']} (pass {header.journal['iteration']})"
        for call in decoded.calls:
            ours = _timeline.call_text(call)
            out.journal.append(
                {
                    "name": ours[0] if ours else str(call["name"]),
                    "kind": "timeout" if ours else str(call["kind"]),
                    "key": str(call.get("key") or ""),
                    "result": _at(call["result"], now) if ours else _preview(call["result"]),
                }
            )
        for effect in header.journal.get("open") or ():
            resolution = effect.get("resolution")
            out.journal.append(
                {
                    "name": effect_label(effect),
                    "kind": "effect",
                    "key": str(effect.get("key")),
                    "result": f"resolved as {resolution}"
                    if resolution
                    else "in doubt: "
                    "its intent is recorded and its result is not; it may have fired",
                }
            )
    out.timeline = _timeline.build(header, decoded.calls, page, _history.read(store, header))
    return out


def _offers(out: RunPage, header: ckpt.Checkpoint, status: str, sent_at: float | None) -> None:
    """Which action forms the page offers, and why not the others (what the CLI refuses)."""
    if out.finished:
        out.signal_note = "the run has finished: a signal would never be read"
    elif out.waits_for is None:
        out.signal_note = (
            "the run is not waiting for a signal (a signal it will wait for later can be "
            "sent ahead from the command line: durable-steps signal)"
        )
    elif sent_at is not None:
        out.signal_note = (
            f"signal {out.waits_for!r} was delivered already (a signal name is delivered once "
            "per run); the run goes on when it is run again or a worker resumes it"
        )
    if status == "running":
        out.delete_note = (
            "a live process owns this run (its lease is current): rm refuses it; wait for "
            "that process, or stop it"
        )
    elif header.intent is not None or open_effects(header.journal):
        out.delete_note = (
            "a step or effect of this run is or was in doubt: deleting it would forget its "
            "idempotency key, so rm refuses it (durable-steps rm --force deletes it anyway)"
        )


def _sections(out: RunPage, header: ckpt.Checkpoint, sent_at: float | None, now: float) -> None:
    """The wait, intent and error sections, and what the action forms need."""
    wait = header.wait if header.status == "waiting" and isinstance(header.wait, dict) else None
    if wait is not None:
        signal, until = wait.get("signal"), wait.get("until")
        out.wait.append(("step", f"{wait.get('step')} (pass {wait.get('iteration')})"))
        if signal is not None:
            out.waits_for = str(signal)
            got = f"sent {timestamp(sent_at, now)}" if sent_at is not None else "not sent yet"
            out.wait.append(("signal", f"{signal}: {got}"))
            out.accepts = accepts(wait)
            out.wait.append(("accepts", out.accepts))
        if until is not None:
            out.wait.append(("timeout" if signal else "until", timestamp(float(until), now)))
        out.wait.append(("since", timestamp(float(wait.get("since", now)), now)))
    intent = header.intent
    if intent:
        out.intent = [
            ("step", f"{intent.get('step')} (pass {intent.get('iteration')})"),
            ("idempotency key", str(intent.get("key"))),
            ("written", timestamp(float(intent.get("at", 0)), now)),
            ("policy", str(intent.get("policy") or "not recorded (an older checkpoint)")),
            ("resolution", str(intent.get("resolution") or "none yet")),
        ]
        if intent.get("resolution") is None:
            out.doubt.append(f"step {intent.get('step')!r} (key {intent.get('key')})")
            out.fired_note = FIRED_SKIPS_STEP[0].upper() + FIRED_SKIPS_STEP[1:] + "."
    for effect in open_effects(header.journal):
        out.effect_in_doubt = True
        out.doubt.append(f"effect {effect_label(effect)} (key {effect.get('key')})")
    error = header.error
    if error:
        out.error = [
            ("step", f"{error.get('step')} (pass {error.get('iteration')})"),
            ("error", f"{error.get('type')}: {error.get('message')}"),
            ("attempts", str(error.get("attempts"))),
            ("at", timestamp(float(error.get("at", 0)), now)),
        ]
