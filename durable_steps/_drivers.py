"""Effects and the two drivers that perform them (sync and asyncio).

The run protocol (:mod:`durable_steps._protocol.runner`) is a generator that never
does I/O: it yields the effects below and is sent their results, or has
their exceptions thrown in. The drivers differ only in *how* they perform an
effect — directly, or with ``await`` and ``asyncio.to_thread`` — so ``run``
and ``arun`` share every line of the protocol.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Callable, Generator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from . import testing
from .errors import DefinitionError

if TYPE_CHECKING:
    from .stores import Store

__all__ = [
    "Await",
    "AwaitableInSyncRun",
    "Blocking",
    "Call",
    "Delete",
    "Get",
    "GetMany",
    "ListKeys",
    "ListObjects",
    "Protocol",
    "Put",
    "Sleep",
    "Sweep",
    "drive_async",
    "drive_sync",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Get:
    """Read a key: result ``(bytes, version) | None``."""

    key: str


@dataclass(frozen=True)
class GetMany:
    """Read several keys at once (in parallel): result a list of what ``Get`` gives."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class ListKeys:
    """List the keys under a prefix: result a list of keys."""

    prefix: str


@dataclass(frozen=True)
class ListObjects:
    """List the objects under a prefix, in key order: result a list of
    :class:`~durable_steps.stores.ObjectInfo`, at most ``limit`` of them.
    """

    prefix: str
    limit: int | None = None


@dataclass(frozen=True)
class Put:
    """Conditional write: result the new version. ``not_before``: the
    ``time.monotonic()`` moment it may be sent at the earliest (a store that
    limits writes per object name, see ``_fleet.pacing``); the driver waits for it
    in the thread that sends it, never on an event loop.
    """

    key: str
    data: bytes
    match: str | None
    not_before: float = 0.0


@dataclass(frozen=True)
class Delete:
    """Remove a key if it is still at version ``match``."""

    key: str
    match: str | None


@dataclass(frozen=True)
class Sweep:
    """Remove what killed writers left under a prefix, where the store keeps
    such files (the local store's ``sweep``); nothing elsewhere.
    """

    prefix: str


@dataclass(frozen=True)
class Call:
    """Call user code (a step, ``reconcile``); awaited when it is async."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Await:
    """Wait until ``futures`` are done: work a step left running in this
    process (an effect still firing), waited for off the event loop.
    """

    futures: tuple[Future[Any], ...]


@dataclass(frozen=True)
class Blocking:
    """Call the library's own blocking code (a journal write, which takes the
    run's lock; a wait for a write slot): in this thread, or in a worker
    thread under asyncio, so it never blocks the event loop.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Sleep:
    """Wait between retries (skipped under ``testing.no_wait()``)."""

    seconds: float


class AwaitableInSyncRun(DefinitionError):
    """User code called by the sync driver returned an awaitable: it is async
    in a way the definition-time check could not see (say, a sync wrapper
    around an ``async def``). The awaitable was never awaited, so its work
    did not happen: the runner records neither a failure nor an intent for it.
    """


Effect = (
    Get | GetMany | ListKeys | ListObjects | Put | Delete | Sweep | Call | Await | Blocking | Sleep
)
Protocol = Generator[Effect, Any, T]


def _next(protocol: Protocol[T], send: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Advance ``protocol``: ``(True, result)`` when it is done, else ``(False, effect)``."""
    try:
        return False, (protocol.throw(error) if error is not None else protocol.send(send))
    except StopIteration as done:
        return True, done.value


def _perform(effect: Effect, store: Store) -> Any:
    if isinstance(effect, Call):
        result = effect.fn(*effect.args)
        if inspect.isawaitable(result):  # an async callable that looked sync
            if inspect.iscoroutine(result):
                result.close()  # no "never awaited" warning on top of our error
            raise AwaitableInSyncRun(
                f"{getattr(effect.fn, '__name__', effect.fn)!r} returned an awaitable, so it "
                "is async and did not run: run the workflow with `await wf.arun(...)`"
            )
        return result
    if isinstance(effect, Await):
        return futures.wait(effect.futures)
    if isinstance(effect, Blocking):
        return effect.fn(*effect.args)
    if isinstance(effect, Sleep):
        if not testing.sleeps_disabled():
            time.sleep(effect.seconds)
        return None
    return _request(effect, store)


def _request(effect: Effect, store: Store) -> Any:  # noqa: PLR0911 - a return per effect
    """Perform a store effect."""
    if isinstance(effect, Get):
        return store.get(effect.key)
    if isinstance(effect, GetMany):
        if len(effect.keys) < 2:
            return [store.get(key) for key in effect.keys]
        from concurrent.futures import ThreadPoolExecutor  # only format-2 resumes pay for it

        with ThreadPoolExecutor(len(effect.keys)) as pool:
            return list(pool.map(store.get, effect.keys))
    if isinstance(effect, ListKeys):
        return [info.key for info in store.list(effect.prefix)]
    if isinstance(effect, ListObjects):  # the listing pages lazily: a limit stops it early
        return list(itertools.islice(store.list(effect.prefix), effect.limit))
    if isinstance(effect, Put):
        wait = effect.not_before - time.monotonic()
        if wait > 0:  # pacing is the store's limit, not a retry: no_wait() does not skip it
            time.sleep(wait)
        return store.put(effect.key, effect.data, match=effect.match)
    if isinstance(effect, Delete):
        return store.delete(effect.key, match=effect.match)
    assert isinstance(effect, Sweep), effect
    return _sweep(store, effect.prefix)


async def _perform_async(effect: Effect, store: Store) -> Any:
    if isinstance(effect, Call):
        result = effect.fn(*effect.args)  # sync steps run on the loop, like sync code does
        return (await result) if inspect.isawaitable(result) else result
    import asyncio  # here, not at the top: it costs ~13 ms of import for sync users

    if isinstance(effect, Sleep):
        if not testing.sleeps_disabled():
            await asyncio.sleep(effect.seconds)
        return None
    if isinstance(effect, Await):  # the work may be a task of this very loop
        return await asyncio.wait([asyncio.wrap_future(f) for f in effect.futures])
    return await asyncio.to_thread(_perform, effect, store)


def _sweep(store: Store, prefix: str) -> None:
    """Call the store's optional ``sweep(prefix)`` (see :class:`Sweep`)."""
    method = getattr(store, "sweep", None)
    if callable(method):
        method(prefix)


def drive_sync(protocol: Protocol[T], store: Store) -> T:
    """Run ``protocol`` to completion in this thread."""
    send: Any = None
    error: BaseException | None = None
    while True:
        done, item = _next(protocol, send, error)
        if done:
            return item  # type: ignore[no-any-return]
        send, error = None, None
        try:
            send = _perform(item, store)
        except BaseException as exc:  # the protocol decides what an error means
            error = exc
        item = None  # a Put holds a whole checkpoint: let it go while the step runs


async def drive_async(protocol: Protocol[T], store: Store) -> T:
    """Run ``protocol`` under asyncio: store calls in a worker thread, async
    steps awaited, sync steps called on the event loop.
    """
    send: Any = None
    error: BaseException | None = None
    while True:
        done, item = _next(protocol, send, error)
        if done:
            return item  # type: ignore[no-any-return]
        send, error = None, None
        try:
            send = await _perform_async(item, store)
        except BaseException as exc:  # the protocol decides what an error means
            error = exc
        item = None  # a Put holds a whole checkpoint: let it go while the step runs
