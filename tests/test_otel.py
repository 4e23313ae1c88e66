"""durable_steps.integrations.otel: spans and metrics from a run's events, with the real SDK.

Spans go to the SDK's ``InMemorySpanExporter`` (in this process) or, for a
child process that SIGKILLs itself mid-run, to a JSON-lines file written as
each span ends; metrics are read with ``InMemoryMetricReader``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import durable_steps as ds
from durable_steps._record import checkpoint as ckpt
from durable_steps.integrations.otel import Tracing, _run_context, trace_id

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def by_name(finished: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def one(finished: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = by_name(finished, name)
    assert len(found) == 1, [s.name for s in finished]
    return found[0]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


# --- the workflow of the crash test: a retry, a model call, a refund, a kill ---------------


def nonce(store: Path, workflow: str, run_id: str) -> str:
    """The run's nonce, as its checkpoint holds it."""
    found = ds.LocalStore(store).get(ckpt.checkpoint_key(workflow, run_id))
    assert found is not None
    return ckpt.decode(found[0], where="test")[0].run_nonce


def agent_workflow(
    store: Path, tracing: Tracing, kill_after_model: Path | None = None
) -> ds.Workflow:
    """``plan`` fails once then succeeds; ``act`` calls the model, then refunds (an effect)."""
    wf = ds.Workflow("agent", store=store, on_event=[tracing])
    tries = {"plan": 0}

    @wf.step(retry=ds.Retry(attempts=3, wait=0, on=ConnectionError))
    def plan(state: dict[str, Any]) -> None:
        tries["plan"] += 1
        if tries["plan"] == 1:
            raise ConnectionError("model endpoint reset")
        state["plan"] = "refund"

    @wf.step()
    def act(state: dict[str, Any], ctx: ds.Context) -> None:
        state["answer"] = ctx.call("model", lambda: {"text": "refund 5"})
        if kill_after_model is not None and kill_after_model.exists():
            kill_after_model.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        state["refund"] = ctx.effect("refund", lambda idempotency_key: idempotency_key)

    @wf.step()
    def done(state: dict[str, Any]) -> None:
        state["done"] = True

    return wf


class JsonLinesExporter(SpanExporter):
    """Appends each ended span as one JSON line, flushed: what a SIGKILL cannot take back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.path.open("a") as out:
            for span in spans:
                out.write(json.dumps(json.loads(span.to_json())) + "\n")
            out.flush()
            os.fsync(out.fileno())
        return SpanExportResult.SUCCESS


def child(store: str, spans_file: str, kill_file: str) -> None:
    """The crashing process: traces to ``spans_file`` and dies inside ``act``."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(Path(spans_file))))
    wf = agent_workflow(Path(store), Tracing(provider), Path(kill_file))
    wf.run("r1", {})


