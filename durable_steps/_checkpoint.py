r"""The checkpoint record: what one stored object of a run holds.

Layout (format 1) — one object per run, at ``<workflow>/<run_id>/checkpoint``::

    {"format":1,"workflow":"support-agent","run_id":"ticket-4411",...}\\n
    <the state, as the serializer encoded it>

The first line is a JSON *header*; everything after the first newline is the
*payload*, the serializer's bytes, copied verbatim (a JSON state stays
readable with ``tail -n +2``; a pickle state is not mangled by base64). The
header says how to read the payload and where the run stands:

``format``
    1. A reader refuses a higher number (``CorruptCheckpoint``: written by a
    newer durable_steps) instead of guessing. A later incremental format
    (message histories written as deltas) gets format 2 and is read beside
    this one.
``workflow``, ``run_id``
    The run's identity, checked against the key it was read from.
``run_nonce``
    32 random hex digits chosen when the run is created. Idempotency keys are
    derived from it, so a run deleted and started again under the same id
    gets new keys.
``steps``
    The step names in order: resuming under another sequence raises
    ``WorkflowChanged``.
``serializer``
    The payload's serializer name (``json``, ``pickle``,
    ``pickle+hmac-sha256``).
``status``
    ``running``, ``failed`` (a step used up its retries; see ``error``),
    ``in_doubt`` (a step with ``in_doubt="raise"`` stopped the run; see
    ``intent``) or ``completed`` (the terminal marker: the payload is the
    final state and a rerun runs nothing).
``iteration``, ``next_step``
    The cursor: steps ``[0, next_step)`` of pass ``iteration`` (0-based) are
    committed, and the payload is the state after them.
``intent``
    ``null``, or the non-idempotent step that may be firing:
    ``{"step", "index", "iteration", "key", "at"}``. Written (with the
    unchanged payload) *before* the step fires; cleared by its commit. An
    intent found on resume means the step may have fired.
``error``
    ``null``, or the last failure: ``{"step", "iteration", "type",
    "message", "attempts", "at"}``. Cleared by the next commit.
``history``
    The most recent commits, oldest first, bounded (so a 10,000-step run does
    not grow its checkpoint): ``[step, iteration, attempts, milliseconds,
    at]`` — integers (``at`` in whole seconds since the epoch) because the
    header is encoded on every write and floats are its slowest part.
``committed``
    How many step commits the run has made in all.
``owner``
    ``null``, or the process running the run and its lease:
    ``{"host", "pid", "started", "token", "until"}`` (see ``_lease``). Set by
    every write of a running run; cleared when the run completes, fails,
    stops in doubt or is released.
``created_at``, ``updated_at``
    Seconds since the epoch.
``size``, ``crc32``
    Length and CRC-32 of the payload: a truncated or damaged object is
    detected before anything is decoded.

The header is compact and small (well under a kilobyte), so writing it next
to the payload costs about nothing; the payload itself is encoded once per
commit and reused unchanged by the intent write that precedes the next
non-idempotent step.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import CorruptCheckpoint, DefinitionError

__all__ = [
    "FORMAT",
    "HISTORY_LIMIT",
    "Checkpoint",
    "checkpoint_key",
    "decode",
    "encode",
    "idempotency_key",
    "validate_name",
]

FORMAT = 1
HISTORY_LIMIT = 10
Status = Literal["running", "failed", "in_doubt", "completed", "deleted"]
_STATUSES = ("running", "failed", "in_doubt", "completed", "deleted")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@=+:-]{0,199}")
CHECKPOINT_OBJECT = "checkpoint"


def validate_name(value: object, what: str) -> str:
    """Return ``value`` if it is a safe workflow name or run id, else raise.

    Names become parts of object keys and file paths, so they may not contain
    ``/`` or start with ``.`` (no ``..`` traversal, no hidden files).
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise DefinitionError(
            f"invalid {what} {value!r}: use 1-200 characters from letters, digits and "
            "'._@=+:-', starting with a letter or digit (no '/', no leading '.')"
        )
    return value


