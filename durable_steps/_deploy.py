"""Deploys that change the code: resume by step name, versions, fingerprints, fork.

A run stores the names of the steps that made it, its position among them
(``next_step`` of pass ``iteration``) and, when one is pending, the intent
of the step that may be firing. When the current code has other steps,
:func:`decide` maps that position onto them by *name* (DESIGN.md, "Deploys
that change the code"):

- a step added after the position runs; one added before it does not run
  in this pass (it runs from the next pass of an ``until`` loop);
- a step removed (or renamed: the same thing, by name) that the run has not
  reached is skipped; one removed before the position needs nothing;
- :class:`WorkflowChanged` only when the run's next step, or the step of its
  pending intent, is gone, or the order of the steps still to run changed
  (a step still to run moved before the position, or one the pass already
  committed moved after it, would be skipped or run twice).

The decision is pure: it reads names and returns the new cursor, the intent
with its ``index`` remapped (so the in-doubt check of ``_runner._advance``,
and the persisted idempotency key, still apply) and the notes to log. The
run's header takes the current step list at its next write. This module also
holds what a deploy adds around that: ``Workflow(version=, migrate=)``
(:func:`migrate`), step code fingerprints (:func:`fingerprint`) and
``wf.fork`` (:func:`fork`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._drivers import Call, Get, Protocol
from ._events import logger
from ._plan import Plan
from ._record import checkpoint as ckpt
from ._record import format2 as f2
from ._run import RunState
from ._step import Step
from .errors import (
    CheckpointConflict,
    CorruptCheckpoint,
    DefinitionError,
    DurableStepsError,
    SerializationError,
    WorkflowChanged,
)

__all__ = [
    "Decision",
    "ForkRefused",
    "adopt",
    "check_serializer",
    "code_changes",
    "decide",
    "fingerprint",
    "fingerprints",
    "fork",
    "migrate",
    "preview",
    "version_note",
]


# --- resume by name -----------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """Where a stored run resumes under the current step names, and what to say."""

    steps: tuple[str, ...]
    """The current step names: the header's ``steps`` from its next write."""
    next_step: int
    """The cursor, as an index into :attr:`steps`."""
    intent: dict[str, Any] | None
    """The pending intent with ``index`` remapped into :attr:`steps`."""
    notes: tuple[str, ...] = ()
    """One sentence per difference: what the resume does about it."""


def decide(
    run: str,
    stored: Sequence[str],
    current: Sequence[str],
    *,
    next_step: int,
    iteration: int,
    intent: dict[str, Any] | None,
    loops: bool = False,
    renamed: Mapping[str, str] | None = None,
) -> Decision:
    """Map an unfinished run's position onto the ``current`` step names.

    ``loops`` says whether the workflow repeats its pass (``until``): a step
    added before the position then runs from the next pass. ``renamed``
    (``{old name: step name}``, the steps' ``renamed_from``) maps the stored
    names first, so a renamed step is the same step. Raises
    :class:`WorkflowChanged` naming the step and what to do when the run
    cannot be resumed safely.
    """
    stored, current = tuple(stored), tuple(current)
    if stored == current:
        return Decision(current, next_step, intent)
    renames = _renames(run, stored, renamed or {})
    if renames:  # the stored names as the current code calls them
        stored = tuple(renames.get(s, s) for s in stored)
        if intent is not None and intent.get("step") in renames:
            intent = {**intent, "step": renames[intent["step"]]}
    position = stored[next_step]
    where = f"run {run} (at step {position!r}, iteration {iteration})"
    pending = intent.get("step") if intent else None
    if pending is not None and pending not in current:
        raise WorkflowChanged(
            f"{where} has a pending intent of step {pending!r}, which the workflow no longer "
            f"has (steps now {list(current)}): that step may have fired, and only it can "
            "settle that (re-fire with its key, reconcile, or apply a `durable-steps "
            f"resolve`). Resume the run once with code that still has step {pending!r}, "
            "then deploy the change; nothing was written.",
            run=run,
            step=pending,
        )
    if position not in current:
        raise WorkflowChanged(
            f"{where}: its next step {position!r} is gone (steps now {list(current)}), so "
            "where to resume is unknown; nothing was written. Keep (or restore) that step "
            "until the run has passed it (finish the run with the old code), or delete the "
            f"run to start over (`durable-steps rm {run}`).",
            run=run,
            step=position,
        )
    at = current.index(position)
    _check_order(run, where, (stored, current), next_step, at)
    notes = tuple(
        f"step {old!r} renamed to {new!r} (renamed_from): the run knows it by its new name"
        for old, new in renames.items()
    ) + _notes(stored, current, next_step, at, loops)
    if intent is not None and pending is not None:
        intent = {**intent, "index": current.index(pending)}
    return Decision(current, at, intent, notes)


