"""``show``: why a run stopped, what it did and what to do next."""

from __future__ import annotations

import argparse
import os
import pprint
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._deploys import positions
from .._deploys.fingerprints import code_changes, fingerprints
from .._drivers import drive_sync
from .._fleet.leases import is_live
from .._record import checkpoint as ckpt
from .._record.format2 import load_state
from ..errors import CorruptCheckpoint, WorkflowChanged
from ..serializers import (
    SIGNED_SUFFIX,
    SIGNING_KEY_ENV,
    PickleSerializer,
    Serializer,
    resolve_serializer,
)
from ..stores import Store
from ._base import (
    APP,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    RUN_HELP,
    CommandError,
    app_on_store,
    cmd,
    run_ref,
)
from ._format import (
    Style,
    clean,
    human_age,
    human_duration,
    human_size,
    json_text,
    table,
    timestamp,
)
from ._indexed import locate
from ._runs import (
    FINISHED,
    FIRED_SKIPS_STEP,
    RunInfo,
    effect_label,
    load,
    next_step,
    open_effects,
    owner_text,
    status_of,
)
from ._waiting import signal_sent, wait_hint, wait_lines

if TYPE_CHECKING:
    from .._workflow import Workflow

__all__ = ["FINISHED", "describe", "next_hint", "next_step", "register"]


def state_text(state: Any, serializer: str) -> str:
    """A state for reading: indented JSON (still exact JSON), or ``pprint`` for a pickle."""
    if serializer.startswith("json"):
        return json_text(state)
    return clean(pprint.pformat(state, sort_dicts=False), newlines=True)


def _on_rerun(policy: object) -> str:
    """What a rerun does about an unresolved intent, by the step's ``in_doubt`` policy
    (``intent["policy"]``; older checkpoints do not record it).
    """
    if policy == "refire":
        return "a rerun fires it again with the same key (the service can drop a duplicate)"
    if policy == "reconcile":
        return (
            "a rerun first asks the step's reconcile hook whether it went through, and fires "
            "it again with the same key only if not"
        )
    if policy == "raise":
        return "a rerun stops with StepInDoubt until you say what happened"
    return (
        "what a rerun does depends on the step's policy, which this checkpoint does not "
        "record: in_doubt='refire' (the default) fires it again with the same key; a "
        "reconcile hook is asked first whether it went through; in_doubt='raise' stops "
        "with StepInDoubt until you say what happened"
    )


def _doubt(header: ckpt.Checkpoint, intent: dict[str, Any]) -> tuple[str, str]:
    """``'step' may have fired (key K)``, and how to tell the run whether it did."""
    step = header.steps[header.next_step] if header.next_step < len(header.steps) else "?"
    effect = intent.get("effect")
    skips = f"does not fire effect {intent.get('label')} again" if effect else "skips the step"
    resolve = (
        "ask the service it calls whether that key went through, then "
        f"`{cmd()} resolve {header.run} --fired` (it did: the rerun {skips}) or "
        "`--not-fired` (the rerun fires it again with the same key)"
    )
    if not effect:
        resolve += f". Note: {FIRED_SKIPS_STEP}"
    what = f"effect {intent.get('label')} of step " if effect else ""
    return f"{what}{intent.get('step', step)!r} may have fired (key {intent.get('key')})", resolve


def _effect_intent(header: ckpt.Checkpoint) -> dict[str, Any] | None:
    """The first effect in doubt, shaped like a step's intent (for the hints)."""
    effects = open_effects(header.journal)
    if not effects or header.journal is None:
        return None
    first = effects[0]
    return {
        "step": header.journal["step"],
        "effect": first["name"],
        "label": effect_label(first),
        "key": first["key"],
        "policy": first.get("policy"),
    }


def _crashed_hint(header: ckpt.Checkpoint, intent: dict[str, Any], resume: str) -> str:
    """The advice for a run nobody runs that has an intent, resolved or not."""
    if intent.get("resolution") is not None:
        return f"resolved as {intent['resolution']}; {resume} to continue"
    doubt, resolve = _doubt(header, intent)
    policy = intent.get("policy")
    if policy == "raise":
        return f"nobody is running it and {doubt}: {_on_rerun(policy)}: {resolve}"
    step = header.steps[header.next_step]
    return (
        f"nobody is running it and {doubt}: {_on_rerun(policy)}. To decide yourself, "
        f"{resolve}. Then {resume} to resume at step {step!r}"
    )


