"""What every remote object store shares: retries, lost-response read-back, messages, clock.

S3, GCS and Azure Blob talk to a service over a network that can fail
between a request and its answer. What is the same on every such service
lives here once:

* :class:`Retrier` — the retry loop: a bounded number of attempts with full
  jitter exponential backoff (tenacity), each retry logged at WARNING, the
  attempt number passed to the call so that a write knows whether it is a
  retry; and what the last fault becomes: "cannot reach" (the connection
  failed), "kept failing" (the service answered with transient faults to the
  end), or the store's own reading of a refusal.
* :meth:`Retrier.refused_write` / :meth:`Retrier.refused_delete` — what a
  refused conditional write or delete means. A refusal on the first attempt
  is a real conflict. A refusal on a retry may be our own earlier attempt,
  which landed while its response was lost: the object is read back, and if
  it holds exactly the bytes being written, the write is ours and its version
  is returned.
* :func:`listing` — a listing fetched page by page, each page retried on
  its own.
* :class:`ClockSkew` — how far this host's clock is ahead of the service's,
  from the ``Date`` header of the latest answer below 500.

Each store keeps its own :class:`Service`: which faults are transient, which
are a lost connection, how a fault reads in a sentence, and what a refusal
means. Those are the services' own vocabularies.
"""

from __future__ import annotations

import collections
import email.utils
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from durable_steps.errors import CheckpointConflict, StoreError
from durable_steps.stores._protocol import ObjectInfo

__all__ = [
    "ClockSkew",
    "Retrier",
    "Service",
    "attempts_text",
    "clause",
    "conflict",
    "describe",
    "join_prefix",
    "listing",
    "not_sent",
    "refused",
]

T = TypeVar("T")
Entry = tuple[str, str, int, float]  # a listed object: full name, version, size, modified
Page = tuple[Iterable[Entry], "str | None"]  # a page of a listing and the next page's token

log = logging.getLogger("durable_steps.stores")


def join_prefix(prefix: str) -> str:
    """``"/a//b/"`` → ``"a/b"``: a store prefix without empty path segments."""
    return "/".join(part for part in prefix.strip("/").split("/") if part)


def clause(exc: BaseException | str) -> str:
    """An exception's text without its closing punctuation, to embed in a sentence."""
    return str(exc).strip().rstrip(".!?;:, ")


def describe(exc: BaseException | None) -> str:
    """A fault in a few words: its type and text (a service may say it better)."""
    return f"{type(exc).__name__}: {clause(exc)}" if exc is not None else "no answer"


def attempts_text(n: int) -> str:
    """``"1 attempt"``, ``"3 attempts"``."""
    return f"{n} attempt{'s' if n != 1 else ''}"


def conflict(where: str, match: str | None) -> CheckpointConflict:
    """The :class:`CheckpointConflict` for a refused write of ``where`` against ``match``."""
    if match is None:
        what = "it already exists: another writer created it"
    else:
        what = f"it is no longer version {match}: another writer changed or deleted it"
    return CheckpointConflict(
        f"conditional write to {where} refused; {what}. "
        "Nothing was overwritten; this process must stop."
    )


def refused(service: str, where: str, fault: str, hint: str) -> StoreError:
    """The StoreError for an answer that is no conflict and not worth retrying."""
    return StoreError(f"{service} refused a request for {where}: {fault}; {hint}.")


def not_sent(service: str, where: str, exc: BaseException, check: str) -> StoreError:
    """The StoreError for a request that failed before it was sent (credentials, config)."""
    return StoreError(
        f"{service} request for {where} failed before it was sent: {clause(exc)}. Check {check}."
    )


@dataclass(frozen=True)
class Service:
    """How one service fails: the store-specific half of :class:`Retrier`.

    ``transient(exc)``: worth another attempt. ``connection_errors``: the
    request or its answer was lost on the way (retried or not, the last one
    says "cannot reach"). ``describe(exc)``: the fault in a few words, for the
    log and the messages. ``refusal(exc, where)``: the StoreError for any
    other fault, or ``None`` to let it propagate unchanged (our own
    CheckpointConflict, say).
    """

    name: str
    endpoint: str
    transient: Callable[[BaseException], bool]
    connection_errors: tuple[type[BaseException], ...]
    refusal: Callable[[BaseException, str], StoreError | None]
    describe: Callable[[BaseException | None], str] = describe
    logger: logging.Logger = log


