"""A child process that does one thing the index of runs follows, and SIGKILLs itself
before or after its N-th write (any PUT or DELETE: heads, parts, index entries).

    python tests/indexchild.py --store URL --op OP --kill N --when before|after

``--kill 0`` dies nowhere and prints how many writes the op made; ``--at TEXT``
dies before (or after) the first write whose key contains TEXT instead (``put:TEXT``,
``delete:TEXT``: the first such PUT, or DELETE). The ops,
each on what :func:`prepare` left in the store: ``create`` (a run that then
waits), ``submit``, ``signal``, ``wake`` (a signalled run resumed to its
end), ``tombstone`` (a run completed under ``on_complete="delete"``),
``resolve`` (an effect in doubt), ``fork``, ``rm`` and ``prune``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import durable_steps as ds
from durable_steps.stores import ObjectInfo

OPS = ("create", "submit", "signal", "wake", "tombstone", "resolve", "fork", "rm", "prune")


def desk(store: ds.Store, **options: Any) -> ds.Workflow:
    """ask waits for 'approval' (when told to); pay is an effect."""
    wf = ds.Workflow("desk", store=store, **options)

    @wf.step()
    def ask(state: dict[str, Any], ctx: ds.Context) -> None:
        state["answer"] = ctx.wait_for("approval") if state.get("wait") else "yes"

    @wf.step(in_doubt="raise")
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        state["paid"] = ctx.effect("pay", lambda idempotency_key: idempotency_key)

    return wf


def prepare(store: ds.Store, op: str) -> None:
    """Leave in ``store`` what ``op`` starts from."""
    wf = desk(store)
    if op in ("signal", "wake"):
        try:
            wf.run("r", {"wait": True})
        except ds.RunSuspended:
            pass
        if op == "wake":
            wf.signal("r", "approval", "ok")
    elif op in ("rm", "prune"):
        wf.run("r", {})
    elif op in ("resolve", "fork"):
        crashing = ds.testing.CrashingStore(store, after_write=3)  # create, ask, intent
        try:
            desk(crashing).run("r", {})
        except ds.testing.SimulatedCrash:
            pass
        with_key = desk(store)
        try:
            with_key.run("r")
        except ds.StepInDoubt:
            pass
    elif op == "tombstone":
        wf.submit("r", {})


class Killer:
    """Counts every write (PUT and DELETE) and dies around the chosen one."""

    def __init__(self, inner: ds.Store, kill: int, when: str, at: str | None = None) -> None:
        self.inner, self.kill, self.when, self.writes = inner, kill, when, 0
        self.at = at

    def _count(self, key: str, kind: str) -> None:
        self.writes += 1
        kinds, _, text = (self.at or "").rpartition(":")
        if self.at is not None and text in key and kinds in ("", kind):
            self.kill, self.at = self.writes, None
        if self.writes == self.kill and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)

    def _after(self) -> None:
        if self.writes == self.kill and self.when == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    def get(self, key: str) -> tuple[bytes, str] | None:
        return self.inner.get(key)

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        self._count(key, "put")
        try:
            return self.inner.put(key, data, match=match)
        finally:  # also after a refused write: a process can die on the answer
            self._after()

    def delete(self, key: str, *, match: str | None = None) -> None:
        self._count(key, "delete")
        try:
            self.inner.delete(key, match=match)
        finally:
            self._after()

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def sweep(self, prefix: str) -> None:
        sweep = getattr(self.inner, "sweep", None)
        if sweep is not None:
            sweep(prefix)

    def close(self) -> None:
        self.inner.close()


def run(store: Killer, url: str, op: str) -> None:
    """Do ``op`` through the killing store."""
    from durable_steps.cli import _main

    wf = desk(store)  # type: ignore[arg-type]
    if op == "create":
        try:
            wf.run("r", {"wait": True})
        except ds.RunSuspended:
            pass
    elif op == "submit":
        wf.submit("r", {})
    elif op == "signal":
        wf.signal("r", "approval", "ok")
    elif op == "wake":
        wf.run("r")
    elif op == "tombstone":
        desk(store, on_complete="delete").run("r")  # type: ignore[arg-type]
    elif op == "resolve":
        wf.resolve("r", fired=False)
    elif op == "fork":
        wf.fork("r", "f")
    else:
        _main.open_store = lambda _url: store  # type: ignore[assignment]
        argv = ["rm", "desk/r", "--force"] if op == "rm" else ["prune", "--completed"]
        prune = ["--older-than", "0s", "--yes"] if op == "prune" else []
        assert _main.main(["--store", url, *argv, *prune]) == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--op", choices=OPS, required=True)
    parser.add_argument("--kill", type=int, default=0)
    parser.add_argument("--when", choices=("before", "after"), default="before")
    parser.add_argument("--at", default=None)
    args = parser.parse_args()
    store = Killer(ds.open_store(args.store), args.kill, args.when, args.at)
    run(store, args.store, args.op)
    print(store.writes)


if __name__ == "__main__":
    main()