def _finished_hint(header: ckpt.Checkpoint) -> str:
    """The advice for a completed run, or the tombstone of one."""
    if header.status == "completed":
        return (
            f"nothing left to do; a rerun returns the final state. Delete: {cmd()} rm {header.run}"
        )
    return (
        f"completed and its state deleted at {timestamp(header.updated_at)}; a rerun of this "
        f"id returns None and runs nothing; `{cmd()} rm {header.run}` frees the id for a new run"
    )


def next_hint(header: ckpt.Checkpoint, sent_at: float | None = None) -> str:
    """What to do about a run, in one sentence (the ``next:`` line of ``show``);
    ``sent_at``: when the signal a waiting run waits for was sent.
    """
    return wait_hint(header, sent_at, time.time()) or _hint(header)


def _hint(header: ckpt.Checkpoint) -> str:
    """:func:`next_hint` of a run that does not wait."""
    name = header.run
    step = header.steps[header.next_step] if header.next_step < len(header.steps) else "?"
    intent = header.intent or _effect_intent(header) or {}
    doubt, resolve = _doubt(header, intent)
    if header.status in FINISHED:
        return _finished_hint(header)
    if header.status == "in_doubt":  # the step's in_doubt="raise" policy stopped the run
        return f"{doubt}: {resolve}, and rerun the workflow"
    if header.status == "failed":
        pending = bool(intent) and intent.get("resolution") is None
        also = f"; {doubt}: if it did, `{cmd()} resolve {name} --fired` first" if pending else ""
        return f"fix the cause, then rerun the workflow: it resumes at step {step!r}{also}"
    if is_live(header.owner, since=header.updated_at):
        who = owner_text(header.owner, header.status, since=header.updated_at)
        return f"it is being run by {who}: wait for it (`{cmd()} show {name}` again to follow it)"
    resume = f"rerun the workflow or `{cmd()} worker --app {APP.get()}`"
    if intent:
        return _crashed_hint(header, intent, resume)
    queued = header.owner is None and not header.committed
    why, go = (
        ("it was submitted and has not started", "start it")
        if queued
        else ("nobody is running it (it crashed, was killed or released)", "resume")
    )
    return f"{why}: {resume} to {go} at step {step!r}; to discard it: {cmd()} rm {name}"


def _fields(pairs: list[tuple[str, str]], style: Style, red: str = "") -> list[str]:
    """Aligned ``label  value`` lines; values are cleaned, the one labelled ``red`` painted."""
    width = max(len(label) for label, _ in pairs)
    lines = []
    for label, value in pairs:
        text = style.paint(clean(value), "red") if label == red else clean(value)
        lines.append(f"  {style.dim(label.ljust(width))}  {text}")
    return lines


def _size_text(header: ckpt.Checkpoint, size: int, payload: bytes) -> str:
    """What the run keeps: its checkpoint object (``size`` bytes) and, in
    format 2, the parts it lists; the head holds a small state whole or the
    changes since the last part.
    """
    if header.status == "deleted":
        return f"{human_size(size)} (a tombstone: the state was deleted when the run completed)"
    if header.format == 1:
        return f"{human_size(size)} ({human_size(len(payload))} of state)"
    held = f"{human_size(len(payload))} of state or changes" if payload else "no changes"
    if not header.parts:
        return f"{human_size(size)}, all in the head ({held})"
    parts = sum(p["size"] for p in header.parts)
    count = len(header.parts)
    return (
        f"{human_size(size + parts)} in all: a {human_size(size)} head ({held}) and "
        f"{count} part{'s' * (count != 1)} of {human_size(parts)}"
    )


def _format_text(header: ckpt.Checkpoint) -> str:
    if header.format == 1:
        return "1 (the whole state in one object; the run continues in format 1)"
    return "2 (a head with a small state or the recent changes, and parts it references)"


def _code_text(header: ckpt.Checkpoint, current: dict[str, str] | None) -> str:
    """Which steps' code changed since the run's last commit (informational)."""
    if not header.code:
        return "no fingerprints recorded (written before durable_steps recorded them)"
    if current is None:
        return (
            f"fingerprints of {len(header.code)} step{'s' * (len(header.code) != 1)} recorded "
            "at the last commit; "
            "`--app module:workflow` compares them with the current code"
        )
    changed = code_changes(header.code, current)
    other = list(current) != list(header.steps)  # renamed, added, removed, moved
    if not changed:
        if other:
            return "the same code for the steps both have, but the steps differ (see deploy)"
        return "unchanged since the last commit (by --app)"
    also = "; the steps differ too (see deploy)" if other else ""
    return f"changed since the last commit (by --app): {', '.join(changed)}{also}"


