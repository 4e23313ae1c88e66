"""Definitions: what a step may be, refused when decorated, not when it first runs.

Async detection (functions, callable objects, partials, reconcile), the
accepted signatures ``fn(state)`` / ``fn(state, ctx)`` over every kind of
callable, and the check on a step's return value (a non-None return
replaces the whole state, so one of another kind is refused).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.testing import SimulatedCrash
from tests.storetools import committed

Runner = Callable[..., Any]


@pytest.fixture(params=["sync", "async"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Run a workflow with wf.run or, under asyncio, with wf.arun."""

    def runner(wf: ds.Workflow, run_id: str, state: Any = None) -> Any:
        if request.param == "sync":
            return wf.run(run_id, state)
        return asyncio.run(wf.arun(run_id, state))

    return runner


def header_of(store: ds.Store, wf: str, run_id: str) -> ckpt.Checkpoint:
    found = store.get(ckpt.checkpoint_key(wf, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0]


# --- async callables -----------------------------------------------------------------


async def async_step(state: dict[str, Any]) -> None:
    state["ran"] = True


async def async_step_with_extra(state: dict[str, Any], extra: int) -> None:
    state["ran"] = extra


class AsyncCallable:
    async def __call__(self, state: dict[str, Any]) -> None:
        state["ran"] = True


class AsyncMethods:
    async def step(self, state: dict[str, Any]) -> None:
        state["ran"] = True


def sync_step(state: dict[str, Any]) -> None:
    state["ran"] = True


class SyncCallable:
    def __call__(self, state: dict[str, Any]) -> None:
        state["ran"] = True


ASYNC_CALLABLES = {
    "async-def": async_step,
    "object-with-async-call": AsyncCallable(),
    "partial-of-async-def": functools.partial(async_step_with_extra, extra=1),
    "partial-of-async-object": functools.partial(AsyncCallable()),
    "partial-of-partial": functools.partial(functools.partial(async_step_with_extra, extra=1)),
    "bound-async-method": AsyncMethods().step,
    "staticmethod-of-async-def": staticmethod(async_step),
}


@pytest.mark.parametrize("fn", ASYNC_CALLABLES.values(), ids=ASYNC_CALLABLES.keys())
def test_async_callables_are_refused_by_run_before_any_io(fn: Any, tmp_path: Path) -> None:
    """Every kind of async callable is async at definition: run() refuses it before any I/O."""
    store = tmp_path / "store"
    wf = ds.Workflow("asy", store=store)
    made = wf.step(name="think")(fn)
    assert made.is_async
    with pytest.raises(ds.DefinitionError, match=r"step 'think' .* is async: .*await wf\.arun"):
        wf.run("r1", {})
    assert not store.exists()
    assert asyncio.run(wf.arun("r1", {})) == {"ran": True}  # the partial sets ran=1


class Constructed:
    """A class used as a step: calling it constructs (sync), whatever its __call__ is."""

    def __init__(self, state: dict[str, Any]) -> None:
        state["ran"] = True

    async def __call__(self, state: dict[str, Any]) -> None: ...


@pytest.mark.parametrize(
    "fn",
    [sync_step, SyncCallable(), functools.partial(sync_step), Constructed],
    ids=["function", "object-with-sync-call", "partial", "class-with-async-call"],
)
def test_sync_callables_are_not_taken_for_async(fn: Any) -> None:
    """Plain functions, sync callable objects, partials and classes are sync steps."""
    assert not ds.step(fn, name="s").is_async


class AsyncReconcile:
    async def __call__(self, state: Any, ctx: Any) -> bool:
        return True


async def async_reconcile(state: Any, ctx: Any, extra: int = 0) -> bool:
    return True


@pytest.mark.parametrize(
    "reconcile",
    [async_reconcile, AsyncReconcile(), functools.partial(async_reconcile, extra=1)],
    ids=["async-def", "object-with-async-call", "partial-of-async-def"],
)
def test_async_reconcile_needs_arun(reconcile: Any, tmp_path: Path) -> None:
    """An async reconcile= (also a callable object or a partial) makes run() refuse before I/O."""
    store = tmp_path / "store"
    wf = ds.Workflow("asy-reconcile", store=store)
    wf.step(idempotent=False, reconcile=reconcile)(sync_step)
    assert wf.steps[0].is_async
    with pytest.raises(ds.DefinitionError, match="arun"):
        wf.run("r1", {})
    assert not store.exists()
    assert asyncio.run(wf.arun("r1", {})) == {"ran": True}


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non-idempotent"])
def test_sync_run_meeting_an_awaitable_records_no_failure_and_no_intent(idempotent: bool) -> None:
    """A step async in a way definition cannot see (a sync wrapper returning a coroutine):
    run() refuses it naming the run and step, records neither a failure nor an intent,
    and the next arun runs it once, not in doubt.
    """
    store = ds.MemoryStore()
    seen: list[bool] = []

    async def fire(state: dict[str, Any], ctx: ds.Context) -> None:
        seen.append(ctx.in_doubt)
        state["fired"] = ctx.idempotency_key

    def wrapper(state: dict[str, Any], ctx: ds.Context) -> Any:  # looks sync, returns a coroutine
        return fire(state, ctx)

    wf = ds.Workflow("hidden-async", store=store)
    wf.step(name="first")(lambda s: s.update(first=True))
    wf.step(name="fire", idempotent=idempotent, retry=ds.Retry(attempts=3, wait=0, on=Exception))(
        wrapper
    )
    assert not wf.steps[1].is_async  # the case only the driver can catch
    with pytest.raises(ds.DefinitionError) as raised:
        wf.run("r1", {})
    message = str(raised.value)
    assert "run hidden-async/r1: step 'fire' is async" in message
    assert "await wf.arun" in message
    assert (raised.value.run, raised.value.step) == ("hidden-async/r1", "fire")
    assert seen == []  # the coroutine never ran (and was closed: no warning under -W error)
    header = header_of(store, "hidden-async", "r1")
    assert (header.status, header.next_step, header.error, header.intent) == (
        "running",
        1,
        None,
        None,
    )
    final = asyncio.run(wf.arun("r1"))
    assert seen == [False]  # once, and not in doubt
    assert final["first"] is True
    assert len(final["fired"]) > 0


def test_sync_run_meeting_an_awaitable_keeps_an_earlier_intent() -> None:
    """An intent left by a crash stays when run() then meets the awaitable: that earlier
    attempt may have fired, so the next arun still treats the step as in doubt.
    """
    store = ds.MemoryStore()
    seen: list[tuple[bool, str]] = []
    crash = {"on": True}

    async def fire(state: dict[str, Any], ctx: ds.Context) -> None:
        seen.append((ctx.in_doubt, ctx.idempotency_key))

    def wrapper(state: dict[str, Any], ctx: ds.Context) -> Any:
        if crash["on"]:
            raise SimulatedCrash("the process died while the step ran")
        return fire(state, ctx)

    wf = ds.Workflow("hidden-async-doubt", store=store)
    wf.step(name="fire", idempotent=False)(wrapper)
    with pytest.raises(SimulatedCrash):
        wf.run("r1", {})
    intent = header_of(store, "hidden-async-doubt", "r1").intent
    assert intent is not None
    crash["on"] = False
    with pytest.raises(ds.DefinitionError, match=r"await wf\.arun"):
        wf.run("r1")
    assert header_of(store, "hidden-async-doubt", "r1").intent == intent
    asyncio.run(wf.arun("r1"))
    assert seen == [(True, intent["key"])]


# --- signatures ----------------------------------------------------------------------


def keyword_only_ctx(state: Any, *, ctx: Any) -> None: ...


def ctx_first(ctx: Any, state: Any) -> None: ...


def context_first(context: Any, state: Any) -> None: ...


def no_parameters() -> None: ...


def three_required(state: Any, ctx: Any, extra: Any) -> None: ...


def four_required(a: Any, b: Any, c: Any, d: Any) -> None: ...


class Methods:
    def in_class_body(self, state: Any) -> None: ...

    def swapped(self, ctx: Any, state: Any) -> None: ...

    @staticmethod
    def static_swapped(ctx: Any, state: Any) -> None: ...

    def __call__(self, ctx: Any, state: Any) -> None: ...


BAD_SIGNATURES: dict[str, tuple[Any, str]] = {
    "keyword-only-ctx": (keyword_only_ctx, r"'ctx' must not be keyword-only"),
    "ctx-then-state": (ctx_first, "the state comes first"),
    "context-then-state": (context_first, "the state comes first"),
    "no-parameters": (no_parameters, "must be fn\\(state\\) or fn\\(state, ctx\\)"),
    "three-required": (three_required, "must be fn\\(state\\) or fn\\(state, ctx\\)"),
    "lambda-no-parameters": (lambda: None, "must be fn\\(state\\) or fn\\(state, ctx\\)"),
    "lambda-ctx-state": (lambda ctx, state: None, "the state comes first"),
    "method-from-class-body": (Methods.in_class_body, "method taken from its class"),
    "bound-method-swapped": (Methods().swapped, "the state comes first"),
    "staticmethod-swapped": (Methods.__dict__["static_swapped"], "the state comes first"),
    "callable-object-swapped": (Methods(), "the state comes first"),
    "partial-leaving-three": (functools.partial(four_required, 1), "must be fn\\(state\\)"),
    "partial-keyword-only": (functools.partial(keyword_only_ctx), "keyword-only"),
}


@pytest.mark.parametrize(
    ("fn", "message"), BAD_SIGNATURES.values(), ids=list(BAD_SIGNATURES.keys())
)
def test_bad_signatures_fail_when_decorated(fn: Any, message: str) -> None:
    """Signatures that could only fail when the step runs are refused at decoration."""
    with pytest.raises(ds.DefinitionError, match=message) as raised:
        ds.step(fn, name="s")
    assert "step 's'" in str(raised.value)
    wf = ds.Workflow("sig", store="memory://")
    with pytest.raises(ds.DefinitionError, match=message):
        wf.step(name="s")(fn)
    assert wf.steps == ()


@pytest.mark.parametrize(
    "fn",
    [lambda s: None, functools.partial(sync_step), SyncCallable()],
    ids=["lambda", "partial", "callable-object"],
)
def test_steps_without_a_usable_name_fail_when_decorated(fn: Any) -> None:
    """A lambda, partial or callable object without name= is refused at once, asking for name=."""
    with pytest.raises(ds.DefinitionError, match="pass name="):
        ds.step(fn)
    with pytest.raises(ds.DefinitionError, match="pass name="):
        ds.Workflow("unnamed", store="memory://", steps=[fn])


def state_only(state: dict[str, Any]) -> None:
    state["got"] = ["state"]


def state_and_ctx(state: dict[str, Any], ctx: ds.Context) -> None:
    state["got"] = ["state", ctx.step]


def ctx_with_default(state: dict[str, Any], ctx: Any = None) -> None:
    state["got"] = ["state", ctx.step]


def star_args(*args: Any) -> None:
    args[0]["got"] = ["state", args[1].step]


def positional_only(state: dict[str, Any], /) -> None:
    state["got"] = ["state"]


def with_options(state: dict[str, Any], ctx: ds.Context, *, label: str = "x", **kw: Any) -> None:
    state["got"] = ["state", ctx.step]


def extra_first(extra: str, state: dict[str, Any], ctx: ds.Context) -> None:
    state["got"] = [extra, ctx.step]


class Good:
    def method(self, state: dict[str, Any], ctx: ds.Context) -> None:
        state["got"] = ["state", ctx.step]

    @staticmethod
    def static(state: dict[str, Any]) -> None:
        state["got"] = ["state"]

    def __call__(self, state: dict[str, Any]) -> None:
        state["got"] = ["state"]


GOOD_SIGNATURES: dict[str, tuple[Any, list[str]]] = {
    "state": (state_only, ["state"]),
    "state-ctx": (state_and_ctx, ["state", "s"]),
    "ctx-with-default": (ctx_with_default, ["state", "s"]),
    "star-args": (star_args, ["state", "s"]),
    "positional-only": (positional_only, ["state"]),
    "optional-keywords": (with_options, ["state", "s"]),
    "partial-binding-first": (functools.partial(extra_first, "bound"), ["bound", "s"]),
    "bound-method": (Good().method, ["state", "s"]),
    "staticmethod": (Good.__dict__["static"], ["state"]),
    "callable-object": (Good(), ["state"]),
    "lambda": (lambda state: state.update(got=["state"]), ["state"]),
    "lambda-ctx": (lambda state, ctx: state.update(got=["state", ctx.step]), ["state", "s"]),
}


@pytest.mark.parametrize(("fn", "got"), GOOD_SIGNATURES.values(), ids=list(GOOD_SIGNATURES.keys()))
def test_accepted_shapes_get_state_and_ctx(fn: Any, got: list[str], run: Runner) -> None:
    """Every accepted kind of callable gets the state first, and ctx second when it takes two."""
    wf = ds.Workflow("shapes", store="memory://", steps=[ds.step(fn, name="s")])
    assert run(wf, "r1", {}) == {"got": got}


def test_reconcile_and_until_signatures_fail_when_defined() -> None:
    """reconcile= must take (state, ctx) and until= (state), and until may not be async."""
    with pytest.raises(ds.DefinitionError, match=r"reconcile must take \(state, ctx\)"):
        ds.step(sync_step, idempotent=False, reconcile=lambda state: True)
    with pytest.raises(ds.DefinitionError, match=r"reconcile must take \(state, ctx\)"):
        ds.step(sync_step, idempotent=False, reconcile=lambda state, ctx, more: True)
    with pytest.raises(ds.DefinitionError, match=r"until must take \(state\)"):
        ds.Workflow("u", store="memory://", until=lambda: True)
    with pytest.raises(ds.DefinitionError, match=r"until must take \(state\)"):
        ds.Workflow("u", store="memory://", until=lambda state, ctx: True)

    async def done(state: Any) -> bool:
        return True

    with pytest.raises(ds.DefinitionError, match="not async"):
        ds.Workflow("u", store="memory://", until=done)


# --- return values -------------------------------------------------------------------


WRONG_RETURNS: dict[str, tuple[Any, Any, str]] = {
    "str-for-dict": ({"transcript": ["hi"]}, "done", "returned a str, but the state is a dict"),
    "helper-dict": (
        {"transcript": ["hi"], "n": 1},
        {"status": 200},
        "returned a new dict without the state's keys 'transcript', 'n'",
    ),
    "int-for-list": (["a"], 3, "returned an int, but the state is a list"),
    "list-for-dict": ({"a": 1}, [1], "returned a list, but the state is a dict"),
}


@pytest.mark.parametrize(
    ("initial", "returned", "message"), WRONG_RETURNS.values(), ids=list(WRONG_RETURNS.keys())
)
def test_wrong_return_fails_the_step_and_keeps_the_state(
    initial: Any, returned: Any, message: str, run: Runner
) -> None:
    """A return of another kind fails the step (StepFailed naming run and step), is not
    retried, is recorded, and leaves the committed state intact and resumable there.
    """
    store = ds.MemoryStore()
    calls: list[int] = []
    wf = ds.Workflow("returns", store=store)
    wf.step(name="first")(lambda s: None)

    @wf.step(retry=ds.Retry(attempts=3, wait=0, on=Exception))
    def reply(state: Any, ctx: ds.Context) -> Any:
        calls.append(ctx.attempt)
        return returned

    with pytest.raises(ds.StepFailed) as raised:
        run(wf, "r1", initial)
    err = raised.value
    assert (err.run, err.step, err.attempts) == ("returns/r1", "reply", 1)
    assert "run returns/r1: step 'reply' (iteration 0) failed on attempt 1" in str(err)
    assert message in str(err)
    assert "state.clear(); state.update(new)" in str(err)
    assert isinstance(err.__cause__, ds.DefinitionError)
    assert calls == [1]  # not retried: a bug, not bad luck
    header = header_of(store, "returns", "r1")
    assert (header.status, header.next_step) == ("failed", 1)
    assert header.error is not None
    assert header.error["type"] == "durable_steps.errors.DefinitionError"
    _, state = committed(store, ckpt.checkpoint_key("returns", "r1"))
    assert state == initial  # the committed state

    fixed = ds.Workflow("returns", store=store)
    fixed.step(name="first")(lambda s: None)
    fixed.step(name="reply")(lambda s: None)
    assert run(fixed, "r1") == initial


class Box:
    def __init__(self, n: int) -> None:
        self.n = n


class BigBox(Box):
    pass


RIGHT_RETURNS: dict[str, tuple[Any, Callable[[Any], Any], Any]] = {
    "same-object": ({"a": 1}, lambda s: s.update(b=2) or s, {"a": 1, "b": 2}),
    "dict-with-every-key": ({"a": 1}, lambda s: {**s, "b": 2}, {"a": 1, "b": 2}),
    "cleared-and-updated": ({"a": 1}, lambda s: s.clear() or s.update(z=0), {"z": 0}),
    "new-list": ([1], lambda s: [*s, 2], [1, 2]),
    "new-str": ("a", lambda s: s + "b", "ab"),
    "subclass-of-state": (Box(1), lambda s: BigBox(s.n + 1), None),
}


@pytest.mark.parametrize(
    ("initial", "fn", "final"), RIGHT_RETURNS.values(), ids=list(RIGHT_RETURNS.keys())
)
def test_returns_of_the_same_kind_replace_the_state(
    initial: Any, fn: Callable[[Any], Any], final: Any, run: Runner
) -> None:
    """The same object, a dict keeping every key, or a value of the state's type replaces it."""
    serializer = "pickle" if isinstance(initial, Box) else "json"
    wf = ds.Workflow("returns-ok", store="memory://", serializer=serializer)
    wf.step(name="s")(fn)
    result = run(wf, "r1", initial)
    if final is None:
        assert (type(result), result.n) == (BigBox, 2)
    else:
        assert result == final
