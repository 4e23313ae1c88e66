"""Model requests as journaled calls, streamed ones included.

A request is recorded as its ``ModelResponse`` (pydantic-ai's
``ModelMessagesTypeAdapter`` JSON) and rebuilt from that JSON on both paths,
so a replayed response equals a live one.

A streamed request (``run_stream``, ``run_stream_events``, ``iter`` with
``node.stream``, or an ``event_stream_handler``) is drained inside the
journaled call and recorded with *every event the stream produced* — each
part's start, its deltas and its end, the final-result event — then
streamed back from the record, live or replayed. A consumer therefore sees
the same events in the same order as from the plain agent, and the same
events again when the step re-runs; what it loses is timing: a live
response arrives once the model finished, not token by token. (Recording
the events rather than re-deriving them from the parts is what keeps the
deltas: pydantic-ai's own ``replay_events=True`` turns each part into one
start event.) A record of an earlier version (the response alone) replays
as one start event per part.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, TypeAdapter
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    ModelResponseStreamEvent,
)
from pydantic_ai.models import CompletedStreamedResponse, StreamedResponse
from pydantic_ai.models.wrapper import WrapperModel

from ._tools import Binding, binding

if TYPE_CHECKING:
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import RunContext

_EVENTS: TypeAdapter[list[ModelResponseStreamEvent]] = TypeAdapter(
    list[ModelResponseStreamEvent],
    config=ConfigDict(defer_build=True, ser_json_bytes="base64", val_json_bytes="base64"),
)


def dump_response(response: ModelResponse) -> Any:
    """A response as the JSON pydantic-ai writes it."""
    return ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]


def load_response(data: Any) -> ModelResponse:
    """A response from :func:`dump_response`'s JSON."""
    message = ModelMessagesTypeAdapter.validate_python([data])[0]
    assert isinstance(message, ModelResponse)
    return message


def _streamed(recorded: Any) -> bool:
    """Whether ``recorded`` is a streamed request's record (its response and events).

    Either path replays either record: a step whose re-run asks without
    streaming what its first attempt streamed (an ``event_stream_handler``
    dropped, ``run_stream`` changed to ``run``) gets the recorded response; the
    other way round, a response recorded unstreamed streams back one start
    event per part.
    """
    return isinstance(recorded, dict) and recorded.keys() == {"response", "events"}


class JournaledModel(WrapperModel):
    """The agent's model, each request a journaled call of the bound step."""

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        """A recorded model request (replayed if the step recorded it before)."""
        bound = binding.get()
        if bound is None:
            return await super().request(messages, model_settings, model_request_parameters)

        async def live() -> Any:
            response = await self.wrapped.request(
                messages, model_settings, model_request_parameters
            )
            return dump_response(response)

        recorded = await self._recorded(bound, messages, live)
        if _streamed(recorded):  # recorded streamed: the response is the same either way
            recorded = recorded["response"]
        return load_response(recorded)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """A streamed request, drained and recorded with its events; they stream back."""
        bound = binding.get()
        if bound is None:
            async with super().request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as live_stream:
                yield live_stream
            return

        async def live() -> Any:
            async with self.wrapped.request_stream(
                messages, model_settings, model_request_parameters, run_context
            ) as stream:
                events = [event async for event in stream]
            return {
                "response": dump_response(stream.get()),
                "events": _EVENTS.dump_python(events, mode="json"),
            }

        recorded = await self._recorded(bound, messages, live)
        if _streamed(recorded):
            response = load_response(recorded["response"])
            replay: bool | list[ModelResponseStreamEvent] = _EVENTS.validate_python(
                recorded["events"]
            )
        else:  # recorded by an earlier version: the response alone
            response, replay = load_response(recorded), True
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=replay
        )

    async def _recorded(
        self, bound: Binding, messages: list[ModelMessage], live: Callable[[], Awaitable[Any]]
    ) -> Any:
        """The response to ``messages`` as recorded (``live()`` made and recorded, or
        replayed). A failed try records nothing, and its retry gets a name of its own
        (see ``integrations._names``, "Model responses").
        """
        await bound.settle(messages)  # a hook's answer this request goes on from
        name = bound.request_name(messages)
        title = f"model request {bound.requests} ({self.wrapped.model_name})"
        try:
            return await bound.ctx._acall(name, live, (), {}, title=title)
        except Exception:
            bound.request_failed(messages, name)
            raise
