"""Tool calls as journaled calls and effects: their names, titles, keys and records.

A tool's result is recorded as JSON and rebuilt from that JSON on both paths
(live and replayed), so the model sees the same thing either way. Three
things make "the same" hold beyond plain JSON values:

- **Types.** A result is rebuilt by the tool function's return annotation
  (``-> Order``, ``-> list[Order]``, ``-> dict[str, Point]``: nested types
  too). A result that is an instance of a class (a pydantic model, a
  dataclass) is also recorded with its class's ``module:qualname``
  (``"type"``), which picks among the classes the annotation names (``->
  Order | Refund``); it is never imported: a record is data, and a class
  the annotation does not name is not built from it. Without an annotation
  (or ``-> Any``) the JSON form is returned, live and replayed alike; so it
  is when the annotation would not give back what the tool returned (a
  subclass it does not name, a value it would coerce, ``-> BaseModel``):
  the model must see the same JSON as from the plain agent.
- **Multimodal content.** Results are encoded as pydantic-ai encodes a
  ``ToolReturnPart``'s content (``ModelMessagesTypeAdapter``: bytes as
  base64, each ``BinaryImage``, ``DocumentUrl``... tagged by its ``kind``),
  so they come back as those classes, inside lists and dicts too.
- **Usage.** A tool may run a sub-agent with ``usage=run_ctx.usage``; what
  that adds to the run's usage is recorded with the result (``"usage"``)
  and added again when the call replays. To tell one tool's usage from its
  neighbours' when tools run concurrently (pydantic-ai runs a response's
  tool calls together), each live call gets its own copy of the usage, and
  the difference is added to the run's own when the call ends.

A record is ``{"return": json, ["type": "module:Class"], ["usage": RunUsage]}``,
``{"retry": message}`` (a ``ModelRetry``: the model is told again, the tool
not asked again), ``{"failed": message}`` (a ``ToolFailed``: the model is
told the tool failed, which it answered; asked again, the tool might now
succeed, and the history would hold a result the recorded answer never saw)
or ``{"tool_return": ToolReturn as JSON}``. Anything else is
what ``wf.resolve(fired=True, result=...)`` recorded for an effect in doubt,
given to the model as the tool's return value.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from copy import copy
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    ToolReturn,
    ToolReturnPart,
)
from pydantic_ai.toolsets import FunctionToolset, WrapperToolset
from pydantic_ai.usage import RunUsage
from pydantic_core import PydanticSerializationError, to_json

from ...errors import DefinitionError, SerializationError
from .._names import response_name, tool_call_name

if TYPE_CHECKING:
    from pydantic_ai.tools import RunContext
    from pydantic_ai.toolsets import ToolsetTool

    from ..._execution.context import Context

_TOOL_RETURN: TypeAdapter[ToolReturn[Any]] = TypeAdapter(ToolReturn)
_USAGE: TypeAdapter[RunUsage] = TypeAdapter(RunUsage)
try:  # a failure the model is told of, as of a ModelRetry (not in every release)
    from pydantic_ai.exceptions import ToolFailed
except ImportError:  # a release without it: no tool raises one
    ToolFailed = None  # type: ignore[misc,assignment]

_OUTCOMES = frozenset({"return", "retry", "failed", "tool_return"})
_EXTRAS = frozenset({"type", "usage"})
_JSON_LEAVES = (str, int, float, bool, type(None), list, dict, tuple)
_MAX_ARGS = 160  # characters of a tool's arguments in its title


@dataclass
class Binding:
    """One agent run inside a step: where its calls are recorded, and their names."""

    ctx: Context
    prefix: str
    effects: frozenset[str]
    live: frozenset[str]
    outer: dict[ContextVar[Any], Any] = field(default_factory=dict)
    """The agent's ``override`` variables as they were outside this run."""
    requests: int = 0
    """Model requests made so far (a retried one counted once): ``model:<requests>``."""
    tries: int = 0
    """Failed tries of the last request in this attempt."""
    failed: tuple[int, Any] | None = None
    """The messages of the last request, when its try failed: their count and the last."""
    failed_name: str = ""
    """The name of that failed try."""
    tools: set[str] = field(default_factory=set)
    settling: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while one of a response's concurrent tools records the hook's answer."""

    def request_name(self, messages: list[Any]) -> str:
        """The name of a model request for ``messages`` (``model:3``; ``model:3.2`` for
        a retry). A retry asks with the messages the failed try had; a request with
        other ones is a new request (the failure was answered another way: a hook
        returned a response, or told the model to retry).
        """
        if self.failed is not None and self.failed == (len(messages), messages[-1:]):
            self.tries += 1
        else:
            self.requests, self.tries = self.requests + 1, 0
        self.failed = None
        return response_name(self.prefix, self.requests, self.tries, self.ctx._recorded)

    def request_failed(self, messages: list[Any], name: str) -> None:
        """The try just named failed; a request with the same ``messages`` is its retry."""
        self.failed, self.failed_name = (len(messages), messages[-1:]), name

    def answered(self, messages: list[Any]) -> tuple[str, ModelResponse] | None:
        """The failed try's name and the response that answered it in its stead, when
        ``messages`` go on from one (an ``on_model_request_error`` hook returned it):
        it is in ``messages``, right after the failed try's own.
        """
        if self.failed is None or self.failed == (len(messages), messages[-1:]):
            return None
        count = self.failed[0]
        if len(messages) > count and isinstance(messages[count], ModelResponse):
            return self.failed_name, messages[count]
        return None

    async def settle(self, messages: list[Any]) -> None:
        """Record the hook's answer to the failed try, if ``messages`` go on from one.

        Called before anything is made from the answer: the next model request,
        each tool of the answer (``messages`` is then the run's history, the
        answer last), the end of the run (a final answer). The failed try
        recorded nothing; asked again on a re-run of the step, a request that
        failed for a passing reason (a timeout, a 503) would get the model's
        own answer, and the run would go on from a transcript that the records
        made after the hook's answer (tool calls, effects and their keys, the
        output) never saw. Recorded, the re-run replays the hook's answer as
        the response; the hook does not run again. Recorded once: the tools of
        one response run concurrently, the first records, the others wait.
        """
        async with self.settling:
            found = self._answer(messages)
            if found is None:
                return
            name, data, shown = found

            async def hooks_answer() -> Any:
                return data

            self.ctx._release(name)
            await self.ctx._acall(name, hooks_answer, (), {}, title=shown)
            self.failed = None

    def settle_sync(self, messages: list[Any]) -> None:
        """:meth:`settle` at the end of a sync run (``run_sync``), outside its loop."""
        found = self._answer(messages)
        if found is None:
            return
        name, data, shown = found
        self.ctx._release(name)
        self.ctx._call(name, lambda: data, (), {}, title=shown)
        self.failed = None

    def _answer(self, messages: list[Any]) -> tuple[str, Any, str] | None:
        """The name, record and title of the hook's answer :meth:`settle` records."""
        answered = self.answered(messages)
        if answered is None:
            return None
        name, response = answered
        data = ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]
        for run_field in ("run_id", "conversation_id"):  # the agent's, set on each run
            if data.get(run_field) is not None:
                data[run_field] = None
        return name, data, f"model request {self.requests} (answered by on_model_request_error)"

    def tool_name(self, run_ctx: RunContext[Any]) -> str:
        call_id = run_ctx.tool_call_id or run_ctx.tool_name or "?"
        name = tool_call_name(self.prefix, call_id)  # (a long id shortened)
        # Ids repeated within one response never get here: pydantic-ai (2.54 and later)
        # refuses such a response before any of its tools runs (the run fails, as plainly).
        if name in self.tools:  # a model that reuses ids across responses (TestModel does)
            name = tool_call_name(self.prefix, call_id, f"@{run_ctx.run_step}")
        self.tools.add(name)
        return name

    def where(self) -> str:
        return f"run {self.ctx.workflow}/{self.ctx.run_id}: step {self.ctx.step!r}"


