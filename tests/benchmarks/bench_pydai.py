"""The ``pydai`` section of ``bench.py``: a long conversation through DurableAgent.

Issue 26's shape: a support agent, each turn one user prompt, two model
requests (the first asks for a tool, the second answers) and one tool call,
on a scripted ``FunctionModel`` (no network: what is timed is pydantic-ai
and durable_steps). Each turn's messages are distinct and ~1 KB. Three loops
of the same turns on the same storage:

plain
    pydantic-ai alone: ``agent.run_sync(prompt, message_history=history)``,
    the history the previous turn's ``all_messages()``.
durable
    one step per turn, ``DurableAgent.run_sync(prompt, ctx=ctx, state=state)``
    keeping the conversation in the state: three journaled calls a turn
    (three more writes than a bare step).
bare step
    a workflow whose step only appends a ~1 KB message: what durable_steps
    costs per step without any agent.

The plain and durable turns run in lockstep (each step makes the plain
turn, then the durable one), so both see the same load on a shared machine;
a durable turn is timed from its start to the next step's start, less that
step's plain turn (its commit included). Early is the median of the first 50
turns, late of the last 50. Targets (issue 26): durable ≤ 1.10 x (plain +
bare step) over all turns; flat: durable's late/early over plain's
late/early ≤ 1.3; bytes written per turn proportional to the turn's new
messages (late/early about 1). Beside the
first ratio, ``durable/(plain+4xbare)`` counts one bare step's cost for
each of a turn's four writes (each journaled call is one, as DESIGN.md
says): what durable_steps adds beyond the writes that make each call
durable.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import durable_steps as ds

TURNS = {"normal": 200, "quick": 100}
EDGE = 50  # turns in "early" and "late"
SPEED_TARGET, FLAT_TARGET = 1.10, 1.3
WRITES = 4  # a turn's writes: model request, tool call, model request, commit


def _agent() -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        n = sum(isinstance(m, ModelResponse) for m in messages)
        if last.parts[-1].part_kind == "user-prompt":
            args = {"order": n, "note": f"{n:05d} " + "a" * 120}
            return ModelResponse(parts=[ToolCallPart("lookup", args, tool_call_id=f"c{n}")])
        return ModelResponse(parts=[TextPart(f"{n:05d} " + "r" * 300)])

    agent = Agent(FunctionModel(model))

    @agent.tool_plain
    def lookup(order: int, note: str) -> dict[str, Any]:
        return {"order": order, "status": "shipped", "log": note + "l" * 150}

    return agent


def _prompt(turn: int) -> str:
    return f"{turn:05d} " + "q" * 200


def _lockstep(store: Any, turns: int) -> tuple[list[float], list[float], list[int]]:
    """Plain and durable turns in lockstep: (plain seconds, durable seconds, bytes).

    Each step first makes the plain agent's turn (on its own history, timed
    apart), then the durable one; a durable turn is from the end of the
    plain turn to the next step's start (its commit included). Interleaving
    turn by turn exposes both to the same load on a shared machine.
    """
    from durable_steps.integrations.pydantic_ai import DurableAgent

    plain_agent, durable = _agent(), DurableAgent(_agent())
    history: list[Any] = []
    wf = ds.Workflow("bench-pydai", store=store, until=lambda s: s["turn"] >= turns)
    plain: list[float] = []
    starts: list[float] = []
    written: list[int] = []

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        nonlocal history
        began = time.perf_counter()
        answered = plain_agent.run_sync(_prompt(state["turn"]), message_history=history)
        history = answered.all_messages()
        plain.append(time.perf_counter() - began)
        starts.append(time.perf_counter())
        written.append(store.bytes_written())
        durable.run_sync(_prompt(state["turn"]), ctx=ctx, state=state)
        state["turn"] += 1

    wf.run(f"pydai-{uuid.uuid4().hex[:8]}", {"turn": 0})
    ends = [*(s - p for s, p in zip(starts[1:], plain[1:])), time.perf_counter()]
    written.append(store.bytes_written())
    durable_times = [e - s for s, e in zip(starts, ends)]
    return plain, durable_times, [b - a for a, b in pairwise(written)]


def _bare(store: Any, turns: int) -> list[float]:
    wf = ds.Workflow("bench-bare", store=store, until=lambda s: s["turn"] >= turns)
    starts: list[float] = []

    @wf.step()
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        starts.append(time.perf_counter())
        state["messages"].append(f"{state['turn']:05d} " + "m" * 1000)
        state["turn"] += 1

    wf.run(f"bare-{uuid.uuid4().hex[:8]}", {"turn": 0, "messages": []})
    starts.append(time.perf_counter())
    return [b - a for a, b in pairwise(starts)]


def _new_message_bytes() -> int:
    """JSON bytes of one turn's four new messages (as the state keeps them)."""
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    agent = _agent()
    first = agent.run_sync(_prompt(0)).all_messages()
    return len(ModelMessagesTypeAdapter.dump_json(first))