def test_span_tree_of_a_run_with_a_retry_and_journaled_calls(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A run is one span; each attempt (the failed one too) a child; each call a grandchild."""
    provider, exporter = spans
    agent_workflow(tmp_path, Tracing(provider)).run("r1", {})
    finished = exporter.get_finished_spans()
    run = one(finished, "run agent")
    r1 = nonce(tmp_path, "agent", "r1")
    assert parent_of(run) == _run_context("agent", "r1", r1).span_id
    assert format(run.context.trace_id, "032x") == trace_id("agent", "r1", r1)
    assert run.attributes is not None
    assert run.attributes["durable_steps.workflow"] == "agent"
    assert run.attributes["durable_steps.run.id"] == "r1"
    assert run.attributes["durable_steps.run.resumed"] is False
    assert run.attributes["durable_steps.run.outcome"] == "completed"
    assert run.status.status_code is StatusCode.OK
    assert not run.links

    failed, retried = by_name(finished, "step plan")
    assert [s.attributes["durable_steps.step.attempt"] for s in (failed, retried)] == [1, 2]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "builtins.ConnectionError"
    assert failed.attributes["durable_steps.step.retry_wait"] == 0
    assert [e.name for e in failed.events] == ["exception"]
    assert retried.status.status_code is StatusCode.OK
    act, done = one(finished, "step act"), one(finished, "step done")
    for step in (failed, retried, act, done):
        assert parent_of(step) == run.context.span_id
        assert step.attributes["durable_steps.step.iteration"] == 0
        assert step.context.trace_id == run.context.trace_id

    model, refund = one(finished, "call model"), one(finished, "effect refund")
    assert parent_of(model) == parent_of(refund) == act.context.span_id
    assert model.attributes["durable_steps.call.kind"] == "call"
    assert refund.attributes["durable_steps.call.kind"] == "effect"
    assert refund.attributes["durable_steps.idempotency_key"]
    assert refund.status.status_code is StatusCode.OK
    # Children end before their parents: the tree is well nested in time.
    assert run.start_time <= failed.start_time
    assert done.end_time <= run.end_time
    assert act.start_time <= model.start_time <= model.end_time <= refund.start_time
    assert refund.end_time <= act.end_time


def test_a_run_made_again_under_its_id_or_in_another_store_gets_a_trace_of_its_own(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """The trace id follows the run's nonce: same id, deleted and made again, or in a
    second store, is a new trace; `show` prints the trace id the spans carry."""
    provider, exporter = spans
    traces = []
    for store in (tmp_path / "a", tmp_path / "a", tmp_path / "b"):
        wf = ds.Workflow("agent", store=store, on_event=[Tracing(provider)], on_complete="delete")
        wf.step(name="only")(lambda state: None)
        wf.run("r1", {})
        (run,) = by_name(exporter.get_finished_spans(), "run agent")
        exporter.clear()
        shown = subprocess.run(
            [sys.executable, "-m", "durable_steps", "--store", str(store), "show", "agent/r1"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        assert f"{run.context.trace_id:032x}" in shown
        traces.append(run.context.trace_id)
        ds.LocalStore(store).delete(ckpt.checkpoint_key("agent", "r1"))  # free the id
    assert len(set(traces)) == 3


def test_sigkill_then_resume_links_to_the_crashed_execution(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A run SIGKILLed in one process and resumed in another stays one trace, linked."""
    spans_file, kill_file = tmp_path / "spans.jsonl", tmp_path / "kill"
    kill_file.touch()
    code = "import sys; from tests.test_otel import child; child(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store"), str(spans_file), str(kill_file)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    crashed = [json.loads(line) for line in spans_file.read_text().splitlines()]
    # What ended before the kill was exported; the run's and act's spans never ended.
    assert [s["name"] for s in crashed] == ["step plan", "step plan", "call model"]
    anchor = _run_context("agent", "r1", nonce(tmp_path / "store", "agent", "r1"))
    assert {s["context"]["trace_id"] for s in crashed} == {f"0x{anchor.trace_id:032x}"}
    crashed_run_span = crashed[0]["parent_id"]

    provider, exporter = spans
    final = agent_workflow(tmp_path / "store", Tracing(provider)).run("r1")
    assert final["refund"]
    assert final["done"]
    finished = exporter.get_finished_spans()
    assert sorted(s.name for s in finished) == [
        "effect refund",
        "run agent",
        "step act",
        "step done",
    ]
    run = one(finished, "run agent")
    assert run.context.trace_id == anchor.trace_id  # the crashed execution's trace
    assert parent_of(run) == anchor.span_id
    assert f"0x{run.context.span_id:016x}" != crashed_run_span
    assert run.attributes["durable_steps.run.resumed"] is True
    assert run.attributes["durable_steps.run.resumed_step"] == "act"
    (link,) = run.links
    assert (link.context.trace_id, link.context.span_id) == (anchor.trace_id, anchor.span_id)
    assert link.attributes == {"durable_steps.link.type": "resumes"}
    # The model call was recorded before the kill: replayed, an event on the step, no span.
    act = one(finished, "step act")
    (replayed,) = [e for e in act.events if e.name == "durable_steps.call.replayed"]
    assert replayed.attributes == {
        "durable_steps.call.name": "model",
        "durable_steps.call.replayed": True,
    }
    assert parent_of(one(finished, "effect refund")) == act.context.span_id