def _deploy_text(header: ckpt.Checkpoint, app: Workflow) -> str:
    """What resuming the run under ``app``'s code does (renames, steps added and
    removed, a version), or why it would not resume.
    """
    if header.status in FINISHED:
        return "finished: nothing to resume"
    try:
        decision = positions.preview(header, app._plan(header.run_id, asynchronous=True))
    except WorkflowChanged as exc:
        return f"would not resume: WorkflowChanged: {exc.message}"
    return "; ".join(decision.notes) or "the same steps and version: resumes as it is"


def describe(
    header: ckpt.Checkpoint,
    payload: bytes,
    size: int,
    style: Style,
    *,
    sent_at: float | None = None,
    app: Workflow | None = None,
) -> list[str]:
    """The lines of ``show``; ``sent_at`` as for :func:`next_hint`; ``app`` is the
    current code (``--app``): which steps' code changed, and what a resume does.
    """
    code = fingerprints(app.steps) if app is not None else None
    now = time.time()
    n = len(header.steps)
    if header.status in FINISHED:
        where = f"finished in iteration {header.iteration}"
    else:
        step = header.steps[header.next_step] if header.next_step < n else "?"
        where = f"next step {step!r} ({header.next_step + 1} of {n}), iteration {header.iteration}"
    status = status_of(header)
    lines = [f"{style.bold(clean(header.run))}  {style.status(status)}"]
    lines += _fields(
        [
            ("position" if status in ("running", *FINISHED) else "stopped at", where),
            ("owner", owner_text(header.owner, header.status, since=header.updated_at)),
            ("committed", f"{header.committed} step commit{'s' * (header.committed != 1)}"),
            ("steps", " -> ".join(header.steps)),
            ("serializer", header.serializer),
            ("version", str(header.version) if header.version is not None else "none"),
            ("code", _code_text(header, code)),
            *([("deploy", _deploy_text(header, app))] if app is not None else []),
            ("format", _format_text(header)),
            ("size", _size_text(header, size, payload)),
            ("created", timestamp(header.created_at, now)),
            ("updated", timestamp(header.updated_at, now)),
            ("trace id", _trace(header)),
        ],
        style,
    )
    lines += wait_lines(header, sent_at, style, now)
    if header.intent:
        intent = header.intent
        resolution = intent.get("resolution") or "none yet"
        lines += ["", style.bold("pending intent")]
        lines += _fields(
            [
                ("step", f"{intent.get('step')} (iteration {intent.get('iteration')})"),
                ("idempotency key", str(intent.get("key"))),
                ("written", timestamp(float(intent.get("at", 0)), now)),
                ("policy", str(intent.get("policy") or "not recorded (an older checkpoint)")),
                ("resolution", resolution),
            ],
            style,
        )
    if header.journal:
        lines += _journal_lines(header, header.journal, style, now)
    if header.error:
        err = header.error
        lines += ["", style.bold("last error")]
        lines += _fields(
            [
                ("step", f"{err.get('step')} (iteration {err.get('iteration')})"),
                ("error", f"{err.get('type')}: {err.get('message')}"),
                ("attempts", str(err.get("attempts"))),
                ("at", timestamp(float(err.get("at", 0)), now)),
            ],
            style,
            red="error",
        )
    if header.history:
        rows = [
            [
                str(s),
                str(i),
                str(a),
                human_duration(int(millis) / 1000) if a else "not run (resolved)",
                human_age(now - float(at)),
            ]
            for s, i, a, millis, at in header.history
        ]
        lines += ["", style.bold("recent steps (oldest first)")]
        headers = ["STEP", "ITER", "ATTEMPTS", "DURATION", "COMMITTED"]
        lines += table(headers, rows, style=style, right=(1, 2, 3), indent="  ")
    lines += ["", f"{style.bold('next:')} {clean(next_hint(header, sent_at))}"]
    return lines


def _journal_lines(
    header: ckpt.Checkpoint, journal: dict[str, Any], style: Style, now: float
) -> list[str]:
    """The ``journal`` section: the step in progress's recorded calls and open effects."""
    calls = journal["calls"]
    recorded = f"{calls} result{'s' * (calls != 1)} (replayed when the step runs again)"
    if header.format == 1 and journal.get("inline"):
        recorded += ": " + ", ".join(repr(entry[0]) for entry in journal["inline"])
    pairs = [
        ("step", f"{journal['step']} (iteration {journal['iteration']})"),
        ("recorded", recorded),
    ]
    for entry in journal["open"]:
        resolution = entry.get("resolution")
        what = f"resolved as {resolution}" if resolution else "in doubt (it may have fired)"
        named = f", journal name {entry['name']!r}" if "title" in entry else ""
        pairs.append(
            (
                f"effect {effect_label(entry)}",
                f"{what}, idempotency key {entry['key']}, intent written "
                f"{timestamp(float(entry['at']), now)}{named}",
            )
        )
    return ["", style.bold("journal of the step in progress"), *_fields(pairs, style)]