def checkpoint_key(workflow: str, run_id: str) -> str:
    """The store key of a run's checkpoint."""
    return f"{workflow}/{run_id}/{CHECKPOINT_OBJECT}"


def idempotency_key(run_nonce: str, iteration: int, index: int, step: str) -> str:
    """Derive the idempotency key of one step of one pass of one run.

    ``ds-`` and 40 hex digits of SHA-256 over the run's nonce, the pass, the
    step's position and its name: 43 printable ASCII characters (within the
    64 that Stripe and AWS client tokens allow), the same on every retry and
    re-fire of that step in that pass, different for every other pass, step
    and run. The runner persists the key in the intent before the step fires
    and reuses the persisted value, so a future change here never changes the
    key of a step already in flight.
    """
    material = f"{run_nonce}:{iteration}:{index}:{step}".encode()
    return "ds-" + hashlib.sha256(material).hexdigest()[:40]


def _now() -> float:
    """Wall-clock seconds to the millisecond: short to write, precise enough."""
    return round(time.time(), 3)


@dataclass(frozen=True)
class Checkpoint:
    """The header of a checkpoint (see the module docstring for each field)."""

    workflow: str
    run_id: str
    steps: tuple[str, ...]
    serializer: str
    run_nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    status: Status = "running"
    iteration: int = 0
    next_step: int = 0
    intent: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    history: tuple[tuple[Any, ...], ...] = ()
    committed: int = 0
    owner: dict[str, Any] | None = None
    created_at: float = field(default_factory=_now)
    updated_at: float = field(default_factory=_now)

    @property
    def run(self) -> str:
        """``workflow/run_id``, the way errors and logs name a run."""
        return f"{self.workflow}/{self.run_id}"

    def evolve(self, **changes: Any) -> Checkpoint:
        """A copy with ``changes`` applied and ``updated_at`` set to now."""
        return self.replace(updated_at=_now(), **changes)

    def replace(self, **changes: Any) -> Checkpoint:
        """A copy with ``changes`` applied.

        ``dataclasses.replace`` re-runs ``__init__`` (with its default
        factories) and costs ~7 µs; the runner copies the header two or three
        times per step, so this copies the field dict instead (~1 µs).
        """
        unknown = changes.keys() - self.__dict__.keys()
        if unknown:
            raise TypeError(f"Checkpoint has no fields {sorted(unknown)}")
        copy = object.__new__(Checkpoint)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy

    def with_commit(
        self,
        step: str,
        attempts: int,
        seconds: float,
        *,
        iteration: int,
        next_step: int,
        completed: bool,
    ) -> Checkpoint:
        """The header after committing ``step``: cursor moved, intent and
        error cleared, the commit appended to the bounded history.
        """
        now = _now()
        entry = (step, self.iteration, attempts, round(seconds * 1000), int(now))
        return self.replace(
            status="completed" if completed else "running",
            iteration=iteration,
            next_step=next_step,
            intent=None,
            error=None,
            history=(*self.history, entry)[-HISTORY_LIMIT:],
            committed=self.committed + 1,
            updated_at=now,
        )


def encode(header: Checkpoint, payload: bytes) -> bytes:
    """Serialize ``header`` and ``payload`` into the stored bytes."""
    # vars(), not dataclasses.asdict(): the fields are already JSON-ready and
    # asdict's deep copy costs more than the rest of the header together.
    record = {"format": FORMAT, **vars(header), "size": len(payload), "crc32": zlib.crc32(payload)}
    return _HEADER_JSON.encode(record).encode() + b"\n" + payload


# One encoder for every header: json.dumps() with options builds a new
# encoder per call, which costs more than encoding the header itself.
_HEADER_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


