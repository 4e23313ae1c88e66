"""S3Store's retry loop, and its reading of what botocore answers or raises.

Kept apart from :mod:`durable_steps.stores.s3` so that the store reads as the
write protocol, and this as S3's (and botocore's) ways to fail and what each
becomes: a retry, logged at WARNING on ``durable_steps``, or a StoreError; plus
the service's clock, read off the ``Date`` of its answers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotocoreConnectionError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)
from urllib3.exceptions import HTTPError as URLLib3Error

from durable_steps.errors import StoreError
from durable_steps.stores._s3options import S3Options

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

T = TypeVar("T")
logger = logging.getLogger("durable_steps")

# Error codes worth another attempt, whatever their HTTP status.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "ConditionalRequestConflict",  # 409: a concurrent conditional write is in flight
    }
)
CONNECTION_ERRORS = (
    BotocoreConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError, ...
    IncompleteReadError,  # a body shorter than its Content-Length
    URLLib3Error,  # a body read that botocore's StreamingBody does not wrap
)
MISSING_KEY_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def clause(exc: BaseException) -> str:
    """An exception's text without its closing punctuation, to embed in a sentence."""
    return str(exc).strip().rstrip(".!?;:, ")


def describe(exc: BaseException | None) -> str:
    if isinstance(exc, ClientError):
        return f"{error_code(exc) or 'error'} (HTTP {http_status(exc)})"
    return f"{type(exc).__name__}: {clause(exc)}" if exc is not None else "no answer"


def attempts_text(n: int) -> str:
    return f"{n} attempt{'s' if n != 1 else ''}"


def botocore_retries(client: S3Client) -> bool:
    """Whether ``client`` may resend a request by itself (botocore's retries)."""
    retries = getattr(getattr(client.meta, "config", None), "retries", None) or {}
    if "total_max_attempts" in retries:
        return int(retries["total_max_attempts"]) > 1
    if "max_attempts" in retries:  # counts retries, not attempts
        return int(retries["max_attempts"]) > 0
    return True  # botocore's defaults retry


def unsupported(exc: ClientError) -> bool:
    return error_code(exc) == "NotImplemented" or http_status(exc) == 501


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        if unsupported(exc):
            return False
        return (
            error_code(exc) in TRANSIENT_CODES or http_status(exc) >= 500 or http_status(exc) == 429
        )
    return isinstance(exc, CONNECTION_ERRORS) and not isinstance(exc, SSLError)


def ignores_conditions(endpoint_url: str) -> bool:
    """Whether the endpoint is a service known to ignore If-None-Match/If-Match on PUT."""
    host = (urlparse(endpoint_url).hostname or "").lower()
    # GCS's XML/S3 interoperability API: storage.googleapis.com, its regional
    # and private (PSC) variants.
    return host.endswith("googleapis.com") and host.startswith("storage")


def date_skew(http_response: Any, received: float) -> float | None:
    """How far ``received`` (local epoch seconds) is ahead of the response's ``Date``.

    ``None`` for an answer without a usable ``Date`` or with a 5xx status (a
    load balancer or proxy with its own clock may have written it). ``Date``
    has a resolution of one second, so its midpoint is the best estimate.
    """
    if http_response is None or http_response.status_code >= 500:
        return None
    date = http_response.headers.get("Date")
    try:
        stamped = parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None
    return None if stamped is None else received - (stamped + 0.5)


