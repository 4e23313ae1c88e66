"""Format 2 for small states and states that change size: written whole at every
commit while small, collapsed when changed in place, whole again once compacted; and
the JSON checks of big states' changes (keys, shared containers, depth).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import format2 as f2
from tests.storetools import Wrapped, committed


class _NamedJSON(ds.JSONSerializer):
    """Plain JSON under another name: a run written in format 1, for comparison."""

    name = "json-format-1"


def _counter_run(store: ds.Store, steps: int, **options: Any) -> ds.Workflow:
    """A 2 KB state whose steps change a counter and a note in place."""
    wf = ds.Workflow("small", store=store, until=lambda s: s["i"] >= steps, **options)

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["i"] += 1
        state["note"] = f"pass {state['i']}"

    return wf


def test_a_small_state_is_written_whole_at_every_commit(store: ds.Store) -> None:
    """A 2 KB state changed in place: each head carries one record of the whole state
    (no part is written) and is within 128 bytes of a format-1 checkpoint's size (the
    tail's SHA-256, an empty part list, the record's framing).
    """
    heads: list[bytes] = []

    class Heads(Wrapped):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.startswith("_index/") or "/history/" in key:  # not what is tested
                return super().put(key, data, match=match)
            assert "/parts/" not in key, "a small state wrote a part"
            heads.append(data)
            return super().put(key, data, match=match)

    state = {"i": 0, "note": "", "text": "t" * 2000}
    final = _counter_run(Heads(store), 60).run("r1", dict(state))  # type: ignore[arg-type]
    assert final["i"] == 60
    for data in heads:
        header, tail = ckpt.decode(data, where="test")
        assert header.format == 2
        assert len(f2.records(tail)) == 1
    one = _counter_run(store, 60, serializer=_NamedJSON()).run("f1", dict(state))
    assert one == final
    found = store.get(ckpt.checkpoint_key("small", "f1"))
    assert found is not None
    assert ckpt.decode(found[0], where="test")[0].format == 1
    assert len(heads[-1]) <= len(found[0]) + 128
    assert committed(store, ckpt.checkpoint_key("small", "r1"))[1] == final


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_retry_of_a_small_state_restarts_from_its_whole_record(
    store: ds.Store, serializer: str
) -> None:
    """A small state keeps no shadow, only its last record: a retry starts from that."""
    seen: list[list[str]] = []
    wf = ds.Workflow("retry-small", store=store, serializer=serializer)
    wf.step(name="grow")(lambda s: s["messages"].append("first"))

    @wf.step(retry=ds.Retry(attempts=2, wait=0, on=RuntimeError))
    def flaky(state: dict[str, Any]) -> None:
        seen.append(list(state["messages"]))
        state["messages"].append("half-done")
        if len(seen) == 1:
            raise RuntimeError("first attempt fails")

    with ds.testing.no_wait():
        final = wf.run("r1", {"messages": []})
    assert seen == [["first"], ["first"]]
    assert final["messages"] == ["first", "half-done"]


def test_a_mid_size_state_changed_in_place_is_collapsed_not_accumulated(
    store: ds.Store,
) -> None:
    """A 12 KB state (too big to write whole each time) whose steps replace a 500-byte
    value: the head's tail stays within the state plus its slack, no part is written,
    and a resume rebuilds the state exactly.
    """
    sizes: list[int] = []

    class Sizes(Wrapped):
        def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
            if key.startswith("_index/") or "/history/" in key:  # not what is tested
                return super().put(key, data, match=match)
            assert "/parts/" not in key, "the tail was flushed instead of collapsed"
            sizes.append(len(data.partition(b"\n")[2]))
            return super().put(key, data, match=match)

    wf = ds.Workflow("mid", store=Sizes(store), until=lambda s: s["i"] >= 200)  # type: ignore[arg-type]

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["i"] += 1
        state["reply"] = f"{state['i']:04d}" + "r" * 496

    final = wf.run("r1", {"i": 0, "reply": "", "doc": "d" * 12_000})
    whole = len(json.dumps(final, separators=(",", ":")))
    assert whole > f2.WHOLE_UP_TO
    assert max(sizes) <= whole * (1 + f2._SLACK) + 1_200  # the slack, one more record, framing
    assert committed(store, ckpt.checkpoint_key("mid", "r1"))[1] == final


BIG = "d" * 20_000  # a state over WHOLE_UP_TO: its commits are written as changes


def _two_steps(store: ds.Store, edit: Any, name: str = "h3") -> ds.Workflow:
    """A workflow whose second commit makes ``edit(state)`` to a big JSON state."""
    wf = ds.Workflow(name, store=store, until=lambda s: s["i"] >= 3)

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["i"] += 1
        if state["i"] == 2:
            edit(state)

    return wf


def test_a_tuple_key_added_to_a_big_state_is_refused_not_stored_unreadable() -> None:
    """A tuple key added to an existing dict of a big JSON state is refused at its commit
    (as format 1 and small states do), not stored as a path that no resume can replay.
    """
    store = ds.MemoryStore()

    def edit(state: dict[str, Any]) -> None:
        state["d"][(1, 2)] = "x"

    with pytest.raises(ds.SerializationError, match=r"state\['d'\]"):
        _two_steps(store, edit).run("r", {"i": 0, "d": {}, "doc": BIG})
    # Whatever was stored must still resume (here: to the same refusal, not corruption).
    with pytest.raises(ds.SerializationError):
        _two_steps(store, edit).run("r", None)


class _Key(str):
    """A str subclass (as a StrEnum member is): JSON gives back a plain str."""


@pytest.mark.parametrize("key", [_Key("k"), 1], ids=["str-subclass", "int"])
def test_a_key_json_changes_added_to_a_big_state_is_refused(key: Any) -> None:
    """A key that JSON would give back as another type (a str subclass, an int), added to
    an existing dict of a big state, is refused at its commit as a small state's is.
    """
    store = ds.MemoryStore()

    def edit(state: dict[str, Any]) -> None:
        state["d"][key] = "x"

    with pytest.raises(ds.SerializationError, match=r"state\['d'\]"):
        _two_steps(store, edit).run("r", {"i": 0, "d": {}, "doc": BIG})


def test_one_dict_put_under_two_new_keys_of_a_big_state_is_refused() -> None:
    """One dict stored under two keys in one commit of a big JSON state is refused (it would
    come back as two separate copies after a resume), as the whole-state check refuses it.
    """
    store = ds.MemoryStore()

    def edit(state: dict[str, Any]) -> None:
        shared = {"v": 1}
        state["a"], state["b"] = shared, shared

    with pytest.raises(ds.SerializationError, match="same dict"):
        _two_steps(store, edit).run("r", {"i": 0, "doc": BIG})


def test_one_dict_appended_twice_to_a_list_of_a_big_state_is_refused() -> None:
    """The same dict appended twice in one commit (one ``ext`` op) is refused like above."""
    store = ds.MemoryStore()

    def edit(state: dict[str, Any]) -> None:
        shared = {"role": "user"}
        state["messages"] += [shared, shared]

    with pytest.raises(ds.SerializationError, match="same dict"):
        _two_steps(store, edit).run("r", {"i": 0, "messages": [], "doc": BIG})


class _Heads(ds.MemoryStore):
    """Records the size of every head written."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[int] = []

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        if key.endswith("/checkpoint"):
            self.heads.append(len(data))
        return super().put(key, data, match=match)


