"""Child processes of ``bench.py``, and the workload definitions both share.

Not a test module (``conftest.py`` here keeps pytest away). ``bench.py``
runs it by path::

    python tests/benchmarks/bench_child.py crash  --store URL --run ID ...
        [--shape one|mixed|grow]
    python tests/benchmarks/bench_child.py resume --store URL --run ID ...
    python tests/benchmarks/bench_child.py memory --store URL --mode ds|hand ...

Only ``os``, ``sys`` and ``time`` (already loaded by the interpreter) are
imported at the top, so the ``resume`` child can time ``import
durable_steps`` and ``import boto3`` itself. An ``s3://`` store URL is opened
with the endpoint and credentials from the environment (``AWS_*``), exactly as
a user's script would.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.monotonic()  # CLOCK_MONOTONIC: comparable with the parent's clock

WORKFLOW = "bench"
_TEXT = "the quick brown fox reads the ticket, drafts a reply and checks the facts. " * 40


def make_state(size: int, *, message_bytes: int = 1000) -> dict:
    """A transcript-like state of about ``size`` bytes of JSON."""
    body = _TEXT[: max(1, message_bytes - 40)]
    count = max(1, size // message_bytes)
    return {
        "i": 0,
        "note": "",
        "messages": [
            {"role": "user" if k % 2 else "assistant", "content": f"{k:07d} {body}"}
            for k in range(count)
        ],
    }


def mutate(state: dict) -> None:
    """The small change every step makes (in both loops)."""
    state["i"] += 1
    state["note"] = f"pass {state['i']}"


def random_messages(count: int) -> list[str]:
    """``count`` distinct, incompressible messages of 2 KB of text each."""
    return [os.urandom(1024).hex() for _ in range(count)]


def grow_with(state: dict, messages: list[str]) -> None:
    """Append the next of ``messages`` (the issue 11 growth workload)."""
    mutate(state)
    state["messages"].append({"role": "tool", "content": messages[state["i"] - 1]})


def grow_with_call(state: dict, ctx, messages: list[str]) -> None:
    """:func:`grow_with`, the message got through a journaled call (an agent's model call)."""
    reply = ctx.call("reply", messages.__getitem__, state["i"])
    mutate(state)
    state["messages"].append({"role": "tool", "content": reply})


def one_step_workflow(store, passes: int, *, on_event=(), step_fn=None, name=WORKFLOW, **kw):
    """A workflow with one idempotent step and ``until=`` ``passes`` passes."""
    import durable_steps as ds

    wf = ds.Workflow(name, store=store, until=lambda s: s["i"] >= passes, on_event=on_event, **kw)
    wf.step(name="work")(step_fn or mutate)
    return wf


def mixed_workflow(store, passes: int, *, crash=None, on_first=None, on_event=()):
    """Passes of [think (idempotent), send (not idempotent)].

    ``crash=(step, iteration)`` SIGKILLs the process inside that step (after
    its intent, for ``send``); ``on_first`` is called when the first step starts.
    """
    import durable_steps as ds

    wf = ds.Workflow(
        f"{WORKFLOW}-mixed", store=store, until=lambda s: s["i"] >= passes, on_event=on_event
    )

    def hook(ctx) -> None:
        if on_first is not None:
            on_first()
        if crash is not None and (ctx.step, ctx.iteration) == crash:
            os.kill(os.getpid(), 9)

    @wf.step()
    def think(state, ctx):
        hook(ctx)
        state["note"] = f"draft {ctx.iteration}"

    @wf.step(idempotent=False)
    def send(state, ctx):
        hook(ctx)
        state["i"] += 1

    return wf


# -- child modes ----------------------------------------------------------------


def _crash(args) -> None:
    """Run a new run and SIGKILL this process inside step ``--crash-at``."""
    if args.shape == "mixed":
        step, _, it = args.crash_step.partition(":")
        mixed_workflow(args.store, args.steps, crash=(step, int(it))).run(args.run, {"i": 0})
    elif args.shape == "grow":
        messages = random_messages(args.steps)

        def append(state):
            grow_with(state, messages)
            if state["i"] == args.crash_at:
                os.kill(os.getpid(), 9)

        empty = {"i": 0, "note": "", "messages": []}
        one_step_workflow(args.store, args.steps, step_fn=append).run(args.run, empty)
    else:

        def work(state):
            mutate(state)
            if state["i"] == args.crash_at:
                os.kill(os.getpid(), 9)

        state = make_state(args.size)
        one_step_workflow(args.store, args.steps, step_fn=work).run(args.run, state)
    sys.exit("the crash child was meant to die before finishing")


def _resume(args) -> None:
    """Resume ``--run``; print timestamps as JSON when its first step starts, then die."""
    import json  # after T0 on purpose: part of what a user's script pays too

    marks = {"t0": T0}
    import durable_steps

    marks["imported_ds"] = time.monotonic()
    if args.store.startswith("s3://"):
        import durable_steps.stores.s3  # noqa: F401  (boto3, botocore)

    marks["imported_boto3"] = time.monotonic()

    def report() -> None:
        marks["first_step"] = time.monotonic()
        sys.stdout.write(json.dumps(marks) + "\n")
        sys.stdout.flush()
        os._exit(0)  # die without committing: the checkpoint stays as found

    if args.shape == "mixed":
        wf = mixed_workflow(args.store, args.steps, on_first=report)
    else:
        wf = one_step_workflow(args.store, args.steps, step_fn=lambda state: report())
    marks["workflow_ready"] = time.monotonic()
    wf.store = _TimedStore(wf.store, marks)
    wf.run(args.run)
    sys.exit("the resumed run finished without calling a step")


class _TimedStore:
    """Adds the seconds spent in each store call to ``marks`` (``get_s``, ``put_s``)."""

    def __init__(self, inner, marks: dict) -> None:
        self.inner, self.marks = inner, marks

    def _timed(self, what: str, fn, *args, **kwargs):
        t = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.marks[what] = self.marks.get(what, 0.0) + time.monotonic() - t

    def get(self, key):
        return self._timed("get_s", self.inner.get, key)

    def put(self, key, data, *, match=None):
        return self._timed("put_s", self.inner.put, key, data, match=match)

    def delete(self, key, *, match=None):
        return self.inner.delete(key, match=match)

    def list(self, prefix):
        return self.inner.list(prefix)

    def close(self):
        self.inner.close()


def hand_write_file(directory, path, temp, data: bytes) -> None:
    """The hand-written local checkpoint: temp file in the same directory,
    fsync, rename over the target, fsync the directory."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _hand_local_writer(root: str):
    import json

    directory = os.path.join(root, "hand")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "checkpoint")
    temp = os.path.join(directory, ".tmp-checkpoint")

    def write(state) -> int:
        data = json.dumps(state).encode()
        hand_write_file(directory, path, temp, data)
        return len(data)

    return write


def _memory(args) -> None:
    """Peak RSS of checkpointing a big state, over the RSS after building it."""
    import gc
    import json
    import resource

    import durable_steps as ds

    s3 = args.store.startswith("s3://")
    if s3:
        import boto3

        import durable_steps.stores.s3

        bucket, _, prefix = args.store.removeprefix("s3://").partition("/")
        client = boto3.session.Session().client("s3")
        client.head_bucket(Bucket=bucket)  # warm the client (models, connection)
    state = make_state(args.size)
    gc.collect()
    # Nothing has encoded the state yet. ru_maxrss is inherited across exec
    # (it starts at the parent's RSS), so the peak is taken from /proc's
    # VmHWM instead, reset here so that it covers the checkpointing only.
    reset = _reset_peak()
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = _status("VmRSS") if reset else base_maxrss
    started = time.monotonic()
    if args.mode == "hand":
        if s3:

            def write(st) -> int:
                data = json.dumps(st).encode()
                client.put_object(Bucket=bucket, Key=f"{prefix}/hand/checkpoint", Body=data)
                return len(data)
        else:
            write = _hand_local_writer(args.store)
        for _ in range(args.steps):
            mutate(state)
            write(state)
    else:
        store = ds.S3Store(bucket, prefix, client=client) if s3 else ds.LocalStore(args.store)
        one_step_workflow(store, args.steps).run(args.run, state)
    seconds = time.monotonic() - started
    peak_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = _status("VmHWM") if reset else peak_maxrss
    # Live copies, without the allocator's high water: the largest amount of
    # memory allocated (and not yet freed) at once by three more steps.
    import tracemalloc

    tracemalloc.start()
    if args.mode == "hand":
        for _ in range(3):
            mutate(state)
            write(state)
    else:
        one_step_workflow(store, state["i"] + 3).run(f"{args.run}-traced", state)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    encoded = len(json.dumps(state, ensure_ascii=False, separators=(",", ":")).encode())
    print(
        json.dumps(
            {
                "encoded_bytes": encoded,
                "baseline_rss": base,
                "peak_rss": peak,
                "peak_from": "VmHWM (reset after building)" if reset else "ru_maxrss",
                "ru_maxrss_before": base_maxrss,
                "ru_maxrss_after": peak_maxrss,
                "seconds": seconds,
                "traced_peak": traced_peak,
            }
        )
    )


def _reset_peak() -> bool:
    """Reset this process's peak RSS (Linux: ``5`` into clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status("VmHWM") > 0


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes (0 if unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["crash", "resume", "memory"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--shape", choices=["one", "mixed", "grow"], default="one")
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=3)
    parser.add_argument("--crash-step", default="send:1")
    parser.add_argument("--mode", choices=["ds", "hand"], default="ds")
    args = parser.parse_args(argv)
    {"crash": _crash, "resume": _resume, "memory": _memory}[args.action](args)


if __name__ == "__main__":
    main()