def _renames(run: str, stored: tuple[str, ...], renamed: Mapping[str, str]) -> dict[str, str]:
    """The renames that apply to a run stored with ``stored`` step names."""
    renames = {old: new for old, new in renamed.items() if old in stored}
    for old, new in renames.items():
        if new in stored:
            raise WorkflowChanged(
                f"run {run} has both step {old!r} and step {new!r} (steps were {list(stored)}), "
                f"so {new!r}'s renamed_from={old!r} would make two of its steps one; nothing was "
                f"written. Drop {old!r} from renamed_from until the run has finished.",
                run=run,
                step=new,
            )
    return renames


def _check_order(
    run: str, where: str, names: tuple[tuple[str, ...], tuple[str, ...]], next_step: int, at: int
) -> None:
    """Refuse a new order that would skip a step still to run in this pass
    (it moved before another, or before the position) or run one twice.
    """
    stored, current = names
    moved, highest = [], -1
    for s in stored[next_step:]:
        if s in current:
            index = current.index(s)
            if index < highest:
                moved.append(s)
            highest = max(highest, index)
    again = [s for s in current[at + 1 :] if s in stored[:next_step]]
    if moved or again:
        step = (moved or again)[0]
        why = (
            f"step {step!r}, still to run in this pass, now comes before a step it followed"
            if moved
            else f"step {step!r}, already committed in this pass, now comes after the "
            "run's position and would run twice"
        )
        raise WorkflowChanged(
            f"{where}: the order of the steps still to run changed: {why} (steps were "
            f"{list(stored)}, now {list(current)}); nothing was written. Finish the run with "
            "the old code, or deploy the new order once it has passed those steps.",
            run=run,
            step=step,
        )


def _notes(
    stored: tuple[str, ...], current: tuple[str, ...], next_step: int, at: int, loops: bool
) -> tuple[str, ...]:
    """One sentence per step added or removed: what the resume does about it."""
    notes = []
    for s in current:
        if s in stored:
            continue
        if current.index(s) > at:
            notes.append(f"step {s!r} added after the run's position: it will run")
        else:
            later = "it runs from the next pass" if loops else "new runs run it"
            notes.append(
                f"step {s!r} added before the run's position: it does not run in this "
                f"pass ({later})"
            )
    for s in stored:
        if s in current:
            continue
        if stored.index(s) < next_step:
            notes.append(f"step {s!r} removed before the run's position: nothing to do")
        else:
            notes.append(f"step {s!r} removed after the run's position: it is skipped")
    return tuple(notes)


def check_serializer(run: str, stored: str, current: str) -> None:
    """Refuse a run saved with another serializer (its bytes would not decode)."""
    if stored != current:
        raise WorkflowChanged(
            f"run {run} was saved with serializer {stored!r}, but the workflow now uses "
            f"{current!r}. Use the serializer (and signing key) it was started with, or "
            "start a new run.",
            run=run,
        )


def adopt(run: RunState, header: ckpt.Checkpoint) -> ckpt.Checkpoint:
    """``header`` mapped onto the current steps (see :func:`decide`); the notes
    are logged and sent to subscribers. Raises :class:`WorkflowChanged`.
    """
    plan = run.plan
    decision = _decide(header, plan)
    notes = decision.notes
    changed = code_changes(header.code, plan.code)
    if changed:
        notes += (f"the code of {_names(changed)} changed since the run's last commit",)
    for note in notes:
        logger.info("run %s: %s", run.name, note)
        run.event("code_changed", detail=note)
    if decision.steps == header.steps:
        return header
    renamed = plan.renamed()
    journal, wait = header.journal, header.wait
    if journal is not None and journal["step"] in renamed:  # its records follow it (_log)
        journal = {**journal, "step": renamed[journal["step"]]}
    if wait is not None and wait["step"] in renamed:
        wait = {**wait, "step": renamed[wait["step"]]}
    return header.replace(
        steps=decision.steps,
        next_step=decision.next_step,
        intent=decision.intent,
        journal=journal,
        wait=wait,
    )


def _decide(header: ckpt.Checkpoint, plan: Plan) -> Decision:
    return decide(
        header.run,
        header.steps,
        tuple(s.name for s in plan.steps),
        next_step=header.next_step,
        iteration=header.iteration,
        intent=header.intent,
        loops=plan.until is not None,
        renamed=plan.renamed(),
    )


