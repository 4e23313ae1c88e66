"""Deleting what a run keeps beside its head: its parts, signals and history.

``rm``, ``prune``, ``on_complete="delete"`` and a worker that finds a deleted
run's leftovers all end here. The head is not touched: whoever deletes a
run deletes (or tombstones) its head under their own condition first.
"""

from __future__ import annotations

from .._drivers import Delete, ListKeys, ListObjects, Protocol, Sweep
from .._record import format2 as f2
from .._record import history
from .signals import signals_prefix

__all__ = ["clear_leftovers", "clear_objects"]


def clear_objects(workflow: str, run_id: str) -> Protocol[int]:
    """Delete everything under a run's ``parts/``, ``signals/`` and ``history/``,
    and what killed writers left there that no key lists; how many parts there were.
    """
    found = []
    prefixes = (f2.parts_prefix(workflow, run_id), signals_prefix(workflow, run_id))
    for prefix in (*prefixes, history.history_prefix(workflow, run_id)):
        keys = yield ListKeys(prefix)
        for key in keys:
            yield Delete(key, None)
        yield Sweep(prefix)
        found.append(len(keys))
    return found[0]  # the parts' (a run with none but signals left counts none)


def clear_leftovers(workflow: str, run_id: str, before: float) -> Protocol[bool]:
    """What a delete whose head went first left of a run (see ``cli/_cleanup``):
    its parts and signals last written before ``before`` (store clock). Returns
    False, deleting nothing, when a younger one is there: a run being created
    under that id now writes its parts a moment before its head, and a reader
    that found no head cannot tell it from a leftover but by age.
    """
    prefixes = (f2.parts_prefix(workflow, run_id), signals_prefix(workflow, run_id))
    found = []
    for prefix in prefixes:
        found += yield ListObjects(prefix)
    if any(info.modified >= before for info in found):
        return False
    for info in found:
        yield Delete(info.key, None)
    for prefix in prefixes:
        yield Sweep(prefix)
    return True