class Retrier:
    """Calls to one service: retried, logged, and their last fault made a StoreError."""

    def __init__(
        self,
        service: Service,
        *,
        attempts: int,
        wait: float,
        max_wait: float,
        sleep: Callable[[float], None],
    ) -> None:
        if attempts < 1:
            raise ValueError("retry_attempts must be at least 1")
        self.service = service
        self.attempts = attempts
        self.wait = wait
        self.max_wait = max_wait
        self.sleep = sleep

    def __call__(self, fn: Callable[[int], T], op: str, where: str) -> T:
        """Call ``fn(attempt_number)`` for ``op`` on ``where``, retrying transient faults.

        Every retry is logged at WARNING on the service's logger, naming the
        object, the attempt and the fault. The last fault becomes a
        :class:`~durable_steps.StoreError` (see :class:`Service`).
        """
        service = self.service

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            service.logger.warning(
                "%s %s %s: attempt %d of %d failed (%s); retrying in %.2f s",
                service.name,
                op,
                where,
                state.attempt_number,
                self.attempts,
                service.describe(exc),
                delay,
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_random_exponential(multiplier=self.wait, max=self.max_wait),
            retry=retry_if_exception(service.transient),
            before_sleep=log_retry,
            sleep=self.sleep,
            reraise=True,
        )
        tried, started = 0, time.monotonic()
        try:
            for attempt in retrying:
                with attempt:
                    tried = attempt.retry_state.attempt_number
                    return fn(tried)
        except service.connection_errors as exc:
            raise StoreError(
                f"cannot reach {service.name} for {op} {where} at {service.endpoint} "
                f"after {attempts_text(tried)} in {time.monotonic() - started:.1f} s: "
                f"{clause(exc)}. Check the endpoint URL and the network; rerun later "
                "(the run resumes)."
            ) from exc
        except Exception as exc:
            if service.transient(exc):
                raise StoreError(
                    f"{service.name} kept failing for {op} {where}: {service.describe(exc)} "
                    f"after {attempts_text(tried)} in {time.monotonic() - started:.1f} s. "
                    "The service is unavailable or throttling; rerun later (the run resumes)."
                ) from exc
            error = service.refusal(exc, where)
            if error is None:
                raise
            raise error from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    def refused_write(
        self,
        *,
        attempt: int,
        data: bytes,
        match: str | None,
        where: str,
        read: Callable[[], tuple[bytes, str] | None],
        may_have_resent: bool = False,
    ) -> str:
        """Decide a refused conditional write: return our version, or raise a conflict.

        On a retry (``attempt > 1``), or when a lower layer ``may_have_resent``
        the request, the refusal may come from our own earlier attempt, which
        landed while its response was lost: ``read()`` the object back, and if
        it holds exactly ``data`` return its version (logged at WARNING).
        Otherwise raise :class:`CheckpointConflict`. Two writers of
        byte-identical data are indistinguishable this way, which is harmless:
        the object holds exactly what each of them meant to write.
        """
        if attempt > 1 or may_have_resent:
            landed = read()
            if landed is not None and landed[0] == data:
                self.service.logger.warning(
                    "%s: a retried write was refused by our own earlier attempt, whose "
                    "response was lost; keeping it (version %s)",
                    where,
                    landed[1],
                )
                return landed[1]
        raise conflict(where, match)

    @staticmethod
    def refused_delete(
        *, match: str | None, where: str, read: Callable[[], tuple[bytes, str] | None]
    ) -> None:
        """Decide a refused conditional delete: fine if the object is gone, else a conflict.

        Services refuse a conditional delete of a missing object too (Azure,
        SeaweedFS: 412), and a retried delete whose first attempt landed meets
        the same refusal. Gone is gone, whoever deleted it; an object still
        there is another writer's, and :class:`CheckpointConflict` is raised.
        """
        if read() is not None:
            raise conflict(where, match)


def listing(page: Callable[[str | None], Page], base: str) -> Iterator[ObjectInfo]:
    """Every object a listing names under ``base``, fetched page by page.

    ``page(token)`` is one (retried) request: ``None`` asks for the first page,
    and a page without a next token is the last. Each page is retried on its
    own, so a transient fault mid-listing neither restarts nor duplicates the
    listing. Keys are yielded relative to ``base``; a name outside it is
    skipped.
    """
    token: str | None = None
    while True:
        entries, token = page(token)
        for name, version, size, modified in entries:
            if name.startswith(base):
                yield ObjectInfo(
                    key=name[len(base) :], version=version, size=size, modified=modified
                )
        if not token:
            return


class ClockSkew:
    """Seconds this host's clock is ahead of a service's, from answers' ``Date`` headers.

    :meth:`observe` is called with every answer's ``Date`` header and status;
    :attr:`value` is the estimate, or ``None`` before any answer. A lease that
    compares its own clock with times written by other hosts uses it to tell
    a skewed clock from a stale lease.

    Each reading is *received - dated*: the true skew plus however long the
    answer took to come back, never less. So the estimate is the smallest of
    the readings of the last :attr:`WINDOW` seconds, not the latest: one answer
    held up for 25 s by the network must not pass for a clock 25 s ahead,
    which would end everybody else's view of this host's leases early.
    """

    WINDOW = 60.0
    """Seconds a reading counts: short, so that a stepped clock (NTP) shows soon."""

    def __init__(self) -> None:
        self._readings: collections.deque[tuple[float, float]] = collections.deque()
        self._lock = threading.Lock()
        self.value: float | None = None

    def observe(self, date_header: str | None, status: int | None = None) -> None:
        """Record the skew an answer dated ``date_header`` shows.

        Ignored: no or a bad header, a time in no known zone (``-0000``), and a
        5xx answer (a load balancer or proxy with its own clock may have
        written it). ``Date`` has a resolution of one second, so the middle of
        the stamped second is the best estimate of when it was written.
        """
        received = time.time()
        if not date_header or (status is not None and status >= 500):
            return
        try:
            served = email.utils.parsedate_to_datetime(date_header)
        except (TypeError, ValueError):
            return
        if served.tzinfo is None:  # "-0000": cannot be compared with this clock
            return
        now = time.monotonic()
        with self._lock:
            readings = self._readings
            readings.append((now, received - (served.timestamp() + 0.5)))
            while readings[0][0] < now - self.WINDOW:
                readings.popleft()
            self.value = min(reading for _, reading in readings)
