"""A child process running workflows of journaled calls; SIGKILLs itself on cue.

Run it by path (it needs only the installed ``durable_steps``; the
``KillingStore`` idea is ``tests/crashchild.py``'s, for journal writes)::

    python tests/journalchild.py jrn-turns --store URL --run RUN_ID --log EXEC_LOG \
        --ledger LEDGER [--crash BOUNDARY:NAME:ITER]
    python tests/journalchild.py jrn-gather|jrn-effects|jrn-threads --store URL \
        --run RUN_ID --log EXEC_LOG [--ledger LEDGER] [--kill-at-calls N]

``--store`` is a store URL (S3 endpoint and credentials from the environment).

``jrn-turns``: one step ``turn`` looping :data:`PASSES`
passes. Each pass makes ``ctx.call("model", ...)``, whose deterministic
"reply" names 2 or 3 tool calls (ids ``t<pass>-<j>``), then one
``ctx.effect("tool:<id>", charge, ...)`` per tool call. Every fn call appends
``model:<pass>`` or ``tool:<id>`` to the *executions log* when it starts;
``charge`` also appends ``tool:<id>:<idempotency key>`` to the *ledger* (the
payment API: fsynced before it returns). The state holds the transcript
(never a key), so a crashed-and-resumed run's final state can be compared
byte for byte with an uncrashed one.

``--crash`` picks where the process dies with ``SIGKILL``; NAME is a call's
name (``model``, ``tool:t1-0``), ``turn`` for the commit boundaries:

``before-record:NAME:I`` / ``after-record:NAME:I``
    around the head write that records NAME's result (its fn has returned);
``before-intent:NAME:I`` / ``after-intent:NAME:I``
    around the head write of effect NAME's intent (its fn has not started);
``inside:NAME:I``
    inside effect NAME's fn, right after its ledger line landed;
``between:NAME:I``
    in the step, after effect NAME returned, before the next call starts;
``before-commit:turn:I`` / ``after-commit:turn:I``
    around the write that commits pass I.

``--in-doubt raise`` gives ``turn`` ``in_doubt="raise"``: a ``StepInDoubt``
exits with status 3 and the message on stderr. ``--format1`` writes the run
in format 1 (a custom serializer), whose journal rides in the header.
``--stop`` makes the crash a SIGSTOP: the process freezes there, alive.

``jrn-quick`` (a store that paces its head's writes, see
``durable_steps._fleet.pacing``): one step ``turn`` looping :data:`QUICK_PASSES`
passes, each making :data:`QUICK_CALLS` quick ``ctx.call("q:<i>")`` (logged
``q:<pass>:<i>``), then ``ctx.effect("pay")`` (logged ``pay:<pass>``, its
key in the ledger as ``pay:<pass>:<key>``), then :data:`QUICK_AFTER` more
calls; most call results ride on a later write (deferred). ``--interval S``
makes the store declare ``min_write_interval`` S (the local store has none;
GCSStore's own is used otherwise). ``--crash before-write:head:N`` /
``after-write:head:N`` dies around the N-th head write of the run (0: its
creation), ``inside:pay:I`` inside the effect after its ledger line,
``between:q:<i>:I`` right after call i returned (its result perhaps deferred).

``jrn-gather``: one async step making :data:`FANOUT`
concurrent ``ctx.acall("tool:<i>", ...)`` through ``asyncio.gather``;
``jrn-effects``: the same with ``ctx.aeffect``, each appending
``tool:<i>:<key>`` to the ledger. ``jrn-threads``: the same 50 calls made
with ``ctx.call`` by :data:`WORKERS` threads inside one sync step, with the
same final state. ``--kill-at-calls N``
dies right after the first head write that records the N-th result (group
commit may record several in one write).

Write boundaries are found by :class:`KillingStore`, which decodes each head
it is asked to write against the last one it saw (``journal["calls"]``,
``journal["open"]``, ``committed``). On success the child prints the final
state as JSON (sorted keys) on stdout and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt

PASSES = 3
FANOUT = 50
WORKERS = 5
EXIT_IN_DOUBT = 3
TURNS = "jrn-turns"
GATHER = "jrn-gather"
THREADS = "jrn-threads"
EFFECTS = "jrn-effects"
QUICK = "jrn-quick"
QUICK_PASSES = 2
QUICK_CALLS = 8
QUICK_AFTER = 3
QUICK_CALL_SECONDS = 0.04

Crash = tuple[str, str, int]
Boundary = tuple[str, str, int]
"""``(kind, name, iteration)`` of a head write: create, record, intent, commit, other."""


STOP = {"signal": signal.SIGKILL}
"""What :func:`die` sends: ``--stop`` makes it SIGSTOP (paused, not dead)."""


def die() -> None:
    """Die the hard way: no cleanup, no flushing, no exception handlers (or, with
    ``--stop``, freeze right here until SIGCONT)."""
    os.kill(os.getpid(), STOP["signal"])


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it: it must survive our own SIGKILL."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[str]:
    """The lines of a log file (none if it does not exist yet)."""
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def tool_ids(iteration: int) -> list[str]:
    """The tool calls the model asks for in pass ``iteration`` (2 or 3 of them)."""
    return [f"t{iteration}-{j}" for j in range(2 + iteration % 2)]


def call_names(iteration: int) -> list[str]:
    """The journaled calls of pass ``iteration`` of ``turns``, in the order they run."""
    return ["model", *(f"tool:{t}" for t in tool_ids(iteration))]


def initial_state() -> dict[str, Any]:
    """The state every ``turns`` run starts from."""
    return {"turns": 0, "messages": [{"role": "user", "content": "pay the invoices"}]}


def parse_crash(spec: str | None) -> Crash | None:
    """``"inside:tool:t1-0:1"`` → ``("inside", "tool:t1-0", 1)``."""
    if not spec:
        return None
    boundary, rest = spec.split(":", 1)
    name, iteration = rest.rsplit(":", 1)
    return boundary, name, int(iteration)


class KillingStore:
    """Wrap a store; SIGKILL the process around one chosen head write.

    Each head ``put`` is classified (:meth:`classify`) by decoding it against
    the last head this process read or wrote. A result write is named by the
    effect that left ``open``, else by ``names(iteration)[calls - 1]`` (the
    order the step makes its calls in; ``names=None`` when there is no such
    order: concurrent calls). Parts pass through.
    """

    def __init__(
        self,
        inner: ds.Store,
        crash: Crash | None = None,
        *,
        names: Callable[[int], list[str]] | None = call_names,
        kill_at_calls: int | None = None,
    ) -> None:
        self.inner = inner
        self.crash = crash
        self.names = names
        self.kill_at_calls = kill_at_calls
        self.last: ckpt.Checkpoint | None = None

    def classify(self, data: bytes, match: str | None) -> Boundary:
        """What the head write ``data`` is, against the last head seen."""
        header, _ = ckpt.decode(data, where="journalchild")
        last = self.last
        if match is None or last is None:
            return "create", "run", 0
        if header.committed > last.committed:
            return "commit", header.history[-1][0], header.history[-1][1]
        new = header.journal
        if new is None:
            return "other", "", -1
        old = last.journal
        if old is None or (old["step"], old["iteration"]) != (new["step"], new["iteration"]):
            old = {"calls": 0, "open": []}
        was_open = {e["name"] for e in old["open"]}
        now_open = {e["name"] for e in new["open"]}
        if now_open - was_open:
            return "intent", min(now_open - was_open), new["iteration"]
        if new["calls"] > old["calls"]:
            closed = was_open - now_open
            if closed:
                name = min(closed)
            else:  # a call: named by the order calls are made in, when there is one
                name = self.names(new["iteration"])[new["calls"] - 1] if self.names else ""
            return "record", name, new["iteration"]
        return "other", "", -1

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Pass through, remembering the head read."""
        found = self.inner.get(key)
        if found is not None and "/parts/" not in key:
            self.last = ckpt.decode(found[0], where="journalchild")[0]
        return found

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write through; die before or after the chosen write."""
        if key.startswith("_index/"):  # the index of runs: not a boundary of the run's own
            return self.inner.put(key, data, match=match)
        if "/parts/" in key:
            return self.inner.put(key, data, match=match)
        kind, name, iteration = self.classify(data, match)
        if self.crash == (f"before-{kind}", name, iteration):
            die()
        version = self.inner.put(key, data, match=match)
        self.last = ckpt.decode(data, where="journalchild")[0]
        if self.crash == (f"after-{kind}", name, iteration):
            die()
        journal = self.last.journal
        if self.kill_at_calls is not None and journal and journal["calls"] >= self.kill_at_calls:
            die()
        return version

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Pass through."""
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ds.ObjectInfo]:
        """Pass through."""
        return self.inner.list(prefix)

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()


