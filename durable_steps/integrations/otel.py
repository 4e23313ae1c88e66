"""OpenTelemetry spans and metrics for runs: ``Workflow(..., on_event=[Tracing()])``.

:class:`Tracing` (``Tracing(tracer_provider=None, meter_provider=None)``)
is an ``on_event`` subscriber; without providers it uses the global ones
(``opentelemetry.trace.set_tracer_provider``, ``metrics.set_meter_provider``),
even when they are set after it was made.

**Spans.** Each execution of a run (one process running it, from its start
or resume to its completion or stop; ``Workflow.submit`` makes a short one)
is a span ``run <workflow>``; each
attempt of a step a child ``step <name>``, current while the step runs, so
spans the step's own code makes (an instrumented HTTP or model client) nest
under it; each journaled call that runs its function (``ctx.call``,
``ctx.effect``) a grandchild ``call <name>`` or ``effect <name>``, from
``call_started`` to ``call_recorded``. A replayed call does no work, so it is
an event ``durable_steps.call.replayed`` on its step's span, not a span: an
agent resumed after 40 model calls shows the calls it made, not 40 empty
spans. A call whose function raised ends with its attempt, as an error.

**One trace per run, across processes.** Every execution span of run
``workflow/run_id`` is the child of a span context derived from that
identity alone (:func:`trace_id` gives its trace id), so the first
execution, one that crashed (its spans exported before the SIGKILL) and the
resume in another process a day later share one trace, with nothing stored
in the checkpoint. A resumed or woken execution also carries a ``Link`` to
that context (``durable_steps.link.type`` ``"resumes"``): the earlier
executions are the trace it points to. That parent span is never exported
itself (backends show the executions under a missing root), and it is
sampled, so a ``ParentBased`` sampler keeps every run; the caller's span, if
one is current when the run starts, is linked (``"caller"``) rather than
made the parent, which would split a run over its callers' traces.

**Metrics** (attributes: ``durable_steps.workflow``,
``durable_steps.step.name``; never the run id, to keep cardinality low):
``durable_steps.step.commits``, ``.retries``, ``.failures``, ``.in_doubt``,
``durable_steps.effect.in_doubt``, ``durable_steps.step.duration`` (seconds
from a step's first attempt to its commit), ``durable_steps.calls`` (journaled
calls whose function ran, by ``durable_steps.call.kind`` ``call`` or
``effect``, and replays, ``durable_steps.call.replayed``; replays include the
journal's records of waits, ``ctx.sleep`` and ``ctx.wait_for``), and
``durable_steps.run.executions`` (by ``durable_steps.run.outcome``:
``completed``, ``submitted``, ``suspended``, ``released``, ``failed``, ``in_doubt``,
``error``).

Events come from several threads (concurrent journaled calls, workers); a
lock per execution orders them, and nothing here raises into a run.
"""

from __future__ import annotations

import threading
from contextvars import Token
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from .._events import Event, logger
from .._execution.run_state import Released
from .._record.checkpoint import trace_ids
from .._version import __version__
from ..errors import RunSuspended, StepFailed, StepInDoubt

__all__ = ["Tracing", "trace_id"]

_SCOPE = "durable_steps"


