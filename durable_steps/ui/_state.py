"""A run's state for the page: decoded when that is safe, as a tree; what the last commit changed.

Reading a state runs the serializer. JSON is safe to decode; a pickle runs
code chosen by whoever wrote it, so without ``--unsafe-unpickle`` the page
shows an *outline* instead: its size and the classes it would import, read
with :func:`pickletools.genops`, which walks the opcodes and executes none.
A signed run is verified with ``$DURABLE_STEPS_SIGNING_KEY`` (as ``show
--state`` does) or not decoded at all.

The replay mirrors :func:`durable_steps._record.format2.load_state` (each
part checked against the head's size and digest before it is decoded) and
keeps, besides the state, the journal records of the step in progress and
the ops of the last commit's record: "what the last step changed". A state
written whole (a small one is, at every commit: see ``format2``) has no
record of its change, and the page says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickletools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .._record import checkpoint as ckpt
from .._record import format2 as f2
from .._record.delta import apply
from .._record.finders import JOURNAL
from ..errors import CorruptCheckpoint
from ..serializers import (
    SIGNED_SUFFIX,
    SIGNING_KEY_ENV,
    PickleSerializer,
    Serializer,
    resolve_serializer,
)
from ..stores import Store

__all__ = ["Decoded", "Node", "decode_run", "outline", "tree"]

MAX_NODES = 4000
"""A bigger state is shown up to this many values (the rest summarised)."""
MAX_DEPTH = 32
"""Values nested deeper are shown as JSON text (the page's tree is drawn recursively)."""
MAX_TEXT = 20_000
"""A longer string is cut to this many characters on the page."""


@dataclass
class Decoded:
    """What the page could read of a run's stored state."""

    state: Any = None
    decoded: bool = False
    problem: str | None = None
    """Why the state was not decoded (a pickle, a signed run without the key)."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """The journal records of the step in progress: name, kind, key, result."""
    last_change: list[list[Any]] | None = None
    """The ops of the last commit's record; None when it is not known."""
    whole: bool = False
    """The last commit wrote the state whole (no record of its change)."""
    outline: dict[str, Any] | None = None


def serializer_for(header: ckpt.Checkpoint, unsafe: bool) -> tuple[Serializer | None, str | None]:
    """The serializer to decode ``header``'s state with, or why not (``show --state``'s rules)."""
    name = header.serializer
    inner = name.removesuffix(SIGNED_SUFFIX)
    key = os.environ.get(SIGNING_KEY_ENV)
    if inner not in ("json", "pickle"):
        return None, f"a custom serializer ({name}): the page cannot decode it"
    if inner == "pickle" and not unsafe:
        return None, (
            "a pickle: unpickling runs code chosen by whoever wrote it, so only its outline "
            "is shown. Start the page with --unsafe-unpickle if you trust everyone who can "
            "write to this store"
        )
    if name.endswith(SIGNED_SUFFIX):
        if not key:
            return None, f"signed ({name}): set {SIGNING_KEY_ENV} to its key to read it"
        return resolve_serializer(inner, key), None
    if inner == "pickle" and key:
        return None, (
            f"an unsigned pickle while {SIGNING_KEY_ENV} is set: refusing to unpickle it, "
            "as the workflow itself would"
        )
    return (PickleSerializer() if inner == "pickle" else resolve_serializer("json")), None


def decode_run(store: Store, header: ckpt.Checkpoint, payload: bytes, unsafe: bool) -> Decoded:
    """Read what the page shows of a run's state (see the module docstring)."""
    if header.status == "deleted":
        return Decoded(problem="none: the state was deleted when the run completed")
    serializer, problem = serializer_for(header, unsafe)
    if serializer is None:
        out = Decoded(problem=problem)
        if header.serializer.removesuffix(SIGNED_SUFFIX) == "pickle":
            out.outline = outline(
                _pickles(store, header, payload), header.serializer.endswith(SIGNED_SUFFIX)
            )
        return out
    try:
        if header.format == 1:
            return _format1(header, payload, serializer)
        return _replay(store, header, payload, serializer)
    except CorruptCheckpoint as exc:
        return Decoded(problem=f"cannot be decoded: {exc.message}")
    except Exception as exc:  # a bad pickle, a damaged record: the page still shows the rest
        return Decoded(problem=f"cannot be decoded: {type(exc).__name__}: {exc}")


def _format1(header: ckpt.Checkpoint, payload: bytes, serializer: Serializer) -> Decoded:
    import base64

    out = Decoded(state=serializer.loads(payload), decoded=True)
    journal = header.journal or {}
    for name, kind, key, data in journal.get("inline") or ():
        value = serializer.loads(base64.b64decode(data))
        out.calls.append({"name": name, "kind": kind, "key": key, "result": value})
    return out


def _replay(store: Store, header: ckpt.Checkpoint, tail: bytes, serializer: Serializer) -> Decoded:
    parts = f2.Parts(serializer, header.workflow, header.run_id, None)
    keys = [parts.key(p["name"]) for p in header.parts]
    found = [store.get(k) for k in keys]
    where = f"run {header.run}: checkpoint"
    journal = header.journal
    current = [journal["step"], journal["iteration"]] if journal else None
    out = Decoded(decoded=True)
    state: Any = None
    for part, got in zip(header.parts, found, strict=True):
        if got is None:
            return Decoded(problem="a part changed while it was read (compacted): reload the page")
        data = f2._check_part(got[0], part, header, where)
        if part["kind"] == "base":
            state, out.last_change, out.whole = serializer.loads(data), None, True
            continue
        for record in f2.records(data):
            state = _one(parts, record, state, current, out)
    for record in f2.records(tail):
        state = _one(parts, record, state, current, out)
    out.state = state
    return out


def _one(
    parts: f2.Parts, record: bytes, state: Any, current: list[Any] | None, out: Decoded
) -> Any:
    """Replay one record into ``state``; note a journal call or a commit's change."""
    ops = parts.finder.ops(record)
    if ops and ops[0][0] == JOURNAL:
        step, iteration, name, kind, key = ops[0][1][:5]
        if [step, iteration] == current:
            out.calls.append({"name": name, "kind": kind, "key": key, "result": ops[0][2]})
        return state
    out.whole = bool(ops) and ops[0][0] == "set" and ops[0][1] == []
    out.last_change = None if out.whole else ops
    return apply(state, ops)


# --- a pickle's outline, without running it --------------------------------------


def _pickles(store: Store, header: ckpt.Checkpoint, payload: bytes) -> list[bytes]:
    """The pickles a run's state is made of: its payload (format 1), or its
    parts' and tail's (format 2), each part checked against the head first.
    """
    if header.format == 1:
        return [payload]
    out = []
    where = f"run {header.run}: checkpoint"
    for part in header.parts:
        got = store.get(f2.parts_prefix(header.workflow, header.run_id) + part["name"])
        if got is None:
            continue
        try:
            data = f2._check_part(got[0], part, header, where)
        except CorruptCheckpoint:
            continue
        out += [data] if part["kind"] == "base" else f2.records(data)
    with contextlib.suppress(ValueError):
        out += f2.records(payload)
    return out


_UNKNOWN = object()
"""A value on the simulated pickle stack that is not a string we know."""
_MARK = object()
_TAG = 32
"""A signed serializer's bytes start with a 32-byte HMAC tag (``SignedSerializer``)."""


def _bare(data: bytes, signed: bool) -> bytes:
    """``data`` without a signed serializer's tag, when it is a tagged pickle."""
    if signed and len(data) > _TAG and data[_TAG : _TAG + 1] == b"\x80":
        return data[_TAG:]
    return data


def outline(pickles: list[bytes], signed: bool = False) -> dict[str, Any]:
    """What a pickle state is, read without unpickling: its bytes and the
    classes and functions it would import (``module.name``: count).

    The imports are found by simulating the pickle machine's stack, not by
    pattern: ``GLOBAL`` and ``INST`` name theirs in the opcode;
    ``STACK_GLOBAL`` takes the two values on top of the stack, which may have
    come from the memo (``BINGET`` of strings put there earlier), so the memo
    is tracked too (``MEMOIZE``/``PUT`` and the ``GET`` forms). Whatever
    cannot be attributed (a ``STACK_GLOBAL`` whose operands are not two known
    strings, a pickle that cannot be read) makes ``unknown`` true: the page
    then says the imports are unknown instead of listing fewer than there are.
    ``signed``: the run's serializer signs, so each pickle starts with a tag.
    """
    names: Counter[str] = Counter()
    total, unknown = 0, False
    todo = [_bare(p, signed) for p in pickles]
    while todo:
        data = todo.pop()
        total += len(data)
        try:
            unknown |= _imports(data, names, todo, signed)
        except Exception:  # damaged, hostile or not a pickle: say the imports are unknown
            unknown = True
    return {
        "bytes": total,
        "pickles": len(pickles),
        "imports": sorted(names.items()),
        "unknown": unknown,
    }


def _imports(data: bytes, names: Counter[str], todo: list[bytes], signed: bool) -> bool:
    """Count ``data``'s imports into ``names`` (nested pickles onto ``todo``); True
    when one could not be attributed.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    unknown = False
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            names[str(arg).replace(" ", ".")] += 1
        if name == "STACK_GLOBAL":
            module, attr = (stack[-2], stack[-1]) if len(stack) >= 2 else (None, None)
            if isinstance(module, str) and isinstance(attr, str):
                names[f"{module}.{attr}"] += 1
            else:
                unknown = True
            del stack[-2:]
            stack.append(_UNKNOWN)
            continue
        if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):  # MEMOIZE: the next index
            memo[len(memo) if arg is None else int(arg)] = stack[-1] if stack else _UNKNOWN
            continue
        if name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(int(arg or 0), _UNKNOWN))
            continue
        if name == "MARK":
            stack.append(_MARK)
            continue
        if isinstance(arg, bytes) and _bare(arg, signed)[:1] == b"\x80":
            todo.append(_bare(arg, signed))  # a value pickled on its own, inside a record
        before = op.stack_before
        if pickletools.markobject in before:
            while stack and stack.pop() is not _MARK:
                pass
        else:
            del stack[len(stack) - min(len(before), len(stack)) :]
        pushed = arg if isinstance(arg, str) and ("UNICODE" in name or "STRING" in name) else None
        stack.extend(pushed if pushed is not None else _UNKNOWN for _ in op.stack_after)
    return unknown


# --- the tree ---------------------------------------------------------------------


@dataclass
class Node:
    """One value of the state as the page draws it: a leaf's text, or a
    container's summary and children (``<details>`` in the template).
    """

    label: str
    kind: str
    text: str
    children: list[Node] = field(default_factory=list)


def tree(value: Any, label: str = "state") -> Node:
    """``value`` as a :class:`Node` tree, at most :data:`MAX_NODES` values."""
    budget = [MAX_NODES]
    return _node(value, label, budget, 0)


def _node(value: Any, label: str, budget: list[int], depth: int) -> Node:
    budget[0] -= 1
    if depth >= MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        return Node(label, "deep", _leaf(json.dumps(value, default=repr)))
    if isinstance(value, dict):
        node = Node(label, "object", f"{{}} {len(value)} key{'s' * (len(value) != 1)}")
        items: list[tuple[str, Any]] = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        node = Node(label, "array", f"[] {len(value)} item{'s' * (len(value) != 1)}")
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return Node(label, _kind(value), _leaf(value))
    for i, (key, item) in enumerate(items):
        if budget[0] <= 0:
            node.children.append(Node("…", "more", f"{len(items) - i} more not shown"))
            break
        node.children.append(_node(item, key, budget, depth + 1))
    return node


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else "object"


def _leaf(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = value if isinstance(value, str) else repr(value)
    if len(text) > MAX_TEXT:
        return f"{text[:MAX_TEXT]}… ({len(text) - MAX_TEXT} more characters)"
    return text