class WriteKiller(KillingStore):
    """Wrap a store; SIGKILL the process around its N-th head write (0: the
    creation), counted in this process. Declares ``min_write_interval`` (the
    inner store's, or ``interval``) so the run paces its head's writes.
    """

    def __init__(self, inner: ds.Store, crash: Crash | None, interval: float | None) -> None:
        super().__init__(inner, None, names=None)
        self.at = crash
        self.count = 0
        self.min_write_interval = (
            float(getattr(inner, "min_write_interval", 0.0)) if interval is None else interval
        )

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write through; die before or after the chosen head write."""
        if key.startswith("_index/") or "/parts/" in key:
            return self.inner.put(key, data, match=match)
        n, self.count = self.count, self.count + 1
        if self.at == ("before-write", "head", n):
            die()
        version = self.inner.put(key, data, match=match)
        if self.at == ("after-write", "head", n):
            die()
        return version


def quick_workflow(
    store: ds.Store, log: Path, ledger: Path, crash: Crash | None, interval: float | None
) -> ds.Workflow:
    """``jrn-quick`` on ``store`` (wrapped in a :class:`WriteKiller`)."""

    def lookup(iteration: int, i: int) -> dict[str, int]:
        append_line(log, f"q:{iteration}:{i}")
        time.sleep(QUICK_CALL_SECONDS)
        return {"it": iteration, "i": i}

    def pay(iteration: int, idempotency_key: str) -> dict[str, int]:
        append_line(log, f"pay:{iteration}")
        append_line(ledger, f"pay:{iteration}:{idempotency_key}")
        if crash == ("inside", "pay", iteration):
            die()
        return {"paid": iteration}

    wf = ds.Workflow(
        QUICK,
        store=WriteKiller(store, crash, interval),
        until=lambda s: s["turns"] >= QUICK_PASSES,
        serializer="json",
    )

    @wf.step
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        out: list[Any] = []
        for i in range(QUICK_CALLS + QUICK_AFTER):
            if i == QUICK_CALLS:
                out.append(ctx.effect("pay", pay, ctx.iteration))
            out.append(ctx.call(f"q:{i}", lookup, ctx.iteration, i))
            if crash == ("between", f"q:{i}", ctx.iteration):
                die()
        state["log"].append(out)
        state["turns"] += 1

    return wf


def quick_names(iteration: int) -> list[str]:
    """What ``jrn-quick``'s pass ``iteration`` logs, in order."""
    calls = [f"q:{iteration}:{i}" for i in range(QUICK_CALLS + QUICK_AFTER)]
    return [*calls[:QUICK_CALLS], f"pay:{iteration}", *calls[QUICK_CALLS:]]


