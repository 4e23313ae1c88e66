"""The one approval payload: what every approval the library waits for accepts.

A person approves or rejects with the shape the tutorial teaches, wherever
the approval comes from (an agent integration's tool approval, the web
page, ``durable-steps signal``, ``wf.signal``)::

    {"approved": true}
    {"approved": false, "message": "why"}    # message optional
    true / false

Nothing else decides: a payload of another shape (``"approve"``,
``{"approve": true}``, ``null``) is neither a yes nor a no. So a wait for
an approval records that it accepts only this (``accepts: "approval"`` in
the run's ``wait``), and a signal whose payload does not fit is refused
when it is sent (:func:`durable_steps._fleet.signals.send`) — a typo is heard by
the person who made it, instead of silently approving or rejecting a tool
call. One sent before the run waited (so not checked then) is not
delivered: the run keeps waiting, and a signal of the right shape may be
sent under the same name (it replaces the one that decided nothing).

Waits recorded by earlier versions carry no ``accepts`` and accept anything,
as they did; an ``accepts`` this version does not know is not checked
either (a newer writer's kind).
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

__all__ = ["APPROVAL", "SHAPE", "Accepts", "accepted", "approval", "refusal"]

APPROVAL: Final = "approval"
"""A wait's ``accepts`` for an approval: :func:`approval` decides its payload."""

Accepts = Literal["approval"]
"""What a wait may say it accepts (``ctx.wait_for(..., accepts=)``)."""

SHAPE = (
    '{"approved": true}, {"approved": false, "message": "why"} (message optional), '
    "or bare true / false"
)
"""The accepted payloads, in the words every refusal and ``show`` use."""

_KEYS = frozenset({"approved", "message"})


def approval(payload: Any) -> tuple[bool, str | None] | None:
    """``(approved, message)`` for an approval payload, None for any other shape.

    ``message`` is the rejection's reason (None when not given); on an
    approval it is ignored.
    """
    if payload is True or payload is False:
        return payload, None
    if not isinstance(payload, dict) or not set(payload) <= _KEYS:
        return None  # an unknown key ("mesage", "approve") is a typo, not a decision
    approved, message = payload.get("approved"), payload.get("message")
    if not isinstance(approved, bool) or not (message is None or isinstance(message, str)):
        return None
    return approved, None if approved else message


def accepted(accepts: object, payload: Any) -> bool:
    """Whether a wait that accepts ``accepts`` takes ``payload`` (None, a record written
    before waits said what they accept, or a kind unknown here: anything).
    """
    return accepts != APPROVAL or approval(payload) is not None


def refusal(run: str, signal: str, payload: Any, step: object = None) -> str:
    """Why ``payload`` decides nothing for signal ``signal`` of ``run``, and what to send."""
    at = f" at step {step!r}" if step is not None else ""
    shown = json.dumps(payload)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return (
        f"run {run} waits{at} for signal {signal!r} as an approval, and the payload "
        f"{shown} is not one: send {SHAPE}"
    )
