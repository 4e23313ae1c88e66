"""Property tests: any workflow, crashed anywhere, any number of times, ends right.

In-process and fast: a :class:`~durable_steps.MemoryStore` wrapped in
:class:`~durable_steps.testing.CrashingStore` (a ``SimulatedCrash`` right
before or right after the N-th write of an attempt), plus faults inside steps
(a ``SimulatedCrash`` after the side effect, or an exception before or after
it). Hypothesis draws the workflow — 1 to 5 steps, which of them are
idempotent, which retry, each non-idempotent step's in-doubt policy
(re-fire, reconcile, or raise-and-resolve), 1 to 4 passes via ``until`` —
and a list of faults, one per attempt. The run is resumed until it completes.

The "world" records what really happened: every step execution and every
firing of a non-idempotent step with its key (the external API's ledger).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.testing import CrashingStore, SimulatedCrash
from tests.budget import examples

RUN = "r1"
WRITE_FAULTS = ("before_write", "after_write")
STEP_FAULTS = ("crash_inside", "fail_before", "fail_after")


@dataclass(frozen=True)
class Spec:
    """A workflow: per-step flags, passes, and the driver."""

    idempotent: tuple[bool, ...]
    retry: tuple[bool, ...]
    policy: tuple[str, ...]  # "refire" | "reconcile" | "raise"; "-" for idempotent steps
    passes: int
    use_async: bool
    delete: bool = False  # on_complete="delete" instead of the terminal marker

    @property
    def n(self) -> int:
        return len(self.idempotent)

    @property
    def total(self) -> int:
        """Step executions in an uncrashed run."""
        return self.passes * self.n

    def pos(self, index: int, iteration: int) -> int:
        """Position of (step, pass) in the run's order of execution."""
        return iteration * self.n + index


@dataclass
class World:
    """What really happened, across every attempt (process lifetime)."""

    spec: Spec
    attempt: int = 0
    calls: int = 0  # step calls in the current attempt
    fault: tuple[str, int] | None = None  # a step fault for the current attempt
    triggered: tuple[str, int] | None = None  # (fault kind, step index) once it fired
    # (attempt, index, iteration, ctx.in_doubt) of every step call
    execs: list[tuple[int, int, int, bool]] = field(default_factory=list)
    ledger: list[tuple[int, int, str]] = field(default_factory=list)  # (index, iteration, key)
    reconciled: list[tuple[int, int, int]] = field(default_factory=list)

    def start_attempt(self, attempt: int, fault: tuple[str, int] | None) -> None:
        self.attempt, self.calls, self.fault, self.triggered = attempt, 0, fault, None


def effect(spec: Spec, state: dict[str, Any], index: int, iteration: int) -> None:
    """What step ``index`` does to the state (reconcile does the same)."""
    state["trail"].append(f"{index}:{iteration}")
    if index == spec.n - 1:
        state["passes"] += 1


