"""What the web page reads, without a browser: the list's cost beside many finished runs,
and a pickle state shown as an outline without running any of it.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the ui extra is not installed")

import durable_steps as ds
from durable_steps._drivers import drive_sync
from durable_steps._fleet import index as _index
from durable_steps._record import checkpoint as ckpt
from durable_steps.ui import _detail, _listing

pytestmark = pytest.mark.ui


class Counting(ds.MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def get(self, key: str) -> Any:
        self.calls["get"] += 1
        return super().get(key)

    def list(self, prefix: str = "", **kw: Any) -> Any:
        self.calls["list"] += 1
        return super().list(prefix, **kw)


def finished(store: ds.Store, count: int, start: int) -> None:
    """``count`` completed runs, written as this version leaves them (head and done entry)."""
    now = time.time()
    for i in range(start, start + count):
        header = ckpt.Checkpoint(
            "desk",
            f"done-{i:05d}",
            ("ask",),
            "json",
            status="completed",
            next_step=1,
            committed=1,
            created_at=now - 9000 + i,
            updated_at=now - 8000 + i,
        )
        store.put(ckpt.checkpoint_key("desk", header.run_id), ckpt.encode(header, b"{}"))
        drive_sync(_index.moved(None, header), store)


def test_the_list_reads_the_live_runs_and_one_page_however_many_finished() -> None:
    """Beside 3 live runs, 100 or 1,100 finished ones: the list (and a live status
    filter) reads the same heads either way; the count of finished runs stops at 1000+."""
    store = Counting()
    wf = ds.Workflow("desk", store=store)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["answer"] = ctx.wait_for("answer")

    for i in range(3):
        with pytest.raises(ds.RunSuspended):
            wf.run(f"live-{i}", {})
    reads = []
    for more in (100, 1000):
        finished(store, more, len(reads) * 100)
        store.calls.clear()
        listing = _listing.list_runs(store, limit=10)
        assert [r.status for r in listing.rows[:3]] == ["waiting"] * 3
        assert len(listing.rows) == 10
        assert listing.more
        waiting = _listing.list_runs(store, status="waiting")
        assert len(waiting.rows) == 3
        reads.append(store.calls["get"])
    assert reads[0] == reads[1]
    assert listing.counts == {"waiting": "3", "completed": "1000+"}
    found = _listing.list_runs(store, query="done-00042")
    assert [r.run_id for r in found.rows] == ["done-00042"]


class Planted:
    """An object whose unpickling would leave a file: proof that nothing was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.path).touch, ())


def test_a_pickle_state_is_an_outline_unless_unsafe_unpickle(tmp_path: Path) -> None:
    """Without --unsafe-unpickle the page names what unpickling would import and runs
    none of it; with it, the state is decoded."""
    marker = tmp_path / "unpickled"
    store = ds.MemoryStore()
    wf = ds.Workflow("pick", store=store, serializer="pickle")

    @wf.step()
    def keep(state: dict[str, Any]) -> None:
        state["planted"] = Planted(str(marker))

    wf.run("p", {"n": 1})
    marker.unlink(missing_ok=True)  # whatever the run itself did
    shown = _detail.run_page(store, "pick", "p")
    assert shown.tree is None
    assert shown.state is not None
    assert shown.state.outline is not None
    assert any("pathlib" in name for name, _ in shown.state.outline["imports"])
    assert "--unsafe-unpickle" in (shown.state.problem or "")
    assert not marker.exists()
    decoded = _detail.run_page(store, "pick", "p", unsafe=True)
    assert decoded.tree is not None
    assert marker.exists()


def test_the_outline_names_what_a_pickle_imports_however_it_is_hidden() -> None:
    """INST is counted; STACK_GLOBAL's operands are taken from the simulated stack and
    memo, not from the last strings seen; a signed pickle's tag is skipped; what cannot
    be read says "unknown" instead of an empty list. Nothing here is unpickled."""
    from durable_steps.ui._state import outline

    inst = b"(S'echo hi'\nios\nsystem\n."
    assert outline([inst])["imports"] == [("os.system", 1)]

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    decoy = (
        b"\x80\x04"
        + text("os") + b"\x94" + b"0"
        + text("system") + b"\x94" + b"0"
        + text("collections") + text("OrderedDict") + b"00"
        + b"h\x00h\x01\x93."
    )  # fmt: skip
    got = outline([decoy])
    assert got["imports"] == [("os.system", 1)]
    assert not got["unknown"]
    signed = outline([b"t" * 32 + inst.replace(b"(S", b"\x80\x02(S")], signed=True)
    assert signed["imports"] == [("os.system", 1)]
    assert outline([b"\x80\x04h\x07h\x08\x93."])["unknown"]  # operands nobody put there
    assert outline([b"\x80\x04\xff garbage"])["unknown"]