class Format1JSON(ds.JSONSerializer):
    """JSON under another name: a custom serializer, so runs are written in format 1
    (the journal's results then ride in the header)."""

    name = "json-format1"


def turns_workflow(
    store: ds.Store,
    log: Path,
    ledger: Path,
    crash: Crash | None,
    *,
    in_doubt: str = "refire",
    format1: bool = False,
) -> ds.Workflow:
    """``jrn-turns`` on ``store`` (wrapped in a :class:`KillingStore`); ``in_doubt``
    is the step's policy for an effect in doubt; ``format1`` writes format 1.
    """

    def model(iteration: int, seen: int) -> dict[str, Any]:
        append_line(log, f"model:{iteration}")
        calls = [
            {"id": t, "amount": 100 * (iteration + 1) + j}
            for j, t in enumerate(tool_ids(iteration))
        ]
        return {"content": f"turn {iteration} after {seen} messages", "tool_calls": calls}

    def charge(call: dict[str, Any], iteration: int, idempotency_key: str) -> dict[str, Any]:
        name = f"tool:{call['id']}"
        append_line(log, name)
        append_line(ledger, f"{name}:{idempotency_key}")
        if crash == ("inside", name, iteration):
            die()
        return {"charged": call["amount"], "id": call["id"]}

    wf = ds.Workflow(
        TURNS,
        store=KillingStore(store, crash),
        until=lambda s: s["turns"] >= PASSES,
        serializer=Format1JSON() if format1 else "json",
    )

    @wf.step(in_doubt=in_doubt)  # type: ignore[arg-type]
    def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        reply = ctx.call("model", model, ctx.iteration, len(state["messages"]))
        ids = [c["id"] for c in reply["tool_calls"]]
        state["messages"].append({"role": "assistant", "content": reply["content"], "calls": ids})
        for call in reply["tool_calls"]:
            name = f"tool:{call['id']}"
            out = ctx.effect(name, charge, call, ctx.iteration)
            state["messages"].append({"role": "tool", "id": call["id"], "content": out})
            if crash == ("between", name, ctx.iteration):
                die()
        state["turns"] += 1

    return wf


def spread(i: int) -> float:
    """How long call ``i`` of 50 takes: 0-100 ms, out of order, so that the kill
    finds calls started, finished and recorded in every mix."""
    return 0.002 * (i * 7 % FANOUT)