def _run_context(workflow: str, run_id: str, run_nonce: str) -> SpanContext:
    """The span context every execution of the run hangs from (a pure function)."""
    trace, span = trace_ids(workflow, run_id, run_nonce)
    return SpanContext(trace, span, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def trace_id(workflow: str, run_id: str, run_nonce: str) -> str:
    """The trace id (32 hex digits) of run ``workflow/run_id`` with nonce
    ``run_nonce`` (``durable-steps show`` prints both): search it in your backend.
    """
    return format(trace_ids(workflow, run_id, run_nonce)[0], "032x")


_Current = tuple["Token[Context]", int]
"""A span made current: the token that undoes it, and the thread it was made in."""


def _make_current(span: trace.Span) -> _Current:
    return otel_context.attach(trace.set_span_in_context(span)), threading.get_ident()


def _restore(current: _Current | None) -> None:
    """Undo :func:`_make_current` in the thread that did it (run and step
    boundaries are reported by the thread running the run; a token belongs
    to the context it was made in).
    """
    if current is not None and current[1] == threading.get_ident():
        otel_context.detach(current[0])


@dataclass
class _Execution:
    """The open spans of one execution of a run."""

    span: trace.Span
    current: _Current | None
    """The run span, made current in the thread that runs the run."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    step: trace.Span | None = None
    step_current: _Current | None = None
    calls: dict[tuple[Any, ...], trace.Span] = field(default_factory=dict)
    refired: set[str] = field(default_factory=set)
    """Effects found in doubt within this attempt: their next call span fires them again."""


def _outcome(error: BaseException | None) -> str:
    if error is None:  # Workflow.submit: created, not run
        return "submitted"
    if isinstance(error, RunSuspended):
        return "suspended"
    if isinstance(error, Released):
        return "released"
    if isinstance(error, StepFailed):
        return "failed"
    if isinstance(error, StepInDoubt):
        return "in_doubt"
    return "error"


class Tracing:
    """An ``on_event`` subscriber making OpenTelemetry spans and metrics (module docstring).

    ``tracer_provider`` and ``meter_provider`` default to the global ones.
    One instance can serve many workflows and concurrent runs.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_SCOPE, __version__, meter_provider=meter_provider)
        self._commits = meter.create_counter(
            "durable_steps.step.commits", "{step}", "Steps committed to the checkpoint"
        )
        self._retries = meter.create_counter(
            "durable_steps.step.retries", "{attempt}", "Failed step attempts followed by a retry"
        )
        self._failures = meter.create_counter(
            "durable_steps.step.failures", "{step}", "Steps that failed for good (the run stops)"
        )
        self._in_doubt = meter.create_counter(
            "durable_steps.step.in_doubt", "{step}", "Steps found in doubt after a crash"
        )
        self._effects_in_doubt = meter.create_counter(
            "durable_steps.effect.in_doubt", "{effect}", "Effects found in doubt after a crash"
        )
        self._durations = meter.create_histogram(
            "durable_steps.step.duration", "s", "From a step's first attempt to its commit"
        )
        self._calls = meter.create_counter(
            "durable_steps.calls", "{call}", "Journaled calls recorded or replayed"
        )
        self._executions = meter.create_counter(
            "durable_steps.run.executions", "{execution}", "Executions of runs, by outcome"
        )
        self._lock = threading.Lock()
        self._open: dict[str, _Execution] = {}

    def __call__(self, event: Event) -> None:
        """Turn ``event`` into spans and metrics; never raises."""
        try:
            self._handle(event)
        except Exception:  # observability never breaks a run
            logger.exception("durable_steps tracing failed on %s; ignored", event.kind)

    # --- dispatch ----------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        kind = event.kind
        metric = {"durable_steps.workflow": event.workflow}
        if event.step is not None:
            metric["durable_steps.step.name"] = event.step
        self._count(event, metric)
        if kind in ("run_started", "run_resumed", "run_woken"):
            self._begin(event)
            return
        key = event.execution or f"{event.workflow}/{event.run_id}"
        with self._lock:
            run = self._open.get(key)
            if run is not None and kind in ("run_completed", "run_stopped"):
                del self._open[key]
        if run is None:
            return
        with run.lock:
            if kind in ("run_completed", "run_stopped"):
                self._end_run(run, event)
            elif kind == "step_in_doubt" or (kind == "effect_in_doubt" and event.attempt is None):
                self._doubt(run, event)
            elif kind.startswith(("call_", "signal_", "effect_")):
                self._call(run, event)
            else:
                self._step(run, event)

    def _count(self, event: Event, metric: dict[str, str]) -> None:
        kind = event.kind
        if kind == "step_committed":
            self._commits.add(1, metric)
            if event.duration is not None:
                self._durations.record(event.duration, metric)
        elif kind == "step_retrying":
            self._retries.add(1, metric)
        elif kind == "step_failed":
            self._failures.add(1, metric)
        elif kind == "step_in_doubt":
            self._in_doubt.add(1, metric)
        elif kind == "effect_in_doubt" and event.attempt is None:
            # Found before the step runs; the same doubt is reported again,
            # within the attempt, as the effect fires once more: counted once.
            self._effects_in_doubt.add(1, metric)
        elif kind == "call_started":  # the function runs (a call_recorded follows unless it raises)
            effect = "effect" if event.idempotency_key is not None else "call"
            self._calls.add(1, {**metric, "durable_steps.call.kind": effect})
        elif kind == "call_replayed":
            self._calls.add(1, {**metric, "durable_steps.call.replayed": True})
        elif kind in ("run_completed", "run_stopped"):
            outcome = "completed" if kind == "run_completed" else _outcome(event.error)
            self._executions.add(1, {**metric, "durable_steps.run.outcome": outcome})

    # --- the run's span ----------------------------------------------------------

    def _begin(self, event: Event) -> None:
        key = event.execution or f"{event.workflow}/{event.run_id}"
        resumed = event.kind != "run_started"
        with self._lock:
            run = self._open.get(key)
        if run is not None:  # run_woken, then its run_resumed: one execution
            if event.step is not None:
                run.span.set_attribute("durable_steps.run.resumed_step", event.step)
            return
        anchor = _run_context(event.workflow, event.run_id, event.run_nonce or "")
        links = [Link(anchor, {"durable_steps.link.type": "resumes"})] if resumed else []
        caller = trace.get_current_span().get_span_context()
        if caller.is_valid:
            links.append(Link(caller, {"durable_steps.link.type": "caller"}))
        attributes: dict[str, Any] = {
            "durable_steps.workflow": event.workflow,
            "durable_steps.run.id": event.run_id,
            "durable_steps.run.resumed": resumed,
            "durable_steps.run.woken": event.kind == "run_woken",
        }
        if event.execution is not None:
            attributes["durable_steps.run.execution"] = event.execution
        if resumed and event.step is not None:
            attributes["durable_steps.run.resumed_step"] = event.step
            attributes["durable_steps.run.resumed_iteration"] = event.iteration or 0
        span = self._tracer.start_span(
            f"run {event.workflow}",
            context=trace.set_span_in_context(NonRecordingSpan(anchor)),
            attributes=attributes,
            links=links,
        )
        execution = _Execution(span, _make_current(span))
        with self._lock:
            self._open[key] = execution

    def _end_run(self, run: _Execution, event: Event) -> None:
        error = event.error
        outcome = "completed" if event.kind == "run_completed" else _outcome(error)
        stopped = f"the execution stopped ({outcome})"
        for span in run.calls.values():
            _fail(span, error, stopped)
        run.calls.clear()
        if run.step is not None:
            _fail(run.step, error, stopped)
            _restore(run.step_current)
            run.step = None
        run.span.set_attribute("durable_steps.run.outcome", outcome)
        if outcome in ("completed", "submitted", "suspended", "released"):
            run.span.set_status(
                Status(StatusCode.OK if outcome == "completed" else StatusCode.UNSET)
            )
        else:
            _fail(run.span, error, None, end=False)
        _restore(run.current)
        run.span.end()

    # --- steps -----------------------------------------------------------------

    def _step(self, run: _Execution, event: Event) -> None:
        kind = event.kind
        attributes: dict[str, Any] = {
            "durable_steps.step.name": event.step or "",
            "durable_steps.step.iteration": event.iteration or 0,
        }
        if kind == "step_started":
            if run.step is not None:  # never expected: a lost end closes it
                run.step.end()
                _restore(run.step_current)
            attributes["durable_steps.step.attempt"] = event.attempt or 1
            if event.idempotency_key is not None:
                attributes["durable_steps.idempotency_key"] = event.idempotency_key
            run.step = self._tracer.start_span(
                f"step {event.step}",
                context=trace.set_span_in_context(run.span),
                attributes=attributes,
            )
            run.refired.clear()
            run.step_current = _make_current(run.step)
            return
        step, run.step = run.step, None
        if step is None:  # committed or failed without an attempt here (reconcile, a resolve)
            if event.error is not None:
                attributes["error.type"] = _error_type(event.error)
            run.span.add_event(f"durable_steps.{kind.replace('_', '.', 1)}", attributes)
            return
        for span in run.calls.values():  # calls whose function raised
            _fail(span, event.error, "the step attempt ended before the call was recorded")
        run.calls.clear()
        if kind == "step_committed":
            step.set_status(Status(StatusCode.OK))
        elif kind == "run_suspended":
            step.set_attribute("durable_steps.step.suspended", True)
        else:  # step_retrying, step_failed
            if kind == "step_retrying" and event.duration is not None:
                step.set_attribute("durable_steps.step.retry_wait", event.duration)
            _fail(step, event.error, None, end=False)
        _restore(run.step_current)
        run.step_current = None
        step.end()

    def _doubt(self, run: _Execution, event: Event) -> None:
        """A step or an effect found in doubt before the step runs again: an event."""
        attributes: dict[str, Any] = {
            "durable_steps.step.name": event.step or "",
            "durable_steps.step.iteration": event.iteration or 0,
        }
        if event.call is not None:
            attributes["durable_steps.call.name"] = event.call
        if event.title is not None:
            attributes["durable_steps.call.title"] = event.title
        if event.idempotency_key is not None:
            attributes["durable_steps.idempotency_key"] = event.idempotency_key
        run.span.add_event(f"durable_steps.{event.kind.replace('_', '.', 1)}", attributes)

    # --- journaled calls ---------------------------------------------------------

    def _call(self, run: _Execution, event: Event) -> None:
        kind, name = event.kind, event.call or ""
        key = (event.step, event.iteration, event.attempt, name)
        parent = run.step if run.step is not None else run.span
        attributes: dict[str, Any] = {"durable_steps.call.name": name}
        if event.title is not None:
            attributes["durable_steps.call.title"] = event.title
        if event.idempotency_key is not None:
            attributes["durable_steps.idempotency_key"] = event.idempotency_key
        if kind == "call_started":
            effect = event.idempotency_key is not None
            attributes["durable_steps.call.kind"] = "effect" if effect else "call"
            attributes["durable_steps.step.name"] = event.step or ""
            attributes["durable_steps.step.attempt"] = event.attempt or 1
            if name in run.refired:
                attributes["durable_steps.effect.refired"] = True
            run.calls[key] = self._tracer.start_span(
                f"{'effect' if effect else 'call'} {event.title or name}",
                context=trace.set_span_in_context(parent),
                attributes=attributes,
            )
        elif kind == "call_recorded":
            span = run.calls.pop(key, None)
            if span is not None:  # (the journal's own records, of waits, have no start)
                span.set_status(Status(StatusCode.OK))
                span.end()
        elif kind == "effect_in_doubt":  # within the attempt: it fires again now
            run.refired.add(name)
        else:  # call_replayed, signal_received
            if kind == "call_replayed":
                attributes["durable_steps.call.replayed"] = True
            parent.add_event(f"durable_steps.{kind.replace('_', '.', 1)}", attributes)


def _fail(span: trace.Span, error: BaseException | None, why: str | None, end: bool = True) -> None:
    """Mark ``span`` failed by ``error`` (or for ``why``), and end it unless told not to."""
    if error is not None:
        span.record_exception(error)
        span.set_attribute("error.type", _error_type(error))
    description = why or (f"{type(error).__name__}: {error}" if error is not None else None)
    span.set_status(Status(StatusCode.ERROR, description))
    if end:
        span.end()


def _error_type(error: BaseException) -> str:
    """``error.type`` as the semantic conventions want it: the fully qualified class name."""
    return f"{type(error).__module__}.{type(error).__qualname__}"