def bench_pydai(
    backends: list[Any],
    mode: str,
    *,
    counting: Callable[[Any], Any],
    table: Callable[..., str],
    human: Callable[[float], str],
) -> tuple[list[dict], str]:
    """Per-turn time and bytes of a long DurableAgent conversation, per backend."""
    turns = TURNS[mode]
    edge = min(EDGE, turns // 4)
    med = statistics.median
    per_turn_new = _new_message_bytes()
    results, rows = [], []
    for b in backends:
        bare = med(_bare(counting(b.store), turns))
        plain, times, written = _lockstep(counting(b.store), turns)
        p_all, p_early, p_late = med(plain), med(plain[:edge]), med(plain[-edge:])
        d_all, d_early, d_late = med(times), med(times[:edge]), med(times[-edge:])
        speed = d_all / (p_all + bare)
        # A turn writes four times (three journaled calls and the commit): each a bare step's
        # write, which no keeping of the history can save. What is left is ours.
        beyond_writes = d_all / (p_all + WRITES * bare)
        flat = (d_late / d_early) / (p_late / p_early)
        bytes_early, bytes_late = med(written[:edge]), med(written[-edge:])
        result = {
            "store": b.name,
            "turns": turns,
            "plain_ms": [p_early * 1e3, p_late * 1e3, p_all * 1e3],
            "durable_ms": [d_early * 1e3, d_late * 1e3, d_all * 1e3],
            "bare_step_ms": bare * 1e3,
            "speed_ratio": speed,
            "speed_pass": speed <= SPEED_TARGET,
            "speed_ratio_per_write": beyond_writes,
            "flat_ratio": flat,
            "flat_pass": flat <= FLAT_TARGET,
            "bytes_per_turn": [bytes_early, bytes_late],
            "new_message_bytes": per_turn_new,
        }
        results.append(result)
        rows.append(
            [
                b.name,
                f"{p_early * 1e3:.1f} / {p_late * 1e3:.1f}",
                f"{bare * 1e3:.1f}",
                f"{d_early * 1e3:.1f} / {d_late * 1e3:.1f}",
                f"{speed:.2f} {'PASS' if speed <= SPEED_TARGET else 'MISS'}",
                f"{beyond_writes:.2f}",
                f"{flat:.2f} {'PASS' if flat <= FLAT_TARGET else 'MISS'}",
                f"{human(bytes_early)} / {human(bytes_late)}",
                f"{bytes_late / per_turn_new:.1f}x",
            ]
        )
    text = table(
        f"pydai: a {turns}-turn DurableAgent conversation (2 requests + 1 tool call a turn)",
        [
            "store",
            "plain ms early/late",
            "bare step ms",
            "durable ms early/late",
            f"durable/(plain+bare) <={SPEED_TARGET}",
            f"durable/(plain+{WRITES}xbare)",
            f"growth over plain's <={FLAT_TARGET}",
            "bytes/turn early/late",
            "late/new msgs",
        ],
        rows,
        f"Medians of the first and last {edge} turns (plain and durable in lockstep); the "
        "speed ratios over all turns. "
        f"A turn's new messages\nare {human(per_turn_new)} of JSON; bytes per turn are what the "
        "store was sent (journal records and\nthe commit's change), proportional to them when "
        "early and late agree.",
    )
    return results, text