def gather_workflow(
    store: ds.Store, log: Path, kill_at_calls: int | None, ledger: Path | None = None
) -> ds.Workflow:
    """``jrn-gather`` on ``store`` (wrapped in a :class:`KillingStore`); with a
    ``ledger``, ``jrn-effects``: the same, each call an ``aeffect``.
    """

    async def tool(i: int) -> dict[str, int]:
        append_line(log, f"tool:{i}")
        await asyncio.sleep(spread(i))
        return {"i": i, "square": i * i}

    async def pay(i: int, idempotency_key: str) -> dict[str, int]:
        append_line(log, f"tool:{i}")
        await asyncio.sleep(spread(i))
        assert ledger is not None
        append_line(ledger, f"tool:{i}:{idempotency_key}")
        return {"i": i, "square": i * i}

    name = GATHER if ledger is None else EFFECTS
    wf = ds.Workflow(name, store=KillingStore(store, names=None, kill_at_calls=kill_at_calls))

    @wf.step()
    async def fanout(state: dict[str, Any], ctx: ds.Context) -> None:
        if ledger is None:
            calls = [ctx.acall(f"tool:{i}", tool, i) for i in range(FANOUT)]
        else:
            calls = [ctx.aeffect(f"tool:{i}", pay, i) for i in range(FANOUT)]
        state["out"] = await asyncio.gather(*calls)

    return wf


def threads_workflow(store: ds.Store, log: Path, kill_at_calls: int | None) -> ds.Workflow:
    """The ``jrn-threads`` workflow on ``store`` (wrapped in a :class:`KillingStore`)."""

    def tool(i: int) -> dict[str, int]:
        append_line(log, f"tool:{i}")
        return {"i": i, "square": i * i}

    wf = ds.Workflow(THREADS, store=KillingStore(store, names=None, kill_at_calls=kill_at_calls))

    @wf.step()
    def fanout(state: dict[str, Any], ctx: ds.Context) -> None:
        out: list[Any] = [None] * FANOUT

        def worker(first: int) -> None:
            for i in range(first, FANOUT, WORKERS):
                out[i] = ctx.call(f"tool:{i}", tool, i)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        state["out"] = out

    return wf


def fanout_workflow(
    workflow: str, store: ds.Store, log: Path, ledger: Path, kill: int | None
) -> ds.Workflow:
    """``jrn-gather``, ``jrn-effects`` or ``jrn-threads``: 50 calls, one final state."""
    if workflow == THREADS:
        return threads_workflow(store, log, kill)
    return gather_workflow(store, log, kill, ledger if workflow == EFFECTS else None)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the chosen workflow, print its final state."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workflow", choices=(TURNS, GATHER, EFFECTS, THREADS, QUICK))
    parser.add_argument("--store", required=True, help="store URL")
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--log", required=True, type=Path, help="executions log")
    parser.add_argument("--ledger", type=Path, help="side-effect ledger (jrn-turns, jrn-effects)")
    parser.add_argument("--crash", default=None, help="BOUNDARY:NAME:ITER (jrn-turns)")
    parser.add_argument(
        "--kill-at-calls", type=int, default=None, help="N (jrn-gather, jrn-effects, jrn-threads)"
    )
    parser.add_argument("--in-doubt", default="refire", choices=("refire", "raise"))
    parser.add_argument("--format1", action="store_true", help="write format 1 (jrn-turns)")
    parser.add_argument("--stop", action="store_true", help="SIGSTOP instead of SIGKILL")
    parser.add_argument("--interval", type=float, default=None, help="S (jrn-quick)")
    args = parser.parse_args(argv)
    if args.stop:
        STOP["signal"] = signal.SIGSTOP
    store = ds.open_store(args.store)
    try:
        if args.workflow == TURNS:
            crash = parse_crash(args.crash)
            wf = turns_workflow(
                store, args.log, args.ledger, crash, in_doubt=args.in_doubt, format1=args.format1
            )
            final = wf.run(args.run, initial_state())
        elif args.workflow == QUICK:
            wf = quick_workflow(
                store, args.log, args.ledger, parse_crash(args.crash), args.interval
            )
            final = wf.run(args.run, {"turns": 0, "log": []})
        else:
            wf = fanout_workflow(args.workflow, store, args.log, args.ledger, args.kill_at_calls)
            final = (
                asyncio.run(wf.arun(args.run, {})) if wf.steps[0].is_async else wf.run(args.run, {})
            )
    except ds.StepInDoubt as exc:
        print(f"StepInDoubt: {exc}", file=sys.stderr)
        return EXIT_IN_DOUBT
    finally:
        store.close()
    print(json.dumps(final, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
