"""The registry of the index of runs: which workflows it covers, in which layout.

See :mod:`durable_steps._fleet.index` ("The registry"): ``_index/workflows/<workflow>/<state>``
(``flat``, ``indexed`` — complete in the earlier per-run-folder layout — or
``partial``) and ``_index/flat-complete`` (every workflow is registered). Readers trust
the index of a workflow only when it is ``flat``; anything else is listed whole.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from .._drivers import Delete, ListObjects, Protocol, Put
from ..errors import CheckpointConflict

if TYPE_CHECKING:
    from ..stores import ObjectInfo

__all__ = [
    "COMPLETE",
    "OLD_COMPLETE",
    "ROOT",
    "complete",
    "create_entry",
    "mark_indexed",
    "registered",
    "registry",
    "registry_key",
    "workflows",
]


ROOT = "_index/"
"""Where the index of runs keeps everything (this module is its lowest layer)."""


def create_entry(key: str) -> Protocol[None]:
    """Create an entry; one that exists already is just as good."""
    with contextlib.suppress(CheckpointConflict):
        yield Put(key, b"", None)


def registry_key(workflow: str | None = None) -> str:
    """The registry entry of ``workflow`` (or the prefix of them all)."""
    return f"{ROOT}workflows/" + (workflow or "")


_REGISTERED: set[tuple[str, str]] = set()
"""(store, workflow) pairs this process knows to be in the registry."""


def registered(store_id: str, workflow: str, run_id: str | None = None) -> Protocol[None]:
    """Make sure ``workflow`` is in the registry, once per process and store.

    The first run of a workflow with no objects yet registers it as ``flat``;
    a workflow that already has objects (runs written by an earlier version)
    as partial, until ``reindex`` builds what they lack. The objects of
    ``run_id`` itself (the run being created: a big first state writes its
    base part before its head) are no earlier version's.
    """
    if (store_id, workflow) in _REGISTERED:
        return
    own = f"{workflow}/{run_id}/" if run_id is not None else None

    def others(infos: list[ObjectInfo]) -> bool:
        return any(own is None or not i.key.startswith(own) for i in infos)

    found = yield ListObjects(registry_key(workflow) + "/")
    if not found:
        # Two keys: the first may be the new run's own part, which sorts first
        # only if nothing else does; anything else there sorts after it or before.
        if not others((yield ListObjects("", 2))):  # a new store: nothing written unindexed
            yield from create_entry(COMPLETE)
            existing = False
        else:
            existing = others((yield ListObjects(f"{workflow}/", 2)))
        yield from create_entry(registry_key(workflow) + ("/partial" if existing else "/flat"))
    _REGISTERED.add((store_id, workflow))


COMPLETE = f"{ROOT}flat-complete"
"""Exists when every workflow of the store is in the registry (a store this layout
made from its first run, or one ``reindex`` went through whole): a run id found in
no registered workflow is then in none."""
OLD_COMPLETE = f"{ROOT}complete"
""":data:`COMPLETE` of the earlier layout (``reindex`` deletes it when it moves a store)."""


def complete() -> Protocol[bool]:
    """Whether the registry names every workflow of the store (see :data:`COMPLETE`)."""
    return bool((yield ListObjects(COMPLETE, 1)))


def workflows() -> Protocol[dict[str, bool]]:
    """The registered workflows, each with whether its index is complete in this
    layout (``flat``; one complete in the earlier layout is not, until ``reindex``).
    """
    return {workflow: "flat" in states for workflow, states in (yield from registry()).items()}


def registry() -> Protocol[dict[str, set[str]]]:
    """The registered workflows, each with its states (``flat``, ``indexed``, ``partial``)."""
    found: dict[str, set[str]] = {}
    for info in (yield ListObjects(registry_key())):
        workflow, _, state = info.key[len(registry_key()) :].partition("/")
        if state in ("flat", "indexed", "partial"):
            found.setdefault(workflow, set()).add(state)
    return found


def mark_indexed(workflow: str | None) -> Protocol[None]:
    """``reindex`` built the workflow's entries (with None: the whole store's, and
    every workflow is registered): readers may trust the index.
    """
    if workflow is None:
        yield from create_entry(COMPLETE)
        yield Delete(OLD_COMPLETE, None)
        return
    yield from create_entry(registry_key(workflow) + "/flat")
    yield Delete(registry_key(workflow) + "/partial", None)
    yield Delete(registry_key(workflow) + "/indexed", None)
