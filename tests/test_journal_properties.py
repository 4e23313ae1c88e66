"""Property test of journaled calls: random steps, random calls, random crashes.

In-process and fast, like ``tests/test_properties.py``: a
:class:`~durable_steps.MemoryStore`, wrapped in a
:class:`~durable_steps.testing.CrashingStore` (a ``SimulatedCrash`` right
before or after the N-th write of an attempt), plus faults inside a call's
fn (a ``Crash`` — a BaseException, as a kill ends the step — after its side
effect, or an ordinary exception a retry catches) and in the step between
two calls. Hypothesis draws 1 to 3 steps, each making 1 to 5 calls and
effects in a fixed order, which steps retry, 1 to 3 passes, sync or async,
and one fault per attempt; the run is resumed until it completes.

Every fn returns a value no other invocation returns, so a replay is told
apart from a second call. The "world" records, in order, every invocation
(with its key) and every value a step received.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.testing import CrashingStore, SimulatedCrash
from tests.budget import examples

RUN = "r1"
FN_FAULTS = ("crash_in_fn", "fail_in_fn")
Op = tuple[str, str]  # (kind, name): ("call", "c0"), ("effect", "e1")
Where = tuple[int, str, str]  # (pass, step, name): what one journal entry is for


class Crash(BaseException):
    """Ends a step like a kill: not an Exception, so nothing catches it."""


@dataclass(frozen=True)
class Spec:
    """A workflow: each step's calls, which steps retry, passes, the driver."""

    ops: tuple[tuple[Op, ...], ...]
    retry: tuple[bool, ...]
    passes: int
    use_async: bool

    def writes(self) -> int:
        """Head writes of an uncrashed run: create, then per step a record per
        call, intent and record per effect, and the commit."""
        per_pass = sum(1 + sum(1 if k == "call" else 2 for k, _ in ops) for ops in self.ops)
        return 1 + self.passes * per_pass

    def calls(self) -> int:
        """Fn invocations of an uncrashed run."""
        return self.passes * sum(len(ops) for ops in self.ops)


@dataclass
class World:
    """What really happened across every attempt, in order."""

    attempt: int = 0
    fault: tuple[str, int] | None = None
    invoked: int = 0  # fn invocations in this attempt
    returned: int = 0  # calls returned to a step in this attempt
    seq: itertools.count[int] = field(default_factory=itertools.count)
    # ("inv", where, key, value) for every fn invocation that got as far as its
    # side effect; ("got", where, None, value) for every value a step received.
    log: list[tuple[str, Where, str | None, Any]] = field(default_factory=list)

    def start(self, attempt: int, fault: tuple[str, int] | None) -> None:
        self.attempt, self.fault, self.invoked, self.returned = attempt, fault, 0, 0


def build(spec: Spec, world: World, store: ds.Store) -> ds.Workflow:
    """The workflow of ``spec``, recording into ``world``."""

    def invoke(where: Where, idempotency_key: str | None = None) -> dict[str, Any]:
        key = idempotency_key
        world.invoked += 1
        fault = world.fault
        if fault == ("fail_in_fn", world.invoked):
            raise TimeoutError("a flaky tool")  # before any side effect
        value = {"where": list(where), "n": next(world.seq)}  # unique: a replay is visible
        world.log.append(("inv", where, key, value))
        if fault == ("crash_in_fn", world.invoked):
            raise Crash  # after the side effect, before the result is recorded
        return value

    def received(state: dict[str, Any], where: Where, value: Any) -> None:
        world.log.append(("got", where, None, value))
        state["got"].append(value)
        world.returned += 1
        if world.fault == ("crash_between", world.returned):
            raise Crash

    def make(index: int) -> ds.Step[..., Any]:
        name = f"s{index}"
        ops = spec.ops[index]
        if spec.use_async:

            async def afn(state: dict[str, Any], ctx: ds.Context) -> None:
                for kind, op in ops:
                    where = (ctx.iteration, name, op)
                    if kind == "call":

                        async def acall(w: Where = where) -> Any:
                            return invoke(w, None)

                        value = await ctx.acall(op, acall)
                    else:

                        async def aeffect(idempotency_key: str, w: Where = where) -> Any:
                            return invoke(w, idempotency_key)

                        value = await ctx.aeffect(op, aeffect)
                    received(state, where, value)
                state["passes"] += index == len(spec.ops) - 1

            fn: Any = afn
        else:

            def fn(state: dict[str, Any], ctx: ds.Context) -> None:
                for kind, op in ops:
                    where = (ctx.iteration, name, op)
                    if kind == "call":
                        value = ctx.call(op, invoke, where)
                    else:
                        value = ctx.effect(op, invoke, where)
                    received(state, where, value)
                state["passes"] += index == len(spec.ops) - 1

        retry = ds.Retry(attempts=3, wait=0, on=TimeoutError) if spec.retry[index] else None
        made: ds.Step[..., Any] = ds.step(fn, name=name, retry=retry)
        return made

    return ds.Workflow(
        "jprop",
        steps=[make(i) for i in range(len(spec.ops))],
        store=store,
        until=lambda s: s["passes"] >= spec.passes,
    )


