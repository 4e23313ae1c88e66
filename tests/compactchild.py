"""A child process whose agent compacts its transcript, and SIGKILLs itself on cue.

Run it by path::

    python tests/compactchild.py --store URL --run RUN_ID [--crash BOUNDARY:STEP:ITER]

The workflow ``compact`` (pickle) has one step, ``turn``, looped for
:data:`PASSES` passes: passes 1-25 append a 2 KB message (a 50 KB transcript),
each reply a journaled call (``ctx.call``), pass 26 compacts it to a 4.4 KB
summary, the passes after it change a note in place. ``--crash`` is
:mod:`crashchild`'s (``before-commit:turn:25`` dies just before the compaction's
commit lands), and ``inside:turn:25`` dies in the compaction's
step once its summary is recorded). On success it prints, as JSON, the
final state and the bytes the run's checkpoint takes in the store (its head
and every part it lists), and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crashchild import KillingStore, die, parse_crash

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt

PASSES = 30
COMPACT_AT = 26


def build_workflow(store: ds.Store, crash: tuple[str, str, int] | None = None) -> ds.Workflow:
    """The compacting agent (pickle, so the finder is the pickle one)."""
    wf = ds.Workflow("compact", store=store, serializer="pickle", until=lambda s: s["i"] >= PASSES)

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        state["i"] += 1
        if state["i"] < COMPACT_AT:  # the model's reply, recorded, then appended
            reply = ctx.call("model", lambda i: f"{i:04d}" + "m" * 2000, state["i"])
            state["messages"].append(reply)
        elif state["i"] == COMPACT_AT:  # the model's summary, recorded, replaces them
            summary = ctx.call("summarize", lambda n: "summary " * n, 550)  # 4.4 KB
            if crash == ("inside", "turn", ctx.iteration):
                die()
            state["messages"] = [summary]
        else:
            state["note"] = f"pass {state['i']}"

    return wf


def stored_size(store: ds.Store, run_id: str) -> int:
    """The bytes of the run's head and of every part it lists."""
    found = store.get(ckpt.checkpoint_key("compact", run_id))
    assert found is not None
    header, _ = ckpt.decode(found[0], where="compactchild")
    return len(found[0]) + sum(p["size"] for p in header.parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--crash")
    args = parser.parse_args()
    store = ds.open_store(args.store)
    crash = parse_crash(args.crash)
    wf = build_workflow(KillingStore(store, crash), crash)
    final = wf.run(args.run, {"i": 0, "messages": [], "note": ""})
    print(json.dumps({"state": final, "size": stored_size(store, args.run)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
