"""Checkpoints in Azure Blob Storage, with ETag conditions.

The write protocol
------------------
The version of a blob is its ETag (kept in its quoted header form). The first
write of a key is *create-only* (``If-None-Match: *``); every later one, and a
conditional delete, is *compare-and-swap* on the ETag read or written last
(``If-Match: <ETag>``). The service documents two refusals, and both become
:class:`~durable_steps.CheckpointConflict`: ``409 BlobAlreadyExists`` for a
create-only write of a blob that exists, ``412 ConditionNotMet`` for an
``If-Match`` that does not hold (also for a blob that is gone). Other 409s (a
lease, a pending copy) are not conflicts of ours and raise
:class:`~durable_steps.StoreError`.

Transient faults (408, 429, 500, 503 ``ServerBusy``, lost connections and
timeouts) are retried by this store alone: every call passes
``retry_total=0``, which switches azure-core's retry policy off for that call
even on a client you passed in. A retried write that is refused is read back,
as for :class:`~durable_steps.S3Store`: identical bytes mean our own earlier
attempt landed and only its response was lost.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    IncompleteReadError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.pipeline import PipelineResponse
from azure.storage.blob import BlobServiceClient, ContainerClient

from durable_steps.errors import StoreError
from durable_steps.stores._protocol import ObjectInfo
from durable_steps.stores._remote import (
    ClockSkew,
    Page,
    Retrier,
    Service,
    describe,
    join_prefix,
    listing,
    refused,
)

__all__ = ["CONNECTION_STRING_ENV", "AzureBlobStore"]

CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONNECTION_ERRORS = (
    ServiceRequestError,  # the request was not sent: refused, DNS, connect timeout
    ServiceResponseError,  # sent, but the answer was lost or timed out
    IncompleteReadError,  # the body was cut off
)
_REFUSALS = frozenset({"BlobAlreadyExists", "ConditionNotMet"})


def _status(exc: HttpResponseError) -> int:
    return int(exc.status_code or 0)


def _code(exc: HttpResponseError) -> str:
    headers = getattr(exc.response, "headers", None) or {}
    return str(headers.get("x-ms-error-code") or getattr(exc, "error_code", None) or "")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _CONNECTION_ERRORS):
        return True
    return isinstance(exc, HttpResponseError) and _status(exc) in _TRANSIENT_STATUS


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, HttpResponseError) and not isinstance(exc, _CONNECTION_ERRORS):
        return f"{_code(exc) or 'error'} (HTTP {_status(exc)})"
    return describe(exc)


def _refused(exc: HttpResponseError) -> bool:
    return _code(exc) in _REFUSALS or _status(exc) == 412


def _quoted(etag: str) -> str:
    # Headers carry the ETag quoted, listings without quotes: one spelling.
    return etag if etag.startswith('"') else f'"{etag}"'


class AzureBlobStore:
    """A :class:`~durable_steps.stores.Store` on an Azure Blob container, under ``prefix``.

    ``AzureBlobStore("agent-checkpoints", "prod")`` keeps key ``k`` at
    ``az://agent-checkpoints/prod/k`` and never touches blobs outside
    ``prod/``. Without ``client``, the account comes from the connection
    string in ``$AZURE_STORAGE_CONNECTION_STRING`` (for Azurite too). To use
    Microsoft Entra ID or a SAS token, pass ``client=BlobServiceClient(url,
    credential=...)`` (or a ``ContainerClient`` of this container). The store
    closes only a client it created.

    Writes are conditional; see the module docstring. Transient faults are
    retried up to ``retry_attempts`` attempts in all, with full jitter
    exponential backoff from ``retry_wait`` up to ``retry_max_wait`` seconds
    (``sleep`` is injectable for tests); each request waits
    ``connect_timeout`` to connect and ``read_timeout`` for an answer. Each
    retry is logged at WARNING on the ``durable_steps.stores`` logger.
    """

    _page_size: int | None = None  # blobs per LIST request; None: the service's maximum

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        client: BlobServiceClient | ContainerClient | None = None,
        retry_attempts: int = 4,
        retry_wait: float = 0.5,
        retry_max_wait: float = 5.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 20.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not container:
            raise ValueError("AzureBlobStore needs a container name")
        self.container = container
        self.prefix = join_prefix(prefix)
        self._base = f"{self.prefix}/" if self.prefix else ""
        self._skew = ClockSkew()
        # Per-call options: no azure-core retries, our timeouts, the Date hook.
        self._options: dict[str, Any] = {
            "retry_total": 0,
            "connection_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "raw_response_hook": self._observe,
        }
        self._owns_client = client is None
        if client is None:
            connection_string = os.environ.get(CONNECTION_STRING_ENV)
            if not connection_string:
                raise StoreError(
                    f"no Azure Storage account for {self!r}: set {CONNECTION_STRING_ENV} to "
                    "the account's connection string, or pass AzureBlobStore(..., "
                    "client=BlobServiceClient(account_url, credential=...))."
                )
            try:
                client = BlobServiceClient.from_connection_string(connection_string)
            except ValueError as exc:
                raise StoreError(
                    f"{CONNECTION_STRING_ENV} is not a valid connection string: {exc}"
                ) from exc
        self._client = client
        if isinstance(client, ContainerClient):
            if client.container_name != container:
                raise ValueError(
                    f"the ContainerClient is for {client.container_name!r}, not {container!r}"
                )
            self._container = client
        else:
            self._container = client.get_container_client(container)
        service = Service(
            name="Azure Blob Storage",
            endpoint=self._container.url,
            transient=_is_transient,
            connection_errors=_CONNECTION_ERRORS,
            refusal=self._refusal,
            describe=_describe,
        )
        self._retry = Retrier(
            service, attempts=retry_attempts, wait=retry_wait, max_wait=retry_max_wait, sleep=sleep
        )

    @property
    def url(self) -> str:
        """The URL that opens this store again (``--store``, ``store=``)."""
        return f"az://{self.container}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:
        return f"AzureBlobStore('az://{self.container}/{self.prefix}')"

    # -- helpers ---------------------------------------------------------------

    def _observe(self, response: PipelineResponse[Any, Any]) -> None:
        answer = response.http_response
        self._skew.observe(answer.headers.get("Date"), answer.status_code)

    def _where(self, full_key: str) -> str:
        return f"az://{self.container}/{full_key}"

    def _refusal(self, exc: BaseException, where: str) -> StoreError | None:
        """The StoreError for a fault that is not transient; None: let it propagate."""
        if not isinstance(exc, HttpResponseError):
            return None
        code, status = _code(exc), _status(exc)
        if code == "ContainerNotFound":
            hint = (
                f"the container {self.container!r} does not exist in account "
                f"{self._container.account_name!r}: create it, or check the name and "
                f"{CONNECTION_STRING_ENV}"
            )
        elif isinstance(exc, ClientAuthenticationError) or code.startswith("Authentication"):
            hint = "the credentials were rejected: check the account key, SAS token or identity"
        elif status == 403:
            hint = (
                "access denied: the identity needs read, write, delete and list on the "
                f"container {self.container!r} (e.g. Storage Blob Data Contributor)"
            )
        else:
            hint = "see the cause below"
        return refused("Azure Blob Storage", where, _describe(exc), hint)

    def clock_skew(self) -> float | None:
        """Seconds this host's clock is ahead of the service's (latest response); None before."""
        return self._skew.value

    # -- the Store protocol ----------------------------------------------------

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(bytes, ETag)`` of ``key``, or ``None`` if it does not exist."""
        full = self._base + key
        return self._retry(lambda _attempt: self._get_once(full), "GET", self._where(full))

    def _get_once(self, full: str) -> tuple[bytes, str] | None:
        try:
            downloader = self._container.download_blob(full, **self._options)
            data = downloader.readall()
        except ResourceNotFoundError as exc:
            if _code(exc) == "BlobNotFound":
                return None
            raise
        return data, _quoted(downloader.properties.etag)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write ``data`` create-only (``match=None``) or if the ETag is ``match``.

        Return the new ETag. Raise :class:`~durable_steps.CheckpointConflict`
        when another writer created, changed or deleted the key; a refused
        retry is read back first (see the module docstring).
        """
        full = self._base + key
        if match is None:
            condition: dict[str, Any] = {"overwrite": False}  # sends If-None-Match: *
        else:
            condition = {
                "overwrite": True,
                "etag": match,
                "match_condition": MatchConditions.IfNotModified,  # If-Match
            }

        def once(attempt: int) -> str:
            try:
                written = self._container.get_blob_client(full).upload_blob(
                    data, **condition, **self._options
                )
            except HttpResponseError as exc:
                gone = match is not None and _code(exc) == "BlobNotFound"
                if not (_refused(exc) or gone):
                    raise
                return self._retry.refused_write(
                    attempt=attempt,
                    data=data,
                    match=match,
                    where=self._where(full),
                    read=lambda: self._get_once(full),
                )
            return _quoted(written["etag"])

        return self._retry(once, "PUT", self._where(full))

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key``; a missing key is not an error.

        With ``match``, the delete carries ``If-Match`` and a refusal raises
        :class:`~durable_steps.CheckpointConflict` unless the key is gone.
        """
        full = self._base + key
        condition: dict[str, Any] = (
            {}
            if match is None
            else {"etag": match, "match_condition": MatchConditions.IfNotModified}
        )

        def once(_attempt: int) -> None:
            try:
                self._container.delete_blob(full, **condition, **self._options)
            except HttpResponseError as exc:
                if _code(exc) == "BlobNotFound":
                    return  # gone already (perhaps by our own attempt whose answer was lost)
                if not _refused(exc):
                    raise
                self._retry.refused_delete(
                    match=match, where=self._where(full), read=lambda: self._get_once(full)
                )

        self._retry(once, "DELETE", self._where(full))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield every blob whose key (relative to the store) starts with ``prefix``.

        Pages by continuation token, each page retried on its own, so a
        transient fault mid-listing neither restarts nor duplicates the listing.
        """
        full = self._base + prefix
        return listing(
            lambda token: self._retry(self._list_page(full, token), "LIST", self._where(full)),
            self._base,
        )

    def _list_page(self, full: str, token: str | None) -> Callable[[int], Page]:
        def once(_attempt: int) -> Page:
            blobs = self._container.list_blobs(
                name_starts_with=full, results_per_page=self._page_size, **self._options
            )
            pages: Any = blobs.by_page(continuation_token=token)  # an azure-core PageIterator
            page = next(pages, None)
            entries = [
                (
                    blob.name,
                    _quoted(blob.etag),
                    int(blob.size or 0),
                    blob.last_modified.timestamp() if blob.last_modified else 0.0,
                )
                for blob in ([] if page is None else page)
            ]
            return entries, pages.continuation_token

        return once

    def close(self) -> None:
        """Close the client if this store created it."""
        if self._owns_client:
            self._client.close()