def preview(header: ckpt.Checkpoint, plan: Plan) -> Decision:
    """What resuming the run of ``header`` under ``plan`` would do, for
    ``durable-steps plan``: the decision, with the version and code notes.
    Raises :class:`WorkflowChanged` as the resume would.
    """
    check_serializer(header.run, header.serializer, plan.serializer.name)
    decision = _decide(header, plan)
    notes = decision.notes
    note = version_note(header.version, plan.version, migrates=plan.migrate is not None)
    if note:
        notes += (note,)
    changed = code_changes(header.code, plan.code)
    if changed:
        notes += (f"the code of {_names(changed)} changed since the run's last commit",)
    return Decision(decision.steps, decision.next_step, decision.intent, notes)


def _names(steps: Sequence[str]) -> str:
    quoted = ", ".join(repr(s) for s in steps)
    return f"step{'s' * (len(steps) != 1)} {quoted}"


# --- versions and migrations --------------------------------------------------


def version_note(stored: str | None, current: str | None, *, migrates: bool) -> str | None:
    """What a resume does about the run's version (None: the same version)."""
    if stored == current:
        return None
    if migrates:
        return f"version {stored!r} -> {current!r}: migrate(state, {stored!r}) runs first"
    return f"version {stored!r} -> {current!r}: no migrate= is given, so the state is used as it is"


def migrate(run: RunState) -> Protocol[None]:
    """Bring a loaded run, unless it has finished, to the workflow's version.

    ``migrate(state, from_version)`` runs before any write: if it raises,
    nothing was written and the run stays byte for byte as it was. Its
    result is committed at once (with the new version), so a crash after
    that never applies it twice, and one before it applies it again.
    """
    plan, header = run.plan, run.header
    if header.status in ("completed", "deleted"):
        return
    note = version_note(header.version, plan.version, migrates=plan.migrate is not None)
    if note is None:
        return
    logger.info("run %s: %s", run.name, note)
    run.event("code_changed", detail=note)
    if plan.migrate is None:  # recorded by the next write
        run.header = header.replace(version=plan.version)
        return
    old, new = header.version, plan.version
    try:
        result = yield Call(plan.migrate, (run.state, old))
    except Exception as exc:
        raise DurableStepsError(
            f"run {run.name}: migrate(state, {old!r}) to version {new!r} raised "
            f"{type(exc).__name__}: {exc}. Nothing was written: the run is as it was. Fix "
            f"migrate() and run it again, or resume the run with the code it was made by"
            f"{f' (version {old!r})' if old is not None else ' (which recorded no version)'}.",
            run=run.name,
        ) from exc
    if result is not None:
        run.state = result
    try:
        yield from run.save(header.evolve(version=new, status="running"), None)
    except SerializationError as exc:
        raise SerializationError(
            f"run {run.name}: the state migrate(state, {old!r}) made cannot be saved "
            f"({exc.path or 'the state'}). Nothing was written: the run is as it was; "
            "fix migrate() and run it again.",
            run=run.name,
            path=exc.path,
        ) from exc


# --- code fingerprints --------------------------------------------------------


def fingerprint(fn: Any) -> str:
    """12 hex digits identifying a function's code: its bytecode, constants
    (nested functions included), names and arguments, not where it lives
    (file, line numbers, qualified name), so moving a step within its file
    changes nothing. Bytecode differs between Python versions: a new Python
    also shows as changed code. A callable without code (a builtin) gets the
    fingerprint of its name.
    """
    target = inspect.unwrap(fn)
    while isinstance(target, functools.partial):  # the function it binds arguments to
        target = inspect.unwrap(target.func)
    code = getattr(target, "__code__", None)
    if code is None:
        code = getattr(type(target).__call__, "__code__", None)  # a callable object
    digest = hashlib.sha256()
    if code is None:
        digest.update(repr(getattr(target, "__qualname__", type(target).__qualname__)).encode())
    else:
        _feed(digest, code)
    return digest.hexdigest()[:12]


def _feed(digest: Any, value: object) -> None:
    """Hash ``value`` canonically: code objects field by field, frozensets
    sorted (their order follows string hashing, which differs per process).
    """
    if isinstance(value, types.CodeType):
        digest.update(b"code(")
        digest.update(value.co_code)
        for part in (value.co_names, value.co_varnames, value.co_freevars, value.co_cellvars):
            digest.update(repr(part).encode())
        digest.update(repr((value.co_argcount, value.co_kwonlyargcount, value.co_flags)).encode())
        for const in value.co_consts:
            _feed(digest, const)
        digest.update(b")")
    elif isinstance(value, (tuple, frozenset)):
        items = value if isinstance(value, tuple) else sorted(value, key=repr)
        digest.update(b"(" if isinstance(value, tuple) else b"{")
        for item in items:
            _feed(digest, item)
        digest.update(b")")
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def fingerprints(steps: Sequence[Step[..., Any]]) -> dict[str, str]:
    """``{step name: fingerprint}`` of the step functions (and reconcile hooks)."""
    out = {}
    for s in steps:
        fp = fingerprint(s.fn)
        if s.reconcile is not None:
            fp = hashlib.sha256(f"{fp}:{fingerprint(s.reconcile)}".encode()).hexdigest()[:12]
        out[s.name] = fp
    return out


