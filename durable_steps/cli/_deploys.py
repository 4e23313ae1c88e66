"""``plan`` and ``fork``: what a deploy of new code does to the runs in flight.

``plan`` reads (never writes) each run and applies the resume rules of
:mod:`durable_steps._deploys.positions` with the code of ``--app``, so CI can stop a
deploy that would strand a run: exit 0 when every run resumes, 4 when one
would raise ``WorkflowChanged``. ``fork`` copies a run's last committed state
and position into a new run (new nonce, new keys), leaving it as it is.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from .._deploys import fork as _fork
from .._deploys import positions
from .._drivers import drive_sync
from .._execution.plan import Plan
from .._record import checkpoint as ckpt
from .._workflow import Workflow
from ..errors import CorruptCheckpoint, WorkflowChanged
from ..serializers import SIGNING_KEY_ENV, Serializer, SignedSerializer, resolve_serializer
from ..stores import Store
from ._base import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    RUN_HELP,
    CommandError,
    app_on_store,
    run_ref,
)
from ._format import Style, clean
from ._indexed import covered, live, locate
from ._runs import effect_label, find_runs, load, open_effects, pinned, status_of

__all__ = ["register"]

_FINISHED = ("completed", "deleted")


def _same_workflow(workflow: Workflow, name: str, run: str) -> None:
    if name != workflow.name:
        raise CommandError(
            f"run {name}/{run} is not a run of --app's workflow {workflow.name!r}", EXIT_USAGE
        )


def _assess(workflow: Workflow, data: bytes, name: str, key: str) -> dict[str, Any]:
    """One run's resume plan under ``workflow``'s code, as a JSON-ready dict."""
    signer = workflow.serializer if isinstance(workflow.serializer, SignedSerializer) else None
    where = f"run {name}: checkpoint {key!r}"
    try:
        header, _ = ckpt.decode(data, where=where, run=name, signer=signer)
    except CorruptCheckpoint as exc:
        return _corrupt(name, exc.message)
    status = status_of(header)
    out: dict[str, Any] = {"run": name, "status": status}
    if header.status in _FINISHED:
        return {**out, "resumes": True, "next_step": None, "notes": ["finished: nothing to run"]}
    plan = workflow._plan(header.run_id, asynchronous=True)
    try:
        decision = positions.preview(header, plan)
    except WorkflowChanged as exc:
        return {**out, "resumes": False, "error": f"WorkflowChanged: {exc.message}"}
    step = decision.steps[decision.next_step]
    where_now = f"{decision.next_step + 1} of {len(decision.steps)}"
    notes = list(decision.notes) or ["the same steps as the code that made it"]
    if decision.intent and decision.intent.get("resolution") is None:
        notes.append(
            f"step {step!r} may have fired (its intent is pending): its in_doubt policy "
            "decides on resume"
        )
    for effect in open_effects(header.journal):
        step_name = (header.journal or {}).get("step")
        notes.append(
            f"effect {effect_label(effect)} of step {step_name!r} may have fired (its intent "
            "is pending, no result): its in_doubt policy decides on resume"
        )
    return {
        **out,
        "resumes": True,
        "next_step": step,
        "position": where_now,
        "iteration": header.iteration,
        "notes": notes,
    }


def _corrupt(name: str, problem: str) -> dict[str, Any]:
    return {"run": name, "status": "corrupt", "resumes": False, "error": problem}


def _lines(result: dict[str, Any], style: Style) -> list[str]:
    head = f"{style.bold(clean(result['run']))}  {style.status(result['status'])}"
    if not result["resumes"]:
        return [f"{head}  {style.paint('would not resume', 'red')}", f"  {clean(result['error'])}"]
    if result.get("next_step") is None:
        return [f"{head}  {clean(result['notes'][0])}"]
    at = (
        f"resumes at step {result['next_step']!r} ({result['position']}), "
        f"iteration {result['iteration']}"
    )
    return [f"{head}  {clean(at)}", *(f"  - {clean(note)}" for note in result["notes"])]


def _cmd_plan(args: argparse.Namespace, store: Store, style: Style) -> int:
    if args.all == (args.run is not None):
        raise CommandError("give either RUN or --all", EXIT_USAGE)
    workflow = app_on_store(args, store)
    store = workflow.store
    results = []
    if args.all:
        runs = live(store, workflow.name) if covered(store, workflow.name) else None
        for info in runs if runs is not None else find_runs(store, workflow.name):
            if info.status == "corrupt":  # unreadable, or another run's checkpoint
                results.append(_corrupt(info.name, info.problem or "unreadable"))
                continue
            found = None if info.status in _FINISHED else store.get(info.key)
            if found is not None:  # (None: finished, or deleted since the LIST)
                results.append(_assess(workflow, found[0], info.name, info.key))
    else:
        name, run_id = locate(store, args.run)
        _same_workflow(workflow, name, run_id)
        _, _, data = load(store, name, run_id)
        results.append(
            _assess(workflow, data, f"{name}/{run_id}", ckpt.checkpoint_key(name, run_id))
        )
    stuck = [r for r in results if not r["resumes"]]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for result in results:
            print("\n".join(_lines(result, style)))
        if args.all:
            print(
                f"{len(results)} unfinished run{'s' * (len(results) != 1)} of "
                f"{workflow.name}: {len(results) - len(stuck)} resume, {len(stuck)} would not"
            )
    if any(r["status"] != "corrupt" for r in stuck):
        return EXIT_REFUSED
    return EXIT_ERROR if stuck else EXIT_OK


def _serializer(header: ckpt.Checkpoint) -> Serializer:
    """The serializer a JSON run was written with (pickles need the app's own)."""
    if not header.serializer.startswith("json"):
        raise CommandError(
            f"run {header.run} has a {header.serializer} state: pass --app module:workflow "
            "so that the workflow's own serializer rebuilds it",
            EXIT_USAGE,
        )
    if header.serializer == "json":
        return resolve_serializer("json")
    key = os.environ.get(SIGNING_KEY_ENV)
    if not key:
        raise CommandError(
            f"run {header.run} is signed ({header.serializer}): set {SIGNING_KEY_ENV} to its "
            "key (or pass --app)",
            EXIT_USAGE,
        )
    return resolve_serializer("json", key)


def _cmd_fork(args: argparse.Namespace, store: Store, style: Style) -> int:
    new_run = args.new_run
    workflow = app_on_store(args, store) if args.app else None
    if workflow is not None:
        store = workflow.store
    name, run_id = locate(store, args.run)
    header, _, _ = load(store, name, run_id)  # exit 3 when it does not exist
    pinned(args, header.run, header.run_nonce)
    if workflow is not None:
        _same_workflow(workflow, name, run_id)
        serializer = workflow.serializer
    else:
        serializer = _serializer(header)
    plan = Plan(name, (), serializer, None, "mark", (), store, 60.0)
    try:
        expected = getattr(args, "expect_nonce", None)
        drive_sync(_fork.fork(plan, run_id, new_run, expect_nonce=expected), store)
    except _fork.ForkRefused as exc:
        raise CommandError(exc.message, EXIT_REFUSED) from exc
    print(f"forked {name}/{run_id} -> {name}/{new_run}; run it with wf.resume({new_run!r})")
    if workflow is None:
        return EXIT_OK
    key = ckpt.checkpoint_key(name, new_run)
    found = store.get(key)
    if found is None:  # deleted at once by someone else: nothing to say of it
        return EXIT_OK
    result = _assess(workflow, found[0], f"{name}/{new_run}", key)
    print("\n".join(_lines(result, style)))  # what the new code does with the fork
    return EXIT_OK if result["resumes"] else EXIT_REFUSED


def register(command: Callable[..., Any]) -> None:
    """Add ``plan`` and ``fork`` through build_parser's ``command`` factory."""
    plan = command(
        "plan",
        _cmd_plan,
        "what new code would do to a run (or every unfinished run) on resume",
        "Read a run (or, with --all, every unfinished run of the --app workflow) and say "
        "where the code of --app would resume it, by step name: steps added, removed or "
        "skipped, the version migration, steps whose code changed since the run's last "
        "commit. Nothing is run or written. Exit 0 if every run resumes, 4 if some would "
        "raise WorkflowChanged, 1 if a checkpoint cannot be read: run it before a deploy.",
    )
    plan.add_argument("run", metavar="RUN", type=run_ref, nargs="?", help=RUN_HELP)
    plan.add_argument("--all", action="store_true", help="every unfinished run of the workflow")
    plan.add_argument(
        "--app", required=True, metavar="MODULE:WORKFLOW", help="the new code, e.g. myagent:wf"
    )
    plan.add_argument("--json", action="store_true", help="a JSON array, for machines")
    fork = command(
        "fork",
        _cmd_fork,
        "copy a run's last committed state and position into a new run",
        "Create NEW_RUN (same workflow) from RUN's last committed state and position, with "
        "a new nonce, so its non-idempotent steps get new idempotency keys; RUN is left as "
        "it is. The new run is not started: rerun the workflow (or a worker) on it. Refused "
        f"(exit 4) if NEW_RUN exists or RUN has finished. Without --app a JSON run is read "
        f"with its own serializer (a signed one with ${SIGNING_KEY_ENV}). With --app (the "
        "new code) it then says what that code does with the fork, as plan does, and exits "
        "4 if it would not resume it.",
    )
    fork.add_argument("run", metavar="RUN", type=run_ref, help=RUN_HELP)
    fork.add_argument(
        "new_run", metavar="NEW_RUN", type=_run_id, help="the new run's id (same workflow)"
    )
    fork.add_argument(
        "--app",
        metavar="MODULE:WORKFLOW",
        help="the workflow (its serializer), and what its code does with the fork",
    )


def _run_id(text: str) -> str:
    workflow, run_id = run_ref(text)
    assert isinstance(run_id, str)
    if workflow is not None:
        raise argparse.ArgumentTypeError("NEW_RUN is a bare run id: the fork keeps the workflow")
    return run_id
