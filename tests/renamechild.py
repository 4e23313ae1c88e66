"""A child process running a support desk's run under old or new code (a step renamed).

    python tests/renamechild.py --store URL --code old|new|newer|back --run R --scene S \
        --ledger FILE

The old code's middle step is ``approval``; the new code's is ``approve``
with ``renamed_from="approval"``. The step drafts a reply (``ctx.call``,
logged ``draft``), may wait for signal ``go``, then refunds (``ctx.effect``,
logged ``refund <key>``). The old code stops where ``--scene`` says:

``kill-inside``   SIGKILL after the refund is recorded, before the step returns
``call``          SIGKILL right after the draft is recorded
``doubt``         SIGKILL inside the refund, after it reached the ledger
``fail``          the step raises after the draft (the run fails)
``wait``          the step waits for signal ``go`` (the run suspends)
``twice``         as ``call``; the new code records a second call, then is SIGKILLed
``signal-kill``   as ``wait``; the new code is SIGKILLed as it receives the signal
                  (marked received, its payload not journaled yet)

The new code runs the run to its end and prints the final state as JSON. The
newer code renames it again: ``approved`` with ``renamed_from=("approve",
"approval")`` (a run the new code stopped inside the step still names it
``approval``, so that a rollback finds it: every earlier name stays). The
``back`` code is the old code redeployed (a rollback): the step is ``approval``
again, and it resumes the run without stopping anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import durable_steps as ds


def append(path: Path, line: str) -> None:
    with path.open("a") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())


def desk(store: str, code: str, scene: str, ledger: Path) -> ds.Workflow:
    def on_event(event: ds.Event) -> None:
        if code == "new" and scene == "signal-kill" and event.kind == "signal_received":
            os.kill(os.getpid(), signal.SIGKILL)

    wf = ds.Workflow("desk", store=store, on_event=[on_event])
    old = code in ("old", "back")  # the old names
    first = code == "old"  # the first run, which stops where --scene says

    @wf.step()
    def prepare(state: dict[str, Any]) -> None:
        state["ticket"] = 4411

    def draft() -> str:
        append(ledger, "draft")
        return "we refund order 4411"

    def refund(*, idempotency_key: str) -> str:
        append(ledger, f"refund {idempotency_key}")
        if first and scene == "doubt":
            os.kill(os.getpid(), signal.SIGKILL)
        return f"re_{idempotency_key[-6:]}"

    def middle(state: dict[str, Any], ctx: ds.Context) -> None:
        state["draft"] = ctx.call("draft", draft)
        if first and scene in ("call", "twice"):
            os.kill(os.getpid(), signal.SIGKILL)
        if scene == "twice":  # a call the new code records (its head names the new step)
            state["second"] = ctx.call("second", lambda: append(ledger, "second") or "ok")
            if code == "new":
                os.kill(os.getpid(), signal.SIGKILL)
        if first and scene == "fail":
            raise ValueError("the refunds API is down")
        if scene in ("wait", "signal-kill"):
            state["go"] = ctx.wait_for("go")
        state["refund"] = ctx.effect("refund", refund)
        if first and scene == "kill-inside":
            os.kill(os.getpid(), signal.SIGKILL)

    if old:
        wf.step(name="approval")(middle)
    elif code == "new":
        wf.step(name="approve", renamed_from="approval")(middle)
    else:
        wf.step(name="approved", renamed_from=("approve", "approval"))(middle)

    @wf.step()
    def finish(state: dict[str, Any]) -> None:
        state["filed"] = True

    return wf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--code", choices=("old", "new", "newer", "back"), required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--scene", required=True)
    parser.add_argument("--ledger", type=Path, required=True)
    args = parser.parse_args()
    wf = desk(args.store, args.code, args.scene, args.ledger)
    try:
        final = wf.run(args.run, {}) if args.code == "old" else wf.resume(args.run)
    except (ds.StepFailed, ds.RunSuspended) as exc:
        print(json.dumps({"stopped": type(exc).__name__}))
        return
    print(json.dumps(final))


if __name__ == "__main__":
    main()
