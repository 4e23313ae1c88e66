"""A child process running a long counter workflow; SIGKILLs itself after a history chunk.

    python tests/historychild.py STORE_DIR RUN_ID PASSES [--kill-after-chunk N]

The workflow ``long`` has two steps (``tick``, ``tock``) looped PASSES
passes. ``--kill-after-chunk N`` kills the process with SIGKILL right after
its N-th history chunk (``<run>/history/...``) is written, before the head
that names it: the crash point a chunk's write protocol must survive. On
success it prints the final state as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import durable_steps as ds


class KillingStore(ds.LocalStore):
    """Dies with SIGKILL after the N-th history chunk is written."""

    def __init__(self, path: str, after: int | None) -> None:
        super().__init__(path)
        self.after, self.chunks = after, 0

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        version = super().put(key, data, match=match)
        if "/history/" in key:
            self.chunks += 1
            if self.chunks == self.after:
                os.kill(os.getpid(), signal.SIGKILL)
        return version


def workflow(store: ds.Store) -> ds.Workflow:
    wf = ds.Workflow("long", store=store, until=lambda s: s["n"] >= s["passes"])

    @wf.step()
    def tick(state: dict[str, Any], ctx: ds.Context) -> None:
        state["calls"] = ctx.call("model", lambda: state["n"] * 2)

    @wf.step()
    def tock(state: dict[str, Any]) -> None:
        state["n"] += 1

    return wf


def main() -> None:
    path, run_id, passes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    after = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--kill-after-chunk" else None
    final = workflow(KillingStore(path, after)).run(run_id, {"n": 0, "passes": passes})
    print(json.dumps(final, sort_keys=True))


if __name__ == "__main__":
    main()