def split_header(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """``(header record, payload)`` if the first line is a header, else None.

    Only the header line is parsed and nothing is checked beyond its being a
    JSON object with a ``format``: :func:`decode` checks the rest, and the
    command line uses this alone to recognise a checkpoint whose payload may
    be damaged.
    """
    newline = data.find(b"\n")
    try:
        record = json.loads(data[:newline]) if newline >= 0 else None
    except ValueError:
        return None
    if not isinstance(record, dict) or "format" not in record:
        return None
    return record, data[newline + 1 :]


def decode(data: bytes, *, where: str, run: str | None = None) -> tuple[Checkpoint, bytes]:
    """Parse stored bytes into ``(header, payload)``.

    ``where`` names the object in error messages and ``run`` goes into the
    error's ``run`` field. Raises
    :class:`CorruptCheckpoint` for anything that is not a complete checkpoint
    of a format this version can read.
    """
    split = split_header(data)
    if split is None:
        raise CorruptCheckpoint(
            f"{where} is not a durable_steps checkpoint (no valid header line). "
            "It was left untouched; restore it or delete the run to start over.",
            run=run,
        )
    record, payload = split
    version = record.pop("format")
    if not isinstance(version, int) or version > FORMAT:
        raise CorruptCheckpoint(
            f"{where} has checkpoint format {version!r}, newer than this durable_steps "
            f"reads (format {FORMAT}). Upgrade durable_steps to resume it; it was left untouched.",
            run=run,
        )
    size, crc = record.pop("size", None), record.pop("crc32", None)
    if size != len(payload) or crc != zlib.crc32(payload):
        raise CorruptCheckpoint(
            f"{where} is truncated or damaged: its header promises {size} bytes of state "
            f"(crc32 {crc}), the object holds {len(payload)}. It was left untouched; "
            "restore it from a backup or delete the run to start over.",
            run=run,
        )
    try:
        header = Checkpoint(
            **{
                **record,
                "steps": tuple(record["steps"]),
                "history": tuple(tuple(h) for h in record.get("history", ())),
            }
        )
    except (KeyError, TypeError) as exc:
        raise CorruptCheckpoint(
            f"{where} has a malformed header ({exc}); left untouched.", run=run
        ) from exc
    problem = _field_problem(header)
    if problem:
        raise CorruptCheckpoint(
            f"{where} has a malformed header: {problem}; left untouched.", run=run
        )
    return header, payload


_SHAPES: dict[str, dict[str, type | tuple[type, ...]]] = {
    "intent": {"step": str, "index": int, "iteration": int, "key": str},
    "error": {"step": str, "type": str, "message": str, "attempts": int},
    "owner": {"host": str, "pid": int, "token": str, "until": (int, float)},
}


def _field_problem(h: Checkpoint) -> str | None:  # noqa: PLR0911 - a return per check
    """Why a decoded header cannot be trusted, or None.

    The CRC covers the payload only, so every header field is checked here:
    a hand-edited or damaged header must stop as CorruptCheckpoint, not as a
    TypeError halfway through a run (possibly after a step fired).
    """
    for name in ("workflow", "run_id", "run_nonce", "serializer"):
        if not isinstance(getattr(h, name), str):
            return f"{name} is not a string"
    if h.status not in _STATUSES:
        return f"unknown status {h.status!r}"
    if not h.steps or not all(isinstance(s, str) for s in h.steps):
        return "steps is not a list of names"
    for name in ("iteration", "next_step", "committed"):
        value = getattr(h, name)
        if not _is_int(value) or value < 0:
            return f"{name} is {value!r}, not a count"
    done = h.status in ("completed", "deleted")
    if h.next_step > len(h.steps) or (h.next_step == len(h.steps) and not done):
        return f"next_step {h.next_step} is past the {len(h.steps)} steps"
    for name in ("created_at", "updated_at"):
        value = getattr(h, name)
        if not (_is_int(value) or isinstance(value, float)) or math.isnan(value):
            return f"{name} is {value!r}, not a time"
    return _record_problem(h)


def _record_problem(h: Checkpoint) -> str | None:
    """The nested fields' part of :func:`_field_problem`."""
    for entry in h.history:
        if len(entry) != 5 or not isinstance(entry[0], str) or not all(map(_is_int, entry[1:])):
            return f"history entry {list(entry)!r} is not [step, iteration, attempts, ms, at]"
    for name, shape in _SHAPES.items():
        value = getattr(h, name)
        if value is None:
            continue
        if not isinstance(value, dict):
            return f"{name} is not an object"
        for key, kind in shape.items():
            if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool):
                return f"{name}.{key} is {value.get(key)!r}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
