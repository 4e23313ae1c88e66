"""Format 2's memory: a big state is held encoded once while it is checkpointed."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import format2 as f2

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=4), inner, max_size=5)
    ),
    max_leaves=40,
)


@given(values)
def test_a_base_part_holds_the_serializers_own_encoding(state: Any) -> None:
    """A base part's payload, encoded a value at a time, is byte for byte what
    the JSON serializer writes for the whole state.
    """
    serializer = ds.JSONSerializer()
    parts = f2.Parts(serializer, "wf", "r", None)
    header = ckpt.Checkpoint(workflow="wf", run_id="r", steps=("s",), serializer="json")
    line = parts.line(header, "base")
    data = parts.base(header, state)
    assert data[: len(line)] == line
    assert data[len(line) :] == serializer.dumps(state)


def test_checkpointing_a_big_state_holds_it_encoded_at_most_twice(tmp_path: Path) -> None:
    """Creating a run with a 4 MB state and committing steps allocates at most
    2x the encoded state at once (the issue 11 target; it was 3.3x).
    """
    state: dict[str, Any] = {
        "i": 0,
        "messages": [{"role": "user", "content": f"{k:07d} " + "x" * 950} for k in range(4000)],
    }
    encoded = len(json.dumps(state, separators=(",", ":")).encode())
    wf = ds.Workflow("mem", store=ds.LocalStore(tmp_path), until=lambda s: s["i"] >= 3)

    @wf.step()
    def work(s: dict[str, Any]) -> None:
        s["i"] += 1

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        wf.run("r", state)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak <= 2.0 * encoded, f"peak {peak / encoded:.2f}x the encoded state"
