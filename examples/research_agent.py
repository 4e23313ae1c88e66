"""A research agent that survives ``kill -9``: run it, crash it, run it again.

    python examples/research_agent.py --crash-at send   # dies just after the email went out
    python examples/research_agent.py                   # resumes; still exactly one email

Each pass of the loop is four steps: ``plan`` (a fake LLM picks the next
sub-question), ``call_tools`` (a fake search), ``draft`` (the fake LLM writes
a paragraph) and ``send`` (a fake email API, once every question is answered).

durable_steps saves the loop's *state* -- the dict the steps read and write --
after every step; it does not save where the process was. A step cut off by
a crash therefore runs again from its start. That is harmless for planning,
searching and drafting. For the email it would be a duplicate, so ``send`` is
``idempotent=False``: its idempotency key is saved *before* it fires and is
the same when it re-fires, and the email API drops a second send with that key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import durable_steps as ds

TOPIC = "Should our agents checkpoint to object storage?"
QUESTIONS = [
    "What does a crash cost a long-running agent?",
    "How do conditional writes keep two workers apart?",
    "Which steps need an idempotency key?",
]
SEARCH_INDEX = {  # the fake search tool's canned results
    QUESTIONS[0]: ["An hour of tool calls and drafts is lost.", "Restarts redo paid LLM calls."],
    QUESTIONS[1]: ["A write with If-Match fails if someone else wrote first."],
    QUESTIONS[2]: ["Emails and charges: anything the outside world keeps."],
}
STEP_NAMES = ["plan", "call_tools", "draft", "send"]
# The demo's runs stay in the directory it is run from, named explicitly: a
# workflow with a non-idempotent step should always say where it resumes from.
DEMO_STORE = "./.durable_steps"


def say(text: str) -> None:
    print(text, flush=True)  # flush: SIGKILL throws away whatever is still buffered


class FakeEmailAPI:
    """An email provider that, like real ones, deduplicates on an idempotency key.

    Its records live in a JSON file so that, like a provider's database, they
    outlive our process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _records(self) -> dict[str, dict[str, str]]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def send(self, to: str, subject: str, body: str, tag: str, key: str) -> tuple[str, bool]:
        """Return (message id, False if this key was seen before and nothing was sent)."""
        records = self._records()
        if key in records:
            return records[key]["id"], False
        message_id = "msg-" + hashlib.sha256(key.encode()).hexdigest()[:10]
        records[key] = {"id": message_id, "to": to, "subject": subject, "body": body, "tag": tag}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(json.dumps(records, indent=2))
        os.replace(temp, self.path)  # all or nothing
        return message_id, True

    def delivered(self, tag: str) -> int:
        return sum(r["tag"] == tag for r in self._records().values())


@dataclass
class Agent:
    """The workflow, its email API, and the events a run reported."""

    workflow: ds.Workflow
    email: FakeEmailAPI
    events: list[str] = field(default_factory=list)

    def run(self, run_id: str) -> dict:
        # A new run starts from this state; an unfinished one ignores it and
        # resumes from its checkpoint; a finished one just returns its result.
        start = {"topic": TOPIC, "draft": [], "passes": 0, "message_id": None}
        final: dict = self.workflow.run(run_id, start)
        if not self.events:
            say(f"run {run_id} was already complete: nothing ran again, nothing was re-sent")
        say(f"=== report: {final['topic']} ===")
        for paragraph in final["draft"]:
            say(paragraph)
        say("=== summary ===")
        say(f"passes: {final['passes']}")
        say(f"emails delivered: {self.email.delivered(run_id)}")
        return final


