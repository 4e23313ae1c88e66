"""A child process that runs a durable workflow and SIGKILLs itself on cue.

Run it by path (it needs only the installed ``durable_steps``, not the
``tests`` package)::

    python tests/crashchild.py --store URL --run RUN_ID --log EXEC_LOG \
        --ledger LEDGER [--crash BOUNDARY:STEP:ITER] [--variant plain|raise|reconcile]

``--store`` is a store URL: a local path, or ``s3://bucket/prefix`` with the
S3 endpoint and credentials taken from the environment only (``AWS_*``, as
``StoreTarget.child_env()`` sets them).

The workflow (``crash-<variant>``) loops :data:`PASSES` passes over
:data:`STEPS`: ``plan`` (idempotent), ``charge`` (not idempotent), ``draft``
(idempotent), ``send`` (not idempotent; it also counts the pass). Each step,
when it starts, appends ``<step>:<iteration>`` to the *executions log*; a
non-idempotent step then appends ``<step>:<iteration>:<idempotency key>`` to
the *ledger* (it models the external payment/mail API: fsynced before the
step returns). The state records only what is the same in every run — the
trail of steps and the pass count, never keys — so the final state of a
crashed-and-resumed run can be compared with an uncrashed one.

``--crash`` picks where the process dies with ``SIGKILL``:

``before-create:run:0`` / ``after-create:run:0``
    around the write that creates the run;
``before-intent:S:I`` / ``after-intent:S:I``
    around the write of step S's intent in pass I (non-idempotent steps);
``inside:S:I``
    in step S of pass I, after its side effect, before it returns;
``before-commit:S:I`` / ``after-commit:S:I``
    around the write that commits step S of pass I;
``before-part:N:0`` / ``after-part:N:0``
    around the N-th write of a format-2 part (``after-part`` is between a
    part and the head that lists it, also when that part is a compaction);
``before-drop:N:0``
    before the N-th deletion of a part a new head dropped (compaction's
    garbage removal).

``--flush-every-commit`` makes every format-2 commit flush its tail into a
part, so a short run goes through every kind of flush and compaction.

Write boundaries are found by :class:`KillingStore`, which wraps the store and
decodes each checkpoint it is asked to write. Variants: ``raise`` gives the
non-idempotent steps ``in_doubt="raise"`` (a ``StepInDoubt`` exits with
status 3 and the message on stderr); ``reconcile`` gives them a
``reconcile=`` hook that looks the key up in the ledger (and notes
``reconcile:<step>:<iteration>`` in the executions log).

On success the child prints the final state as JSON on stdout and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt

STEPS: tuple[tuple[str, bool], ...] = (
    ("plan", True),
    ("charge", False),
    ("draft", True),
    ("send", False),
)
PASSES = 3
VARIANTS = ("plain", "raise", "reconcile")
EXIT_IN_DOUBT = 3


def workflow_name(variant: str) -> str:
    """The workflow name a variant runs under."""
    return f"crash-{variant}"


def initial_state() -> dict[str, Any]:
    """The state every run starts from."""
    return {"passes": 0, "trail": []}


def die() -> None:
    """Die the hard way: no cleanup, no flushing, no exception handlers."""
    os.kill(os.getpid(), signal.SIGKILL)


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


class KillingStore:
    """Wrap a store; SIGKILL the process around one chosen checkpoint write.

    Each ``put`` is classified by decoding the header it carries against the
    last header this process saw (read or written): ``create`` (the
    create-only first write), ``commit`` (the commit count went up: the step
    is the last history entry), ``intent`` (an intent appeared) or ``other``
    (status changes). ``crash`` is ``(boundary, step, iteration)``.
    """

    def __init__(self, inner: ds.Store, crash: tuple[str, str, int] | None = None) -> None:
        self.inner = inner
        self.crash = crash
        self.committed = 0
        self.intent: dict[str, Any] | None = None
        self.parts = self.drops = 0

    def _seen(self, data: bytes) -> None:
        header, _ = ckpt.decode(data, where="crashchild")
        self.committed, self.intent = header.committed, header.intent

    def _classify(self, data: bytes, match: str | None) -> tuple[str, str, int]:
        header, _ = ckpt.decode(data, where="crashchild")
        if match is None:
            return "create", "run", 0
        if header.committed > self.committed:
            step, iteration = header.history[-1][0], header.history[-1][1]
            return "commit", step, iteration
        if header.intent is not None and self.intent is None:
            return "intent", header.intent["step"], header.intent["iteration"]
        return "other", "", -1

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Pass through, remembering the header read."""
        found = self.inner.get(key)
        if found is not None and "/parts/" not in key:
            self._seen(found[0])
        return found

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Write through; die before or after the chosen write."""
        if key.startswith("_index/"):  # the index of runs: not a boundary of the run's own
            return self.inner.put(key, data, match=match)
        if "/parts/" in key:
            self.parts += 1
            if self.crash == ("before-part", str(self.parts), 0):
                die()
            version = self.inner.put(key, data, match=match)
            if self.crash == ("after-part", str(self.parts), 0):
                die()
            return version
        kind, step, iteration = self._classify(data, match)
        if self.crash == (f"before-{kind}", step, iteration):
            die()
        version = self.inner.put(key, data, match=match)
        self._seen(data)
        if self.crash == (f"after-{kind}", step, iteration):
            die()
        return version

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Pass through; die before the chosen deletion of a dropped part."""
        if "/parts/" in key:
            self.drops += 1
            if self.crash == ("before-drop", str(self.drops), 0):
                die()
        self.inner.delete(key, match=match)

    def list(self, prefix: str) -> Iterator[ds.ObjectInfo]:
        """Pass through."""
        return self.inner.list(prefix)

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()


