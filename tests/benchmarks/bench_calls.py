"""The ``calls`` section of ``bench.py``: what a journaled call costs.

A turn of an agent loop is one step that appends a ~200 B message to the
state; the same loop is run three more ways, each turn also making K
journaled calls whose results are ~200 B replies: ``ctx.call`` (K = 10),
``ctx.effect`` (K = 10), and ``ctx.call`` with K = 200 in fewer turns (a step
making many calls: bytes per call must stay bounded, not grow with the
journal). Requests and bytes are counted at the store (``bench.CountingStore``:
one store call is one request on S3), the run's create left out; per call is
the run's total minus the plain loop's for the same turns, over the number
of calls; time is wall time (the create included), the same subtraction,
median of rounds.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import durable_steps as ds

REPLY = "r" * 200
SHAPES = (  # (label, kind, calls per turn, turns)
    ("step, no calls", None, 0, 10),
    ("ctx.call", "call", 10, 10),
    ("ctx.effect", "effect", 10, 10),
    ("ctx.call, 200 per step", "call", 200, 2),
)


def _workflow(store: Any, kind: str | None, per_turn: int, turns: int) -> ds.Workflow:
    wf = ds.Workflow("bench-calls", store=store, until=lambda s: s["turn"] >= turns)

    def reply(i: int, idempotency_key: str | None = None) -> dict[str, Any]:
        return {"content": REPLY, "i": i}

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        for i in range(per_turn):
            make = ctx.call if kind == "call" else ctx.effect
            state["last"] = make(f"{kind}:{i}", reply, i)["i"]
        state["messages"].append(f"{ctx.iteration:04d} " + "m" * 195)
        state["turn"] += 1

    return wf


def _measure(backend: Any, counting: Callable[[Any], Any], shape: tuple, rounds: int) -> dict:
    """Totals of one shape on one backend: requests, bytes written, median seconds."""
    label, kind, per_turn, turns = shape
    seconds, calls, written, created = [], None, 0, 0
    for _ in range(rounds):
        store = counting(backend.store)
        wf = _workflow(store, kind, per_turn, turns)
        began = time.perf_counter()
        wf.run(f"calls-{uuid.uuid4().hex[:8]}", {"turn": 0, "messages": []})
        seconds.append(time.perf_counter() - began)
        calls, written = store.calls, store.bytes_written()
        created = store.writes[0][1]
    assert calls is not None
    # The run's create (one GET finding nothing, one PUT) is no step's cost.
    calls = calls - Counter(get=1, put=1)
    return {
        "store": backend.name,
        "shape": label,
        "kind": kind,
        "calls_per_step": per_turn,
        "steps": turns,
        "requests": dict(calls),
        "bytes": written - created,
        "seconds": statistics.median(seconds),
    }


def bench_calls(
    backends: list[Any],
    mode: str,
    *,
    counting: Callable[[Any], Any],
    table: Callable[..., str],
    human: Callable[[float], str],
    us: Callable[[float], str],
) -> tuple[list[dict], str]:
    """Cost per ``ctx.call`` / ``ctx.effect`` next to the cost per step, per backend."""
    rounds = 2 if mode == "quick" else 3
    results, rows = [], []
    for b in backends:
        measured = [_measure(b, counting, shape, rounds) for shape in SHAPES]
        plain = measured[0]
        per_step = {k: v / plain["steps"] for k, v in plain["requests"].items()}
        step_bytes, step_s = plain["bytes"] / plain["steps"], plain["seconds"] / plain["steps"]
        for m in measured:
            if m["kind"] is None:
                puts, gets = per_step.get("put", 0), per_step.get("get", 0)
                size, secs, unit = step_bytes, step_s, "per step"
            else:
                # Subtract the plain loop's turns: what is left is the calls' own cost.
                n = m["calls_per_step"] * m["steps"]
                base = m["steps"]
                puts = (m["requests"].get("put", 0) - per_step.get("put", 0) * base) / n
                gets = (m["requests"].get("get", 0) - per_step.get("get", 0) * base) / n
                size = (m["bytes"] - step_bytes * base) / n
                secs = (m["seconds"] - step_s * base) / n
                unit = "per call"
            m.update(per_unit={"puts": puts, "gets": gets, "bytes": size, "seconds": secs})
            results.append(m)
            rows.append(
                [
                    b.name,
                    m["shape"],
                    f"{m['steps']}x{m['calls_per_step']}",
                    unit,
                    f"{puts:.2f}",
                    f"{gets:.2f}",
                    human(size),
                    us(secs),
                ]
            )
    text = table(
        "Calls: cost per ctx.call / ctx.effect next to the cost per step",
        ["store", "what", "steps x calls", "unit", "PUT", "GET", "bytes written", "time"],
        rows,
        "Per call: the run's store requests, bytes and wall time minus the plain loop's "
        "(one step per turn,\na ~200 B message per turn) for the same turns, over the calls "
        f"made; each result a ~200 B reply.\nMedian time of {rounds} rounds; requests are "
        "store calls (one HTTP request each on S3), the run's create\n(1 GET, 1 PUT) left out.",
    )
    return results, text
