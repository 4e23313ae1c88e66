"""What is recorded for a model response, a tool call and a guardrail, and how it is rebuilt.

A journaled call's result must be JSON (the workflow's serializer), and the
call returns the *decoded* record on both paths, the live one included. So
each value is turned into JSON here and rebuilt from that JSON, whether it
was just made or replayed: a replayed run sees exactly what the live run saw.

Model responses
    ``ModelResponse`` is a dataclass of the SDK's typed output items
    (pydantic models of the ``openai`` package), a ``Usage`` and two ids.
    The SDK refuses plain dicts where it expects items, so each item is
    stored as ``model_dump(mode="json", exclude_unset=True)`` — the fields
    the model really sent, no ``null`` padding that a later request would
    echo back — and rebuilt by its ``type`` into the item class the
    ``openai`` package declares for it. ``Usage`` goes through the SDK's own
    ``serialize_usage``/``deserialize_usage``, so a replayed run counts the
    tokens the live one paid for.
Tool results
    Stored as ``pydantic_core.to_jsonable_python`` gives them: a tool that
    returns a pydantic model gets its JSON form back, on both paths.
Guardrails
    ``GuardrailFunctionOutput`` as ``{"tripwire_triggered", "output_info"}``
    (``output_info`` as JSON).
"""

from __future__ import annotations

import json
import typing
from typing import Any

from agents import GuardrailFunctionOutput, ModelResponse
from agents.usage import deserialize_usage, serialize_usage  # no public name: see _sdk
from openai.types.responses import ResponseOutputItem
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, to_jsonable_python

from ...errors import SerializationError

if typing.TYPE_CHECKING:
    from ..._execution.context import Context

__all__ = [
    "dump_guardrail",
    "dump_response",
    "dump_tool_result",
    "load_guardrail",
    "load_response",
    "tool_title",
]


def _item_classes() -> dict[str, type[BaseModel]]:
    """The output item classes of the Responses API, by their ``type`` literal."""
    union = typing.get_args(ResponseOutputItem)[0]  # Annotated[Union[...], PropertyInfo]
    found: dict[str, type[BaseModel]] = {}
    for cls in typing.get_args(union):
        field = cls.model_fields.get("type")
        if field is None:
            continue
        for literal in typing.get_args(field.annotation):
            if isinstance(literal, str):
                found.setdefault(literal, cls)
    return found


_ITEMS = _item_classes()


def dump_response(response: ModelResponse) -> dict[str, Any]:
    """A model response as JSON: its output items, usage and ids."""
    output = [
        item.model_dump(mode="json", exclude_unset=True)
        if isinstance(item, BaseModel)
        else to_jsonable_python(item)
        for item in response.output
    ]
    return {
        "output": output,
        "usage": serialize_usage(response.usage),
        "response_id": response.response_id,
        "request_id": response.request_id,
        "raw_usage": response.raw_usage,
    }


def load_response(data: dict[str, Any]) -> ModelResponse:
    """The ``ModelResponse`` :func:`dump_response` recorded, its items typed again."""
    output: list[Any] = []
    for item in data["output"]:
        cls = _ITEMS.get(str(item.get("type"))) if isinstance(item, dict) else None
        # An item type newer than this openai package: kept as the SDK's own
        # RunState does, as its dict.
        output.append(cls.model_validate(item) if cls is not None else item)
    return ModelResponse(
        output=output,
        usage=deserialize_usage(data.get("usage") or {}),
        response_id=data.get("response_id"),
        request_id=data.get("request_id"),
        raw_usage=data.get("raw_usage"),
    )


def dump_tool_result(result: Any, tool: str, ctx: Context, *, effect: bool) -> Any:
    """A tool's return value as JSON, or a SerializationError saying what to do."""
    try:
        return to_jsonable_python(result)
    except PydanticSerializationError as exc:
        then = (
            "It has fired: a retry of the step fires it again with the same idempotency key."
            if effect
            else "Nothing was recorded: the tool runs again when the step does."
        )
        raise SerializationError(
            f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: the result of tool {tool!r} "
            f"cannot be recorded as JSON ({exc}). {then} Return a JSON-able value (a str, "
            "dict, list, a pydantic model or dataclass).",
            run=f"{ctx.workflow}/{ctx.run_id}",
            step=ctx.step,
        ) from exc


def dump_guardrail(output: GuardrailFunctionOutput) -> dict[str, Any]:
    """A guardrail's verdict as JSON."""
    return {
        "tripwire_triggered": bool(output.tripwire_triggered),
        "output_info": to_jsonable_python(output.output_info, fallback=repr),
    }


def load_guardrail(data: dict[str, Any]) -> GuardrailFunctionOutput:
    """The ``GuardrailFunctionOutput`` :func:`dump_guardrail` recorded."""
    return GuardrailFunctionOutput(
        output_info=data.get("output_info"), tripwire_triggered=bool(data["tripwire_triggered"])
    )


def tool_title(name: str, arguments: str) -> str:
    """What a person reads for a tool call: ``refund(order='A1', cents=500)``."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        return f"{name}({arguments})"
    if not isinstance(parsed, dict):
        return f"{name}({parsed!r})"
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in parsed.items())})"
