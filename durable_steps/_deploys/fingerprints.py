"""Step code fingerprints: which steps' code changed since a run's last commit.

Every commit records ``{step: fingerprint}`` of the code that made it
(``Checkpoint.code``); ``show --app`` and the deploy log compare it with the
current code to say which steps changed under a run.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from collections.abc import Sequence
from typing import Any

from .._step import Step

__all__ = ["code_changes", "fingerprint", "fingerprints"]


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
