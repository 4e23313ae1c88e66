"""The change finder: ops that rebuild the live state exactly, byte for byte."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from durable_steps._delta import Tracker, apply, diff, snapshot

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


@settings(max_examples=300)
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