def build_agent(
    store: str | ds.Store | None = None,
    *,
    outbox: str | Path | None = None,
    crash_at: tuple[str, int | None] | None = None,
    fast: bool = False,
) -> Agent:
    """Build the research workflow on ``store`` (None: the library's default)."""
    events: list[str] = []

    def pause() -> None:  # fake LLM/tool latency, so a person sees progress
        if not fast:
            time.sleep(0.05)

    def maybe_crash(ctx: ds.Context) -> None:
        if crash_at and crash_at[0] == ctx.step and crash_at[1] in (None, ctx.iteration):
            say(f"[pass {ctx.iteration}] {ctx.step}: simulated crash (SIGKILL) before its commit")
            os.kill(os.getpid(), signal.SIGKILL)

    def report(event: ds.Event) -> None:  # the runner's events explain what a resume skips
        events.append(event.kind)
        if event.kind == "run_started":
            say(f"new run {event.workflow}/{event.run_id} in {wf.store!r}")
        elif event.kind == "run_resumed" and event.step and event.iteration is not None:
            done = event.iteration * len(STEP_NAMES) + STEP_NAMES.index(event.step)
            say(f"resumed at {event.step} (pass {event.iteration}): {done} steps done, skipped")
            if event.step != "send":
                say(f"{event.step} never committed: it runs again from its start")
        elif event.kind == "step_in_doubt":
            key = event.idempotency_key
            say(f"{event.step} may have fired before the crash: re-firing with same key {key}")

    # The steps below form one pass; passes repeat until the email is sent.
    wf = ds.Workflow(
        "research-agent", store=store, until=lambda s: bool(s["message_id"]), on_event=[report]
    )
    if outbox is None:  # beside the checkpoints, under a dot name the store ignores
        local = isinstance(wf.store, ds.LocalStore)
        outbox = wf.store.root / ".fake-email-outbox.json" if local else "fake-email-outbox.json"
    email = FakeEmailAPI(Path(outbox))

    @wf.step()
    def plan(state: dict, ctx: ds.Context) -> None:
        """Fake LLM: pick the first sub-question the draft does not answer yet."""
        pause()
        state["passes"] += 1  # a crash before the commit discards this with the rest
        state["question"] = QUESTIONS[len(state["draft"])]
        say(f"[pass {ctx.iteration}] plan: next question: {state['question']}")
        maybe_crash(ctx)

    @wf.step()  # idempotent (the default): a search is a read, repeating it is harmless
    def call_tools(state: dict, ctx: ds.Context) -> None:
        pause()
        state["snippets"] = SEARCH_INDEX[state["question"]]
        say(f"[pass {ctx.iteration}] call_tools: {len(state['snippets'])} search result(s)")
        maybe_crash(ctx)

    @wf.step()
    def draft(state: dict, ctx: ds.Context) -> None:
        pause()
        state["draft"].append(f"- {state['question']} {' '.join(state['snippets'])}")
        say(f"[pass {ctx.iteration}] draft: {len(state['draft'])} of {len(QUESTIONS)} paragraphs")
        maybe_crash(ctx)

    # idempotent=False: the key is checkpointed before this runs and reused if a
    # crash leaves it unknown whether the email went out (then ctx.in_doubt).
    @wf.step(idempotent=False)
    def send(state: dict, ctx: ds.Context) -> None:
        if len(state["draft"]) < len(QUESTIONS):
            say(f"[pass {ctx.iteration}] send: draft not finished, nothing to send yet")
            return
        pause()
        key = ctx.idempotency_key  # hand it to the API, as you would to Stripe or SES
        body = "\n".join(state["draft"])
        message_id, sent_now = email.send("team@example.com", state["topic"], body, ctx.run_id, key)
        state["message_id"] = message_id
        if not ctx.in_doubt:
            say(f"[pass {ctx.iteration}] send: email {message_id} accepted (key {key})")
        else:
            verdict = "it went out now" if sent_now else "the email API deduplicated it"
            total = email.delivered(ctx.run_id)
            say(f"[pass {ctx.iteration}] send: {verdict} ({total} email sent in total)")
        maybe_crash(ctx)  # the nastiest moment: sent, but not yet checkpointed

    return Agent(wf, email, events)


def crash_point(text: str) -> tuple[str, int | None]:
    step, _, iteration = text.partition(":")
    if step not in STEP_NAMES or (iteration and not iteration.isdigit()):
        raise argparse.ArgumentTypeError(f"expected STEP or STEP:PASS, STEP one of {STEP_NAMES}")
    return step, int(iteration) if iteration else None


def parse_args(argv: list[str] | None = None, *, store_option: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A crash-resumable research agent demo.")
    if store_option:
        parser.add_argument("--store", help=f"default: $DURABLE_STEPS_STORE or {DEMO_STORE}")
    parser.add_argument("--run-id", default="topic-1")
    parser.add_argument("--crash-at", type=crash_point, help="STEP[:PASS]: SIGKILL inside STEP")
    parser.add_argument("--outbox", help="the fake email API's records (a JSON file)")
    parser.add_argument("--fast", action="store_true", help="no fake latency")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    store = args.store or os.environ.get("DURABLE_STEPS_STORE") or DEMO_STORE
    agent = build_agent(store, outbox=args.outbox, crash_at=args.crash_at, fast=args.fast)
    agent.run(args.run_id)


if __name__ == "__main__":
    main()
