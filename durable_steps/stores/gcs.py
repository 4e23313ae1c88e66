"""Checkpoints in Google Cloud Storage, with generation preconditions.

The write protocol
------------------
Every object in GCS has a *generation*, a number that changes on every
write, even of identical bytes. It is this store's version. The first write
of a key is *create-only* (``ifGenerationMatch=0``: only if no live object
exists); every later one replaces the generation that was read or written
last (``ifGenerationMatch=<generation>``), and so does a conditional delete.
GCS refuses a write whose precondition does not hold with ``412
Precondition Failed``, which becomes :class:`~durable_steps.CheckpointConflict`.

Transient faults (408, 429, 5xx, lost connections and timeouts, a download
whose checksum does not match) are retried by this store alone: every call
passes ``retry=None`` so that google-cloud-storage's own retries never resend
a request behind its back. A retried write that is refused is read back, as
for :class:`~durable_steps.S3Store`: identical bytes mean our own earlier
attempt landed and only its response was lost.

Objects up to 8 MiB are written in one multipart upload; larger ones go
through a resumable upload session, which GCS also subjects to the
precondition.

The write rate of one object
----------------------------
GCS accepts about one write per second to one object name (a faster one is
answered 429, which is retried). The store says so in
:attr:`GCSStore.min_write_interval`, and a run paces the writes of its head
by it, coalescing the journaled call results made in between into the next
write (see ``durable_steps._fleet.pacing``): a step can make many quick calls a
second without meeting the limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import requests
from google.api_core import exceptions as gexc
from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError, TransportError
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption

from durable_steps.errors import StoreError
from durable_steps.stores._protocol import ObjectInfo
from durable_steps.stores._remote import (
    ClockSkew,
    Page,
    Retrier,
    Service,
    clause,
    describe,
    join_prefix,
    listing,
    not_sent,
    refused,
)

__all__ = ["GCSStore"]

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONNECTION_ERRORS = (
    requests.ConnectionError,  # refused, reset, and a response cut off mid-body
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    TransportError,  # google-auth could not reach the token endpoint
)


def _status(exc: BaseException) -> int:
    return int(getattr(exc, "code", 0) or 0)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, gexc.GoogleAPICallError):
        return _status(exc) in _TRANSIENT_STATUS
    return isinstance(exc, (*_CONNECTION_ERRORS, DataCorruption))


def _describe(exc: BaseException | None) -> str:
    # Not the message: google-api-core puts the whole answer's body (lines of XML) in it.
    if isinstance(exc, gexc.GoogleAPICallError):
        return f"HTTP {_status(exc)}"
    return describe(exc)


def _skew_of(client: Any) -> ClockSkew:
    """The clock-skew reading shared by every store on ``client``'s HTTP session.

    A response hook on the session (a ``requests.Session``) sees the ``Date``
    header of every response, whichever call made it. It is installed once
    per session, so stores sharing a client share the reading.
    """
    session = client._http  # google-cloud-core's transport: an AuthorizedSession
    skew: ClockSkew | None = getattr(session, "_durable_steps_skew", None)
    if skew is None and not isinstance(getattr(session, "hooks", None), dict):
        return ClockSkew()  # a custom transport without hooks: no reading, ever
    if skew is None:
        skew = ClockSkew()
        observe = skew.observe

        def hook(response: requests.Response, *_args: Any, **_kwargs: Any) -> None:
            observe(response.headers.get("Date"), response.status_code)

        session.hooks["response"].append(hook)
        session._durable_steps_skew = skew
    return skew


class GCSStore:
    """A :class:`~durable_steps.stores.Store` on a GCS bucket, under ``prefix``.

    ``GCSStore("agent-checkpoints", "prod")`` keeps key ``k`` at
    ``gs://agent-checkpoints/prod/k`` and never touches objects outside
    ``prod/``. Without ``client``, one is made from Application Default
    Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth
    application-default login``, or the metadata server on Google Cloud);
    ``STORAGE_EMULATOR_HOST`` points it at an emulator instead. The store
    closes only a client it created.

    Writes carry generation preconditions; see the module docstring. Transient
    faults are retried up to ``retry_attempts`` attempts in all, with full
    jitter exponential backoff from ``retry_wait`` up to ``retry_max_wait``
    seconds (``sleep`` is injectable for tests); each request waits
    ``connect_timeout`` to connect and ``read_timeout`` for an answer. Each
    retry is logged at WARNING on the ``durable_steps.stores`` logger.

    A missing bucket reads as an empty one; the run's first write then fails
    with a :class:`~durable_steps.StoreError` that names the bucket.

    ``min_write_interval`` (seconds, default 1.0) is how long a run waits
    between two writes of its head, GCS's rate limit for one object name;
    journaled calls made in between are written together (see the module
    docstring). 0 turns the pacing off (an emulator without the limit).
    """

    _page_size: int | None = None  # objects per LIST request; None: the service's maximum

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        retry_attempts: int = 4,
        retry_wait: float = 0.5,
        retry_max_wait: float = 5.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 20.0,
        min_write_interval: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not bucket:
            raise ValueError("GCSStore needs a bucket name")
        if not 0 <= min_write_interval <= 60:
            raise ValueError("GCSStore min_write_interval must be 0-60 seconds")
        self.min_write_interval = float(min_write_interval)
        """Seconds between two writes of one object name (GCS allows about one a second)."""
        self.bucket = bucket
        self.prefix = join_prefix(prefix)
        self._base = f"{self.prefix}/" if self.prefix else ""
        self._timeout = (connect_timeout, read_timeout)
        self._owns_client = client is None
        if client is None:
            try:
                client = storage.Client()
            except DefaultCredentialsError as exc:
                raise StoreError(
                    f"no Google Cloud credentials for {self!r}: {exc}. Run `gcloud auth "
                    "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a "
                    "service-account key file, set STORAGE_EMULATOR_HOST for an emulator, "
                    "or pass GCSStore(..., client=storage.Client(...))."
                ) from exc
            # google-cloud-storage (3.17 at least) fetches bucket metadata in a background
            # thread for its tracing attributes: an extra request per bucket that a
            # checkpoint store has no use for.
            if getattr(client, "_bucket_metadata_cache", None) is not None:
                client._bucket_metadata_cache = None
        self._client: Any = client
        self._bucket = client.bucket(bucket)
        self._skew = _skew_of(client)
        connection = getattr(client, "_connection", None)
        service = Service(
            name="GCS",
            endpoint=str(getattr(connection, "API_BASE_URL", "the storage endpoint")),
            transient=_is_transient,
            # A download whose checksum does not match: the bytes were damaged on the way.
            connection_errors=(*_CONNECTION_ERRORS, DataCorruption),
            refusal=self._refusal,
            describe=_describe,
        )
        self._retry = Retrier(
            service, attempts=retry_attempts, wait=retry_wait, max_wait=retry_max_wait, sleep=sleep
        )

    @property
    def url(self) -> str:
        """The URL that opens this store again (``--store``, ``store=``)."""
        return f"gs://{self.bucket}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:
        return f"GCSStore('gs://{self.bucket}/{self.prefix}')"

    # -- helpers ---------------------------------------------------------------

    def _where(self, full_key: str) -> str:
        return f"gs://{self.bucket}/{full_key}"

    def _refusal(self, exc: BaseException, where: str) -> StoreError | None:
        """The StoreError for a fault that is not transient; None: let it propagate."""
        if isinstance(exc, GoogleAuthError):  # expired or revoked credentials, a failed refresh
            return not_sent(
                "GCS",
                where,
                exc,
                "the Google Cloud credentials (gcloud auth application-default login)",
            )
        if not isinstance(exc, gexc.GoogleAPICallError):
            return None
        status = _status(exc)
        if status == 404:
            hint = (
                f"the bucket {self.bucket!r} does not exist (or is not visible to these "
                "credentials): check the bucket name and the project"
            )
        elif status == 401:
            hint = "the credentials were rejected: check them (gcloud auth application-default)"
        elif status == 403:
            hint = (
                "access denied: the credentials need storage.objects.get, .create, .delete "
                f"and .list on {self.bucket!r} (e.g. roles/storage.objectUser)"
            )
        else:
            hint = "see the cause below"
        return refused("GCS", where, f"HTTP {status} {clause(exc.message)}", hint)

    def clock_skew(self) -> float | None:
        """Seconds this host's clock is ahead of GCS's (latest response); None before any."""
        return self._skew.value

    # -- the Store protocol ----------------------------------------------------

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(bytes, generation)`` of ``key``, or ``None`` if it does not exist."""
        full = self._base + key
        return self._retry(lambda _attempt: self._get_once(full), "GET", self._where(full))

    def _get_once(self, full: str) -> tuple[bytes, str] | None:
        blob = self._bucket.blob(full)
        try:
            # One request: the generation comes back in x-goog-generation.
            data = blob.download_as_bytes(retry=None, timeout=self._timeout)
        except gexc.NotFound:
            return None
        return bytes(data), str(blob.generation)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write ``data`` create-only (``match=None``) or over generation ``match``.

        Return the new generation. Raise :class:`~durable_steps.CheckpointConflict`
        when another writer created, changed or deleted the key; a refused
        retry is read back first (see the module docstring).
        """
        full = self._base + key
        generation = 0 if match is None else int(match)

        def once(attempt: int) -> str:
            blob = self._bucket.blob(full)
            try:
                blob.upload_from_string(
                    data,
                    content_type="application/octet-stream",
                    if_generation_match=generation,
                    retry=None,
                    timeout=self._timeout,
                )
            except gexc.PreconditionFailed:
                return self._retry.refused_write(
                    attempt=attempt,
                    data=data,
                    match=match,
                    where=self._where(full),
                    read=lambda: self._get_once(full),
                )
            return str(blob.generation)

        return self._retry(once, "PUT", self._where(full))

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key``; a missing key is not an error.

        With ``match``, only generation ``match`` is removed
        (``ifGenerationMatch``); a refusal raises
        :class:`~durable_steps.CheckpointConflict` unless the key is gone.
        """
        full = self._base + key

        def once(_attempt: int) -> None:
            blob = self._bucket.blob(full)
            try:
                blob.delete(
                    if_generation_match=None if match is None else int(match),
                    retry=None,
                    timeout=self._timeout,
                )
            except gexc.NotFound:
                return  # gone already (perhaps by our own attempt whose answer was lost)
            except gexc.PreconditionFailed:
                self._retry.refused_delete(
                    match=match, where=self._where(full), read=lambda: self._get_once(full)
                )

        self._retry(once, "DELETE", self._where(full))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield every object whose key (relative to the store) starts with ``prefix``.

        Pages by page token, each page retried on its own, so a transient
        fault mid-listing neither restarts nor duplicates the listing.
        """
        full = self._base + prefix
        return listing(
            lambda token: self._retry(self._list_page(full, token), "LIST", self._where(full)),
            self._base,
        )

    def _list_page(self, full: str, token: str | None) -> Callable[[int], Page]:
        def once(_attempt: int) -> Page:
            iterator = self._client.list_blobs(
                self._bucket,
                prefix=full,
                page_token=token,
                page_size=self._page_size,
                retry=None,
                timeout=self._timeout,
            )
            page = next(iterator.pages, None)
            entries = [
                (
                    blob.name,
                    str(blob.generation),
                    int(blob.size or 0),
                    blob.updated.timestamp() if blob.updated else 0.0,
                )
                for blob in ([] if page is None else page)
            ]
            return entries, iterator.next_page_token

        return once

    def close(self) -> None:
        """Close the client's HTTP session if this store created the client."""
        if self._owns_client:
            self._client.close()