def test_metrics_count_commits_retries_calls_and_step_durations(tmp_path: Path) -> None:
    """Commits, retries, recorded and replayed calls, durations and outcomes are counted."""
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    tracing = Tracing(TracerProvider(), meters)
    agent_workflow(tmp_path, tracing).run("r1", {})
    agent_workflow(tmp_path, tracing).run("r2", {})
    points = metric_points(reader)
    assert points["durable_steps.step.commits"] == {
        (("durable_steps.step.name", "plan"), ("durable_steps.workflow", "agent")): 2,
        (("durable_steps.step.name", "act"), ("durable_steps.workflow", "agent")): 2,
        (("durable_steps.step.name", "done"), ("durable_steps.workflow", "agent")): 2,
    }
    plan = (("durable_steps.step.name", "plan"), ("durable_steps.workflow", "agent"))
    assert points["durable_steps.step.retries"] == {plan: 2}
    act = (("durable_steps.step.name", "act"), ("durable_steps.workflow", "agent"))
    assert points["durable_steps.calls"] == {
        (("durable_steps.call.kind", "call"), *act): 2,
        (("durable_steps.call.kind", "effect"), *act): 2,
    }
    assert points["durable_steps.run.executions"] == {
        (("durable_steps.run.outcome", "completed"), ("durable_steps.workflow", "agent")): 2
    }
    durations = points["durable_steps.step.duration"]
    assert set(durations) == {plan, act, (("durable_steps.step.name", "done"), act[1])}
    assert all(count == 2 for count, _ in durations.values())
    assert all(total >= 0 for _, total in durations.values())
    assert "durable_steps.step.failures" not in points


