"""What a DurableRunner costs over plain ``Runner.run``, per agent run and per model response.

    python tests/benchmarks/bench_openai_agents.py [--rounds 15] [--store DIR]

The agent of ``tests/oachild.py`` (``triage`` hands off to ``billing``, which
looks two orders up and refunds them: 3 model responses, 4 tool calls, 2 of
them effects) runs against the scripted OpenAI server in this process, over
loopback. The model answers in microseconds, so the ratio printed is an upper
bound: against a real model (hundreds of milliseconds per response) the
journal's writes vanish in the model's latency. Requests and bytes are
counted at the store (one store call is one request on S3).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from agents import Runner, set_tracing_disabled  # noqa: E402
from fake_openai import make_server  # noqa: E402

import durable_steps as ds  # noqa: E402
from durable_steps.integrations.openai_agents import DurableRunner  # noqa: E402
from tests import oachild  # noqa: E402

MESSAGE = "Orders #1001 and #1002 both arrived broken. Please refund them."
RESPONSES = 3


class Counting:
    """A store that counts its calls and the bytes it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.written = 0
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.calls[name] += 1
                if name == "put":
                    self.written += len(args[1])
            return method(*args, **kwargs)

        return counted


async def rounds(base_url: str, store_dir: Path, n: int) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp(prefix="bench-oa-log-"))
    args = argparse.Namespace(log=log, crash=None, approval=False, mode="async", base_url=base_url)
    triage, config, _, client = oachild.build(args)
    args.mode = "plain"  # its refund asks for no idempotency key
    plain_triage, plain_config, _, plain_client = oachild.build(args)
    runner = DurableRunner(effects={"refund"})
    store = Counting(ds.open_store(str(store_dir)))

    async def turn(state: dict[str, Any], ctx: ds.Context) -> None:
        result = await runner.run(triage, MESSAGE, ctx=ctx, run_config=config)
        state["output"] = result.final_output
        ctx.finish()

    wf = ds.Workflow("bench-openai-agents", steps=[ds.step(turn, name="turn")], store=store)
    plain: list[float] = []
    durable: list[float] = []
    calls: Counter[str] = Counter()
    written = 0
    for i in range(n + 1):  # the first round warms both up and is not counted
        began = time.perf_counter()
        expected = (await Runner.run(plain_triage, MESSAGE, run_config=plain_config)).final_output
        plain_s = time.perf_counter() - began
        before, before_bytes = Counter(store.calls), store.written
        began = time.perf_counter()
        final = await wf.arun(f"r-{uuid.uuid4().hex[:8]}", {})
        durable_s = time.perf_counter() - began
        assert final["output"] == expected
        if i:
            plain.append(plain_s)
            durable.append(durable_s)
            calls += store.calls - before
            written += store.written - before_bytes
    await client.close()
    await plain_client.close()
    return {"plain": plain, "durable": durable, "calls": calls, "written": written, "n": n}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--store", default=None, help="a directory (default: a temporary one)")
    args = parser.parse_args()
    set_tracing_disabled(True)
    server = make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store_dir = Path(args.store or tempfile.mkdtemp(prefix="bench-oa-store-"))
    got = asyncio.run(rounds(server.url, store_dir, args.rounds))
    server.shutdown()
    plain, durable, n = statistics.median(got["plain"]), statistics.median(got["durable"]), got["n"]
    requests = {k: v / n for k, v in sorted(got["calls"].items())}
    print(f"OpenAI Agents SDK, {n} agent runs of {RESPONSES} model responses + 4 tool calls")
    print(f"  store: {store_dir} (local)")
    print(f"  plain Runner.run     {plain * 1000:8.1f} ms per agent run (median)")
    print(f"  DurableRunner.run    {durable * 1000:8.1f} ms per agent run (median, run created)")
    print(f"  ratio durable/plain  {durable / plain:8.2f}x")
    added = (durable - plain) * 1000
    print(f"  added per agent run  {added:8.1f} ms ({added / RESPONSES:.1f} ms per model response,")
    print("                       its tool calls' records included)")
    print(f"  store requests/run   {requests}")
    print(f"  bytes written/run    {got['written'] / n:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
