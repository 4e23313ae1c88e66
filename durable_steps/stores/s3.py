"""Checkpoints in S3 or any S3-compatible service that honours conditional writes.

The write protocol
------------------
Every write is conditional. The first write of a key is *create-only*
(``If-None-Match: *``); every later one is *compare-and-swap* on the ETag that
was read or written last (``If-Match: <ETag>``). The service refuses a write
whose condition does not hold with ``412 Precondition Failed`` (AWS answers
``404 NoSuchKey`` to an ``If-Match`` write of a key that is gone), and that
becomes :class:`~durable_steps.CheckpointConflict`: another writer owns the
checkpoint now, and nothing was overwritten.

Transient faults (5xx, throttling, ``409 ConditionalRequestConflict``, lost
connections and timeouts) are retried a bounded number of times with
exponential backoff and jitter. botocore's own retries are switched off on the
client this module creates so that one retry loop, this one, sees every
attempt.

A retried write has one subtlety: the attempt whose *response* was lost may
have *landed*. Its retry is then refused (412, or 404 for ``If-Match``) by our
own earlier write. So when a retry is refused, the store reads the object
back: if it holds exactly the bytes we were writing, the write is ours and its
ETag is returned; otherwise another writer got there first and the refusal is
a real :class:`~durable_steps.CheckpointConflict`. A refusal on the *first*
attempt is a conflict at once, with no read — unless the client is one you
passed in whose botocore retries are on: botocore may then have resent the
request itself, so the object is read back as for a retry. Two writers that write
byte-identical checkpoints are indistinguishable this way, which is harmless:
the object holds exactly what each of them meant to write.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, TypeVar
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotocoreConnectionError
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from durable_steps.errors import (
    CheckpointConflict,
    ConditionalWritesUnsupported,
    StoreError,
)
from durable_steps.stores._protocol import ObjectInfo

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ListObjectsV2OutputTypeDef

__all__ = ["S3Store"]

T = TypeVar("T")

# Error codes worth another attempt, whatever their HTTP status.
_TRANSIENT_CODES = frozenset(
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
_CONNECTION_ERRORS = (
    BotocoreConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    ConnectionClosedError,
    ReadTimeoutError,
    ResponseStreamingError,
    IncompleteReadError,
)
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _botocore_retries(client: S3Client) -> bool:
    """Whether ``client`` may resend a request by itself (botocore's retries)."""
    retries = getattr(getattr(client.meta, "config", None), "retries", None) or {}
    if "total_max_attempts" in retries:
        return int(retries["total_max_attempts"]) > 1
    if "max_attempts" in retries:  # counts retries, not attempts
        return int(retries["max_attempts"]) > 0
    return True  # botocore's defaults retry


def _unsupported(exc: ClientError) -> bool:
    return _code(exc) == "NotImplemented" or _status(exc) == 501


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        if _unsupported(exc):
            return False
        return _code(exc) in _TRANSIENT_CODES or _status(exc) >= 500 or _status(exc) == 429
    return isinstance(exc, _CONNECTION_ERRORS) and not isinstance(exc, SSLError)


def _ignores_conditions(endpoint_url: str) -> bool:
    """Whether the endpoint is a service known to ignore If-None-Match/If-Match on PUT."""
    host = (urlparse(endpoint_url).hostname or "").lower()
    # GCS's XML/S3 interoperability API: storage.googleapis.com, its regional
    # and private (PSC) variants.
    return host.endswith("googleapis.com") and host.startswith("storage")


class S3Store:
    """A :class:`~durable_steps.stores.Store` on an S3 bucket, under ``prefix``.

    ``S3Store("agent-checkpoints", "prod")`` keeps key ``k`` at
    ``s3://agent-checkpoints/prod/k`` and never touches objects outside
    ``prod/``. Without ``client``, one is made from boto3's standard
    configuration (credentials chain, profiles, ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` for S3-compatible services) with botocore's retries
    off, ``connect_timeout`` and ``read_timeout`` as given.

    When you pass your own ``client``, its botocore retry configuration still
    applies *under* this store's retries (each of our attempts may be several
    of botocore's): for the tightest control create it with
    ``Config(retries={"total_max_attempts": 1})``. The store closes only a
    client it created.

    Writes are conditional; see the module docstring for the protocol and for
    how a write whose response was lost is recognised as our own. Transient
    faults are retried up to ``retry_attempts`` attempts in all, with full
    jitter exponential backoff from ``retry_wait`` seconds up to
    ``retry_max_wait`` seconds (``sleep`` is injectable for tests).

    Services without conditional writes are refused with
    :class:`~durable_steps.ConditionalWritesUnsupported`: Backblaze B2 answers
    ``501 NotImplemented`` to the condition headers, and GCS's S3
    interoperability endpoint (``storage.googleapis.com``) silently ignores
    them, so it is refused at construction. ``unsafe_unconditional_writes=True``
    writes without conditions instead: two processes resuming the same run can
    then overwrite each other's checkpoints. It warns when the store is made.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: S3Client | None = None,
        unsafe_unconditional_writes: bool = False,
        retry_attempts: int = 5,
        retry_wait: float = 0.5,
        retry_max_wait: float = 5.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not bucket:
            raise ValueError("S3Store needs a bucket name")
        if retry_attempts < 1:
            raise ValueError("retry_attempts must be at least 1")
        self.bucket = bucket
        self.prefix = "/".join(part for part in prefix.strip("/").split("/") if part)
        self._base = f"{self.prefix}/" if self.prefix else ""
        self._unsafe = unsafe_unconditional_writes
        self._attempts = retry_attempts
        self._wait = retry_wait
        self._max_wait = retry_max_wait
        self._sleep = sleep
        self._owns_client = client is None
        if client is None:
            config = Config(
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            )
            client = boto3.session.Session().client("s3", config=config)
        self._client: S3Client = client
        # A client of the user's may retry inside botocore: a write of ours can
        # then land and be refused on botocore's retry, before our own retry
        # logic sees anything, so refusals are checked against the object.
        self._inner_retries = _botocore_retries(client)
        endpoint = str(client.meta.endpoint_url)
        if unsafe_unconditional_writes:
            warnings.warn(
                f"{self!r} writes checkpoints WITHOUT conditions "
                "(unsafe_unconditional_writes=True): two processes running the same run "
                "can silently overwrite each other's checkpoints.",
                RuntimeWarning,
                stacklevel=2,
            )
        elif _ignores_conditions(endpoint):
            self.close()
            raise ConditionalWritesUnsupported(
                f"{endpoint} (GCS's S3 interoperability API) does not reliably honour "
                f"conditional writes (If-None-Match / If-Match), so {self!r} cannot keep a run "
                "single-writer. Use a service that honours them (AWS S3, R2, MinIO, Ceph, "
                "SeaweedFS), or accept the risk with S3Store(..., "
                "unsafe_unconditional_writes=True)."
            )

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}')"

    # -- helpers ---------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._base + key

    def _where(self, full_key: str) -> str:
        return f"s3://{self.bucket}/{full_key}"

    def _retry(self, fn: Callable[[int], T], full_key: str) -> T:
        """Call ``fn(attempt_number)``, retrying transient faults; map the last to StoreError."""
        retrying = Retrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_random_exponential(multiplier=self._wait, max=self._max_wait),
            retry=retry_if_exception(_is_transient),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    return fn(attempt.retry_state.attempt_number)
        except ClientError as exc:
            if _is_transient(exc):
                raise StoreError(
                    f"S3 kept failing for {self._where(full_key)}: {_code(exc)} "
                    f"(HTTP {_status(exc)}) after {self._attempts} attempts. The service is "
                    "unavailable or throttling; rerun later (the run resumes)."
                ) from exc
            self._raise_client_error(exc, full_key)
        except _CONNECTION_ERRORS as exc:
            raise StoreError(
                f"cannot reach S3 for {self._where(full_key)} at "
                f"{self._client.meta.endpoint_url} after {self._attempts} attempts: {exc}. "
                "Check the endpoint URL and the network; rerun later (the run resumes)."
            ) from exc
        except BotoCoreError as exc:  # no credentials, a bad parameter, a failed refresh...
            raise StoreError(
                f"S3 request for {self._where(full_key)} failed before it was sent: {exc}. "
                "Check the AWS configuration (credentials, profile, region)."
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    def _raise_client_error(self, exc: ClientError, full_key: str) -> NoReturn:
        code, status = _code(exc), _status(exc)
        where = self._where(full_key)
        if code == "NoSuchBucket":
            hint = (
                f"the bucket {self.bucket!r} does not exist at {self._client.meta.endpoint_url}: "
                "check the bucket name, the region and the endpoint (AWS_ENDPOINT_URL_S3)"
            )
        elif code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}:
            hint = "the credentials were rejected: check the access key, secret and profile"
        elif code in {"AccessDenied", "AllAccessDisabled"} or status == 403:
            hint = (
                f"access denied: the credentials need s3:GetObject, s3:PutObject, "
                f"s3:DeleteObject and s3:ListBucket on {self.bucket!r}"
            )
        else:
            hint = "see the cause below"
        raise StoreError(
            f"S3 refused a request for {where}: {code} (HTTP {status}); {hint}."
        ) from exc

    # -- the Store protocol ----------------------------------------------------

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(bytes, ETag)`` of ``key``, or ``None`` if it does not exist."""
        full = self._key(key)

        def once(_attempt: int) -> tuple[bytes, str] | None:
            return self._get_once(full)

        return self._retry(once, full)

    def _get_once(self, full: str) -> tuple[bytes, str] | None:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
        except ClientError as exc:
            if _code(exc) in _MISSING_KEY_CODES:
                return None
            raise
        with response["Body"] as body:
            data = body.read()
        return data, response["ETag"]

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write ``data`` create-only (``match=None``) or if the ETag is ``match``.

        Return the new ETag. Raise :class:`~durable_steps.CheckpointConflict`
        when another writer changed (or created, or deleted) the key, and
        :class:`~durable_steps.ConditionalWritesUnsupported` when the service
        does not implement conditional writes. A retry refused because the
        lost-response attempt before it landed is recognised by reading the
        object back (see the module docstring).
        """
        full = self._key(key)

        def once(attempt: int) -> str:
            try:
                return self._put_once(full, data, match)
            except ClientError as exc:
                if self._unsafe:
                    raise
                if _unsupported(exc):
                    raise ConditionalWritesUnsupported(
                        f"the S3 service at {self._client.meta.endpoint_url} does not implement "
                        f"conditional writes ({_code(exc) or 'HTTP 501'} for "
                        f"{'If-None-Match' if match is None else 'If-Match'} on "
                        f"{self._where(full)}; Backblaze B2 answers so). Without them two "
                        "processes can overwrite each other's checkpoints. Use a service that "
                        "honours them, or accept the risk with S3Store(..., "
                        "unsafe_unconditional_writes=True)."
                    ) from exc
                refused = _status(exc) == 412 or _code(exc) == "PreconditionFailed"
                gone = match is not None and _code(exc) in _MISSING_KEY_CODES
                if not (refused or gone):
                    raise
                if attempt > 1 or self._inner_retries:
                    landed = self._get_once(full)
                    if landed is not None and landed[0] == data:
                        return landed[1]  # our earlier attempt landed; its response was lost
                raise self._conflict(full, match) from exc

        return self._retry(once, full)

    def _put_once(self, full: str, data: bytes, match: str | None) -> str:
        if self._unsafe:
            return self._client.put_object(Bucket=self.bucket, Key=full, Body=data)["ETag"]
        if match is None:
            response = self._client.put_object(
                Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*"
            )
        else:
            response = self._client.put_object(
                Bucket=self.bucket, Key=full, Body=data, IfMatch=match
            )
        return response["ETag"]

    def _conflict(self, full: str, match: str | None) -> CheckpointConflict:
        if match is None:
            what = "it already exists: another writer created it"
        else:
            what = f"it is no longer version {match}: another writer changed or deleted it"
        return CheckpointConflict(
            f"conditional write to {self._where(full)} refused; {what}. "
            "Nothing was overwritten; this process must stop."
        )

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key``; a missing key is not an error.

        With ``match``, the delete carries ``If-Match`` and a refusal raises
        :class:`~durable_steps.CheckpointConflict`. A service that does not
        implement conditional deletes gets a plain delete and a warning.
        """
        full = self._key(key)
        conditional = match is not None and not self._unsafe

        def once(_attempt: int) -> None:
            nonlocal conditional
            try:
                if conditional:
                    assert match is not None
                    self._client.delete_object(Bucket=self.bucket, Key=full, IfMatch=match)
                else:
                    self._client.delete_object(Bucket=self.bucket, Key=full)
            except ClientError as exc:
                if _code(exc) in _MISSING_KEY_CODES:
                    return  # gone already (perhaps by our own attempt whose answer was lost)
                if conditional and _unsupported(exc):
                    warnings.warn(
                        f"{self!r}: the service does not implement conditional deletes; "
                        f"deleting {full!r} unconditionally",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    conditional = False
                    self._client.delete_object(Bucket=self.bucket, Key=full)
                    return
                if conditional and (_status(exc) == 412 or _code(exc) == "PreconditionFailed"):
                    # SeaweedFS refuses If-Match on a missing key with 412 where
                    # AWS says 404: gone is gone, whoever deleted it.
                    if self._get_once(full) is None:
                        return
                    raise self._conflict(full, match) from exc
                raise

        self._retry(once, full)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield every object whose key (relative to the store) starts with ``prefix``.

        Pages through ListObjectsV2 by continuation token, each page retried on
        its own, so a transient fault mid-listing neither restarts nor
        duplicates the listing.
        """
        full = self._key(prefix)
        token: str | None = None
        while True:
            page = self._retry(self._list_page(full, token), full)
            for obj in page.get("Contents", []):
                name = obj.get("Key", "")
                if not name.startswith(self._base):
                    continue
                yield ObjectInfo(
                    key=name[len(self._base) :],
                    version=obj.get("ETag", ""),
                    size=obj.get("Size", 0),
                    modified=obj["LastModified"].timestamp() if "LastModified" in obj else 0.0,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _list_page(
        self, full: str, token: str | None
    ) -> Callable[[int], ListObjectsV2OutputTypeDef]:
        def once(_attempt: int) -> ListObjectsV2OutputTypeDef:
            if token is None:
                return self._client.list_objects_v2(Bucket=self.bucket, Prefix=full)
            return self._client.list_objects_v2(
                Bucket=self.bucket, Prefix=full, ContinuationToken=token
            )

        return once

    def close(self) -> None:
        """Close the client if this store created it."""
        if self._owns_client:
            self._client.close()