def build(spec: Spec, world: World, store: ds.Store) -> ds.Workflow:
    """The workflow of ``spec``, recording into ``world``."""

    def body(index: int, state: dict[str, Any], ctx: ds.Context) -> None:
        world.calls += 1
        world.execs.append((world.attempt, index, ctx.iteration, ctx.in_doubt))
        kind = None
        if world.fault is not None and world.fault[1] == world.calls:
            kind = world.fault[0]
            world.triggered = (kind, index)
            state["trail"].append("partial")  # an in-place change a retry must not see
        if kind == "fail_before":
            raise RuntimeError("failed before the side effect")
        if not spec.idempotent[index]:
            world.ledger.append((index, ctx.iteration, ctx.idempotency_key))
        effect(spec, state, index, ctx.iteration)
        if kind == "fail_after":
            raise RuntimeError("failed after the side effect")
        if kind == "crash_inside":
            raise SimulatedCrash("process died inside the step")

    def reconcile_body(index: int, state: dict[str, Any], ctx: ds.Context) -> bool:
        world.reconciled.append((world.attempt, index, ctx.iteration))
        fired = (index, ctx.iteration, ctx.idempotency_key) in world.ledger
        if fired:
            effect(spec, state, index, ctx.iteration)
        return fired

    def make(index: int) -> ds.Step[..., Any]:
        if spec.use_async:

            async def afn(state: dict[str, Any], ctx: ds.Context) -> None:
                body(index, state, ctx)

            async def areconcile(state: dict[str, Any], ctx: ds.Context) -> bool:
                return reconcile_body(index, state, ctx)

            fn: Any = afn
            rec: Any = areconcile
        else:

            def fn(state: dict[str, Any], ctx: ds.Context) -> None:
                body(index, state, ctx)

            def rec(state: dict[str, Any], ctx: ds.Context) -> bool:
                return reconcile_body(index, state, ctx)

        policy = spec.policy[index]
        return ds.step(
            fn,
            name=f"s{index}",
            idempotent=spec.idempotent[index],
            retry=ds.Retry(attempts=2, wait=0, on=Exception) if spec.retry[index] else None,
            in_doubt="raise" if policy == "raise" else None,
            reconcile=rec if policy == "reconcile" else None,
        )

    return ds.Workflow(
        "prop",
        steps=[make(i) for i in range(spec.n)],
        store=store,
        until=lambda s: s["passes"] >= spec.passes,
        on_complete="delete" if spec.delete else "mark",
    )


def run(wf: ds.Workflow, run_id: str) -> Any:
    """Run with the driver the spec picked."""
    initial = {"passes": 0, "trail": []}
    if any(s.is_async for s in wf.steps):
        return asyncio.run(wf.arun(run_id, initial))
    return wf.run(run_id, initial)


def note(what: str) -> None:
    """A Hypothesis event (see --hypothesis-show-statistics), when under Hypothesis."""
    if currently_in_test_context():
        event(what)


def header_of(store: ds.Store, run_id: str) -> ckpt.Checkpoint | None:
    found = store.get(ckpt.checkpoint_key("prop", run_id))
    return None if found is None else ckpt.decode(found[0], where=run_id)[0]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Spec, list[tuple[str, int]]]:
    n = draw(st.integers(1, 5))
    idempotent = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    retry = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    # A step resolved as fired without running leaves no trace in the state,
    # so "raise" is kept off the last step (which counts the passes).
    policy = tuple(
        "-"
        if idempotent[i]
        else draw(
            st.sampled_from(
                ("refire", "reconcile", "raise") if i < n - 1 else ("refire", "reconcile")
            )
        )
        for i in range(n)
    )
    passes = draw(st.integers(1, 4))
    spec = Spec(idempotent, retry, policy, passes, draw(st.booleans()), draw(st.booleans()))
    writes = 1 + passes * (n + idempotent.count(False))  # of an uncrashed run
    fault = st.one_of(
        st.tuples(st.sampled_from(WRITE_FAULTS), st.integers(1, writes)),
        st.tuples(st.sampled_from(STEP_FAULTS), st.integers(1, spec.total)),
    )
    return spec, draw(st.lists(fault, min_size=1, max_size=4))