binding: ContextVar[Binding | None] = ContextVar("durable_steps_pydantic_ai", default=None)
_key: ContextVar[tuple[str | None, str] | None] = ContextVar(
    "durable_steps_pydantic_ai_key", default=None
)
"""The (tool call id, idempotency key) of the effect tool running in this context."""


def idempotency_key(run_ctx: RunContext[Any]) -> str:
    """The idempotency key of the effect tool call ``run_ctx`` belongs to.

    The same on every re-fire of this tool call (a retry of the step, a
    resume after a crash), different for every other tool call, step, pass
    and run; at most 64 printable ASCII characters. Pass it to the API the
    tool calls, so that a re-fire is deduplicated there. Only a tool named
    in ``DurableAgent(effects=...)``, run by that agent inside a step, has one.
    """
    found = _key.get()
    if found is None or found[0] != run_ctx.tool_call_id:
        raise DefinitionError(
            f"idempotency_key() was called in tool {run_ctx.tool_name!r}, which is not running "
            "as an effect: name it in DurableAgent(agent, effects={...}) and run the agent with "
            "durable.run_sync(..., ctx=ctx) (or await durable.run(...)) inside a step."
        )
    return found[1]


@contextmanager
def outside(bound: Binding) -> Iterator[None]:
    """A tool body's context: no binding, the agent's overrides as outside the run.

    A tool body inherits the run's context variables, so without this an
    ``agent.run`` inside the tool (the agent delegating to itself) would use
    our model, and its requests would be numbered among the outer run's:
    recorded inside the tool's call, they would be missing when the tool
    replays after a crash, and the outer run's next request would get the
    inner run's answer. Reset, the inner run is the plain run it is without
    ``DurableAgent``, and its outcome is part of the tool's recorded result.
    """
    tokens = [(var, var.set(value)) for var, value in bound.outer.items()]
    token = binding.set(None)
    try:
        yield
    finally:
        binding.reset(token)
        for var, var_token in reversed(tokens):
            var.reset(var_token)


