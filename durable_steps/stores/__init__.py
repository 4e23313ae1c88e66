"""Where checkpoints live: the store protocol, the stores, and store URLs.

==================================  ==========================================
``store=``                          store
==================================  ==========================================
``None``                            ``$DURABLE_STEPS_STORE``, else the local
                                    directory ``./.durable_steps``
``"./ckpt"``, ``"file:///var/ckpt"``  :class:`LocalStore`
``"s3://bucket/prefix"``            :class:`S3Store` with boto3's standard
                                    configuration (``AWS_ENDPOINT_URL_S3`` for
                                    R2, MinIO, Ceph, SeaweedFS)
``"gs://bucket/prefix"``            :class:`GCSStore` with Application Default
                                    Credentials (``STORAGE_EMULATOR_HOST`` for
                                    an emulator); extra ``[gcs]``
``"az://container/prefix"``         :class:`AzureBlobStore` on the account of
                                    ``$AZURE_STORAGE_CONNECTION_STRING``;
                                    extra ``[azure]``
``"memory://"``                     a new :class:`MemoryStore`
a ``Store`` object                  itself
==================================  ==========================================

The remote stores share their retry loop, lost-response read-back and
messages (``_remote.py``), and offer one optional method beyond the
protocol: ``clock_skew() -> float | None``, the seconds this host's clock is
ahead of the service's, from the ``Date`` header of the latest response.
"""

from __future__ import annotations

import importlib
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ..errors import DefinitionError
from ._protocol import REQUIRED_METHODS, ObjectInfo, Store
from .local import LocalStore
from .memory import MemoryStore

if TYPE_CHECKING:
    from .azure import AzureBlobStore
    from .gcs import GCSStore
    from .s3 import S3Store

__all__ = [
    "DEFAULT_STORE",
    "STORE_ENV",
    "AzureBlobStore",
    "GCSStore",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "S3Store",
    "Store",
    "command_hint",
    "extra_hint",
    "open_store",
]

STORE_ENV = "DURABLE_STEPS_STORE"
DEFAULT_STORE = "./.durable_steps"


def command_hint(store: object) -> str:
    """``durable-steps`` as a message that suggests a command should spell it to
    reach ``store``: with ``--store URL`` unless the command would find that
    store by itself (``$DURABLE_STEPS_STORE``, else the default directory).
    A store without a ``url`` (memory, a wrapper) gets the bare name.
    """
    url = getattr(store, "url", None)
    if not isinstance(url, str) or _names(os.environ.get(STORE_ENV) or DEFAULT_STORE, url):
        return "durable-steps"
    return f"durable-steps --store {shlex.quote(url)}"


def _names(spec: str, url: str) -> bool:
    """Whether the store URL or path ``spec`` opens the store whose ``url`` is ``url``."""
    if "://" in spec and not spec.startswith("file://"):
        return spec.partition("?")[0].rstrip("/") == url
    path = unquote(urlsplit(spec).path) if spec.startswith("file://") else spec
    return str(Path(path).expanduser().absolute()) == url


def open_store(store: str | os.PathLike[str] | Store | None = None) -> Store:
    """Turn a ``store=`` argument (see the table above) into a store."""
    if store is None:
        store = os.environ.get(STORE_ENV) or DEFAULT_STORE
    if isinstance(store, os.PathLike):
        return LocalStore(store)
    if not isinstance(store, str):
        # getattr, not isinstance(store, Store): since Python 3.12 a protocol
        # check ignores __getattr__, which refuses forwarding wrappers.
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(store, m, None))]
        if missing:
            raise DefinitionError(
                f"store must be a URL, a path or a Store, not {store!r}: it lacks "
                f"callable {', '.join(missing)} (a Store has {', '.join(REQUIRED_METHODS)})"
            )
        return store
    try:
        url = urlsplit(store)
    except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 host
        raise DefinitionError(f"store URL {store!r} is malformed: {exc}") from exc
    scheme = url.scheme.lower()
    if scheme in _REMOTE:
        return _open_remote(store, url.netloc, url.path, url.query, scheme)
    if scheme in ("memory", "file") and (url.query or url.fragment):
        raise DefinitionError(f"store URL {store!r}: {scheme}:// URLs take no parameters")
    if scheme == "memory":
        return MemoryStore()
    if scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise DefinitionError(f"store URL {store!r}: file URLs name a local path (file:///...)")
        return LocalStore(unquote(url.path))
    if scheme and len(scheme) > 1:  # "c:" is a Windows drive, not a scheme
        raise DefinitionError(
            f"store URL {store!r}: unknown scheme {url.scheme!r}; use a path, "
            "file://, s3://, gs://, az:// or memory://"
        )
    if not store:
        raise DefinitionError("store must not be an empty string")
    return LocalStore(store)


# URL scheme -> (store class, what the URL's host part names).
def _open_remote(store: str, netloc: str, path: str, query: str, scheme: str) -> Store:
    """``s3://``, ``gs://`` or ``az://``: the store class, imported only now."""
    name, holder = _REMOTE[scheme]
    if not netloc:
        raise DefinitionError(
            f"store URL {store!r} names no {holder}: use {scheme}://{holder}/prefix"
        )
    store_class = _lazy(name)
    if scheme == "s3":  # its timeouts and retries come from the URL's query too
        return store_class.from_url(store)  # type: ignore[no-any-return]
    if query:
        raise DefinitionError(
            f"store URL {store!r}: {scheme}:// URLs take no parameters; configure "
            f"the store with ds.{name}(...) instead"
        )
    return store_class(netloc, unquote(path).strip("/"))  # type: ignore[no-any-return]


_REMOTE = {
    "s3": ("S3Store", "bucket"),
    "gs": ("GCSStore", "bucket"),
    "az": ("AzureBlobStore", "container"),
}
# The remote stores' classes, importable from here without importing their
# SDKs up front: class name -> (module, pip extra).
_LAZY = {
    "S3Store": ("s3", None),
    "GCSStore": ("gcs", "gcs"),
    "AzureBlobStore": ("azure", "azure"),
}


def extra_hint(extra: str) -> str:
    """How to install an extra: from the index, and from a checkout of the repository."""
    return f"pip install 'durable-steps[{extra}]' (from a checkout: pip install -e '.[{extra}]')"


def _lazy(name: str) -> Any:
    """Import the store class ``name`` from its module, saying which extra is missing."""
    module, extra = _LAZY[name]
    try:
        imported = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if extra is None or exc.name == f"{__name__}.{module}":
            raise
        raise ImportError(
            f"{name} needs the {extra!r} extra ({exc.name} is not installed): {extra_hint(extra)}"
        ) from exc
    return getattr(imported, name)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _lazy(name)
    raise AttributeError(name)