def crash_and_resume(spec: Spec, faults: list[tuple[str, int]]) -> None:
    """Run ``spec`` with one fault per attempt until it completes; check everything."""
    store = ds.MemoryStore()
    world = World(spec)
    resolved_fired: set[tuple[int, int]] = set()
    not_fired: list[tuple[int, int, int]] = []  # (attempt, index, iteration) resolved not fired
    start: dict[int, int] = {}  # attempt -> commits made before it
    doubt: dict[int, int | None] = {}  # attempt -> position of the intent found, if any
    final = None
    for attempt in range(1, len(faults) + 2 * spec.total + 3):
        fault = faults[attempt - 1] if attempt <= len(faults) else None
        header = header_of(store, RUN)
        start[attempt] = header.committed if header else 0
        intent = header.intent if header else None
        doubt[attempt] = spec.pos(intent["index"], intent["iteration"]) if intent else None
        world.start_attempt(attempt, fault if fault and fault[0] in STEP_FAULTS else None)
        crashing = CrashingStore(
            store,
            before_write=fault[1] if fault and fault[0] == "before_write" else None,
            after_write=fault[1] if fault and fault[0] == "after_write" else None,
        )
        try:
            final = run(build(spec, world, crashing), RUN)
            break
        except SimulatedCrash:
            note("a simulated crash")
        except ds.StepFailed:
            # Only an injected exception in a step without retries fails a run.
            assert world.triggered is not None
            kind, index = world.triggered
            assert kind in ("fail_before", "fail_after")
            assert not spec.retry[index]
            note("a step failed")
        except ds.StepInDoubt:
            header = header_of(store, RUN)
            assert header is not None
            assert header.status == "in_doubt"
            assert header.intent is not None
            index, iteration, key = (header.intent[k] for k in ("index", "iteration", "key"))
            assert spec.policy[index] == "raise"
            assert spec.pos(index, iteration) == header.committed  # the resume point
            # Unresolved, it stops again and runs nothing.
            before = len(world.execs)
            world.start_attempt(attempt, None)
            with pytest.raises(ds.StepInDoubt):
                run(build(spec, world, store), RUN)
            assert len(world.execs) == before
            fired = (index, iteration, key) in world.ledger  # a person checks the API
            if fired:
                resolved_fired.add((index, iteration))
            else:
                not_fired.append((attempt, index, iteration))
            note(f"in doubt, resolved fired={fired}")
            build(spec, world, store).resolve(RUN, fired=fired)
    else:
        raise AssertionError(f"the run did not complete after {attempt} attempts")

    header = header_of(store, RUN)
    if spec.delete:
        # The state is gone, a tombstone stays (also after a crash in between).
        assert header is not None
        assert header.status == "deleted"
        assert header.committed == spec.total
    else:
        assert header is not None
        assert header.status == "completed"
        assert header.intent is None
        assert header.committed == spec.total  # every step committed exactly once

    # The final state is the uncrashed reference's (a step resolved as fired
    # without running is the one thing missing from it).
    ref_world = World(spec)
    reference = run(build(spec, ref_world, store), "reference")
    assert ref_world.execs == [
        (0, i, it, False) for it in range(spec.passes) for i in range(spec.n)
    ]
    trail = [t for t in reference["trail"] if tuple(map(int, t.split(":"))) not in resolved_fired]
    if spec.delete and final is None:
        # A crash came after the tombstone landed: the state is gone by design.
        assert attempt > 1
    else:
        assert final == {**reference, "trail": trail}

    # Every non-idempotent (step, pass) fired, always with one key; keys
    # are distinct across steps, passes and runs.
    keys: dict[tuple[int, int], set[str]] = defaultdict(set)
    for index, iteration, key in world.ledger:
        keys[(index, iteration)].add(key)
    assert sorted(keys) == sorted(
        (i, it) for it in range(spec.passes) for i in range(spec.n) if not spec.idempotent[i]
    )
    assert all(len(k) == 1 for k in keys.values()), keys
    one_key = [next(iter(k)) for k in keys.values()]
    assert len(set(one_key)) == len(one_key)
    assert not set(one_key) & {key for _, _, key in ref_world.ledger}

    # Committed steps never ran again: each attempt started at (or after)
    # what was committed before it, and ran forward.
    commits = [start[a] for a in sorted(start)]
    assert commits == sorted(commits)
    for attempt, index, iteration, in_doubt in world.execs:
        pos = spec.pos(index, iteration)
        assert pos >= start[attempt], (attempt, index, iteration)
        # ctx.in_doubt: exactly for the step whose intent the attempt found.
        assert in_doubt == (pos == doubt[attempt]), (attempt, index, iteration, in_doubt)
    for attempt in start:
        positions = [spec.pos(i, it) for a, i, it, _ in world.execs if a == attempt]
        assert positions == sorted(positions)
        for pos, count in Counter(positions).items():
            assert count <= (2 if spec.retry[pos % spec.n] else 1)
    # reconcile is asked only about the step at the resume point, once.
    for attempt, index, iteration in world.reconciled:
        assert spec.policy[index] == "reconcile"
        assert spec.pos(index, iteration) == start[attempt]
    assert len(set(world.reconciled)) == len(world.reconciled)
    # in_doubt="raise": a step that may have fired never fires again unless a
    # person said it had not (one resolve(fired=False) per re-fire).
    for index, iteration in {(i, it) for _, i, it, _ in world.execs}:
        if spec.policy[index] != "raise":
            continue
        fired_in = sorted({a for a, i, it, _ in world.execs if (i, it) == (index, iteration)})
        for earlier, later in itertools.pairwise(fired_in):
            assert any(
                earlier <= a < later and (i, it) == (index, iteration) for a, i, it in not_fired
            ), f"s{index} (pass {iteration}) re-fired in attempt {later} without being resolved"

    if world.reconciled:
        note("reconcile asked")
    if any(n > 1 for n in Counter((i, it) for i, it, _ in world.ledger).values()):
        note("a non-idempotent step fired twice")
    note(f"attempts: {attempt}")

    execs = len(world.execs)
    world.start_attempt(attempt + 1, None)
    again = run(build(spec, world, store), RUN)
    if spec.delete:
        # Deleted: a rerun finds the tombstone, returns None and runs nothing.
        assert again is None
        assert len(world.execs) == execs
    else:
        # Completed: a rerun returns the final state and runs nothing.
        assert again == final
        assert len(world.execs) == execs


