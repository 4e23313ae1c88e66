"""Whether the head a run page shows is the one its workflow signed, and what the page may say.

A workflow that signs (``signing_key=``, or a pickle workflow while
``$DURABLE_STEPS_SIGNING_KEY`` is set) writes every head with a ``sig``
field, and refuses to load one without it or whose tag does not verify
(guarantee 10). The page reads heads as ``show`` does (``cli._runs.load``):
with the key set, a head that says it is signed is verified, and one that
fails is refused, not displayed. That leaves three heads ``show`` prints
as if they were genuine, which the page must not:

- one that says it is signed (its serializer ends in ``+hmac-sha256``) and
  has no ``sig``: no writer with the key writes that, so it is refused
  whether or not the page has the key (the key is not needed to see that
  the signature is missing; with it, ``load`` already refuses it);
- one with a ``sig`` the page cannot check (no key): shown, marked *not
  verified*, every field of it being only what the head claims;
- one without a ``sig`` while the page has the key: a workflow that signs
  refuses it, but a JSON workflow without ``signing_key=`` writes exactly
  that, and nothing in the store says which workflows sign. So it is
  shown, marked *not signed*, with what that means.

A head with a ``sig`` whose serializer does not say it is signed (the
suffix cut off) is checked with the key too: a genuine writer never
writes one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._record import checkpoint as ckpt
from .._record.sealing import sealed as is_sealed
from .._record.sealing import sealed_record
from ..errors import CorruptCheckpoint
from ..serializers import SIGNED_SUFFIX, SIGNING_KEY_ENV, JSONSerializer, SignedSerializer

__all__ = ["Signature", "check", "unsealed_claim"]


@dataclass(frozen=True)
class Signature:
    """What the page knows of a head's signature."""

    kind: str
    """``verified`` (checked with the key), ``unverified`` (signed; no key to check
    it), ``unsigned`` (no signature: genuine only if its workflow does not sign)."""
    text: str
    """The ``signature`` field of the page."""
    warning: str = ""
    """What the page says above everything else (empty: nothing to warn of)."""


def unsealed_claim(raw: Mapping[str, Any]) -> bool:
    """Whether a head's raw header says it is signed and carries no signature: what
    the runs list marks corrupt. The list reads raw headers, not bytes
    (:func:`~durable_steps._record.sealing.sealed_record`); the run page checks the
    bytes and, with the key, the tag itself.
    """
    serializer = raw.get("serializer")
    claims = isinstance(serializer, str) and serializer.endswith(SIGNED_SUFFIX)
    return claims and not sealed_record(raw)


def check(header: ckpt.Checkpoint, data: bytes) -> Signature:
    """How far the head ``data`` (decoded as ``header``) can be trusted; raises
    :class:`CorruptCheckpoint` for one that no workflow with the key wrote.
    """
    where = f"run {header.run}: checkpoint {ckpt.checkpoint_key(header.workflow, header.run_id)!r}"
    claims, sealed = header.serializer.endswith(SIGNED_SUFFIX), is_sealed(data)
    if claims and not sealed:
        raise CorruptCheckpoint(
            f"{where} says it is signed ({header.serializer}) but carries no signature. A "
            "workflow that signs writes one on every head and refuses this one: it was "
            "written by someone without the key (or signed by durable_steps 0.1, whose "
            "signature covered the state only). None of it is shown: its status, journal "
            "and history could be anyone's. It was left untouched.",
            run=header.run,
        )
    key = os.environ.get(SIGNING_KEY_ENV)
    if sealed and key:
        ckpt.decode(
            data, where=where, run=header.run, signer=SignedSerializer(JSONSerializer(), key)
        )
        return Signature("verified", f"verified with ${SIGNING_KEY_ENV}")
    if sealed:
        return Signature(
            "unverified",
            f"signed, not verified (${SIGNING_KEY_ENV} is not set)",
            "Not verified: this run is signed, but the page has no signing key "
            f"(${SIGNING_KEY_ENV}) to check its signature. Its status, position, journal and "
            "timeline below are what its head claims: anyone who can write the store could "
            "have written them. Start the page with the key set to verify them.",
        )
    if key:
        return Signature(
            "unsigned",
            "none",
            "Not signed, while the page has a signing key: a workflow that signs "
            "(signing_key=, or a pickle workflow with the key set) refuses this head. If "
            f"workflow {header.workflow!r} signs, this is not its record, and everything "
            "below is forged; it is genuine only if that workflow does not sign.",
        )
    return Signature("unsigned", "none")
