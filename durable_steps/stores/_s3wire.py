"""S3Store's reading of what botocore answers or raises, and its probe verdicts.

Kept apart from :mod:`durable_steps.stores.s3` so that the store reads as the
write protocol, and this as S3's (and botocore's) ways to fail and what each
becomes: the :class:`~durable_steps.stores._remote.Service` that the shared
retry loop of :mod:`durable_steps.stores._remote` is given.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotocoreConnectionError
from urllib3.exceptions import HTTPError as URLLib3Error

from durable_steps.errors import StoreError
from durable_steps.stores._remote import Service, describe, not_sent, refused

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

# S3Store has always logged its retries on the package's own logger.
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


def describe_s3(exc: BaseException | None) -> str:
    """A fault in a few words: an S3 error code and status, or botocore's exception."""
    if isinstance(exc, ClientError):
        return f"{error_code(exc) or 'error'} (HTTP {http_status(exc)})"
    return describe(exc)


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


def service(bucket: str, endpoint: str) -> Service:
    """S3 at ``endpoint`` as the shared retry loop sees it."""

    def refusal(exc: BaseException, where: str) -> StoreError | None:
        if isinstance(exc, ClientError):
            return client_error(exc, where, bucket, endpoint)
        if isinstance(exc, BotoCoreError):  # no credentials, a bad parameter, a failed refresh
            check = "the AWS configuration (credentials, profile, region)"
            return not_sent("S3", where, exc, check)
        return None  # ours (CheckpointConflict, a missing ETag): unchanged

    return Service(
        name="S3",
        endpoint=endpoint,
        transient=is_transient,
        connection_errors=CONNECTION_ERRORS,
        refusal=refusal,
        describe=describe_s3,
        logger=logger,
    )


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
    return refused("S3", where, describe_s3(exc), hint)


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
