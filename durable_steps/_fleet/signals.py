r"""Signals: messages to a waiting run, sent through the bucket alone.

A signal is one create-only object beside the run's checkpoint,
``<workflow>/<run_id>/signals/<name>``::

    {"format":1,"workflow":"refunds","run_id":"t-1","name":"approval","sent_at":...,"payload":...}

Sending one never writes the run's checkpoint, so it can never conflict
with the process that owns the run, and create-only makes a name deliverable
once: a second send of it is refused (``wf.signal`` returns False). A signal
sent before the run waits for it is kept, and ``ctx.wait_for`` finds it
without waiting. The step that receives a signal records its payload in the
step's journal (a journaled result, like ``ctx.call``'s), so a re-run of that
step gets the same payload even if the object were gone.

With a signing key the object ends in ``"sig"``, an HMAC over the line
without it and bound to the signal's run and name, so a forged or moved
signal is refused before its payload is used (guarantee 10). Payloads are
JSON, at most :data:`MAX_PAYLOAD` bytes encoded. The signals of a run are
removed with it (``rm``, ``prune``, ``on_complete="delete"``).
"""

from __future__ import annotations

import hmac
import json
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._drivers import drive_sync
from .._record import checkpoint as ckpt
from ..errors import (
    CheckpointConflict,
    CorruptCheckpoint,
    DurableStepsError,
    RunSuspended,
    SerializationError,
    SignalRefused,
)
from ..serializers import check_json
from ..stores import command_hint
from . import index as _index
from .approval import accepted, approval, refusal

if TYPE_CHECKING:
    from ..stores import Store

__all__ = [
    "MAX_PAYLOAD",
    "RunChanged",
    "await_wake",
    "await_wake_async",
    "decode",
    "refuse_unaccepted",
    "send",
    "signal_key",
    "signals_prefix",
]

MAX_PAYLOAD = 256 * 1024
"""The largest signal payload, in bytes of JSON (a signal is a message, not a file)."""
_LINE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)
_SIG_TAIL = re.compile(rb',"sig":"([0-9a-f]{64})"\}\Z')


class RunChanged(DurableStepsError):
    """``send(expect_nonce=)`` found another run under the id (``nonce``: its nonce)."""

    def __init__(self, message: str, *, run: str, nonce: object) -> None:
        super().__init__(message, run=run)
        self.nonce = nonce


def signals_prefix(workflow: str, run_id: str) -> str:
    """Where a run's signals live (``rm``, ``prune`` and tombstones clear it)."""
    return f"{workflow}/{run_id}/signals/"


def signal_key(workflow: str, run_id: str, name: str) -> str:
    """The store key of signal ``name`` of a run."""
    return signals_prefix(workflow, run_id) + name


def encode(  # noqa: PLR0917 - a record's fields
    workflow: str,
    run_id: str,
    name: str,
    payload: Any,
    signer: ckpt.Signer | None = None,
    nonce: str | None = None,
    consumed: list[Any] | None = None,
) -> bytes:
    """A signal object; SerializationError for a payload JSON cannot hold or too large.

    ``nonce`` is the run's nonce: a signal belongs to one incarnation of a run
    id, so one sent to a run that was then deleted (or that a racing ``rm``
    missed) is never delivered to a new run under the same id. ``consumed``
    is ``[step, iteration]`` once a step received it (see :func:`consume`).
    """
    run = f"{workflow}/{run_id}"
    check_json(payload, "payload")
    record: dict[str, Any] = {
        "format": 1,
        "workflow": workflow,
        "run_id": run_id,
        "run_nonce": nonce,
        "name": name,
        "sent_at": round(time.time(), 3),
        "payload": payload,
    }
    if consumed is not None:
        record["consumed"] = consumed
    line = _LINE.encode(record).encode()
    if len(line) > MAX_PAYLOAD:
        raise SerializationError(
            f"run {run}: signal {name!r} is {len(line)} bytes of JSON, more than the "
            f"{MAX_PAYLOAD} a signal may carry. Store large data elsewhere (the bucket, a "
            "database) and send its address.",
            run=run,
        )
    if signer is not None:
        line = b'%s,"sig":"%s"}' % (line[:-1], signer.seal(line, b"signal").encode())
    return line


def decode(
    data: bytes, workflow: str, run_id: str, name: str, signer: ckpt.Signer | None = None
) -> dict[str, Any]:
    """A signal object's record, once it is proven to be this run id's signal ``name``
    (``payload``, ``run_nonce``, ``sent_at``, and ``consumed`` once received).
    """
    run = f"{workflow}/{run_id}"
    where = f"run {run}: signal {name!r}"
    if signer is not None:
        found = _SIG_TAIL.search(data)
        body = data[: found.start()] + b"}" if found else b""
        if found is None or not hmac.compare_digest(
            found.group(1).decode(), signer.seal(body, b"signal")
        ):
            raise CorruptCheckpoint(
                f"{where} is not signed with the workflow's signing key, so it was refused "
                "unread (anyone who can write the store could have sent it). Delete "
                f"{signal_key(workflow, run_id, name)!r} (a name is sent once) and send it "
                "again with the key (wf.signal, or $DURABLE_STEPS_SIGNING_KEY for the "
                "command line).",
                run=run,
            )
        data = body
    record = _record(data)
    fields = ("format", "workflow", "run_id", "name")
    if record is None or tuple(record.get(f) for f in fields) != (1, workflow, run_id, name):
        raise CorruptCheckpoint(
            f"{where}: the object at {signal_key(workflow, run_id, name)!r} is not that "
            "signal (damaged, or copied from another run); it was left untouched. Delete it "
            "and send the signal again.",
            run=run,
        )
    return record