def with_retries(
    fn: Callable[[int], T],
    op: str,
    *,
    where: str,
    bucket: str,
    endpoint: str,
    options: S3Options,
    sleep: Callable[[float], None],
) -> T:
    """Call ``fn(attempt_number)`` for ``op`` on ``where``, retrying transient faults.

    Every retry is logged at WARNING; the last fault, and any other botocore
    exception, becomes a :class:`~durable_steps.StoreError` (whatever ``fn``
    raises of ours, such as CheckpointConflict, passes through).
    """
    n = options.retry_attempts

    def log_retry(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning(
            "S3 %s %s: attempt %d of %d failed (%s); retrying in %.2f s",
            op,
            where,
            state.attempt_number,
            n,
            describe(exc),
            wait,
        )

    retrying = Retrying(
        stop=stop_after_attempt(n),
        wait=wait_random_exponential(multiplier=options.retry_wait, max=options.retry_max_wait),
        retry=retry_if_exception(is_transient),
        before_sleep=log_retry,
        sleep=sleep,
        reraise=True,
    )
    tried, started = 0, time.monotonic()
    try:
        for attempt in retrying:
            with attempt:
                tried = attempt.retry_state.attempt_number
                return fn(tried)
    except ClientError as exc:
        if is_transient(exc):
            raise StoreError(
                f"S3 kept failing for {op} {where}: {error_code(exc)} "
                f"(HTTP {http_status(exc)}) after {attempts_text(tried)} in "
                f"{time.monotonic() - started:.1f} s. The service is unavailable or "
                "throttling; rerun later (the run resumes)."
            ) from exc
        raise client_error(exc, where, bucket, endpoint) from exc
    except CONNECTION_ERRORS as exc:
        raise StoreError(
            f"cannot reach S3 for {op} {where} at {endpoint} "
            f"after {attempts_text(tried)} in {time.monotonic() - started:.1f} s: "
            f"{clause(exc)}. Check the endpoint URL and the network; rerun later "
            "(the run resumes)."
        ) from exc
    except BotoCoreError as exc:  # no credentials, a bad parameter, a failed refresh...
        raise StoreError(
            f"S3 request for {where} failed before it was sent: "
            f"{clause(exc)}. Check the AWS configuration (credentials, profile, region)."
        ) from exc
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


def client_error(exc: ClientError, where: str, bucket: str, endpoint: str) -> StoreError:
    """The StoreError for a ClientError that is no conflict and not worth retrying."""
    code, status = error_code(exc), http_status(exc)
    if code == "NoSuchBucket":
        hint = (
            f"the bucket {bucket!r} does not exist at {endpoint}: "
            "check the bucket name, the region and the endpoint (AWS_ENDPOINT_URL_S3)"
        )
    elif code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}:
        hint = "the credentials were rejected: check the access key, secret and profile"
    elif code in {"AccessDenied", "AllAccessDisabled"} or status == 403:
        hint = (
            f"access denied: the credentials need s3:GetObject, s3:PutObject, "
            f"s3:DeleteObject and s3:ListBucket on {bucket!r}"
        )
    else:
        hint = "see the cause below"
    return StoreError(f"S3 refused a request for {where}: {code} (HTTP {status}); {hint}.")


def etag_of(response: Any, where: str) -> str:
    """The ETag of a GetObject or PutObject answer; without one, a StoreError."""
    etag = response.get("ETag")
    if not etag:
        raise StoreError(
            f"S3 answered for {where} without an ETag; a checkpoint store needs one to "
            "compare-and-swap. Use a service that returns ETags."
        )
    return str(etag)


class ProbeVerdicts:
    """Each (endpoint, bucket)'s conditional-write verdict, computed once per process.

    ``None`` means conditions are honoured, a string is the refusal. One lock
    per target, so a probe of one bucket never waits for another's.
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, str], str | None] = {}
        self._fresh_locks()
        if hasattr(os, "register_at_fork"):  # POSIX
            # A fork while another thread probes would hand the child a held
            # lock; the verdicts stay valid (same service), the locks must not.
            os.register_at_fork(after_in_child=self._fresh_locks)

    def _fresh_locks(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def get(self, target: tuple[str, str], probe: Callable[[], str | None]) -> str | None:
        """The verdict for ``target``, running ``probe`` if no verdict is known yet."""
        with self._lock:
            lock = self._locks.setdefault(target, threading.Lock())
        with lock:
            if target not in self._verdicts:
                self._verdicts[target] = probe()
            return self._verdicts[target]
