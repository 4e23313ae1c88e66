"""What a run's whole history costs (``durable_steps._record.history``), and reading it.

Runs the same workflow twice in one process on a counting in-memory store:
with the history log, as this version writes it, and with it switched off
(``history.add`` returning no log, as before it existed), and prints per
step the bytes of history chunks, the bytes every head write grew by, and
the PUTs added; then the cost of reading the timeline of a 10,000-step run
(requests and time). Two workloads: a tiny state (a counter: the smallest
head, where the log is the largest share), and a transcript growing by
2 KB a step (format 2's test case).

    python tests/benchmarks/bench_history.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from collections import Counter
from typing import Any
from unittest import mock

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps._record import history
from durable_steps.ui import _history


class Counting(ds.MemoryStore):
    """A memory store that counts PUTs and bytes by kind of object."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()

    def put(self, key: str, data: bytes, **kw: Any) -> Any:
        kind = "index" if key.startswith("_") else key.split("/")[2]
        self.puts[kind] += 1
        self.bytes[kind] += len(data)
        return super().put(key, data, **kw)

    def get(self, key: str) -> Any:
        self.requests["GET"] += 1
        return super().get(key)

    def list(self, prefix: str = "", **kw: Any) -> Any:
        self.requests["LIST"] += 1
        return super().list(prefix, **kw)


def counter(store: ds.Store) -> ds.Workflow:
    wf = ds.Workflow("tiny", store=store, until=lambda s: s["n"] >= s["steps"])

    @wf.step()
    def tick(state: dict[str, Any]) -> None:
        state["n"] += 1

    return wf


def transcript(store: ds.Store) -> ds.Workflow:
    wf = ds.Workflow("chat", store=store, until=lambda s: len(s["messages"]) >= s["steps"])

    @wf.step()
    def reply(state: dict[str, Any]) -> None:
        state["messages"].append({"role": "assistant", "content": "x" * 2048})

    return wf


def measure(make: Any, initial: dict[str, Any], steps: int, log: bool) -> Counting:
    store = Counting()
    off = mock.patch.object(history, "add", return_value=None)  # no log: as before it
    with contextlib.nullcontext() if log else off:
        make(store).run("r", {**copy.deepcopy(initial), "steps": steps})
    return store


def report(name: str, make: Any, initial: dict[str, Any], steps: int) -> None:
    on, off = measure(make, initial, steps, True), measure(make, initial, steps, False)
    heads = on.bytes["checkpoint"] - off.bytes["checkpoint"]
    puts = sum(on.puts.values()) - sum(off.puts.values())
    print(f"{name}, {steps} steps:")
    print(
        f"  history chunks     {on.bytes['history'] / steps:6.1f} bytes/step "
        f"({on.puts['history']} chunks)"
    )
    print(
        f"  head writes grew   {heads / steps:6.1f} bytes/step "
        f"({heads / off.bytes['checkpoint']:.1%} of the heads' bytes)"
    )
    total_on = sum(on.bytes.values())
    total_off = sum(off.bytes.values())
    print(f"  bytes written      {total_on / total_off:6.3f}x without the log")
    print(
        f"  PUTs               {sum(on.puts.values()) / steps:6.3f}/step "
        f"(+{puts / steps:.3f}; without the log {sum(off.puts.values()) / steps:.3f})"
    )


def reading(steps: int) -> None:
    store = Counting()
    counter(store).run("r", {"n": 0, "steps": steps})
    found = store.get(ckpt.checkpoint_key("tiny", "r"))
    assert found is not None
    header, _ = ckpt.decode(found[0], where="bench")
    store.requests.clear()
    _history._cache.clear()
    started = time.perf_counter()
    kept = _history.read(store, header)
    assert kept is not None
    page = kept.entries(kept.total - 200, kept.total)  # the last page of the timeline
    cold = time.perf_counter() - started
    asked = dict(store.requests)
    store.requests.clear()
    started = time.perf_counter()
    again = _history.read(store, header)
    assert again is not None
    again.entries(0, 200)
    warm = time.perf_counter() - started
    print(
        f"reading a page of the timeline of a {steps}-step run ({kept.total} entries kept, "
        f"{len(page)} shown): "
        f"{asked} in {cold * 1000:.0f} ms; again (chunks cached) {dict(store.requests)} "
        f"in {warm * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    report("a counter (the smallest head)", counter, {"n": 0}, args.steps)
    report("a transcript growing 2 KB a step", transcript, {"messages": []}, min(args.steps, 600))
    reading(10_000)


if __name__ == "__main__":
    main()
