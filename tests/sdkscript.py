"""Scripted OpenAI Agents SDK responses, for the in-process ``Model``s of the tests."""

from __future__ import annotations

import json
from typing import Any

from agents import ModelResponse, Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)


def message(text: str) -> ResponseOutputMessage:
    """An assistant message saying ``text``."""
    return ResponseOutputMessage(
        id="msg_1",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


def tool_call(
    name: str, args: dict[str, Any], call_id: str, n: int = 1
) -> ResponseFunctionToolCall:
    """A call of function tool ``name`` with ``args``, under ``call_id``."""
    return ResponseFunctionToolCall(
        type="function_call",
        name=name,
        arguments=json.dumps(args),
        call_id=call_id,
        id=f"fc_{n}",
        status="completed",
    )


def response(output: list[Any]) -> ModelResponse:
    """A response of ``output`` items, costing one request."""
    usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
    return ModelResponse(output=output, usage=usage, response_id=None)


def told(items: Any) -> list[str]:
    """The outputs of the function calls in a request's ``input``, sorted."""
    return sorted(
        str(i["output"])
        for i in (items if isinstance(items, list) else [])
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    )