def title(name: str, args: Mapping[str, Any]) -> str:
    """What a person sees for a tool call: ``refund(order='4411', cents=500)``."""
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
    if len(shown) > _MAX_ARGS:
        shown = shown[: _MAX_ARGS - 1] + "\u2026"
    return f"{name}({shown})"


@dataclass
class JournaledToolset(WrapperToolset[Any]):
    """A toolset whose calls are journaled calls (effects: ``ctx._aeffect``)."""

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        """A recorded tool call (replayed if the step recorded it before)."""
        bound = binding.get()
        if bound is None:
            return await super().call_tool(name, tool_args, ctx, tool)
        await bound.settle(ctx.messages)  # a hook's answer called this tool: record it first
        if name in bound.live:
            with outside(bound):
                return await super().call_tool(name, tool_args, ctx, tool)
        journal_name = bound.tool_name(ctx)

        async def call() -> Any:
            usage = ctx.usage
            before = _copy_usage(usage)
            own = replace(ctx, usage=_copy_usage(usage))
            try:
                with outside(bound):
                    result = await self.wrapped.call_tool(name, tool_args, own, tool)
            except ModelRetry as exc:
                record: dict[str, Any] = {"retry": exc.message}
            except BaseException as exc:
                if ToolFailed is None or not isinstance(exc, ToolFailed):
                    usage.incr(own.usage - before)  # not recorded: it runs again, as plainly
                    raise
                record = {"failed": exc.message}
            else:
                record = dump_result(result, name, bound)
            spent = own.usage - before
            if spent != RunUsage():
                record["usage"] = _USAGE.dump_python(spent, mode="json")
            return record

        async def fire(*, idempotency_key: str) -> Any:
            token = _key.set((ctx.tool_call_id, idempotency_key))
            try:
                return await call()
            finally:
                _key.reset(token)

        shown = title(name, tool_args)
        if name in bound.effects:
            recorded = await bound.ctx._aeffect(journal_name, fire, (), {}, title=shown)
        else:
            recorded = await bound.ctx._acall(journal_name, call, (), {}, title=shown)
        return load_result(recorded, ctx, tool, name)


def _copy_usage(usage: RunUsage) -> RunUsage:
    own = copy(usage)
    own.details = dict(usage.details)  # incr() adds to the dict in place
    return own


def dump_result(result: Any, tool: str, bound: Binding) -> dict[str, Any]:
    """The record of a tool's return value (see the module docstring)."""
    try:
        if isinstance(result, ToolReturn):
            return {"tool_return": _TOOL_RETURN.dump_python(result, mode="json")}
        record: dict[str, Any] = {"return": _dump_content(result)}
    except (PydanticSerializationError, ValueError, TypeError) as exc:
        ctx = bound.ctx
        then = (
            "It has fired: a retry of the step fires it again with the same idempotency key."
            if tool in bound.effects
            else "Nothing was recorded: the tool runs again when the step does."
        )
        raise SerializationError(
            f"{bound.where()}: the result of tool {tool!r} cannot be recorded as JSON ({exc}). "
            f"{then} Return a JSON-able value (a str, dict, list, a pydantic model or "
            "dataclass, pydantic-ai's multimodal content).",
            run=f"{ctx.workflow}/{ctx.run_id}",
            step=ctx.step,
        ) from exc
    kind = type(result)
    if not isinstance(result, _JSON_LEAVES) and not kind.__module__.startswith("pydantic_ai."):
        record["type"] = f"{kind.__module__}:{kind.__qualname__}"
    return record


