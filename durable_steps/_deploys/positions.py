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
with its ``index`` remapped (so the in-doubt check of ``_protocol.runner._advance``,
and the persisted idempotency key, still apply) and the notes to log. The
run's header takes the current step list at its next write — except the
names of renamed steps, below. This module also holds ``Workflow(version=,
migrate=)`` (:func:`migrate`); step code fingerprints are in
``_deploys.fingerprints``, ``wf.fork`` in ``_deploys.fork``.

Renames and rollbacks. A rename (``renamed_from``) is one-way: the old code
has no ``renamed_from`` pointing back, so a head that names ``approve``
where the old code has ``approval`` is, to it, a run whose next step (or
pending intent, or journal) is gone: ``WorkflowChanged``. Were the new code
to write its names (at its first write: the claim, the intent of a re-fire,
``in_doubt`` for a person, a failure, a journal record), the deploy could not
be rolled back exactly when a rollback is wanted: the new code stopped inside
the renamed step. So a rename never rewrites a stored run: its head keeps
the names it was stored with (:class:`Held`, applied by ``RunState.write``
to the bytes it sends, never to the header in memory), and ``renamed_from``
is only how the current code reads them. Not only until the renamed step
commits: in an ``until`` loop the next pass stops in that step too, and a
run the new code resumed before the step reaches it fresh. Keeping the old
names, rather than writing the new ones with a record of the rename, also
means the old code needs nothing it lacks — not even this version of the
library. What it costs: a run made before a rename keeps the old name to its
end (``plan`` and ``show --app`` keep saying so; its history has the name
each commit ran under), and a second rename (``approval -> approve ->
approved``) keeps every earlier name in ``renamed_from`` while such runs
are unfinished, as the deploy guide says. A run the new code created has
the new names; the old code resumes one stopped inside the renamed step
only with ``renamed_from`` naming the new name (a rename back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._drivers import Call, Protocol
from .._events import logger
from .._execution.plan import Plan
from .._execution.run_state import RunState
from .._record import checkpoint as ckpt
from ..errors import DurableStepsError, SerializationError, WorkflowChanged
from ..stores import command_hint
from .fingerprints import code_changes

__all__ = [
    "Decision",
    "Held",
    "adopt",
    "check_serializer",
    "decide",
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
    command: str = "durable-steps",
) -> Decision:
    """Map an unfinished run's position onto the ``current`` step names.

    ``loops`` says whether the workflow repeats its pass (``until``): a step
    added before the position then runs from the next pass. ``renamed``
    (``{old name: step name}``, the steps' ``renamed_from``) maps the stored
    names first, so a renamed step is the same step. ``command`` begins the
    commands an error suggests (``durable-steps --store URL``). Raises
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
            f"settle that (re-fire with its key, reconcile, or apply a `{command} "
            f"resolve`). If it was renamed, name it in the new step's renamed_from=; "
            f"else resume the run once with code that still has step {pending!r}, then "
            "deploy the change. Nothing was written.",
            run=run,
            step=pending,
        )
    if position not in current:
        raise WorkflowChanged(
            f"{where}: its next step {position!r} is gone (steps now {list(current)}), so "
            "where to resume is unknown; nothing was written. If it was renamed, name it "
            f"in the new step's renamed_from={position!r}; else keep (or restore) that "
            "step until the run has passed it (finish the run with the old code), or "
            f"delete the run to start over (`{command} rm {run}`).",
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
    merged: dict[str, str] = {}
    for old, new in renames.items():
        if new in merged:
            raise WorkflowChanged(
                f"run {run} has both step {merged[new]!r} and step {old!r} (steps were "
                f"{list(stored)}), and {new!r}'s renamed_from names both, which would make two "
                "of its steps one (a committed one would run again, its effects under new "
                f"keys); nothing was written. Name only one of them until the run has "
                "finished.",
                run=run,
                step=new,
            )
        merged[new] = old
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


@dataclass(frozen=True)
class Held:
    """The names a run was stored with for its renamed steps, which its head keeps
    (see "Renames and rollbacks" above).
    """

    names: Mapping[str, str]
    """``{current name: name the run was stored with}``."""

    def stored(self, header: ckpt.Checkpoint) -> ckpt.Checkpoint:
        """``header`` as it is written: renamed steps under their stored names."""
        names = self.names
        intent, journal, wait = header.intent, header.journal, header.wait
        if intent is not None and intent["step"] in names:  # its key is persisted: unchanged
            intent = {**intent, "step": names[intent["step"]]}
        if journal is not None and journal["step"] in names:
            # Records this execution makes carry the current name: ``was`` lists it,
            # so the old code (and this code again) finds them (see ``_execution.log``).
            step, old = journal["step"], names[journal["step"]]
            was = sorted({step, *journal.get("was", ())} - {old})
            journal = {**journal, "step": old, "was": was}
        if wait is not None and wait["step"] in names:
            wait = {**wait, "step": names[wait["step"]]}
        return header.replace(
            steps=tuple(names.get(s, s) for s in header.steps),
            intent=intent,
            journal=journal,
            wait=wait,
        )


def adopt(run: RunState, header: ckpt.Checkpoint) -> ckpt.Checkpoint:
    """``header`` mapped onto the current steps (see :func:`decide`); the notes
    are logged and sent to subscribers, and ``run.held`` set to keep the
    renamed steps' stored names in the head (:class:`Held`). Raises
    :class:`WorkflowChanged`.
    """
    plan = run.plan
    decision = _decide(header, plan)
    names = {new: old for old, new in plan.renamed().items() if old in header.steps}
    run.held = Held(names) if names else None
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
    if journal is not None and journal["step"] in renamed:  # its records follow it (_execution.log)
        # Its records keep the name they were written under: ``was`` lists the
        # names they may carry, so a second rename (b -> x -> y) still finds them.
        was = sorted({journal["step"], *journal.get("was", ())})
        journal = {**journal, "step": renamed[journal["step"]], "was": was}
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
        command=command_hint(plan.store),
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