def _compacting(store: ds.Store, serializer: Any = "json") -> ds.Workflow:
    """20 steps append 2 KB messages (40 KB), one compacts them to an 800-byte summary,
    then 100 steps change a note in place.
    """
    wf = ds.Workflow("compact", store=store, serializer=serializer, until=lambda s: s["i"] >= 121)

    @wf.step()
    def turn(state: dict[str, Any]) -> None:
        state["i"] += 1
        if state["i"] <= 20:
            state["messages"].append(f"{state['i']:04d}" + "m" * 2000)
        elif state["i"] == 21:
            state["messages"] = ["summary " * 100]
        else:
            state["note"] = f"pass {state['i']} " + "n" * 100

    return wf


def test_a_state_compacted_below_the_whole_size_is_written_whole_again() -> None:
    """An agent that compacts a 40 KB transcript to 1 KB: the commits after it write heads
    of about format 1's size (a small state is written whole), not a tail of changes
    growing to the 16 KB threshold behind a base part of the old 40 KB state.
    """
    store = _Heads()
    final = _compacting(store).run("r", {"i": 0, "messages": [], "note": ""})
    one = ds.MemoryStore()
    assert _compacting(one, _NamedJSON()).run("f1", {"i": 0, "messages": [], "note": ""}) == final
    found = one.get(ckpt.checkpoint_key("compact", "f1"))
    assert found is not None
    after = store.heads[-95:]  # the commits well after the compaction
    assert max(after) <= len(found[0]) + 1024, (max(after), len(found[0]))


def _nested(levels: int) -> list[Any]:
    """A list nested ``levels`` deep."""
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_a_deep_state_that_was_stored_resumes() -> None:
    """A JSON state nested 495 deep (under MAX_DEPTH, stored by its commit) is read back
    by a rerun, as format 1 reads it, not refused with a bare RecursionError.
    """
    store = ds.MemoryStore()

    def edit(state: dict[str, Any]) -> None:
        state["deep"] = _nested(495)

    final = _two_steps(store, edit, "deep").run("r", {"i": 0})
    assert _two_steps(store, edit, "deep").run("r", None) == final


def test_a_deep_small_state_is_refused_with_its_own_path_or_stored() -> None:
    """A small JSON state nested 499 deep, which format 1 stores: either stored and resumed,
    or refused with a path in the state (``state['deep']...``), not in the record's ops.
    """
    store = ds.MemoryStore()

    def edit(state: dict[str, Any]) -> None:
        state["deep"] = _nested(499)

    refused: ds.SerializationError | None = None
    try:
        final = _two_steps(store, edit, "deeper").run("r", {"i": 0})
    except ds.SerializationError as exc:
        refused = exc
    if refused is not None:
        assert (refused.path or "").startswith("state['deep']"), refused.path
    else:
        assert _two_steps(store, edit, "deeper").run("r", None) == final
