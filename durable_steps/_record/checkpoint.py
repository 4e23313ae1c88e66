r"""The checkpoint record: what one stored object of a run holds.

Layout (format 1) — one object per run, at ``<workflow>/<run_id>/checkpoint``::

    {"format":1,"workflow":"support-agent","run_id":"ticket-4411",...}\\n
    <the state, as the serializer encoded it>

The first line is a JSON *header*; everything after the first newline is the
*payload*, the serializer's bytes, copied verbatim (a JSON state stays
readable with ``tail -n +2``; a pickle state is not mangled by base64). The
header says how to read the payload and where the run stands:

``format``
    1 or 2, an int. A reader refuses a higher number (``CorruptCheckpoint``:
    written by a newer durable_steps) instead of guessing, and anything else
    (``0``, ``-5``: not a valid format; ``"1"``, ``1.0``, ``true``: a
    malformed header). Format 2 (:mod:`durable_steps._record.format2`, the default
    for new runs) is this record as the run's *head*, whose payload is the
    *tail* of changes since the last flush, plus two fields: ``parts`` (the
    immutable objects it references, each ``{"name", "kind", "size",
    "sha256"}``) and ``sha256`` (of the tail: the signed line then
    authenticates every byte the run is read from).
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
    ``running``, ``waiting`` (suspended until a time or a signal, see
    ``wait``; no process holds it), ``failed`` (a step used up its retries; see ``error``),
    ``in_doubt`` (a step with ``in_doubt="raise"`` stopped the run; see
    ``intent``), ``completed`` (the terminal marker: the payload is the
    final state and a rerun runs nothing) or ``deleted`` (a *tombstone*: the
    run completed under ``on_complete="delete"``, its state is gone and the
    payload is empty; a rerun runs nothing and returns ``None``, and a late
    create-only write of the run can never land over it).
``iteration``, ``next_step``
    The cursor: steps ``[0, next_step)`` of pass ``iteration`` (0-based) are
    committed, and the payload is the state after them.
``intent``
    ``null``, or the non-idempotent step that may be firing:
    ``{"step", "index", "iteration", "key", "at", "policy"}``, optionally
    ``"resolution"`` (``fired``/``not_fired``, from ``resolve``). ``policy`` is
    the step's in-doubt policy (``refire``, ``raise`` or ``reconcile``), so
    tools can say what a resume will do. Written (with the unchanged payload)
    *before* the step fires, also before every re-fire; cleared by its
    commit. An intent found on resume means the step may have fired.
``journal``
    ``null``, or the journal of the step in progress (journaled calls, see
    :mod:`durable_steps._execution.journal`): ``{"step", "iteration", "calls",
    "open"}`` and, in format 1 only, ``"inline"``. ``calls`` counts the
    results recorded; ``open`` lists the effects whose intent is recorded
    and whose result is not, each ``{"name", "key", "at", "policy"}``
    (the step's in-doubt policy), optionally ``"resolution"`` and ``"title"``
    (what to show a person for it, at most 200 characters); ``inline``
    holds format 1's results themselves (format 2 keeps them as records of
    the tail). Cleared by the step's
    commit. Optional when read: checkpoints written before journaled calls
    existed have no such field, and mean ``null``.
``wait``
    ``null``, or what a ``waiting`` run waits for: ``{"step", "iteration",
    "until", "signal", "since"}`` (``until`` epoch seconds or null,
    ``signal`` a signal name or null), and ``"accepts": "approval"`` when
    the wait takes only an approval payload (absent: any payload; see
    ``durable_steps._fleet.approval``). Set with status ``waiting`` by a
    step that suspended (``ctx.sleep``, ``ctx.wait_for``); cleared by the
    first write of the run once it goes on. Optional when read, like
    ``journal``.
``error``
    ``null``, or the last failure: ``{"step", "iteration", "type",
    "message", "attempts", "at"}``. Cleared by the next commit.
``history``
    The most recent commits, oldest first, bounded (so a 10,000-step run does
    not grow its checkpoint): ``[step, iteration, attempts, milliseconds,
    at]`` — integers (``at`` in whole seconds since the epoch) because the
    header is encoded on every write and floats are its slowest part.
``log``
    ``null``, or the run's whole history, a few bytes per commit (see
    :mod:`durable_steps._record.history`): ``{"names", "recent", "n"}``
    and, once it has chunks, ``"last"`` (the last chunk, named by its digest).
    Optional when read, like ``journal``: runs written before it have none.
``committed``
    How many step commits the run has made in all.
``owner``
    ``null``, or the process running the run and its lease:
    ``{"host", "pid", "started", "token", "until"}``, optionally ``"lease"``
    (seconds, > 0), ``"skew"`` (a number or null), ``"boot"`` (str) and
    ``"pidns"`` (int) (see ``_fleet.leases``). ``pid`` is a positive int below
    2**22 (Linux's ceiling for pid_max) and the times are finite. Set by
    every write of a running run; cleared when the run completes, fails,
    stops in doubt or is released.
``created_at``, ``updated_at``
    Seconds since the epoch.
``size``, ``crc32``
    Length and CRC-32 of the payload: a truncated or damaged object is
    detected before anything is decoded.
``version``
    ``null``, or the ``Workflow(version=...)`` of the code that last wrote
    the run (a resume under another version calls its ``migrate`` first).
``code``
    ``null``, or ``{step: 12 hex digits}``: a fingerprint of each step's
    code (bytecode and constants, see ``_deploys.fingerprints.fingerprint``) as of the
    last commit, so ``show --app`` and ``plan`` can say which steps changed.
``sig``
    Only with a signing key, and always the line's last field: the hex
    HMAC-SHA256 of the header line as written without it, bound to the
    payload (see :meth:`SignedSerializer.seal`). A reader with the key
    refuses a checkpoint without it, or whose tag does not verify, before it
    trusts any field.

What a reader refuses. :func:`decode` raises :class:`CorruptCheckpoint`,
and never another exception, for any bytes that are not such a record: no
header line, a header line that is not a JSON object or is nested deeper
than a header is (a line nested 100,000 deep would otherwise raise
``RecursionError`` in the JSON parser), a missing field (every field above
is written every time, so none is defaulted: a regenerated ``run_nonce``
would change the idempotency keys of a step in flight), an unknown field,
a field of the wrong type or range (a pid of 2**40, a NaN time, an unknown
status or intent policy), or a payload whose size or CRC-32 differs.

The header is compact and small (well under a kilobyte), so writing it next
to the payload costs about nothing; the payload itself is encoded once per
commit and reused unchanged by the intent write that precedes the next
non-idempotent step.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
import zlib
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..errors import CorruptCheckpoint, DefinitionError
from .checks import field_problem, format_problem, is_int, parts_problem, show
from .sealing import Signer, unseal

__all__ = [
    "FORMAT",
    "HISTORY_LIMIT",
    "Checkpoint",
    "Signer",
    "checkpoint_key",
    "decode",
    "effect_key",
    "encode",
    "idempotency_key",
    "validate_name",
]

FORMAT = 2
"""The format new runs are written in; a run keeps the format it was created in."""
HISTORY_LIMIT = 10
Status = Literal["running", "waiting", "failed", "in_doubt", "completed", "deleted"]
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


def trace_ids(workflow: str, run_id: str, run_nonce: str) -> tuple[int, int]:
    """The trace id and the span id every trace of one run hangs from.

    A pure function of the run's identity *and its nonce*: every execution
    of the run, in any process, derives the same ids with nothing stored,
    while a run deleted and created again under the same id, or the same id
    in two stores (staging and production exporting to one backend), gets
    a trace of its own. Never zero, which tracing takes for "no id".
    """
    digest = hashlib.sha256(f"{workflow}/{run_id}/{run_nonce}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def effect_key(run_nonce: str, iteration: int, step: str, name: str) -> str:
    """Derive the idempotency key of effect ``name`` of ``step`` in one pass of a run.

    Like :func:`idempotency_key`, 43 printable ASCII characters, the same on
    every retry and resume of that effect and different for every other
    name, step, pass and run. The material is a JSON list, so no choice of
    names can collide with another (``"a:b", "c"`` vs ``"a", "b:c"``), nor
    with a step's key (whose material is not JSON). The step's position is
    left out: a deploy that inserts a step before it keeps its effects' keys.
    """
    material = json.dumps(["effect", run_nonce, iteration, step, name]).encode()
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
    journal: dict[str, Any] | None = None
    wait: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    history: tuple[tuple[Any, ...], ...] = ()
    log: dict[str, Any] | None = None
    committed: int = 0
    owner: dict[str, Any] | None = None
    created_at: float = field(default_factory=_now)
    updated_at: float = field(default_factory=_now)
    format: int = FORMAT
    parts: tuple[dict[str, Any], ...] = ()
    """Format 2 only: the parts the head references, in replay order."""
    version: str | None = None
    code: dict[str, str] | None = None

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
            journal=None,
            error=None,
            history=(*self.history, entry)[-HISTORY_LIMIT:],
            committed=self.committed + 1,
            updated_at=now,
        )


def encode(header: Checkpoint, payload: bytes, signer: Signer | None = None) -> bytes:
    """Serialize ``header`` and ``payload`` into the stored bytes.

    With a ``signer`` the header line ends in a ``"sig"`` field: a tag over
    the line written without it, and over the payload (see ``seal``). It is
    appended as the line's last field so a reader recovers the signed bytes
    exactly by cutting it off, with no canonical re-encoding.
    """
    # vars(), not dataclasses.asdict(): the fields are already JSON-ready and
    # asdict's deep copy costs more than the rest of the header together.
    record = {"format": header.format, **vars(header)}
    if header.log is None:  # not written until a commit makes one: a new run's head stays
        del record["log"]  # readable by versions before the log existed
    if header.format == 1:
        del record["parts"]
    else:  # the tail, bound to the (signed) line; parts are bound by their own digests
        record["sha256"] = hashlib.sha256(payload).hexdigest()
    record["size"], record["crc32"] = len(payload), zlib.crc32(payload)
    line = _HEADER_JSON.encode(record).encode()
    if signer is not None:
        line = b'%s,"sig":"%s"}' % (line[:-1], signer.seal(line, payload).encode())
    return line + b"\n" + payload


# One encoder for every header: json.dumps() with options builds a new
# encoder per call, which costs more than encoding the header itself. No
# cycle check (a third of the time): the header holds our own records, and
# the values users give it (call results, resolutions) were checked as JSON,
# which refuses cycles.
_HEADER_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, check_circular=False)


def split_header(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """``(header record, payload)`` if the first line is a header, else None.

    Only the header line is parsed and nothing is checked beyond its being a
    JSON object with a ``format``, nested no deeper than a header is: :func:`decode`
    checks the rest, and the command line uses this alone to recognise a
    checkpoint whose payload may be damaged. Never raises: a line nested too
    deep for the JSON parser (RecursionError) is not a header either.
    """
    newline = data.find(b"\n")
    if newline < 0:
        return None
    try:
        record = json.loads(data[:newline])
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(record, dict) or "format" not in record or _deeper_than(record, 8):
        return None
    return record, data[newline + 1 :]


def _deeper_than(value: object, limit: int) -> bool:
    """Whether JSON ``value`` nests more than ``limit`` containers deep (a
    header nests 3: ``history``'s entries); walked without recursion.
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


_OPTIONAL = {"journal": None, "wait": None, "version": None, "code": None, "log": None}
"""Fields added after checkpoints were first written: a checkpoint without one
reads as this value. Unlike the others they may be defaulted: none feeds an
idempotency key or the cursor, and ``None`` means what such a run is (no
journal, no wait, no version recorded, no fingerprints to compare)."""
_REQUIRED = (
    *(f.name for f in fields(Checkpoint) if f.name not in ("format", "parts", *_OPTIONAL)),
    "size",
    "crc32",
)
"""Every field the writer writes: a missing one is refused, never defaulted
(a regenerated ``run_nonce`` would change every idempotency key)."""
_REQUIRED_2 = (*_REQUIRED, "parts", "sha256")
"""What a format-2 head adds."""


def decode(
    data: bytes, *, where: str, run: str | None = None, signer: Signer | None = None
) -> tuple[Checkpoint, bytes]:
    """Parse stored bytes into ``(header, payload)``.

    ``where`` names the object in error messages and ``run`` goes into the
    error's ``run`` field. Raises :class:`CorruptCheckpoint`, and nothing
    else, for anything that is not a complete checkpoint of a format this
    version can read, or, with a ``signer``, that is not signed by its key.
    """
    unseal(data, signer, where, run)
    split = split_header(data)
    if split is None:
        raise CorruptCheckpoint(
            f"{where} is not a durable_steps checkpoint (no valid header line). "
            "It was left untouched; restore it or delete the run to start over.",
            run=run,
        )
    record, payload = split
    record.pop("sig", None)  # checked above when a key is set; ignored otherwise
    version = record.pop("format")
    if is_int(version) and version > FORMAT:
        raise CorruptCheckpoint(
            f"{where} has checkpoint format {version}, newer than this durable_steps "
            f"reads (format {FORMAT}). Upgrade durable_steps to resume it; it was left untouched.",
            run=run,
        )
    problem = format_problem(version) or _presence_problem(record, version)
    if problem:
        raise CorruptCheckpoint(
            f"{where} has a malformed header: {problem}; left untouched.", run=run
        )
    for name, default in _OPTIONAL.items():
        record.setdefault(name, default)
    size, crc = record.pop("size"), record.pop("crc32")
    if not (is_int(size) and is_int(crc)) or (size, crc) != (len(payload), zlib.crc32(payload)):
        raise CorruptCheckpoint(
            f"{where} is truncated or damaged: its header promises {show(size)} bytes of "
            f"state (crc32 {show(crc)}), the object holds {len(payload)}. It was left "
            "untouched; restore it from a backup or delete the run to start over.",
            run=run,
        )
    if version == 2 and record.pop("sha256") != hashlib.sha256(payload).hexdigest():
        raise CorruptCheckpoint(
            f"{where} is damaged: its tail of changes does not match the digest its header "
            "promises. It was left untouched; restore it or delete the run to start over.",
            run=run,
        )
    steps, history = record["steps"], record["history"]
    parts = record.pop("parts", [])
    if not isinstance(steps, list) or not isinstance(history, list):
        problem = "steps and history must be lists"
    elif not all(isinstance(entry, list) for entry in history):
        problem = "history must be a list of lists"
    else:
        problem = parts_problem(parts)
    if not problem:
        checked = {
            **record,
            "steps": tuple(steps),
            "history": tuple(map(tuple, history)),
            "format": version,
            "parts": tuple(parts),
        }
        problem = field_problem(checked)
    if problem:
        raise CorruptCheckpoint(
            f"{where} has a malformed header: {problem}; left untouched.", run=run
        )
    return Checkpoint(**checked), payload


def _presence_problem(record: dict[str, Any], version: int) -> str | None:
    """Which field the writer always writes is missing, or which is unknown."""
    required = _REQUIRED_2 if version == 2 else _REQUIRED
    missing = [name for name in required if name not in record]
    if missing:
        return f"missing field {', '.join(missing)}"
    unknown = sorted(record.keys() - required - _OPTIONAL.keys())
    if unknown:
        return f"unknown field {', '.join(show(name) for name in unknown)}"
    return None
