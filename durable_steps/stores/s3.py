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

A service that accepts the condition headers but ignores them would let two
writers overwrite each other silently, so before the first write of a process
to an endpoint and bucket the store *probes* it: it creates one object under
``_durable_steps/`` twice with ``If-None-Match: *`` and expects the second
create to be refused (see :meth:`S3Store.check_conditional_writes`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from durable_steps.errors import (
    CheckpointConflict,
    ConditionalWritesUnsupported,
    DefinitionError,
    StoreError,
)
from durable_steps.stores._protocol import ObjectInfo
from durable_steps.stores._remote import ClockSkew, Page, Retrier, join_prefix, listing
from durable_steps.stores._s3options import S3Options, parse_query, resolve
from durable_steps.stores._s3wire import (
    MISSING_KEY_CODES,
    ProbeVerdicts,
    botocore_retries,
    error_code,
    etag_of,
    http_status,
    ignores_conditions,
    logger,
    service,
    unsupported,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3Store"]

# Where the conditional-write probe writes, under the store's prefix: no run
# id starts with "_", so this can never be a run's checkpoint.
PROBE_PREFIX = "_durable_steps/probe-"
# Per process, so many stores on one bucket pay for one probe.
_verdicts = ProbeVerdicts()


class S3Store:
    """A :class:`~durable_steps.stores.Store` on an S3 bucket, under ``prefix``.

    ``S3Store("agent-checkpoints", "prod")`` keeps key ``k`` at
    ``s3://agent-checkpoints/prod/k`` and never touches objects outside
    ``prod/``. Without ``client``, one is made from boto3's standard
    configuration (credentials chain, profiles, ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` for S3-compatible services, or ``endpoint_url``) with
    botocore's retries off and this store's timeouts. The store closes only a
    client it created.

    Timeouts and retries (each also read from ``DURABLE_STEPS_S3_<NAME>``,
    e.g. ``DURABLE_STEPS_S3_READ_TIMEOUT=10``, when the argument is not given;
    ``s3://bucket/prefix?read_timeout=10&retry_attempts=3`` passes them as
    arguments, see :meth:`from_url`):

    ``connect_timeout`` (5 s), ``read_timeout`` (20 s)
        for the client this store creates; set them on your own ``client``'s
        ``Config`` instead (passing both is an error).
    ``retry_attempts`` (4), ``retry_wait`` (0.5 s), ``retry_max_wait`` (5 s)
        transient faults (5xx, throttling, ``409 ConditionalRequestConflict``,
        lost connections, timeouts) are retried up to ``retry_attempts``
        attempts in all, with full-jitter exponential backoff: the wait before
        retry ``n`` is random, at most ``min(retry_max_wait, retry_wait *
        2**(n-1))``. Every retry is logged at WARNING on the ``durable_steps``
        logger (key, attempt n of N, cause, wait); the last failure raises
        :class:`~durable_steps.StoreError`.

    So an operation on a service that never answers gives up after at most
    :attr:`worst_case_seconds`: ``retry_attempts * (connect_timeout +
    read_timeout)`` plus the backoffs, 103.5 s with the defaults.

    When you pass your own ``client``, its botocore retry configuration still
    applies *under* this store's retries (each of our attempts may be several
    of botocore's): for the tightest control create it with
    ``Config(retries={"total_max_attempts": 1})``. ``sleep`` is injectable for
    tests.

    Writes are conditional; see the module docstring for the protocol and for
    how a write whose response was lost is recognised as our own. Services
    without conditional writes are refused with
    :class:`~durable_steps.ConditionalWritesUnsupported`: Backblaze B2 answers
    ``501 NotImplemented`` to the condition headers; GCS's S3 interoperability
    endpoint (``storage.googleapis.com``) ignores them and is refused at
    construction; any other service that ignores them is caught by a probe
    before the first write (:meth:`check_conditional_writes`;
    ``verify_conditional_writes=False`` skips it).
    ``unsafe_unconditional_writes=True`` writes without conditions instead: two
    processes resuming the same run can then overwrite each other's
    checkpoints. It warns when the store is made.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: S3Client | None = None,
        endpoint_url: str | None = None,
        unsafe_unconditional_writes: bool = False,
        verify_conditional_writes: bool | None = None,
        retry_attempts: int | None = None,
        retry_wait: float | None = None,
        retry_max_wait: float | None = None,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not bucket:
            raise DefinitionError("S3Store needs a bucket name")
        for_our_client = {
            "endpoint_url": endpoint_url,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
        }
        clashing = [name for name, value in for_our_client.items() if value is not None]
        if client is not None and clashing:
            raise DefinitionError(
                f"S3Store({', '.join(clashing)}=...) configures the client S3Store creates; "
                "with client=, set it on that client (boto3 Config / endpoint_url) instead"
            )
        self.options: S3Options = resolve(
            {
                "verify_conditional_writes": verify_conditional_writes,
                "retry_attempts": retry_attempts,
                "retry_wait": retry_wait,
                "retry_max_wait": retry_max_wait,
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
            },
            os.environ,
        )
        self.bucket = bucket
        self.prefix = join_prefix(prefix)
        self._base = f"{self.prefix}/" if self.prefix else ""
        self._unsafe = unsafe_unconditional_writes
        self._verify = self.options.verify_conditional_writes and not unsafe_unconditional_writes
        self._owns_client = client is None
        if client is None:
            config = Config(
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=self.options.connect_timeout,
                read_timeout=self.options.read_timeout,
            )
            client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        else:  # the timeouts that really apply, for worst_case_seconds
            theirs = getattr(client.meta, "config", None)
            self.options = dataclasses.replace(
                self.options,
                connect_timeout=getattr(theirs, "connect_timeout", self.options.connect_timeout),
                read_timeout=getattr(theirs, "read_timeout", self.options.read_timeout),
            )
        self._client: S3Client = client
        # A client of the user's may retry inside botocore: a write of ours can
        # then land and be refused on botocore's retry, before our own retry
        # logic sees anything, so refusals are checked against the object.
        self._inner_retries = botocore_retries(client)
        self._endpoint = str(client.meta.endpoint_url)
        self._retry = Retrier(
            service(bucket, self._endpoint),
            attempts=self.options.retry_attempts,
            wait=self.options.retry_wait,
            max_wait=self.options.retry_max_wait,
            sleep=sleep,
        )
        self._skew = ClockSkew()
        self._events = getattr(client.meta, "events", None)  # absent on test doubles
        if self._events is not None:
            self._events.register("after-call.s3", self._on_response)
        if unsafe_unconditional_writes:
            warnings.warn(
                f"{self!r} writes checkpoints WITHOUT conditions "
                "(unsafe_unconditional_writes=True): two processes running the same run "
                "can silently overwrite each other's checkpoints.",
                RuntimeWarning,
                stacklevel=2,
            )
        elif ignores_conditions(self._endpoint):
            self.close()
            raise ConditionalWritesUnsupported(
                f"{self._endpoint} (GCS's S3 interoperability API) does not reliably honour "
                f"conditional writes (If-None-Match / If-Match), so {self!r} cannot keep a run "
                "single-writer. Use a service that honours them (AWS S3, R2, MinIO, Ceph, "
                "SeaweedFS), or accept the risk with S3Store(..., "
                "unsafe_unconditional_writes=True)."
            )

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """Open ``s3://bucket/prefix?name=value&...``.

        The query takes ``endpoint_url`` and the options of the class
        docstring (``connect_timeout``, ``read_timeout``, ``retry_attempts``,
        ``retry_wait``, ``retry_max_wait``, ``verify_conditional_writes``); they
        win over ``DURABLE_STEPS_S3_*``. An unknown or malformed one is a
        :class:`~durable_steps.DefinitionError` naming it.
        """
        parts = urlsplit(url)
        if not parts.netloc:
            raise DefinitionError(f"store URL {url!r} names no bucket: use s3://bucket/prefix")
        return cls(parts.netloc, unquote(parts.path).strip("/"), **parse_query(url), **kwargs)

    @property
    def url(self) -> str:
        """The URL that opens this store again (``--store``, ``store=``)."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}')"

    @property
    def worst_case_seconds(self) -> float:
        """The longest one operation takes to give up on a silent service (see above)."""
        return self.options.worst_case_seconds

    @property
    def _sleep(self) -> Callable[[float], None]:
        """The backoff's sleep (tests swap it on a live store)."""
        return self._retry.sleep

    @_sleep.setter
    def _sleep(self, sleep: Callable[[float], None]) -> None:
        self._retry.sleep = sleep

    # -- the service's clock ---------------------------------------------------

    def _on_response(self, http_response: Any = None, **_: Any) -> None:
        if http_response is not None:
            self._skew.observe(http_response.headers.get("Date"), http_response.status_code)

    def clock_skew(self) -> float | None:
        """Seconds this host's clock is ahead of the service's (negative: behind).

        Measured from the ``Date`` header of the most recent answer (below
        500) the service gave this store's client: receipt time minus the
        middle of the stamped second, so within about half a second plus the
        request's latency. ``None`` before any answer.
        """
        return self._skew.value

    # -- helpers ---------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._base + key

    def _where(self, full_key: str) -> str:
        return f"s3://{self.bucket}/{full_key}"

    # -- the conditional-write probe -------------------------------------------

    def check_conditional_writes(self) -> None:
        """Make sure the service refuses a create-only write onto an existing object.

        Runs once per process for this endpoint and bucket (the first write
        calls it): creates ``_durable_steps/probe-<random>`` under the prefix
        with ``If-None-Match: *``, creates it again, expects the second to be
        refused, and deletes it (2 PUTs and 1 DELETE). A service that accepts
        the second create ignores the condition headers, and this raises
        :class:`~durable_steps.ConditionalWritesUnsupported` (every time, for
        every store on that bucket). Does nothing with
        ``verify_conditional_writes=False`` or ``unsafe_unconditional_writes=True``.
        """
        if not self._verify:
            return
        refusal = _verdicts.get((self._endpoint, self.bucket), self._probe)
        if refusal is not None:
            raise ConditionalWritesUnsupported(refusal)
        self._verify = False  # this store need not look the cache up again

    def _probe(self) -> str | None:
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        self._put(probe, b"durable_steps conditional-write probe, first create")
        try:
            self._put(probe, b"durable_steps conditional-write probe, second create")
        except CheckpointConflict:
            refusal = None
        else:
            refusal = (
                f"the S3 service at {self._endpoint} accepted a second create-only write "
                f"(If-None-Match: *) of {self._where(self._key(probe))}: it ignores "
                "conditional writes, so two processes could overwrite each other's "
                "checkpoints. Use a service that honours them (AWS S3, R2, MinIO, Ceph, "
                "SeaweedFS), or accept the risk with S3Store(..., "
                "unsafe_unconditional_writes=True)."
            )
        try:
            self.delete(probe)
        except StoreError as exc:  # e.g. no s3:DeleteObject: a stray probe object is harmless
            logger.warning("%r: could not delete the probe object %s: %s", self, probe, exc)
        return refusal

    # -- the Store protocol ----------------------------------------------------

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(bytes, ETag)`` of ``key``, or ``None`` if it does not exist."""
        full = self._key(key)

        def once(_attempt: int) -> tuple[bytes, str] | None:
            return self._get_once(full)

        return self._retry(once, "GET", self._where(full))

    def _get_once(self, full: str) -> tuple[bytes, str] | None:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
        except ClientError as exc:
            if error_code(exc) in MISSING_KEY_CODES:
                return None
            raise
        with response["Body"] as body:
            data = body.read()
        return data, etag_of(response, self._where(full))

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write ``data`` create-only (``match=None``) or if the ETag is ``match``.

        Return the new ETag. Raise :class:`~durable_steps.CheckpointConflict`
        when another writer changed (or created, or deleted) the key, and
        :class:`~durable_steps.ConditionalWritesUnsupported` when the service
        does not implement conditional writes. A retry refused because the
        lost-response attempt before it landed is recognised by reading the
        object back (see the module docstring). The first write of the process
        to this bucket runs :meth:`check_conditional_writes` first.
        """
        if self._verify:
            self.check_conditional_writes()
        return self._put(key, data, match)

    def _put(self, key: str, data: bytes, match: str | None = None) -> str:
        full = self._key(key)

        def once(attempt: int) -> str:
            try:
                return self._put_once(full, data, match)
            except ClientError as exc:
                if self._unsafe:
                    raise
                if unsupported(exc):
                    raise ConditionalWritesUnsupported(
                        f"the S3 service at {self._endpoint} does not implement "
                        f"conditional writes ({error_code(exc) or 'HTTP 501'} for "
                        f"{'If-None-Match' if match is None else 'If-Match'} on "
                        f"{self._where(full)}; Backblaze B2 answers so). Without them two "
                        "processes can overwrite each other's checkpoints. Use a service that "
                        "honours them, or accept the risk with S3Store(..., "
                        "unsafe_unconditional_writes=True)."
                    ) from exc
                refused = http_status(exc) == 412 or error_code(exc) == "PreconditionFailed"
                gone = match is not None and error_code(exc) in MISSING_KEY_CODES
                if not (refused or gone):
                    raise
                return self._retry.refused_write(
                    attempt=attempt,
                    data=data,
                    match=match,
                    where=self._where(full),
                    read=lambda: self._get_once(full),
                    may_have_resent=self._inner_retries,
                )

        return self._retry(once, "PUT", self._where(full))

    def _put_once(self, full: str, data: bytes, match: str | None) -> str:
        if self._unsafe:
            response = self._client.put_object(Bucket=self.bucket, Key=full, Body=data)
        elif match is None:
            response = self._client.put_object(
                Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*"
            )
        else:
            response = self._client.put_object(
                Bucket=self.bucket, Key=full, Body=data, IfMatch=match
            )
        return etag_of(response, self._where(full))

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
                if error_code(exc) in MISSING_KEY_CODES:
                    return  # gone already (perhaps by our own attempt whose answer was lost)
                if conditional and unsupported(exc):
                    warnings.warn(
                        f"{self!r}: the service does not implement conditional deletes; "
                        f"deleting {full!r} unconditionally",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    conditional = False
                    self._client.delete_object(Bucket=self.bucket, Key=full)
                    return
                if conditional and (
                    http_status(exc) == 412 or error_code(exc) == "PreconditionFailed"
                ):
                    # SeaweedFS refuses If-Match on a missing key with 412 where
                    # AWS says 404: gone is gone, whoever deleted it.
                    self._retry.refused_delete(
                        match=match, where=self._where(full), read=lambda: self._get_once(full)
                    )
                    return
                raise

        self._retry(once, "DELETE", self._where(full))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield every object whose key (relative to the store) starts with ``prefix``.

        Pages through ListObjectsV2 by continuation token, each page retried on
        its own, so a transient fault mid-listing neither restarts nor
        duplicates the listing.
        """
        full = self._key(prefix)
        return listing(
            lambda token: self._retry(self._list_page(full, token), "LIST", self._where(full)),
            self._base,
        )

    def _list_page(self, full: str, token: str | None) -> Callable[[int], Page]:
        def once(_attempt: int) -> Page:
            if token is None:
                page = self._client.list_objects_v2(Bucket=self.bucket, Prefix=full)
            else:
                page = self._client.list_objects_v2(
                    Bucket=self.bucket, Prefix=full, ContinuationToken=token
                )
            entries = [
                (
                    obj.get("Key", ""),
                    obj.get("ETag", ""),
                    obj.get("Size", 0),
                    obj["LastModified"].timestamp() if "LastModified" in obj else 0.0,
                )
                for obj in page.get("Contents", [])
            ]
            return entries, page.get("NextContinuationToken") if page.get("IsTruncated") else None

        return once

    def close(self) -> None:
        """Close the client if this store created it."""
        if self._events is not None:
            self._events.unregister("after-call.s3", self._on_response)
        if self._owns_client:
            self._client.close()