def flush_every_commit() -> None:
    """Make every format-2 commit flush its change into a part, as for a big
    state (tests only: the threshold is private; no state is written whole).
    """
    from durable_steps._record import format2 as _format2

    _format2._MIN_FLUSH = 1
    _format2._FLUSH_RECORDS = 0
    _format2.WHOLE_UP_TO = -1


def parse_crash(spec: str | None) -> tuple[str, str, int] | None:
    """``"inside:charge:1"`` → ``("inside", "charge", 1)``."""
    if not spec:
        return None
    boundary, step, iteration = spec.split(":")
    return boundary, step, int(iteration)


def build_workflow(
    store: ds.Store,
    log: Path,
    ledger: Path,
    *,
    crash: tuple[str, str, int] | None = None,
    variant: str = "plain",
) -> ds.Workflow:
    """The test workflow on ``store`` (wrapped in a :class:`KillingStore`)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")

    def effect(state: dict[str, Any], name: str, iteration: int) -> None:
        # What a step does to the state; reconcile does the same when it
        # finds the effect already happened.
        state["trail"].append(f"{name}:{iteration}")
        if name == "send":
            state["passes"] += 1

    def make(name: str) -> Any:
        def fn(state: dict[str, Any], ctx: ds.Context) -> None:
            append_line(log, f"{name}:{ctx.iteration}")
            if not dict(STEPS)[name]:
                append_line(ledger, f"{name}:{ctx.iteration}:{ctx.idempotency_key}")
            effect(state, name, ctx.iteration)
            if crash == ("inside", name, ctx.iteration):
                die()

        fn.__name__ = name
        return fn

    def reconcile(state: dict[str, Any], ctx: ds.Context) -> bool:
        append_line(log, f"reconcile:{ctx.step}:{ctx.iteration}")
        fired = f"{ctx.step}:{ctx.iteration}:{ctx.idempotency_key}" in read_lines(ledger)
        if fired:
            effect(state, ctx.step, ctx.iteration)
        return fired

    steps = []
    for name, idempotent in STEPS:
        options: dict[str, Any] = {"idempotent": idempotent, "name": name}
        if not idempotent and variant == "raise":
            options["in_doubt"] = "raise"
        if not idempotent and variant == "reconcile":
            options["reconcile"] = reconcile
        steps.append(ds.step(make(name), **options))
    return ds.Workflow(
        workflow_name(variant),
        steps=steps,
        store=KillingStore(store, crash),
        until=lambda s: s["passes"] >= PASSES,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the workflow, print its final state."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL")
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--log", required=True, type=Path, help="executions log")
    parser.add_argument("--ledger", required=True, type=Path, help="side-effect ledger")
    parser.add_argument("--crash", default=None, help="BOUNDARY:STEP:ITER")
    parser.add_argument("--variant", default="plain", choices=VARIANTS)
    parser.add_argument("--flush-every-commit", action="store_true")
    args = parser.parse_args(argv)
    if args.flush_every_commit:
        flush_every_commit()
    wf = build_workflow(
        ds.open_store(args.store),
        args.log,
        args.ledger,
        crash=parse_crash(args.crash),
        variant=args.variant,
    )
    try:
        final = wf.run(args.run, initial_state())
    except ds.StepInDoubt as exc:
        print(f"StepInDoubt: {exc}", file=sys.stderr)
        return EXIT_IN_DOUBT
    finally:
        wf.store.close()
    print(json.dumps(final, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