def _decode_state(store: Store, header: ckpt.Checkpoint, payload: bytes, unsafe: bool) -> Any:
    name = header.serializer
    inner = name.removesuffix(SIGNED_SUFFIX)
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
    if name.endswith(SIGNED_SUFFIX):
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
        if header.format == 1:
            return serializer.loads(payload)
        where = f"run {header.run}: checkpoint"
        loaded = drive_sync(load_state(header, payload, serializer, where), store)
        if loaded is None:
            raise CommandError(
                f"run {header.run} changed while it was read (a part was compacted); show it again"
            )
        return loaded[0]
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"run {header.run}: cannot decode the state: {exc}") from exc


def _trace(header: ckpt.Checkpoint) -> str:
    """The run's OpenTelemetry trace id (``integrations.otel``), 32 hex digits."""
    return format(ckpt.trace_ids(header.workflow, header.run_id, header.run_nonce)[0], "032x")


def _as_json(store: Store, header: ckpt.Checkpoint, data: bytes) -> dict[str, Any]:
    """``show --json``: ``ls --json``'s object for the run (one shape: ``.intent.key``),
    with ``head_size`` (the head alone), ``trace_id``, and ``header``, the stored
    line, kept for one release (scripts of 0.1 read ``.header.intent.key``).
    """
    from ._ls import summary  # lazily: ls is the heavier command

    key, wait = ckpt.checkpoint_key(header.workflow, header.run_id), header.wait or {}
    sent = wait.get("signal") if signal_sent(store, header) is not None else None
    run = RunInfo.parse(header.workflow, header.run_id, key, data, "")
    run = replace(run, signals=frozenset([sent] if sent else []))
    doc = summary(run, time.time())
    doc.update(head_size=len(data), trace_id=_trace(header), header=run.header)
    return doc


def _cmd_show(args: argparse.Namespace, store: Store, style: Style) -> int:
    app = app_on_store(args, store) if args.app else None
    if app is not None:  # where the app's workers would look, as `plan --app`
        store = app.store
    header, payload, data = load(store, *locate(store, args.run))
    gone = header.status == "deleted"  # a tombstone has no state to decode
    state = (
        _decode_state(store, header, payload, args.unsafe_unpickle)
        if args.state and not gone
        else None
    )
    if args.json:
        doc = _as_json(store, header, data)
        if args.state:
            doc["state"] = state
        print(json_text(doc))
        return EXIT_OK
    lines = describe(header, payload, len(data), style, sent_at=signal_sent(store, header), app=app)
    if args.state:
        text = "none: deleted when the run completed" if gone else None
        lines += ["", style.bold("state"), text or state_text(state, header.serializer)]
    print("\n".join(lines))
    return EXIT_OK


def register(command: Callable[..., Any]) -> None:
    """Add the ``show`` subcommand through build_parser's ``command`` factory."""
    show = command(
        "show",
        _cmd_show,
        "why a run stopped: position, owner, what it waits for, pending intent, last error",
        "Show a run: status; where it stopped (next step, iteration, commits); its owner "
        "(host:pid and lease, or none); what a waiting run waits for; the pending intent of a "
        "non-idempotent step and its idempotency key; the last error and its attempts; recent "
        "steps with durations; and what to do next.",
    )
    show.add_argument("run", metavar="RUN", type=run_ref, help=RUN_HELP)
    show.add_argument("--state", action="store_true", help="also print the saved state")
    show.add_argument(
        "--unsafe-unpickle",
        action="store_true",
        help="allow --state to unpickle a pickle state (runs code chosen by whoever wrote "
        f"it; a signed one also needs ${SIGNING_KEY_ENV})",
    )
    show.add_argument(
        "--json",
        action="store_true",
        help="the run as JSON: ls --json's object for it (.intent.key, .status, ...), with "
        "head_size, trace_id, its state with --state, and header (the stored header line; "
        "deprecated, kept for one release)",
    )
    show.add_argument(
        "--app",
        metavar="MODULE:WORKFLOW",
        help="the current code: list the steps whose code changed since the run's last commit",
    )
