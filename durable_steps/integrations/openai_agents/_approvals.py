"""Tool approvals as durable waits: a run that needs a person suspends, and no process waits.

The SDK stops a run at a tool that ``needs_approval`` and returns it with
``interruptions``; the caller decides each one on ``result.to_state()`` and
runs that state again, which goes on without asking the model again. Here
each decision is ``ctx.wait_for(signal)``: the first time, the run
*suspends* (status ``waiting``, its lease released). When the signal comes
(``wf.signal``, ``durable-steps signal``, the web page), the step runs again
from its start: every model response and tool call up to the interruption
replays from the journal, the wait returns the recorded decision, and the
approved tool runs.

The signal is ``approve:<tool call id>`` (characters a signal name may not
hold become ``-``), also what ``RunSuspended.signal`` and ``show`` give.
Its payload decides:

- nothing (``null``), ``true``, ``"approve"`` or ``{"approve": true}``: approved;
- ``false``, ``"reject"`` or ``{"approve": false, "message": "..."}``:
  rejected (the model is told ``message`` if given, else the SDK's default);
- anything else: rejected, with a warning — a tool that needs a person's
  yes runs only on a clear yes.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents import ToolApprovalItem

__all__ = ["decide", "signal_name"]

logger = logging.getLogger("durable_steps")
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._@=+:-]")
_YES = frozenset({"approve", "approved", "yes"})
_NO = frozenset({"reject", "rejected", "no"})


def signal_name(item: ToolApprovalItem, prefix: str = "", iteration: int = 0) -> str:
    """The signal that decides ``item``: ``approve:<tool call id>`` — with the run's
    prefix (``approve:refunds:<id>`` for ``run_name="refunds"``) and, from the second
    pass of a loop on, the pass (``approve:<id>@2``), so no approval is asked for
    under a name a signal was delivered to already.
    """
    raw = item.raw_item
    call_id = raw.get("call_id") if isinstance(raw, dict) else getattr(raw, "call_id", None)
    if not call_id:
        call_id = getattr(raw, "id", None) or item.tool_name or "tool"
    name = _NOT_IN_NAME.sub("-", f"{prefix}{call_id}")[:180]
    return f"approve:{name}" + (f"@{iteration}" if iteration else "")


def decide(payload: Any, signal: str) -> tuple[bool, str | None]:
    """What signal ``signal``'s payload says: (approved, rejection message)."""
    if isinstance(payload, dict) and isinstance(payload.get("approve"), bool):
        message = payload.get("message")
        return payload["approve"], message if isinstance(message, str) else None
    word = payload.strip().lower() if isinstance(payload, str) else None
    if payload is None or payload is True or word in _YES:
        return True, None
    if payload is False or word in _NO:
        return False, None
    logger.warning(
        "signal %r: payload %r is neither an approval nor a rejection; the tool call is "
        'rejected (send true, "approve" or {"approve": true} to approve it)',
        signal,
        payload,
    )
    return False, None
