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
``"memory://"``                     a new :class:`MemoryStore`
a ``Store`` object                  itself
==================================  ==========================================
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ..errors import DefinitionError
from ._protocol import REQUIRED_METHODS, ObjectInfo, Store
from .local import LocalStore
from .memory import MemoryStore

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = [
    "DEFAULT_STORE",
    "STORE_ENV",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "S3Store",
    "Store",
    "open_store",
]

STORE_ENV = "DURABLE_STEPS_STORE"
DEFAULT_STORE = "./.durable_steps"


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
    url = urlsplit(store)
    scheme = url.scheme.lower()
    if scheme == "s3":
        from .s3 import S3Store

        return S3Store.from_url(store)
    if scheme == "memory":
        return MemoryStore()
    if scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise DefinitionError(f"store URL {store!r}: file URLs name a local path (file:///...)")
        return LocalStore(unquote(url.path))
    if scheme and len(scheme) > 1:  # "c:" is a Windows drive, not a scheme
        raise DefinitionError(
            f"store URL {store!r}: unknown scheme {url.scheme!r}; use a path, "
            "file://, s3:// or memory://"
        )
    if not store:
        raise DefinitionError("store must not be an empty string")
    return LocalStore(store)


def __getattr__(name: str) -> Any:
    # S3Store is importable from here without importing boto3 up front.
    if name == "S3Store":
        from .s3 import S3Store

        return S3Store
    raise AttributeError(name)
