"""Telling an in-doubt run what happened, without running it."""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

from .._drivers import drive_sync
from .._fleet import index as _index
from .._fleet.leases import describe, is_live, store_skew
from .._record import checkpoint as ckpt
from .._record import format2 as f2
from .._record import history
from ..errors import CheckpointConflict, DefinitionError, DurableStepsError, RunLocked
from ..serializers import SIGNED_SUFFIX, plain_json

if TYPE_CHECKING:
    from ..serializers import Serializer
    from ..stores import Store

NO_RESULT: Any = object()
"""``resolve``'s default: no result given (None is a result)."""

__all__ = ["NO_RESULT", "doubt_keys", "resolve"]


def doubt_keys(header: ckpt.Checkpoint) -> list[str]:
    """The idempotency keys of what is in doubt in ``header``, sorted: its
    unresolved step intent's and each unresolved effect's. What a person saw
    in doubt, named exactly (``resolve(expect=...)``).
    """
    keys = []
    if header.intent is not None and header.intent.get("resolution") is None:
        keys.append(str(header.intent.get("key")))
    for effect in (header.journal or {}).get("open", ()):
        if isinstance(effect, dict) and effect.get("resolution") is None:
            keys.append(str(effect.get("key")))
    return sorted(keys)


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
    expect: list[str] | None = None,
) -> None:
    """Record what happened to a run's in-doubt step (see ``Workflow.resolve``).

    A signed run is verified and re-signed with ``signer``; without one it is
    refused, since the rewritten header could not be signed. ``result``
    (with ``fired=True``) is what the one effect in doubt returned, recorded
    with ``serializer`` (the run's).

    ``expect``: the keys (:func:`doubt_keys`) of what the caller was shown in
    doubt. When what is in doubt now is not exactly that (it was resolved
    elsewhere, the run went on and is in doubt at another effect), nothing is
    changed: ``CheckpointConflict``. The check and the write are one: the
    write is conditional on the checkpoint that was checked.
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
    if signer is None and header.serializer.endswith(SIGNED_SUFFIX):
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
    if expect is not None and sorted(expect) != doubt_keys(header):
        now = ", ".join(doubt_keys(header)) or "nothing"
        raise CheckpointConflict(
            f"run {name}: what is in doubt changed since it was shown (shown: "
            f"{', '.join(sorted(expect)) or 'nothing'}; now: {now}); nothing was resolved. "
            "Look at the run again and decide for what is in doubt now.",
            run=name,
            step=step,
        )
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
    # A waiting run stays waiting (its effect was left open, then it waited):
    # only its wake, or a worker that finds it due, may move it on.
    changes: dict[str, object] = {"status": "waiting" if header.status == "waiting" else "running"}
    if header.intent is not None:
        changes["intent"] = {**header.intent, "resolution": resolution}
    if effects and journal is not None:  # every effect in doubt gets the same answer
        opened = [
            e if "resolution" in e else {**e, "resolution": resolution} for e in journal["open"]
        ]
        changes["journal"] = {**journal, "open": opened}
    resolved = header.evolve(**changes)
    if isinstance(step, str):  # the timeline's record of it (a head rewritten anyway)
        entry = history.add(
            resolved,
            history.RESOLUTION,
            step,
            1 if fired else 0,
            0.0,
            time.time(),
            (0, min(len(effects), 63), 0),
        )
        resolved = resolved.replace(log=entry)
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
        before = _index.entry_of(header)
        drive_sync(_index.leaving(before, resolved), store)
        store.put(key, ckpt.encode(resolved, payload, signer), match=found[1])
        drive_sync(_index.moved(before, resolved), store)
    except CheckpointConflict as exc:
        raise CheckpointConflict(
            f"run {name} changed while it was being resolved (is it running?); "
            "check its status and resolve again",
            run=name,
            step=step,
        ) from exc


def record_resolved(
    header: ckpt.Checkpoint, payload: bytes, serializer: Any, value: Any
) -> tuple[ckpt.Checkpoint, bytes]:
    """``header`` and ``payload`` with the run's one effect in doubt recorded as
    having returned ``value`` (``resolve(fired=True, result=...)``): the re-run
    step gets ``value`` from its ``ctx.effect``, as if the effect had returned it.
    """
    journal = header.journal
    opened = [e for e in (journal or {}).get("open", ()) if "resolution" not in e]
    if not opened and header.intent is not None:
        raise DefinitionError(
            f"run {header.run}: a result is for an effect in doubt (ctx.effect), and this "
            f"run has step {header.intent.get('step')!r} in doubt instead: resolve it "
            "without a result (--fired or --not-fired).",
            run=header.run,
        )
    if journal is None or len(opened) != 1:
        names = ", ".join(repr(e["name"]) for e in opened) or "none"
        raise DefinitionError(
            f"run {header.run}: a result can be recorded for exactly one effect in doubt; "
            f"this run has {len(opened)} ({names}). Resolve without a result, or one at a time.",
            run=header.run,
        )
    effect = opened[0]
    name, key = effect["name"], effect["key"]
    path = f"the result given for effect {name!r}"
    rest = [e for e in journal["open"] if e is not effect]
    field = {**journal, "open": rest, "calls": journal["calls"] + 1}
    if header.format == 1:
        if serializer.name.startswith("json"):
            value = plain_json(value, path)
        blob = base64.b64encode(serializer.dumps(value)).decode()
        field["inline"] = [*journal["inline"], [name, "effect", key, blob]]
    else:
        finder = f2.Parts(serializer, header.workflow, header.run_id, None).finder
        meta = [journal["step"], journal["iteration"], name, "effect", key]
        record = finder.journal_record(meta, value, path)
        payload = b"".join((payload, *f2.frame(record)))
    return header.replace(journal=field), payload
