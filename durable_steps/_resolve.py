"""Telling an in-doubt run what happened, without running it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _checkpoint as ckpt
from ._journal import record_resolved
from ._lease import describe, is_live
from ._run import store_skew
from .errors import CheckpointConflict, DefinitionError, DurableStepsError, RunLocked

if TYPE_CHECKING:
    from .serializers import Serializer
    from .stores import Store

NO_RESULT: Any = object()
"""``resolve``'s default: no result given (None is a result)."""

__all__ = ["NO_RESULT", "resolve"]


def resolve(
    store: Store,
    workflow: str,
    run_id: str,
    *,
    fired: bool,
    force: bool = False,
    signer: ckpt.Signer | None = None,
    result: Any = NO_RESULT,
    serializer: Serializer | None = None,
) -> None:
    """Record what happened to a run's in-doubt step (see ``Workflow.resolve``).

    A signed run is verified and re-signed with ``signer``; without one it is
    refused, since the rewritten header could not be signed. ``result``
    (with ``fired=True``) is what the one effect in doubt returned, recorded
    with ``serializer`` (the run's).
    """
    if result is not NO_RESULT and not fired:
        raise DefinitionError(
            f"run {workflow}/{run_id}: result= says what a fired effect returned; it cannot "
            "go with fired=False (the effect fires again and returns its own result)"
        )
    name = f"{workflow}/{run_id}"
    key = ckpt.checkpoint_key(workflow, run_id)
    found = store.get(key)
    if found is None:
        raise DurableStepsError(f"run {name} does not exist (no checkpoint at {key!r})", run=name)
    where = f"run {name}: checkpoint {key!r}"
    header, payload = ckpt.decode(found[0], where=where, run=name, signer=signer)
    if signer is None and header.serializer.endswith("+hmac-sha256"):
        raise DurableStepsError(
            f"run {name} is signed: resolving it rewrites its header, which needs the "
            "signing key (pass the workflow's signing_key, or set $DURABLE_STEPS_SIGNING_KEY "
            "for the command line).",
            run=name,
        )
    journal = header.journal
    effects = [e for e in (journal or {}).get("open", ()) if "resolution" not in e]
    if header.intent is None and not effects:
        raise DurableStepsError(
            f"run {name} has no step or effect in doubt (status {header.status}); "
            "nothing to resolve",
            run=name,
        )
    step = header.intent.get("step") if header.intent else (journal or {}).get("step")
    if is_live(header.owner, skew=store_skew(store), since=header.updated_at) and not force:
        assert header.owner is not None
        raise RunLocked(
            f"run {name} is being run by {describe(header.owner)}: its step may be firing "
            "right now, so it is not in doubt. Wait for that process; pass force=True "
            "(--force) only if it is surely gone.",
            run=name,
            step=step,
        )
    resolution = "fired" if fired else "not_fired"
    changes: dict[str, object] = {"status": "running"}
    if header.intent is not None:
        changes["intent"] = {**header.intent, "resolution": resolution}
    if effects and journal is not None:  # every effect in doubt gets the same answer
        opened = [
            e if "resolution" in e else {**e, "resolution": resolution} for e in journal["open"]
        ]
        changes["journal"] = {**journal, "open": opened}
    resolved = header.evolve(**changes)
    if result is not NO_RESULT:
        if serializer is None or serializer.name != header.serializer:
            raise DefinitionError(
                f"run {name}: recording a result needs the run's serializer {header.serializer!r}",
                run=name,
            )
        resolved, payload = record_resolved(
            resolved.replace(journal=journal), payload, serializer, result
        )
    try:
        store.put(key, ckpt.encode(resolved, payload, signer), match=found[1])
    except CheckpointConflict as exc:
        raise CheckpointConflict(
            f"run {name} changed while it was being resolved (is it running?); "
            "check its status and resolve again",
            run=name,
            step=step,
        ) from exc
