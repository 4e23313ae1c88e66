"""Effects firing in this process: one at a time per idempotency key.

An effect's intent is durable before its function starts, so a *crash*
never fires it twice without the run knowing. A process that goes on,
though, can start an effect again while an earlier start of it is still
running here: ``asyncio.gather`` propagates one effect's exception while
its sibling is still in flight, the step's ``retry`` starts the next
attempt, and that attempt reaches the sibling again; or a step suspends
(``wait_for``) with a thread it started still firing, and the run is woken
in this same process. Both starts would carry the same key, so an API that
deduplicates by key takes one — but one without per-key locking would run
both, and even Stripe answers the second with an error.

So every start of an effect first *claims* its key here. A claim held by
an earlier start that has not finished is waited for (the caller blocks,
or awaits off the event loop), and its outcome is taken over: what the
earlier start returned is recorded as this start's result without calling
the function again; if it raised, the effect fires again, with its key, as
any failed effect does. The runner also waits for the effects a step left
running before it retries the step, suspends the run or commits it, so
their results are recorded while the step's journal is still open.

The registry is per process and keyed by the effect's idempotency key,
which is unique to (run, pass, step, effect name): runs never wait for one
another.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

__all__ = ["Firing", "Outcome", "claim"]

Outcome = tuple[bool, Any]
"""``(True, result)``: the function returned ``result``; ``(False, None)``: it raised."""


class Firing:
    """A claim on one key: the start that holds it resolves it with its outcome."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.future: Future[Outcome] = Future()

    def done(self, outcome: Outcome) -> None:
        """Release the key; whoever waits for it gets ``outcome``."""
        with _LOCK:
            if _FIRING.get(self.key) is self:
                del _FIRING[self.key]
        if not self.future.done():
            self.future.set_result(outcome)


_FIRING: dict[str, Firing] = {}
_LOCK = threading.Lock()


def claim(key: str) -> tuple[Firing | None, Future[Outcome] | None]:
    """Claim ``key``: ``(firing, None)`` when it is now ours, or ``(None,
    future)`` of the earlier start to wait for (then claim again).
    """
    with _LOCK:
        held = _FIRING.get(key)
        if held is not None:
            return None, held.future
        firing = _FIRING[key] = Firing(key)
        return firing, None
