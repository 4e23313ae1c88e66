"""Workflows whose runs the web page's tests (and its screenshots) look at.

Run by path, with the store URL and what to do::

    python tests/uiapp.py STORE populate   # a completed, a waiting, a failed run
    python tests/uiapp.py STORE crash      # a refund that dies inside its effect (in doubt)
    python tests/uiapp.py STORE resume RUN # resume WORKFLOW/RUN; print its final state as JSON

``crash`` is a real crash: the process ``os._exit``\\s inside the effect's
function, after its intent is recorded and before its result is, so the run
is left *in doubt* with a dead owner, as after a power cut. The transcripts
hold markup (``<script>``, ``onerror=``): the page must show it as text.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import durable_steps as ds

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
"""What a hostile customer typed: the page must show these characters, run nothing."""


def _support(store: str) -> ds.Workflow:
    wf = ds.Workflow("support-agent", store=store)

    @wf.step()
    def read(state: dict[str, Any], ctx: ds.Context) -> None:
        state["messages"].append({"role": "user", "content": HOSTILE})

    @wf.step()
    def think(state: dict[str, Any], ctx: ds.Context) -> None:
        reply = ctx.call("llm", lambda: {"draft": "Refund 34.00 " + HOSTILE})
        state["draft"] = reply["draft"]
        state["lookup"] = ctx.call("tool:orders", lambda: {"order": "A-2", "total": 3400})

    @wf.step()
    def approve(state: dict[str, Any], ctx: ds.Context) -> None:
        state["approval"] = ctx.wait_for("approval")

    return wf


def _refunds(store: str) -> ds.Workflow:
    wf = ds.Workflow("refunds", store=store)

    @wf.step()
    def plan(state: dict[str, Any]) -> None:
        state["plan"] = f"refund {state['cents']} cents"

    @wf.step(in_doubt="raise")
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        def refund(*, idempotency_key: str) -> dict[str, Any]:
            if os.environ.get("UIAPP_CRASH"):
                os._exit(17)  # the process dies with the refund maybe sent
            return {"id": "re_new", "key": idempotency_key}

        state["refund"] = ctx.effect("refund", refund)

    return wf


def _research(store: str) -> ds.Workflow:
    wf = ds.Workflow("research", store=store, until=lambda s: s["n"] >= 3)

    @wf.step()
    def search(state: dict[str, Any], ctx: ds.Context) -> None:
        state["notes"].append(ctx.call("search", lambda: f"result {state['n']}"))

    @wf.step()
    def summarise(state: dict[str, Any]) -> None:
        state["n"] += 1

    return wf


def _flaky(store: str) -> ds.Workflow:
    wf = ds.Workflow("support-agent", store=store)

    @wf.step(retry=ds.Retry(attempts=2, wait=0))
    def read(state: dict[str, Any]) -> None:
        raise ValueError("mailbox unreachable: " + HOSTILE)

    return wf


WORKFLOWS = {"support-agent": _support, "refunds": _refunds, "research": _research}


def populate(store: str) -> None:
    _research(store).run("r-1", {"n": 0, "notes": []})
    try:
        _support(store).run("ticket-4411", {"messages": []})
    except ds.RunSuspended:
        pass
    try:
        _flaky(store).run("ticket-4410", {"messages": []})
    except ds.StepFailed:
        pass


def main() -> None:
    store, what = sys.argv[1], sys.argv[2]
    if what == "populate":
        populate(store)
    elif what == "crash":
        os.environ["UIAPP_CRASH"] = "1"
        _refunds(store).run("order-17", {"cents": 3400})
    elif what == "resume":
        workflow, _, run_id = sys.argv[3].partition("/")
        print(json.dumps(WORKFLOWS[workflow](store).run(run_id), sort_keys=True))


if __name__ == "__main__":
    main()
