"""Tool approvals as durable waits: a run that needs a person suspends, and no process waits.

The SDK stops a run at a tool that ``needs_approval`` and returns it with
``interruptions``; the caller decides each one on ``result.to_state()`` and
runs that state again, which goes on without asking the model again. Here
each decision is ``ctx.wait_for(signal, accepts="approval")``: the first
time, the run *suspends* (status ``waiting``, its lease released). When the
signal comes (``wf.signal``, ``durable-steps signal``, the web page), the
step runs again from its start: every model response and tool call up to
the interruption replays from the journal, the wait returns the recorded
decision, and the approved tool runs.

The signal is ``approve:<tool call id>`` (characters a signal name may not
hold become ``-``; an id too long for a signal name is shortened to its
head and a digest, :func:`~durable_steps.integrations._names.shortened`),
also what ``RunSuspended.signal`` and ``show`` give. Its payload is the one
approval payload of the project (:mod:`durable_steps._fleet.approval`):
``{"approved": true}``, ``{"approved": false, "message": "why"}`` (the model
is told ``message`` if given, else the SDK's default), or bare ``true`` /
``false``. A payload of another shape decides nothing: it is refused when
sent, and a tool that needs a person's yes runs only on a clear yes.

Runs that waited before ids were shortened
    Earlier versions cut a long id at 180 characters, with no digest (two ids
    sharing those characters shared a signal). A run that recorded its
    approval under such a name, or waits under one, goes on under it: the
    old name is used when the step's journal holds it (a run woken for a
    signal has it recorded before its step runs), for the first call it fits
    only: the old name cannot say which of two such calls it was sent for, so
    any other is asked for under its own new name rather than decided by it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._fleet.approval import SHAPE, approval
from ...errors import SignalRefused
from .._names import shortened

if TYPE_CHECKING:
    from agents import ToolApprovalItem

__all__ = ["decide", "signal_name"]

_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._@=+:-]")
_ROOM = 180
"""Characters of ``<prefix><call id>`` a signal name holds (200 with ``approve:`` and ``@N``)."""


def signal_name(
    item: ToolApprovalItem,
    prefix: str = "",
    iteration: int = 0,
    recorded: Callable[[str], bool] = lambda name: False,
) -> str:
    """The signal that decides ``item``: ``approve:<tool call id>`` — with the run's
    prefix (``approve:refunds:<id>`` for ``run_name="refunds"``) and, from the second
    pass of a loop on, the pass (``approve:<id>@2``), so no approval is asked for
    under a name a signal was delivered to already. ``recorded(journal name)`` says
    whether the step recorded a signal under an earlier version's name (see the
    module docstring).
    """
    raw = item.raw_item
    call_id = raw.get("call_id") if isinstance(raw, dict) else getattr(raw, "call_id", None)
    if not call_id:
        call_id = getattr(raw, "id", None) or item.tool_name or "tool"
    text = _NOT_IN_NAME.sub("-", f"{prefix}{call_id}")
    tail = f"@{iteration}" if iteration else ""
    name = f"approve:{shortened(text, _ROOM, '=')}{tail}"
    legacy = f"approve:{text[:_ROOM]}{tail}"
    return legacy if legacy != name and recorded(f"signal:{legacy}") else name


def decide(payload: Any, run: str, step: str, signal: str) -> tuple[bool, str | None]:
    """What signal ``signal``'s payload says: (approved, rejection message).

    A payload of another shape reached the step only if a run recorded it
    before approvals were checked when sent (an earlier version): it decides
    nothing, and the step fails with an error saying so.
    """
    decided = approval(payload)
    if decided is None:
        raise SignalRefused(
            f"run {run}: step {step!r}: signal {signal!r} carries {payload!r}, which is not "
            f"an approval ({SHAPE}); it was recorded before approvals were checked when "
            "sent, and decides nothing, so the tool call neither runs nor is rejected. "
            "Fork the run (`durable-steps fork`: the fork runs this step again and asks "
            "for a new approval) or delete it.",
            run=run,
            step=step,
            signal=signal,
        )
    return decided