def _record(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _unverified(data: bytes) -> dict[str, Any] | None:
    """A signal object's record, read unverified (the step that receives it verifies it)."""
    signed = _SIG_TAIL.search(data)
    return _record(data[: signed.start()] + b"}" if signed else data)


def for_run(data: bytes, nonce: str) -> bool:
    """Whether a signal object was sent to the incarnation of the run with ``nonce``."""
    record = _unverified(data)
    return record is not None and record.get("run_nonce") == nonce


def wakes(data: bytes, nonce: str, accepts: object) -> bool:
    """Whether a signal object wakes the run with ``nonce`` whose wait accepts
    ``accepts``: sent to it, and of a shape it takes. One received already whose
    payload the wait does not take (an earlier version recorded it unchecked)
    does not: the wait treats it as not received (``_execution.waits.wait_for``).
    """
    record = _unverified(data)
    return (
        record is not None
        and record.get("run_nonce") == nonce
        and accepted(accepts, record.get("payload"))
    )


def _replaceable(data: bytes, nonce: str, wait: dict[str, Any] | None, payload: Any) -> bool:
    """Whether the signal object ``data`` may be replaced by ``payload`` (``send``).

    Yes when it was sent to an earlier run under the id (deleted since), or
    when the run waits for it (``wait``) and the wait does not take it. When
    the run does not wait for it yet (queued, running, waiting for another
    signal), what its wait will take is unknown: one not received yet whose
    payload is no approval (a typo, ``"approve"``) is replaced by an approval
    (``{"approved": true}``), the correction. Anything else was sent and stays.
    """
    if not for_run(data, nonce):
        return True
    if wait is not None:
        return not wakes(data, nonce, wait.get("accepts"))
    record = _unverified(data)
    return (
        record is not None
        and "consumed" not in record
        and approval(record.get("payload")) is None
        and approval(payload) is not None
    )


def refuse_unaccepted(status: object, wait: object, run: str, name: str, payload: Any) -> None:
    """Raise SignalRefused if the run (``status``, its header's ``wait``) waits for
    signal ``name`` and ``payload`` is not what the wait accepts (see
    :mod:`durable_steps._fleet.approval`). The web page asks before it confirms.
    """
    if status != "waiting" or not isinstance(wait, dict):
        return
    if wait.get("signal") == name and not accepted(wait.get("accepts"), payload):
        raise SignalRefused(
            f"{refusal(run, name, payload, wait.get('step'))}. Nothing was sent; the run "
            "still waits.",
            run=run,
            step=wait.get("step") if isinstance(wait.get("step"), str) else None,
            signal=name,
        )


def consumed(record: dict[str, Any], where: list[Any], signer: ckpt.Signer | None) -> bytes:
    """Signal ``record`` marked as received by step ``where`` (``[step, iteration]``),
    so that another step or pass waiting for the same name is told, not given it again.
    """
    return encode(
        record["workflow"],
        record["run_id"],
        record["name"],
        record.get("payload"),
        signer,
        record.get("run_nonce"),
        consumed=where,
    )


def send(  # noqa: PLR0917 - the public wf.signal's arguments, plus where
    store: Store,
    workflow: str,
    run_id: str,
    name: str,
    payload: Any = None,
    signer: ckpt.Signer | None = None,
    *,
    expect_nonce: str | None = None,
) -> bool:
    """Send signal ``name`` to a run: True, or False if it was sent before.

    ``expect_nonce``: send only to the run with that nonce (the web page's
    confirmation), checked on the one read of the run that supplies the nonce
    the signal is bound to, so a run deleted and created again under the id
    in between is refused (:class:`RunChanged`), not signalled.

    Refused (``DurableStepsError``) when the run does not exist or has
    finished: a signal nobody can receive is a mistake worth hearing about.
    Refused (``SignalRefused``) when the run waits for this signal and the
    payload is not of the shape its wait accepts (an approval's). A signal
    left by an earlier run under the same id (deleted since) is replaced, as
    is one that decides nothing: one the waiting run does not accept, or,
    before the run waits for it, one that is no approval when ``payload`` is
    one (see :func:`_replaceable`).
    """
    ckpt.validate_name(run_id, "run id")
    run = f"{workflow}/{run_id}"
    try:
        ckpt.validate_name(name, "signal name")
    except DurableStepsError:
        raise DurableStepsError(
            f"run {run}: {name!r} is not a valid signal name: use 1-200 characters from "
            "letters, digits and '._@=+:-', starting with a letter or digit",
            run=run,
        ) from None
    check_json(payload, "payload")
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    if found is None:
        raise DurableStepsError(
            f"run {run} does not exist, so signal {name!r} was not sent (check the run id "
            f"with `{command_hint(store)} ls`)",
            run=run,
        )
    split = ckpt.split_header(found[0])
    header = split[0] if split else {}
    status, nonce = header.get("status"), header.get("run_nonce")
    if expect_nonce is not None and nonce != expect_nonce:
        raise RunChanged(
            f"run {run} is not the run expected (another run under that id); signal "
            f"{name!r} was not sent",
            run=run,
            nonce=nonce,
        )
    if status in ("completed", "deleted"):
        raise DurableStepsError(
            f"run {run} has {status}, so nothing will receive signal {name!r}; it was not sent",
            run=run,
        )
    refuse_unaccepted(status, header.get("wait"), run, name, payload)
    data = encode(
        workflow, run_id, name, payload, signer, nonce if isinstance(nonce, str) else None
    )
    if isinstance(nonce, str):  # the nudge first: a scan that lists the run sees it came
        drive_sync(_index.nudged(workflow, run_id, nonce, name), store)
    wait = header.get("wait") if status == "waiting" else None
    taking = wait if isinstance(wait, dict) and wait.get("signal") == name else None
    key = signal_key(workflow, run_id, name)
    if not _delivered(store, key, data, str(nonce), taking=taking, payload=payload):
        return False
    if isinstance(nonce, str):
        # The nudge once more, after the signal (create-only: one refused PUT, as a
        # rule). A sender killed between the two writes leaves a nudge with no
        # signal; a worker whose resume finds none deletes it (``_fleet.finding``), so it
        # may have deleted ours just now, before our signal landed: this puts it
        # back. Either our nudge is written after that delete, or the worker's second
        # look at the signal, after its delete, sees the signal and writes it.
        drive_sync(_index.nudged(workflow, run_id, nonce, name), store)
    return True


def _delivered(
    store: Store,
    key: str,
    data: bytes,
    nonce: str,
    *,
    taking: dict[str, Any] | None,
    payload: Any,
) -> bool:
    """Create the signal object (or replace one that decides nothing, see
    :func:`_replaceable`; ``taking`` is the run's wait for this signal): False
    when this incarnation had it already, or the run was deleted meanwhile.
    """
    try:
        store.put(key, data, match=None)
    except CheckpointConflict:
        old = store.get(key)
        if old is None:  # deleted in between (rm of the run): nothing to deliver to
            return False
        if not _replaceable(old[0], nonce, taking, payload):
            return False  # delivered, or one the run will take
        try:  # compare-and-swap: a send or a receive in between wins
            store.put(key, data, match=old[1])
        except CheckpointConflict:
            return False
    return True


POLL_FIRST, POLL_MAX = 0.5, 30.0
"""``wait=True`` polls a signal's key after 0.5 s, then backs off to one GET per 30 s."""


def _pauses(until: float | None) -> Iterator[float]:
    """The pauses of a wait: to ``until`` at once without a signal, else polling backoff."""
    poll = POLL_FIRST
    while True:
        left = None if until is None else until - time.time()
        if left is not None and left <= 0:
            return
        yield poll if left is None else min(poll, left)
        poll = min(poll * 2, POLL_MAX)


def await_wake(store: Store, workflow: str, run_id: str, waiting: RunSuspended) -> None:
    """Block until ``waiting``'s time is due or its signal exists (``wf.run(wait=True)``)."""
    if waiting.signal is None:
        time.sleep(max(0.0, (waiting.until or 0) - time.time()))
        return
    key = signal_key(workflow, run_id, waiting.signal)
    nonce, accepts = _nonce(store, workflow, run_id)
    for pause in _pauses(waiting.until):
        got = store.get(key)
        if got is not None and wakes(got[0], nonce, accepts):
            return
        time.sleep(pause)


async def await_wake_async(store: Store, workflow: str, run_id: str, waiting: RunSuspended) -> None:
    """:func:`await_wake` under asyncio (``await wf.arun(..., wait=True)``)."""
    import asyncio

    if waiting.signal is None:
        await asyncio.sleep(max(0.0, (waiting.until or 0) - time.time()))
        return
    key = signal_key(workflow, run_id, waiting.signal)
    nonce, accepts = await asyncio.to_thread(_nonce, store, workflow, run_id)
    for pause in _pauses(waiting.until):
        got = await asyncio.to_thread(store.get, key)
        if got is not None and wakes(got[0], nonce, accepts):
            return
        await asyncio.sleep(pause)


def _nonce(store: Store, workflow: str, run_id: str) -> tuple[str, object]:
    """The nonce of the run now under this id ("" if none: then nothing is for it),
    and what its wait accepts.
    """
    found = store.get(ckpt.checkpoint_key(workflow, run_id))
    split = ckpt.split_header(found[0]) if found else None
    nonce = split[0].get("run_nonce") if split else None
    wait = split[0].get("wait") if split else None
    accepts = wait.get("accepts") if isinstance(wait, dict) else None
    return nonce if isinstance(nonce, str) else "", accepts
