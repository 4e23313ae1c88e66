"""The change finder: ops that rebuild the live state exactly, byte for byte."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_steps._record import delta as _delta
from durable_steps._record.delta import apply, diff, snapshot
from durable_steps._record.tracker import Tracker
from tests.budget import examples

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=3), inner, max_size=5)
    ),
    max_leaves=30,
)


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def rebuilt(old: Any, new: Any) -> Any:
    """What a resume rebuilds: the stored old state, decoded, with the ops replayed."""
    ops = diff(snapshot(old), new)
    stored = json.loads(encode(old))
    return apply(stored, json.loads(encode(ops)))


@given(values, values)
def test_any_two_states_rebuild_exactly(old: Any, new: Any) -> None:
    """From any state to any other, the ops rebuild the new one byte for byte."""
    assert encode(rebuilt(old, new)) == encode(new)


@st.composite
def edits(draw: st.DrawFn) -> tuple[Any, Any]:
    """A state and the same state after random in-place edits, appends, cuts, deletes."""
    state = draw(st.dictionaries(st.text(max_size=3), values, min_size=1, max_size=4))
    state["messages"] = draw(st.lists(values, max_size=6))
    new = copy.deepcopy(state)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["append", "edit", "cut", "set", "del", "insert"]))
        messages = new["messages"]
        if kind == "append":
            messages.append(draw(values))
        elif kind == "edit" and messages:
            messages[draw(st.integers(0, len(messages) - 1))] = draw(values)
        elif kind == "cut":
            del messages[draw(st.integers(0, len(messages))) :]
        elif kind == "set":
            new[draw(st.text(max_size=3))] = draw(values)
        elif kind == "del" and len(new) > 1:
            key = draw(
                st.sampled_from(sorted(k for k in new if k != "messages"))
                if len(new) > 1
                else st.just("messages")
            )
            new.pop(key, None)
        elif kind == "insert":
            messages.insert(0, draw(values))
    return state, new


@settings(max_examples=examples(300))
@given(edits())
def test_agent_like_edits_rebuild_exactly(case: tuple[Any, Any]) -> None:
    """Appends, edits of old messages, truncations and replacements all rebuild exactly."""
    old, new = case
    assert encode(rebuilt(old, new)) == encode(new)


def test_an_append_is_sent_alone() -> None:
    """Appending one message to a long transcript costs an op holding only that message."""
    state = {"messages": [{"role": "user", "content": "x" * 2000} for _ in range(500)], "n": 1}
    tracker = Tracker(state)
    state["messages"].append({"role": "assistant", "content": "new"})
    state["n"] = 2
    ops = tracker.changes(state)
    assert ops == [
        ["ext", ["messages"], [{"role": "assistant", "content": "new"}]],
        ["set", ["n"], 2],
    ]
    tracker.commit(ops)
    assert tracker.changes(state) == []


def test_an_edit_of_an_old_message_is_found_at_its_path() -> None:
    """An in-place edit deep in an old message is one set at its path."""
    state = {"messages": [{"content": "a", "meta": {"tokens": 1}} for _ in range(50)]}
    tracker = Tracker(state)
    state["messages"][3]["meta"]["tokens"] = 7
    assert tracker.changes(state) == [["set", ["messages", 3, "meta", "tokens"], 7]]


def test_types_are_part_of_the_change() -> None:
    """1, 1.0 and True are equal in Python but not the same JSON: the change is kept."""
    tracker = Tracker({"a": 1, "b": [1]})
    assert tracker.changes({"a": True, "b": [1.0]}) == [
        ["set", ["a"], True],
        ["set", ["b", 0], 1.0],
    ]


def test_the_shadow_does_not_follow_later_in_place_edits() -> None:
    """A value committed by an op and then edited in place shows up as a new change."""
    state: dict[str, Any] = {"messages": []}
    tracker = Tracker(state)
    state["messages"].append({"content": "draft"})
    tracker.commit(tracker.changes(state))
    state["messages"][0]["content"] = "final"
    assert tracker.changes(state) == [["set", ["messages", 0, "content"], "final"]]


def test_the_sign_of_zero_is_part_of_the_change() -> None:
    """0.0 and -0.0 are equal in Python but JSON writes them apart: the change is kept."""
    tracker = Tracker({"messages": [{"score": 0.0}]})
    assert tracker.changes({"messages": [{"score": -0.0}]}) == [
        ["set", ["messages", 0, "score"], -0.0]
    ]


@st.composite
def in_place(draw: st.DrawFn) -> tuple[Any, list[tuple[str, int, Any]]]:
    """A transcript, and edits made in place on the very objects a Tracker copied."""
    messages = draw(st.lists(st.dictionaries(st.text(max_size=2), values, max_size=4), max_size=8))
    moves = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["append", "retype", "reorder", "nest", "cut", "edit"]))
        moves.append((kind, draw(st.integers(0, 7)), draw(values)))
    return {"n": 1, "messages": messages}, moves


def _move(state: dict[str, Any], kind: str, at: int, value: Any) -> None:
    """One in-place edit of an old message (or an append), keeping the leaves it does not touch."""
    messages = state["messages"]
    if kind == "append" or not messages:
        messages.append({"v": value})
        return
    message = messages[at % len(messages)]
    if kind == "retype":  # an equal value of another type: 1 -> True -> 1.0, 0.0 -> -0.0
        for key, old in message.items():
            if type(old) in (int, bool, float):
                message[key] = {int: float, bool: int, float: lambda x: -x if x == 0 else int(x)}[
                    type(old)
                ](old)
                return
        message["x"] = 1
    elif kind == "reorder" and message:  # the same keys and values, another order
        first = next(iter(message))
        message[first] = message.pop(first)
    elif kind == "nest":
        message.setdefault("blocks", []).append({"text": value})
    elif kind == "cut":
        del messages[at % len(messages) :]
    else:
        message["content"] = value


@contextlib.contextmanager
def indexed_from(length: int) -> Iterator[None]:
    """Lists of dicts from ``length`` items on are checked through an index."""
    saved = _delta._INDEX_FROM
    _delta._INDEX_FROM = length
    try:
        yield
    finally:
        _delta._INDEX_FROM = saved


@pytest.mark.parametrize("index_from", [1, _delta._INDEX_FROM])
@settings(max_examples=examples(300))
@given(in_place())
def test_in_place_edits_of_shared_objects_rebuild_exactly(
    index_from: int, case: tuple[Any, list[tuple[str, int, Any]]]
) -> None:
    """Edits made in place on objects whose leaves the shadow shares (types, key
    order, nesting, cuts) are all found, commit after commit; with every list
    of dicts indexed (1) and as shipped.
    """
    state, moves = case
    stored = json.loads(encode(state))
    with indexed_from(index_from):
        tracker = Tracker(state)
        for kind, at, value in moves:
            _move(state, kind, at, value)
            ops = tracker.changes(state)
            stored = apply(stored, json.loads(encode(ops)))
            tracker.commit(ops)
            assert encode(stored) == encode(state)
            assert tracker.changes(state) == []


@settings(max_examples=examples(100))
@given(edits(), edits())
def test_a_tracker_follows_any_sequence_of_states(
    first: tuple[Any, Any], second: tuple[Any, Any]
) -> None:
    """One Tracker through four unrelated states, every list of dicts indexed:
    every commit's ops rebuild it.
    """
    states = [*first, *second]
    stored = json.loads(encode(states[0]))
    with indexed_from(1):
        tracker = Tracker(states[0])
        for state in states[1:]:
            ops = tracker.changes(state)
            stored = apply(stored, json.loads(encode(ops)))
            tracker.commit(ops)
            assert encode(stored) == encode(state)
            assert tracker.changes(state) == []


def transcript(length: int) -> dict[str, Any]:
    return {
        "n": 0,
        "messages": [
            {"role": "user", "content": f"m{k}", "tokens": k, "blocks": [{"text": "t"}]}
            for k in range(length)
        ],
    }


@pytest.mark.parametrize(
    ("edit", "op"),
    [
        (lambda m: m[3].update(tokens=True), ["set", ["messages", 3, "tokens"], True]),
        (lambda m: m[3].update(tokens=3.0), ["set", ["messages", 3, "tokens"], 3.0]),
        (lambda m: m[5].update(role=m[5].pop("role")), None),  # a key moved to the end
        (
            lambda m: m[7]["blocks"][0].update(text="u"),
            ["set", ["messages", 7, "blocks", 0, "text"], "u"],
        ),
        (
            lambda m: m[9]["blocks"].append({"text": "v"}),
            ["ext", ["messages", 9, "blocks"], [{"text": "v"}]],
        ),
        (lambda m: m[2].pop("tokens"), ["del", ["messages", 2, "tokens"]]),
        (lambda m: m.__setitem__(4, "not a dict"), ["set", ["messages", 4], "not a dict"]),
    ],
)
def test_an_indexed_transcript_still_sees_every_change_to_an_old_message(
    edit: Any, op: Any
) -> None:
    """A transcript long enough for an index, its old messages edited in place
    after a few commits: each edit is found exactly, and so are the next ones.
    """
    state = transcript(200)
    stored = json.loads(encode(state))
    tracker = Tracker(state)
    for k in range(3):  # the index is built and extended by these commits
        reply = {"role": "assistant", "content": f"r{k}", "tokens": 0, "blocks": []}
        state["messages"].append(reply)
        ops = tracker.changes(state)
        stored = apply(stored, json.loads(encode(ops)))
        tracker.commit(ops)
    assert id(tracker._shadow["messages"]) in tracker._indexes
    edit(state["messages"])
    ops = tracker.changes(state)
    if op is not None:
        assert ops == [op]
    stored = apply(stored, json.loads(encode(ops)))
    tracker.commit(ops)
    assert encode(stored) == encode(state)
    state["messages"][1]["tokens"] = -1  # and the index still sees the next edit
    ops = tracker.changes(state)
    assert ops == [["set", ["messages", 1, "tokens"], -1]]
    stored = apply(stored, json.loads(encode(ops)))
    assert encode(stored) == encode(state)


def test_an_edit_undone_after_its_commit_is_a_change_too() -> None:
    """An old message edited, committed, then set back to its first value (the
    very object it held) differs from the last commit: the index that knew the
    first value must not vouch for it.
    """
    state = transcript(100)
    first = state["messages"][3]["content"]
    stored = json.loads(encode(state))
    tracker = Tracker(state)
    assert tracker.changes(state) == []  # the index is built here
    for value in ("edited", first):
        state["messages"][3]["content"] = value
        ops = tracker.changes(state)
        assert ops == [["set", ["messages", 3, "content"], value]]
        stored = apply(stored, json.loads(encode(ops)))
        tracker.commit(ops)
    assert encode(stored) == encode(state)


@pytest.mark.parametrize("where", ["message", "value"])
def test_a_replaced_container_put_back_after_its_commit_is_a_change_too(where: str) -> None:
    """An old message (or a container in one) replaced, committed, then put
    back (the very object, with the leaves the index knew): a change again.
    """
    state = transcript(100)
    stored = json.loads(encode(state))
    tracker = Tracker(state)
    assert tracker.changes(state) == []  # the index is built here
    holder, key = (state["messages"], 3) if where == "message" else (state["messages"][3], "blocks")
    original = holder[key]
    for value in ("gone" if where == "message" else "none", original):
        holder[key] = value
        ops = tracker.changes(state)
        stored = apply(stored, json.loads(encode(ops)))
        tracker.commit(ops)
        assert ops
        assert encode(stored) == encode(state)


def test_an_index_goes_with_its_list() -> None:
    """Replacing or cutting an indexed list drops the indexes (none keeps an old
    list alive); an append keeps its index and extends it.
    """
    state = transcript(100)
    tracker = Tracker(state)
    assert tracker.changes(state) == []
    (index,) = tracker._indexes.values()
    state["messages"].append({"role": "assistant"})
    tracker.commit(tracker.changes(state))
    assert tracker.changes(state) == []
    assert list(tracker._indexes.values()) == [index]
    assert index.n == 101
    del state["messages"][50:]
    tracker.commit(tracker.changes(state))
    assert tracker._indexes == {}
    assert tracker.changes(state) == []  # rebuilt for the shorter list
    state["messages"] = transcript(80)["messages"]
    tracker.commit(tracker.changes(state))
    assert tracker._indexes == {}


def _python_calls(fn: Any) -> int:
    """How many Python-level calls of the change finder's own functions ``fn()`` makes."""
    import sys

    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls  # not the garbage collector's callbacks, which a long state wakes
        calls += event == "call" and frame.f_code.co_filename == _delta.__file__

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_finding_an_append_does_not_walk_the_transcript_in_python() -> None:
    """Finding an append (and an edited last message) in a transcript of 10,000
    messages costs far less than a Python call per message more than in one of
    100: the unchanged messages are compared in C, a few hundred at a time.
    """

    def calls(length: int) -> tuple[int, int]:
        state = {
            "n": 0,
            "messages": [
                {
                    "role": "user",
                    "content": f"m{k}",
                    "tokens": k,
                    "blocks": [{"type": "text", "text": "t"}],
                }
                for k in range(length)
            ],
        }
        tracker = Tracker(state)
        state["messages"].append({"role": "assistant", "content": "new"})
        state["n"] = 1
        appended = _python_calls(lambda: tracker.changes(state))
        tracker.commit(tracker.changes(state))
        state["messages"][-2]["tokens"] += 1
        edited = _python_calls(lambda: tracker.changes(state))
        return appended, edited

    short, long = calls(100), calls(10_000)
    assert long[0] - short[0] <= 10_000 // 32
    assert long[1] - short[1] <= 10_000 // 32