def load_result(recorded: Any, ctx: RunContext[Any], tool: ToolsetTool[Any], name: str) -> Any:
    """The tool's return value from its record; its recorded usage added to the run's."""
    if not (
        isinstance(recorded, dict)
        and len(recorded.keys() & _OUTCOMES) == 1
        and recorded.keys() <= _OUTCOMES | _EXTRAS
    ):
        return recorded  # given by hand (resolve of an effect in doubt)
    if "usage" in recorded:
        ctx.usage.incr(_USAGE.validate_python(recorded["usage"]))
    if "retry" in recorded:
        raise ModelRetry(recorded["retry"])
    if "failed" in recorded:
        raise (ModelRetry if ToolFailed is None else ToolFailed)(recorded["failed"])
    if "tool_return" in recorded:
        return _TOOL_RETURN.validate_python(recorded["tool_return"])
    value = recorded["return"]
    declared, named = _declared(tool, name), recorded.get("type")
    picked = _allowed(declared).get(named) if declared and isinstance(named, str) else None
    for kind in (picked, declared):
        if kind is not None:
            try:
                rebuilt = _adapter(kind).validate_python(value)
                # Only if nothing was lost or changed on the way: the model must see what
                # the tool returned (a subclass the annotation does not name keeps its
                # fields, "007" stays a string under -> dict[str, int], 1 is not 1.0).
                if _same_json(_dump_content(rebuilt), value):
                    return rebuilt
            except (ValidationError, PydanticSerializationError, TypeError, ValueError):
                continue  # recorded by another version of the tool: try the next
    return _load_content(value)


def _same_json(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same JSON text, but for the order of arrays: a
    set is dumped in hash order, which differs from process to process (validation
    never reorders a list, so an array in another order is a set's).
    """
    return to_json(a) == to_json(b) or _unordered(a) == _unordered(b)


def _unordered(value: Any) -> bytes:
    """``value``'s JSON with every array's items in one order (by their own JSON)."""

    def canonical(v: Any) -> Any:
        if isinstance(v, list):
            return sorted((canonical(x) for x in v), key=to_json)
        if isinstance(v, dict):
            return {k: canonical(x) for k, x in v.items()}
        return v

    return to_json(canonical(value))


@lru_cache(maxsize=256)
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def _dump_content(value: Any) -> Any:
    """``value`` as pydantic-ai writes a tool return's content (bytes as base64)."""
    request = ModelRequest(parts=[ToolReturnPart("t", value, tool_call_id="t")])
    message = ModelMessagesTypeAdapter.dump_python([request], mode="json")[0]
    return message["parts"][0]["content"]


def _part(content: Any) -> dict[str, Any]:
    return {"part_kind": "tool-return", "tool_name": "t", "tool_call_id": "t", "content": content}


def _load_content(value: Any) -> Any:
    """The content pydantic-ai reads back (multimodal parts as their classes)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    message = {"kind": "request", "parts": [_part(value)]}
    return ModelMessagesTypeAdapter.validate_python([message])[0].parts[0].content  # type: ignore[union-attr]


@lru_cache(maxsize=256)
def _allowed(declared: Any) -> dict[str, type]:
    """The classes a return annotation names (``Order | Refund``, ``list[Order]``...),
    by the ``module:qualname`` a record gives: the only ones a record may pick.

    A record comes from the store or from ``wf.resolve(result=...)``; letting
    its ``"type"`` name any class would import modules named by data (their
    import-time code runs) and build classes from it. pydantic-ai's own
    content types need no name: they are tagged in the JSON itself.
    """
    found: dict[str, type] = {}
    stack = [declared]
    while stack:
        kind = stack.pop()
        if isinstance(kind, type):
            found[f"{kind.__module__}:{kind.__qualname__}"] = kind
        stack.extend(arg for arg in typing.get_args(kind) if not isinstance(arg, (str, int)))
    return found


def _declared(tool: ToolsetTool[Any], name: str) -> Any:
    """The return annotation of a function tool, or None (not known, or ``Any``)."""
    toolset = getattr(tool, "toolset", None)
    if not isinstance(toolset, FunctionToolset):
        return None
    found = toolset.tools.get(getattr(tool, "original_name", None) or name)
    function = getattr(found, "function", None)
    return None if function is None else _return_type(function)


@lru_cache(maxsize=256)
def _return_type(function: Any) -> Any:
    try:
        declared = typing.get_type_hints(function).get("return")
    except Exception:  # an annotation that does not resolve (a name local to a function)
        return None
    return None if declared in (None, Any, object) else declared
