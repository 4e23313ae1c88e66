"""A checkpoint's signature: the ``sig`` field that ends a signed head's header line.

With a signing key (:class:`~durable_steps.SignedSerializer`), :func:`checkpoint.encode
<durable_steps._record.checkpoint.encode>` appends ``"sig": <64 hex>`` as the header
line's last field: a tag over the line written without it and over the payload, so a
reader recovers the signed bytes exactly by cutting it off, with no canonical
re-encoding. This module finds that field (:func:`sealed`, for readers without the key
too: the web page) and checks it (:func:`unseal`, before anything is trusted).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from typing import Any, Protocol

from ..errors import CorruptCheckpoint

__all__ = ["Signer", "sealed", "sealed_record", "unseal"]


class Signer(Protocol):
    """What signs a checkpoint (:class:`~durable_steps.SignedSerializer` does)."""

    def seal(self, header: bytes, payload: bytes) -> str:
        """The hex tag that binds the header line ``header`` to ``payload``."""
        ...


_TAG = "[0-9a-f]{64}"
"""What a tag is: 64 hex digits (an HMAC-SHA256)."""
_SIG_TAIL = re.compile(rb',"sig":"(%s)"\}\Z' % _TAG.encode())
_TAG_TEXT = re.compile(_TAG)


def _seal_of(line: bytes) -> re.Match[bytes] | None:
    """The ``sig`` field ending a header ``line``, if any (the tag is the line's
    last field: only its end is looked at).
    """
    return _SIG_TAIL.search(line, max(len(line) - 80, 0))


def sealed(data: bytes) -> bool:
    """Whether the stored head ``data`` carries a signature (not whether it verifies)."""
    newline = data.find(b"\n")
    return _seal_of(data[:newline] if newline >= 0 else data) is not None


def sealed_record(record: Mapping[str, Any]) -> bool:
    """:func:`sealed` for a header line already parsed (``record``, in its order):
    a tag in its last field, ``sig``.
    """
    tag = record.get("sig")
    return list(record)[-1:] == ["sig"] and isinstance(tag, str) and bool(_TAG_TEXT.fullmatch(tag))


def unseal(data: bytes, signer: Signer | None, where: str, run: str | None) -> None:
    """Check a signed checkpoint's tag before anything in it is trusted.

    Guarantee 10: with a signing key, the header (status, cursor, nonce,
    intent, owner) is authenticated together with the payload, and the run
    it names is checked against the key it was read from by the caller, so
    an edited header or a payload moved from another run is refused unread.
    """
    if signer is None:
        return
    newline = data.find(b"\n")
    line = data[:newline] if newline >= 0 else data
    found = _seal_of(line)
    if found is None:
        raise CorruptCheckpoint(
            f"{where} is not signed, but a signing key is set, so it is refused unread: "
            "anyone who can write the store could have written it (or it was signed by "
            "durable_steps 0.1, whose signature covered the state only). Resume it without "
            "the key only if you trust every writer of the store; it was left untouched.",
            run=run,
        )
    body = line[: found.start()] + b"}"
    payload = data[newline + 1 :] if newline >= 0 else b""
    if not hmac.compare_digest(found.group(1).decode(), signer.seal(body, payload)):
        raise CorruptCheckpoint(
            f"{where}: its signature does not verify: the checkpoint was changed by someone "
            "without the signing key (or signed with another key, or moved from another "
            "run). It was refused unread and left untouched.",
            run=run,
        )