def run(spec: Spec, wf: ds.Workflow, run_id: str) -> Any:
    """Run with the driver the spec picked."""
    initial = {"passes": 0, "got": []}
    if spec.use_async:
        return asyncio.run(wf.arun(run_id, initial))
    return wf.run(run_id, initial)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Spec, list[tuple[str, int]]]:
    n = draw(st.integers(1, 3))
    ops = []
    for _ in range(n):
        kinds = draw(st.lists(st.sampled_from(("call", "effect")), min_size=1, max_size=5))
        ops.append(tuple((k, f"{k[0]}{j}") for j, k in enumerate(kinds)))
    retry = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    spec = Spec(tuple(ops), retry, draw(st.integers(1, 3)), draw(st.booleans()))
    fault = st.one_of(
        st.tuples(st.sampled_from(("before_write", "after_write")), st.integers(1, spec.writes())),
        st.tuples(st.sampled_from((*FN_FAULTS, "crash_between")), st.integers(1, spec.calls())),
    )
    return spec, draw(st.lists(fault, min_size=1, max_size=4))


def note(what: str) -> None:
    """A Hypothesis event (see --hypothesis-show-statistics), when under Hypothesis."""
    if currently_in_test_context():
        event(what)


def header_of(store: ds.Store, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key("jprop", run_id))
    assert found is not None
    return ckpt.decode(found[0], where=run_id)[0]


def crash_and_resume(spec: Spec, faults: list[tuple[str, int]]) -> None:
    """Run ``spec`` with one fault per attempt until it completes; check the journal."""
    store = ds.MemoryStore()
    world = World()
    final = None
    for attempt in range(1, len(faults) + 3):
        fault = faults[attempt - 1] if attempt <= len(faults) else None
        writes = fault if fault and fault[0].endswith("_write") else None
        world.start(attempt, None if writes else fault)
        crashing = CrashingStore(
            store,
            before_write=writes[1] if writes and writes[0] == "before_write" else None,
            after_write=writes[1] if writes and writes[0] == "after_write" else None,
        )
        try:
            final = run(spec, build(spec, world, crashing), RUN)
        except (Crash, SimulatedCrash) as exc:
            note(f"crashed: {type(exc).__name__}")
            continue
        except ds.StepFailed as exc:
            note("a step failed")
            cause = exc.__cause__
        else:
            break
        assert isinstance(cause, TimeoutError)  # only a flaky tool in a step without retries
    else:
        raise AssertionError("the run did not complete once the faults ran out")

    header = header_of(store, RUN)
    assert header.status == "completed"
    assert header.journal is None  # the commits cleared every journal

    invoked: dict[Where, list[tuple[str | None, Any]]] = defaultdict(list)
    got: dict[Where, list[Any]] = defaultdict(list)
    for what, where, key, value in world.log:
        if what == "inv":
            # A finished call never runs again: nothing after its first result.
            assert where not in got, f"{where} ran again after its result was recorded"
            invoked[where].append((key, value))
        else:
            got[where].append(value)
    everything = {
        (it, f"s{i}", op)
        for it in range(spec.passes)
        for i, ops in enumerate(spec.ops)
        for _, op in ops
    }
    assert set(got) == everything
    for where, values in got.items():
        # Replayed results equal the first result, which is the last value its fn
        # produced (an earlier one was lost with its attempt, never returned).
        assert all(v == values[0] for v in values), (where, values)
        assert values[0] == invoked[where][-1][1]
    # The committed state holds exactly the recorded results, in call order.
    expected = [
        got[(it, f"s{i}", op)][0]
        for it in range(spec.passes)
        for i, ops in enumerate(spec.ops)
        for _, op in ops
    ]
    assert final is not None
    assert final["got"] == expected

    # Keys: one per (pass, step, name) on every invocation, distinct, and
    # derived from the run alone (stable across processes and retries).
    keys: dict[Where, set[str | None]] = {w: {k for k, _ in inv} for w, inv in invoked.items()}
    effects = {
        (it, f"s{i}", op)
        for it in range(spec.passes)
        for i, ops in enumerate(spec.ops)
        for kind, op in ops
        if kind == "effect"
    }
    for where, found in keys.items():
        if where in effects:
            assert found == {ckpt.effect_key(header.run_nonce, *where)}, (where, found)
        else:
            assert found == {None}
    one = [next(iter(keys[w])) for w in effects]
    assert len(set(one)) == len(one)

    if any(len(inv) > 1 for inv in invoked.values()):
        note("a call ran twice (its record had not landed)")
    if any(len(v) > 1 for v in got.values()):
        note("a result was replayed")

    # A further run returns the final state and calls nothing.
    before = len(world.log)
    world.start(0, None)
    assert run(spec, build(spec, world, store), RUN) == final
    assert len(world.log) == before


@settings(deadline=None, max_examples=examples(150))
@given(scenarios())
def test_random_calls_and_crashes_replay_first_results_under_stable_keys(
    scenario: tuple[Spec, list[tuple[str, int]]],
) -> None:
    """Random calls, effects and crashes: replays equal first results; keys stable, distinct."""
    crash_and_resume(*scenario)