def test_an_edit_of_the_last_message_keeps_the_index_of_those_before_it() -> None:
    """An agent that updates its last message's own key every step keeps the
    index of the transcript (cut short of that message, not rebuilt), and the
    next edits are still found exactly.
    """
    state = transcript(100)
    stored = json.loads(encode(state))
    tracker = Tracker(state)
    assert tracker.changes(state) == []  # the index is built here
    (index,) = tracker._indexes.values()
    for k in range(3):
        state["messages"].append({"role": "assistant", "content": f"r{k}", "tokens": 0})
        state["messages"][-2]["tokens"] = -k
        ops = tracker.changes(state)
        stored = apply(stored, json.loads(encode(ops)))
        tracker.commit(ops)
        assert encode(stored) == encode(state)
        assert list(tracker._indexes.values()) == [index]
        assert index.n == len(state["messages"]) - 2
    state["messages"][-2]["tokens"] = True  # 0 -> True on a message the index re-covers
    ops = tracker.changes(state)
    assert ops == [["set", ["messages", 101, "tokens"], True]]
    stored = apply(stored, json.loads(encode(ops)))
    assert encode(stored) == encode(state)


def _containers(value: Any) -> list[Any]:
    """Every dict and list in ``value``, outermost first."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if type(item) in (dict, list):
            found.append(item)
            stack.extend(item.values() if type(item) is dict else item)
    return found


_RETYPED = {int: float, bool: int, float: lambda x: -x if x == 0 else int(x)}


@st.composite
def mutations(draw: st.DrawFn, root: Any, kept: list[Any]) -> None:
    """One in-place mutation of a random container of ``root``: appends, cuts,
    inserts, pops, reversals, retypes, reorders, deletes, and objects taken out
    earlier (``kept``) put back, possibly in two places at once.
    """
    holder = draw(st.sampled_from(_containers(root)))
    # Never an object that holds ``holder``: a cycle is not a JSON state.
    back = [v for v in kept if all(c is not holder for c in _containers(v))]
    new = draw(st.one_of(values, st.sampled_from(back) if back else values))
    kind = draw(st.integers(0, 9))
    if type(holder) is list:
        if kind < 3 or not holder:
            holder.append(new if kind else {"k": new})
            return
        at = draw(st.integers(0, len(holder) - 1))
        if kind < 5:
            kept.append(holder[at])
            holder[at] = new
        elif kind == 5:
            del holder[at:]
        elif kind == 6:
            holder.insert(at, {"k": new})
        elif kind == 7:
            holder.reverse()
        else:
            kept.append(holder.pop(at))
        return
    if kind < 3 or not holder:
        holder[draw(st.sampled_from(["k", "m", "x", "content"]))] = new
        return
    key = draw(st.sampled_from(list(holder)))
    old = holder[key]
    if kind < 5:
        kept.append(old)
        holder[key] = new
    elif kind == 5:
        holder[key] = holder.pop(key)  # the same key and value, moved to the end
    elif kind == 6:
        kept.append(holder.pop(key))
    elif type(old) in _RETYPED:
        holder[key] = _RETYPED[type(old)](old)
    else:
        holder[key] = draw(leaves)


@pytest.mark.parametrize(("index_from", "lengths"), [(1, [0, 2, 5]), (64, [63, 64, 65])])
@settings(max_examples=examples(200), deadline=None)
@given(data=st.data())
def test_a_tracker_follows_random_mutations_of_an_indexed_list(
    index_from: int, lengths: list[int], data: st.DataObject
) -> None:
    """Random in-place mutations anywhere in a state holding a list of dicts
    (or being one), commit after commit: the ops rebuild it byte for byte, are
    empty right after, and no index outlives its list in the shadow.
    """
    length = data.draw(st.sampled_from(lengths))
    messages = [{"k": i, "v": [i] if i % 2 else 0.0} for i in range(length)]
    state: Any = messages if data.draw(st.booleans()) else {"n": 1, "messages": messages}
    stored = json.loads(encode(state))
    kept: list[Any] = []
    with indexed_from(index_from):
        tracker = Tracker(state)
        for _ in range(data.draw(st.integers(1, 8))):
            for _ in range(data.draw(st.integers(1, 3))):
                data.draw(mutations(state, kept))
            ops = tracker.changes(state)
            stored = apply(stored, json.loads(encode(ops)))
            tracker.commit(ops)
            assert encode(stored) == encode(state)
            assert tracker.changes(state) == []
            shadow = {id(c) for c in _containers(tracker._shadow)}
            assert all(id(index.source) in shadow for index in tracker._indexes.values())


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(content="edited"),
        lambda m: m.update(tokens=float(m["tokens"])),  # equal, another type
        lambda m: m.update(role=m.pop("role")),  # the same keys, another order
        lambda m: m["blocks"][0].update(text="u"),  # deep inside a value the index holds
        lambda m: m.pop("blocks"),
    ],
)
def test_an_index_vouches_for_the_messages_before_an_edited_one(edit: Any) -> None:
    """A message edited in place (its keys, its values, deep inside one) ends
    what the index vouches for there, not at 0: the messages before it are not
    compared again, and the change is still found exactly.
    """
    state = transcript(100)
    stored = json.loads(encode(state))
    tracker = Tracker(state)
    assert tracker.changes(state) == []  # the index is built here
    edit(state["messages"][80])
    assert _delta._indexed(tracker._shadow["messages"], state["messages"], tracker._indexes) == 80
    ops = tracker.changes(state)
    assert ops
    assert all(op[1][:2] == ["messages", 80] for op in ops)
    stored = apply(stored, json.loads(encode(ops)))
    assert encode(stored) == encode(state)
