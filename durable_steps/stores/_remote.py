"""What every remote object store shares: retries, lost-response read-back, messages.

The cloud stores (GCS and Azure Blob here; S3 follows the same protocol) talk
to a service over a network that can fail between a request and its answer.
Three things are the same on every such service and live here once:

* :class:`Retrier` — the retry loop: a bounded number of attempts with full
  jitter exponential backoff (tenacity), each retry logged at WARNING, the
  attempt number passed to the call so that a write knows whether it is a
  retry.
* :func:`refused_write` / :func:`refused_delete` — what a refused
  conditional write or delete means. A refusal
  on the first attempt is a real conflict. A refusal on a retry may be our own
  earlier attempt, which landed while its response was lost: the object is
  read back, and if it holds exactly the bytes being written, the write is
  ours and its version is returned.
* :class:`ClockSkew` — how far this host's clock is ahead of the service's,
  from the ``Date`` header of the latest response.

Each store keeps its own classification (which exceptions are transient,
which answers are refusals): those are the services' own vocabularies.
"""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from durable_steps.errors import CheckpointConflict

__all__ = [
    "ClockSkew",
    "Retrier",
    "conflict",
    "join_prefix",
    "kept_failing",
    "refused_delete",
    "refused_write",
    "unreachable",
]

T = TypeVar("T")

log = logging.getLogger("durable_steps.stores")


def join_prefix(prefix: str) -> str:
    """``"/a//b/"`` → ``"a/b"``: a store prefix without empty path segments."""
    return "/".join(part for part in prefix.strip("/").split("/") if part)


class Retrier:
    """Calls ``fn(attempt_number)`` until it succeeds, retrying transient faults.

    ``transient(exc)`` decides what is worth another attempt. Every retry is
    logged at WARNING on the ``durable_steps.stores`` logger, naming the
    object and the fault. The last exception (transient or not) propagates
    unchanged: each store turns it into its own :class:`StoreError`.
    """

    def __init__(
        self,
        transient: Callable[[BaseException], bool],
        *,
        attempts: int,
        wait: float,
        max_wait: float,
        sleep: Callable[[float], None],
    ) -> None:
        if attempts < 1:
            raise ValueError("retry_attempts must be at least 1")
        self.transient = transient
        self.attempts = attempts
        self.wait = wait
        self.max_wait = max_wait
        self.sleep = sleep

    def __call__(self, fn: Callable[[int], T], where: str) -> T:
        """Run ``fn`` with retries; ``where`` names the object in the log lines."""

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning(
                "%s: attempt %d of %d failed (%s: %s); retrying in %.2fs",
                where,
                state.attempt_number,
                self.attempts,
                type(exc).__name__,
                exc,
                delay,
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_random_exponential(multiplier=self.wait, max=self.max_wait),
            retry=retry_if_exception(self.transient),
            before_sleep=log_retry,
            sleep=self.sleep,
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                return fn(attempt.retry_state.attempt_number)
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


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


def refused_write(
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
    landed while its response was lost: ``read()`` the object back, and if it
    holds exactly ``data`` return its version. Otherwise raise
    :class:`CheckpointConflict`. Two writers of byte-identical data are
    indistinguishable this way, which is harmless: the object holds exactly
    what each of them meant to write.
    """
    if attempt > 1 or may_have_resent:
        landed = read()
        if landed is not None and landed[0] == data:
            log.warning(
                "%s: a retried write was refused by our own earlier attempt, whose "
                "response was lost; keeping it (version %s)",
                where,
                landed[1],
            )
            return landed[1]
    raise conflict(where, match)


def refused_delete(
    *, match: str | None, where: str, read: Callable[[], tuple[bytes, str] | None]
) -> None:
    """Decide a refused conditional delete: fine if the object is gone, else a conflict.

    Services refuse a conditional delete of a missing object too (Azure,
    SeaweedFS: 412), and a retried delete whose first attempt landed meets the
    same refusal. Gone is gone, whoever deleted it; an object still there is
    another writer's, and :class:`CheckpointConflict` is raised.
    """
    if read() is not None:
        raise conflict(where, match)


def kept_failing(service: str, where: str, fault: str, attempts: int) -> str:
    """Message for a transient fault that outlasted every retry."""
    return (
        f"{service} kept failing for {where}: {fault} after {attempts} attempts. The service "
        "is unavailable or throttling; rerun later (the run resumes)."
    )


def unreachable(service: str, where: str, endpoint: str, exc: BaseException, attempts: int) -> str:
    """Message for a connection that failed on every attempt."""
    return (
        f"cannot reach {service} for {where} at {endpoint} after {attempts} attempts: {exc}. "
        "Check the endpoint and the network; rerun later (the run resumes)."
    )


class ClockSkew:
    """Seconds this host's clock is ahead of a service's, from response ``Date`` headers.

    :meth:`observe` is called with every response's ``Date`` header (an HTTP
    date, one-second resolution); :attr:`value` is the latest reading, or
    ``None`` before any. A lease that compares its own clock with times
    written by other hosts can use it to tell a skewed clock from a stale
    lease.
    """

    def __init__(self) -> None:
        self.value: float | None = None

    def observe(self, date_header: str | None) -> None:
        """Record the skew a response dated ``date_header`` shows (ignores a bad header)."""
        if not date_header:
            return
        try:
            served = email.utils.parsedate_to_datetime(date_header)
        except (TypeError, ValueError):
            return
        if served.tzinfo is None:  # "-0000": a time in no known zone cannot be compared
            return
        self.value = time.time() - served.timestamp()