def metric_points(reader: InMemoryMetricReader) -> dict[str, dict[tuple[Any, ...], Any]]:
    """Metric name -> sorted attributes -> value (a histogram: (count, sum))."""
    out: dict[str, dict[tuple[Any, ...], Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "durable_steps"
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    attrs = tuple(sorted((point.attributes or {}).items()))
                    value = (point.count, point.sum) if hasattr(point, "count") else point.value
                    out.setdefault(metric.name, {})[attrs] = value
    return out


def test_a_crash_after_an_intent_ends_the_spans_and_counts_the_doubt_once(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A crash mid-effect ends its spans as errors; the resume counts the effect in doubt once."""
    provider, exporter = spans
    reader = InMemoryMetricReader()
    tracing = Tracing(provider, MeterProvider(metric_readers=[reader]))
    store = ds.LocalStore(tmp_path)
    # Writes: create, the plan commit, the model call's record, the refund's intent.
    crashing = ds.testing.CrashingStore(store, after_write=4)
    wf = agent_workflow(tmp_path, tracing)
    wf.store = crashing
    with ds.testing.no_wait(), pytest.raises(ds.testing.SimulatedCrash):
        wf.run("r1", {})
    first = exporter.get_finished_spans()
    run = one(first, "run agent")
    assert run.status.status_code is StatusCode.ERROR
    assert run.attributes["durable_steps.run.outcome"] == "error"
    assert run.attributes["error.type"] == "durable_steps.testing.SimulatedCrash"
    assert one(first, "step act").status.status_code is StatusCode.ERROR
    refund = one(first, "effect refund")  # its intent was written, then the "crash"
    assert refund.status.status_code is StatusCode.ERROR
    assert refund.end_time <= one(first, "step act").end_time

    exporter.clear()
    wf.store = store
    wf.run("r1")
    again = exporter.get_finished_spans()
    resumed = one(again, "run agent")
    (doubt,) = [e for e in resumed.events if e.name == "durable_steps.effect.in_doubt"]
    assert doubt.attributes is not None
    assert doubt.attributes["durable_steps.call.name"] == "refund"
    refired = one(again, "effect refund")
    assert refired.attributes["durable_steps.effect.refired"] is True
    assert (
        refired.attributes["durable_steps.idempotency_key"]
        == (refund.attributes["durable_steps.idempotency_key"])
    )
    points = metric_points(reader)
    act = (("durable_steps.step.name", "act"), ("durable_steps.workflow", "agent"))
    assert points["durable_steps.effect.in_doubt"] == {act: 1}
    assert points["durable_steps.calls"] == {
        (("durable_steps.call.kind", "call"), *act): 1,  # the model, before the crash
        (("durable_steps.call.kind", "effect"), *act): 2,  # the refund: fired, then again
        (("durable_steps.call.replayed", True), *act): 1,  # the model, on resume
    }
    assert points["durable_steps.run.executions"] == {
        (("durable_steps.run.outcome", "error"), ("durable_steps.workflow", "agent")): 1,
        (("durable_steps.run.outcome", "completed"), ("durable_steps.workflow", "agent")): 1,
    }


def test_a_step_in_doubt_and_a_failed_step(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A non-idempotent step in doubt is an event and a count; a failure ends the run in error."""
    provider, exporter = spans
    reader = InMemoryMetricReader()
    tracing = Tracing(provider, MeterProvider(metric_readers=[reader]))
    store = ds.MemoryStore()
    crashing = ds.testing.CrashingStore(store, after_write=2)  # create, then pay's intent
    wf = ds.Workflow("pay", store=crashing, on_event=[tracing])
    calls = []

    @wf.step(idempotent=False)
    def pay(state: dict[str, Any], ctx: ds.Context) -> None:
        calls.append(ctx.idempotency_key)
        raise ValueError("card declined")

    with pytest.raises(ds.testing.SimulatedCrash):
        wf.run("r1", {})
    wf.store = store
    with pytest.raises(ds.StepFailed):
        wf.run("r1")
    finished = exporter.get_finished_spans()
    first, second = by_name(finished, "run pay")
    assert first.attributes["durable_steps.run.outcome"] == "error"
    assert second.attributes["durable_steps.run.outcome"] == "failed"
    assert second.status.status_code is StatusCode.ERROR
    (doubt,) = [e for e in second.events if e.name == "durable_steps.step.in_doubt"]
    assert doubt.attributes is not None
    assert doubt.attributes["durable_steps.step.name"] == "pay"
    (attempt,) = by_name(finished, "step pay")
    assert parent_of(attempt) == second.context.span_id
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.attributes["error.type"] == "builtins.ValueError"
    points = metric_points(reader)
    pay_attrs = (("durable_steps.step.name", "pay"), ("durable_steps.workflow", "pay"))
    assert points["durable_steps.step.in_doubt"] == {pay_attrs: 1}
    assert points["durable_steps.step.failures"] == {pay_attrs: 1}
    assert len(calls) == 1  # the in-doubt step fired again once, then failed


def test_a_step_resolved_as_fired_commits_without_an_attempt_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """A person's "it fired" commits the step without running it: events, no attempt span."""
    provider, exporter = spans
    store = ds.MemoryStore()
    wf = ds.Workflow("paid", store=ds.testing.CrashingStore(store, after_write=2))
    wf.on_event = (Tracing(provider),)
    wf.step(name="pay", idempotent=False, in_doubt="raise")(lambda state: None)
    with pytest.raises(ds.testing.SimulatedCrash):  # right after pay's intent
        wf.run("r1", {})
    wf.store = store
    with pytest.raises(ds.StepInDoubt):
        wf.run("r1")
    wf.resolve("r1", fired=True)
    wf.run("r1")
    finished = exporter.get_finished_spans()
    assert [s.attributes["durable_steps.run.outcome"] for s in by_name(finished, "run paid")] == [
        "error",
        "in_doubt",
        "completed",
    ]
    assert not by_name(finished, "step pay")
    last = by_name(finished, "run paid")[-1]
    assert [e.name for e in last.events] == [
        "durable_steps.step.in_doubt",
        "durable_steps.step.committed",
    ]


def test_a_worker_running_runs_in_threads_gives_each_run_its_own_tree(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Submits are short spans; 4 worker threads run 12 runs: each run's spans in its trace."""
    provider, exporter = spans
    wf = ds.Workflow("batch", store=tmp_path, on_event=[Tracing(provider)])

    @wf.step()
    def fetch(state: dict[str, Any], ctx: ds.Context) -> None:
        state["page"] = ctx.call("get", lambda: state["n"] * 10)

    @wf.step()
    def save(state: dict[str, Any], ctx: ds.Context) -> None:
        time.sleep(0.01)  # overlap the runs
        state["saved"] = ctx.effect("put", lambda idempotency_key: state["page"])

    for n in range(12):
        wf.submit(f"r{n}", {"n": n})
    assert not otel_trace.get_current_span().get_span_context().is_valid  # nothing left current
    submits = by_name(exporter.get_finished_spans(), "run batch")
    assert [s.attributes["durable_steps.run.outcome"] for s in submits] == ["submitted"] * 12
    exporter.clear()
    report = ds.Worker(wf, concurrency=4).run(until_idle=True)
    assert len(report.completed) == 12
    finished = exporter.get_finished_spans()
    ids = {s.context.span_id: s for s in finished}
    runs = by_name(finished, "run batch")
    assert sorted(s.attributes["durable_steps.run.id"] for s in runs) == sorted(
        f"r{n}" for n in range(12)
    )
    for run in runs:
        run_id = run.attributes["durable_steps.run.id"]
        expected = trace_id("batch", run_id, nonce(tmp_path, "batch", run_id))
        assert format(run.context.trace_id, "032x") == expected
    for span in finished:
        if span.name == "run batch":
            continue
        parent = ids[parent_of(span)]  # every step and call has its parent exported
        assert parent.context.trace_id == span.context.trace_id
    assert len(by_name(finished, "call get")) == len(by_name(finished, "effect put")) == 12


def test_concurrent_calls_from_threads_are_each_a_span_of_their_step(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Journaled calls made from 8 threads at once give 8 ended call spans under their step."""
    provider, exporter = spans
    wf = ds.Workflow("fan", store=tmp_path, on_event=[Tracing(provider)])
    barrier = threading.Barrier(8)

    def tool(i: int) -> int:
        barrier.wait(timeout=10)  # all 8 calls are in flight together
        return i * i

    @wf.step()
    def fan(state: dict[str, Any], ctx: ds.Context) -> None:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ctx.call, f"tool:{i}", tool, i) for i in range(8)]
            state["squares"] = [f.result() for f in futures]

    assert wf.run("r1", {})["squares"] == [i * i for i in range(8)]
    finished = exporter.get_finished_spans()
    step = one(finished, "step fan")
    calls = [s for s in finished if s.name.startswith("call tool:")]
    assert sorted(s.name for s in calls) == sorted(f"call tool:{i}" for i in range(8))
    assert all(parent_of(s) == step.context.span_id for s in calls)
    assert all(s.status.status_code is StatusCode.OK for s in calls)


def test_the_step_span_is_current_and_the_callers_span_is_linked(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Spans the step's code makes nest under its attempt; the caller's span is linked."""
    provider, exporter = spans
    tracer = provider.get_tracer("app")
    wf = ds.Workflow("nest", store=tmp_path, on_event=[Tracing(provider)])

    @wf.step()
    def ask(state: dict[str, Any]) -> None:
        with tracer.start_as_current_span("http POST"):
            state["ok"] = True

    with tracer.start_as_current_span("request") as request:
        wf.run("r1", {})
        assert otel_trace.get_current_span() is request  # the run left the context as it found it
    finished = exporter.get_finished_spans()
    run, step = one(finished, "run nest"), one(finished, "step ask")
    assert parent_of(one(finished, "http POST")) == step.context.span_id
    (link,) = run.links
    assert link.context.span_id == request.get_span_context().span_id
    assert link.attributes == {"durable_steps.link.type": "caller"}
    assert run.context.trace_id != request.get_span_context().trace_id


def test_two_executions_of_one_run_in_one_process_keep_their_own_spans(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A takeover while the straggler's step still runs: two run spans, each with its steps."""
    provider, exporter = spans
    wf = ds.Workflow("two", store=tmp_path, on_event=[Tracing(provider)])
    entered, release = threading.Event(), threading.Event()
    calls = []

    @wf.step()
    def slow(state: dict[str, Any]) -> None:
        calls.append(1)
        if len(calls) == 1:  # the straggler: stuck until the takeover is done
            entered.set()
            release.wait(timeout=30)

    errors: list[BaseException] = []

    def straggler() -> None:
        try:
            wf.run("r1", {})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=straggler)
    thread.start()
    assert entered.wait(timeout=30)
    wf.run("r1", takeover=True)
    release.set()
    thread.join(timeout=30)
    assert [type(e) for e in errors] == [ds.CheckpointConflict]
    finished = exporter.get_finished_spans()
    runs = {s.attributes["durable_steps.run.outcome"]: s for s in by_name(finished, "run two")}
    assert set(runs) == {"completed", "error"}
    assert runs["error"].attributes["error.type"] == "durable_steps.errors.CheckpointConflict"
    steps = by_name(finished, "step slow")
    assert sorted(parent_of(s) for s in steps) == sorted(r.context.span_id for r in runs.values())


async def _async_step(state: dict[str, Any], ctx: ds.Context) -> None:
    state["text"] = await ctx.acall("model", _model)


async def _model() -> str:
    return "hi"


def test_async_runs_and_a_suspended_then_woken_run(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """arun gives the same tree; a suspended run's wake is a new execution linked to the run."""
    import asyncio

    provider, exporter = spans
    wf = ds.Workflow("later", store=tmp_path, on_event=[Tracing(provider)])
    wf.step(name="ask")(_async_step)

    @wf.step()
    def nap(state: dict[str, Any], ctx: ds.Context) -> None:
        ctx.sleep(0.2)

    with pytest.raises(ds.RunSuspended):
        asyncio.run(wf.arun("r1", {}))
    time.sleep(0.3)
    assert asyncio.run(wf.arun("r1"))["text"] == "hi"
    finished = exporter.get_finished_spans()
    first, woken = by_name(finished, "run later")
    assert first.attributes["durable_steps.run.outcome"] == "suspended"
    assert first.status.status_code is StatusCode.UNSET
    (ask,) = by_name(finished, "step ask")  # the second execution replays it: no new attempt
    assert parent_of(one(finished, "call model")) == ask.context.span_id
    assert woken.attributes["durable_steps.run.woken"] is True
    assert woken.attributes["durable_steps.run.resumed_step"] == "nap"
    assert [link.attributes for link in woken.links] == [{"durable_steps.link.type": "resumes"}]
    naps = by_name(finished, "step nap")
    assert [s.attributes.get("durable_steps.step.suspended") for s in naps] == [True, None]
    assert all(parent_of(s) in (first.context.span_id, woken.context.span_id) for s in naps)


class _BrokenTracerProvider(TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        raise_on = super().get_tracer(*args, **kwargs)

        class Broken:
            def start_span(self, *a: Any, **k: Any) -> Any:
                raise RuntimeError("exporter exploded")

            def __getattr__(self, name: str) -> Any:
                return getattr(raise_on, name)

        return Broken()


def test_a_broken_tracer_never_breaks_a_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tracer that raises is logged and ignored: the run completes."""
    wf = agent_workflow(tmp_path, Tracing(_BrokenTracerProvider()))
    with ds.testing.no_wait(), caplog.at_level(logging.ERROR, "durable_steps"):
        assert wf.run("r1", {})["done"] is True
    assert "exporter exploded" in caplog.text


def test_global_providers_are_used_when_none_is_given(tmp_path: Path) -> None:
    """Tracing() reports to the global providers, even ones set after it was made."""
    code = f"""
import durable_steps as ds
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from durable_steps.integrations.otel import Tracing

tracing = Tracing()
exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
wf = ds.Workflow("g", store={str(tmp_path)!r}, on_event=[tracing])
wf.step(name="s")(lambda state: None)
wf.run("r1", {{}})
names = sorted(m.name for r in reader.get_metrics_data().resource_metrics
               for s in r.scope_metrics for m in s.metrics)
print(sorted(s.name for s in exporter.get_finished_spans()), names)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == (
        "['run g', 'step s'] ['durable_steps.run.executions', 'durable_steps.step.commits', "
        "'durable_steps.step.duration']"
    )


def test_run_stopped_ends_every_unfinished_execution_and_progress_skips_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed execution ends with run_stopped (error attached); Progress adds no line."""
    import io

    seen: list[ds.Event] = []
    pipe = io.StringIO()
    wf = ds.Workflow("stops", store="memory://", on_event=[seen.append, ds.Progress(pipe)])

    @wf.step()
    def boom(state: dict[str, Any]) -> None:
        raise ValueError("no")

    with caplog.at_level(logging.ERROR, "durable_steps"), pytest.raises(ds.StepFailed):
        wf.run("r1", {})
    assert [e.kind for e in seen] == ["run_started", "step_started", "step_failed", "run_stopped"]
    assert isinstance(seen[-1].error, ds.StepFailed)
    assert len({e.execution for e in seen}) == 1
    assert seen[0].execution is not None
    assert "subscriber" not in caplog.text  # Progress did not fail on the new kind
    assert pipe.getvalue().count("\n") == 1  # the failure's line only


def test_import_durable_steps_imports_no_integration_package() -> None:
    """``import durable_steps`` loads neither opentelemetry, pydantic_ai nor ray."""
    code = (
        "import sys, durable_steps, durable_steps.integrations\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}"
        " & {'opentelemetry', 'pydantic_ai', 'ray'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