def code_changes(recorded: dict[str, str] | None, current: dict[str, str]) -> list[str]:
    """The steps whose code differs from what the run's last commit recorded
    (steps new to the run, or a run from before fingerprints, are not listed).
    """
    if not recorded:
        return []
    return [s for s, fp in current.items() if s in recorded and recorded[s] != fp]


# --- fork ---------------------------------------------------------------------


class ForkRefused(DurableStepsError):
    """The fork was refused and nothing was written (the command line exits 4)."""


def fork(plan: Plan, source: str, target: str) -> Protocol[None]:
    """Create run ``target`` from run ``source``'s last committed state and
    position, with a new nonce (so new idempotency keys); ``source`` is only read.
    """
    if source == target:
        raise DefinitionError(f"fork: run {plan.workflow}/{source} cannot be forked onto itself")
    src, new = RunState(plan, source), RunState(plan, target)
    header = yield from _read_source(src)
    if (yield Get(new.key)) is not None:
        raise ForkRefused(
            f"run {new.name} already exists, so {src.name} was not forked onto it (nothing "
            f"was written): choose another id, or remove it first (`durable-steps rm "
            f"{new.name}`).",
            run=new.name,
        )
    intent = header.intent
    if intent is not None and intent.get("resolution") != "not_fired":
        logger.warning(
            "run %s: step %r may have fired (key %s) and was not resolved; the fork %s "
            "fires it with a new key, which the service cannot match to that one",
            src.name,
            intent.get("step"),
            intent.get("key"),
            new.name,
        )
    journal = header.journal
    if journal is not None and (journal["calls"] or journal["open"]):
        logger.warning(
            "run %s: step %r was in progress with %d journaled call(s) recorded and %d "
            "effect(s) in doubt; the fork %s runs that step again from its start, so its "
            "calls run again and its effects fire again under new idempotency keys. Let "
            "the source finish the step first if that matters.",
            src.name,
            journal["step"],
            journal["calls"],
            len(journal["open"]),
            new.name,
        )
    new.state = src.state
    fresh = ckpt.Checkpoint(
        workflow=plan.workflow,
        run_id=target,
        steps=header.steps,
        serializer=header.serializer,
        iteration=header.iteration,
        next_step=header.next_step,
        history=header.history,
        committed=header.committed,
        format=ckpt.FORMAT if f2.supports(plan.serializer) else 1,
        version=header.version,
        code=header.code,
    )
    try:
        yield from new.save(fresh, None, release=True)
    except CheckpointConflict as exc:
        raise ForkRefused(
            f"run {new.name} was created by another process while {src.name} was being "
            "forked onto it; it is theirs and was left as it is. Choose another id.",
            run=new.name,
        ) from exc
    logger.info(
        "run %s forked from %s at step %r (iteration %d)",
        new.name,
        src.name,
        header.steps[header.next_step],
        header.iteration,
    )


_READS = 3


def _read_source(src: RunState) -> Protocol[ckpt.Checkpoint]:
    """Decode the run to fork and rebuild its committed state into ``src.state``."""
    for _ in range(_READS):  # a format-2 part gone: the head was replaced; read it again
        found = yield Get(src.key)
        if found is None:
            raise DurableStepsError(
                f"run {src.name} does not exist (no checkpoint at {src.key!r}); nothing to fork",
                run=src.name,
            )
        where = f"run {src.name}: checkpoint {src.key!r}"
        header, payload = ckpt.decode(found[0], where=where, run=src.name, signer=src.signer)
        if (header.workflow, header.run_id) != (src.plan.workflow, src.run_id):
            raise CorruptCheckpoint(
                f"{where} belongs to run {header.run}; it was left untouched.", run=src.name
            )
        if header.status in ("completed", "deleted"):
            raise ForkRefused(
                f"run {src.name} is {header.status}: it has no steps left to run, so there "
                "is nothing to fork (start a new run instead).",
                run=src.name,
            )
        check_serializer(src.name, header.serializer, src.plan.serializer.name)
        if (yield from src.load_state(header, payload)):
            return header
    raise CorruptCheckpoint(
        f"run {src.name}: a part its checkpoint lists is missing (read {_READS} times); "
        "nothing was forked.",
        run=src.name,
    )