# The intent is written and the process dies before firing; the person
# resolves "not fired"; the re-fire fires and dies: the step is in doubt again.
REFIRE_AFTER_RESOLVE_DIES = (
    Spec((False, True), (False, False), ("raise", "-"), 1, use_async=False),
    [("after_write", 2), ("crash_inside", 1), ("crash_inside", 1)],
)


@pytest.mark.slow
@settings(deadline=None, max_examples=examples(100))
@given(scenarios())
def test_any_crash_sequence_resumes_to_the_uncrashed_result(
    scenario: tuple[Spec, list[tuple[str, int]]],
) -> None:
    """Any workflow, crashed or failing at any write or step any number of times,
    resumes to the uncrashed final state, one key per firing, no committed re-runs.
    """
    crash_and_resume(*scenario)


@pytest.mark.slow
def test_every_write_boundary_of_a_fixed_workflow() -> None:
    """Exhaustively: a crash before or after each write of a mixed 3-pass workflow
    resumes correctly (the enumeration hypothesis only samples).
    """
    for delete in (False, True):
        spec = Spec(
            idempotent=(True, False, True, False),
            retry=(False, True, False, False),
            policy=("-", "reconcile", "-", "refire"),
            passes=3,
            use_async=False,
            delete=delete,
        )
        writes = 1 + spec.passes * 6
        for n in range(1, writes + 1):
            for kind in WRITE_FAULTS:
                crash_and_resume(spec, [(kind, n)])
        for n in range(1, spec.total + 1):
            for kind in STEP_FAULTS:
                crash_and_resume(spec, [(kind, n)])


def test_refire_after_resolve_that_dies_is_in_doubt_again() -> None:
    """in_doubt="raise": after resolve(fired=False), a re-fire that dies leaves the step
    in doubt again; the next run must raise StepInDoubt, not fire a third time.
    """
    crash_and_resume(*REFIRE_AFTER_RESOLVE_DIES)
