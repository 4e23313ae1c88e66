"""A tiny OpenAI-compatible server that plays a scripted support agent, offline.

    python examples/fake_openai.py --port 8765 &
    OPENAI_BASE_URL=http://127.0.0.1:8765/v1 OPENAI_API_KEY=sk-fake python examples/support_agent.py

It answers ``POST /v1/chat/completions`` the way the real API does (a
``chat.completion`` object, ``tool_calls`` with JSON-encoded arguments,
``finish_reason``), and ``POST /v1/responses`` (the Responses API the OpenAI
Agents SDK uses by default: ``input`` items in, ``output`` items out), so the
real ``openai`` SDK talks to it unchanged. The
"model" is a script, and the same list of messages always gets the same
answer, ids included, so a replayed model call and a repeated one can be told
apart only by counting requests: ``GET /calls`` says how many chat
completions and responses were served.

The script, looking only at the messages after the last user message:

1. No tool result yet: for every order number in the user's message
   (``#1001``, ``order 1001``, ``A-1001``), ask for ``lookup_order`` and
   ``refund`` with ``{"order_id": ...}`` (``refund`` also gets a ``reason``),
   all in one turn, as parallel tool calls. A tool the request does not offer
   is not asked for; with no order number, or no tool to use, it asks which
   order the customer means.
   With none of those tools offered but a handoff (a ``transfer_to_...``
   tool, as the Agents SDK names them), hand off to the first one offered.
2. Tool results present: answer in text, quoting each tool's result (a
   handoff's own result is not quoted). A request for structured output
   (a JSON schema) gets that answer as a JSON object of the schema's shape.

A Responses API request is turned into the same transcript (function calls
into an assistant's ``tool_calls``, their outputs into ``tool`` messages) and
answered by the same script.

Like the real API it rejects (400) a transcript in which an assistant's tool
calls are not each answered by exactly one ``tool`` message, so an agent that
loses or repeats a tool result on resume fails here too.

Importable too: :func:`complete` is the script (a request body in, a
completion out), :func:`respond` its Responses API form, and
:func:`make_server` builds the HTTP server without starting it. Standard
library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeOpenAIServer", "complete", "main", "make_server", "respond"]

CREATED = 1_700_000_000  # a fixed timestamp: the same request gets the same answer
ORDER = re.compile(r"(?:#|\border\s+)([A-Za-z]*-?\d+)|\b([A-Z]{1,3}-\d+)\b", re.IGNORECASE)
SUPPORT_TOOLS = ("lookup_order", "refund")


class RequestError(Exception):
    """A request the real API would reject: its status and OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        }


def _digest(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _text(content: Any) -> str:
    """A message's content as text (a string, or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _orders(text: str) -> list[str]:
    found: list[str] = []
    for match in ORDER.finditer(text):
        order = match.group(1) or match.group(2)
        if order not in found:
            found.append(order)
    return found


def _offered(body: dict[str, Any]) -> set[str]:
    names = set()
    for tool in body.get("tools") or []:
        if isinstance(tool, dict) and tool.get("type") == "function":
            # Chat Completions nests the name in "function"; the Responses API does not.
            names.add(str(tool.get("function", {}).get("name") or tool.get("name")))
    return names


def _validate(body: Any) -> tuple[str, list[dict[str, Any]]]:
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    model, messages = body.get("model"), body.get("messages")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "you must provide a model parameter", "model")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty array", "messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError(400, "every message must be an object with a 'role'", "messages")
    if body.get("stream"):
        raise RequestError(400, "this fake server does not stream: leave 'stream' unset", "stream")
    _check_tool_replies(messages)
    return model, messages


def _check_tool_replies(messages: list[dict[str, Any]]) -> None:
    """Reject a transcript whose tool calls and tool messages do not pair up, as OpenAI does.

    An agent resumed after a crash that lost (or doubled) a tool result must
    fail here just as it would against the real API.
    """
    open_calls: list[str] = []
    for message in [*messages, {"role": "end"}]:
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                raise RequestError(
                    400,
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    f"preceding message with 'tool_calls' (tool_call_id {call_id!r}).",
                    "messages",
                )
            open_calls.remove(call_id)
            continue
        if open_calls:
            raise RequestError(
                400,
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(open_calls)}",
                "messages",
            )
        if message["role"] == "assistant":
            open_calls = [str(c.get("id")) for c in message.get("tool_calls") or []]


def _assistant_turn(
    messages: list[dict[str, Any]], offered: set[str], schema: Any = None
) -> dict[str, Any]:
    """The scripted assistant message for this transcript."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    user_text = _text(messages[last_user]["content"])
    since = messages[last_user + 1 :]
    handoffs = {
        str(c.get("id"))
        for m in since
        for c in m.get("tool_calls") or []
        if str(c.get("function", {}).get("name", "")).startswith("transfer_to_")
    }
    results = [m for m in since if m["role"] == "tool" and m.get("tool_call_id") not in handoffs]
    if results:
        lines = [f"- {_text(m.get('content'))}" for m in results]
        content = "Here is what I did for you:\n" + "\n".join(lines)
        if schema is not None:
            content = json.dumps(_shaped(schema, content, len(results)))
        return {"role": "assistant", "content": content}
    orders = _orders(user_text)
    wanted = [name for name in SUPPORT_TOOLS if name in offered]
    transfers = sorted(name for name in offered if name.startswith("transfer_to_"))
    if orders and not wanted and transfers and not handoffs:
        call_id = "call_" + _digest(messages, transfers[0])[:24]
        function = {"name": transfers[0], "arguments": "{}"}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    if not orders or not wanted:
        question = "Which order is this about? Please give me its order number."
        if schema is not None:
            question = json.dumps(_shaped(schema, question, 0))
        return {"role": "assistant", "content": question}
    calls = []
    for order in orders:
        for name in wanted:
            arguments: dict[str, Any] = {"order_id": order}
            if name == "refund":
                arguments["reason"] = "requested by the customer"
            call_id = "call_" + _digest(messages, order, name)[:24]
            function = {"name": name, "arguments": json.dumps(arguments)}
            calls.append({"id": call_id, "type": "function", "function": function})
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _shaped(schema: Any, text: str, count: int) -> Any:
    """A value of JSON schema ``schema``'s shape: strings are ``text``, numbers ``count``."""
    if not isinstance(schema, dict):
        return text
    for union in ("anyOf", "oneOf"):
        if schema.get(union):
            return _shaped(schema[union][0], text, count)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        return {name: _shaped(sub, text, count) for name, sub in properties.items()}
    if kind == "array":
        return [_shaped(schema.get("items"), text, count)]
    if kind in ("integer", "number"):
        return count
    if kind == "boolean":
        return True
    if "enum" in schema:
        return schema["enum"][0]
    return text


def complete(body: Any) -> dict[str, Any]:
    """The chat completion the script answers to a request ``body`` (deterministic).

    Raises :class:`RequestError` for a body the real API would reject.
    """
    model, messages = _validate(body)
    if not any(m["role"] == "user" for m in messages):
        raise RequestError(400, "the messages must contain a user message", "messages")
    response_format = body.get("response_format") or {}
    schema = (response_format.get("json_schema") or {}).get("schema", {}) or None
    message = _assistant_turn(messages, _offered(body), schema)
    message.setdefault("refusal", None)
    prompt_tokens = sum(len(_text(m.get("content")).split()) + 4 for m in messages)
    completion_tokens = len(json.dumps(message).split())
    return {
        "id": "chatcmpl-" + _digest(model, messages, body.get("tools"))[:29],
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "system_fingerprint": "fp_fake_openai",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses API request's ``instructions`` and ``input`` as a chat transcript."""
    raw = body.get("input")
    items: list[Any] = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw or []
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in items:
        if not isinstance(item, dict):
            raise RequestError(400, "every input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            last = messages[-1] if messages else {}
            if last.get("role") != "assistant" or last.get("content"):
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            last.setdefault("tool_calls", []).append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output)
            call_id = item.get("call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        # other items (reasoning, hosted tools) carry nothing the script reads
    return messages


def respond(body: Any) -> dict[str, Any]:
    """The Responses API answer (``object: "response"``) the script gives ``body``.

    Raises :class:`RequestError` for a body the real API would reject.
    """
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "you must provide a model parameter", "model")
    if body.get("stream"):
        raise RequestError(400, "this fake server does not stream: leave 'stream' unset", "stream")
    messages = _messages_of(body)
    if not any(m["role"] == "user" for m in messages):
        raise RequestError(400, "the input must contain a user message", "input")
    _check_tool_replies(messages)
    text_format = (body.get("text") or {}).get("format") or {}
    schema = text_format.get("schema") if text_format.get("type") == "json_schema" else None
    message = _assistant_turn(messages, _offered(body), schema)
    digest = _digest(model, messages, body.get("tools"))
    output: list[dict[str, Any]] = []
    if message.get("content") is not None:
        output.append(
            {
                "type": "message",
                "id": "msg_" + digest[:24],
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": "fc_" + _digest(digest, call["id"])[:24],
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    input_tokens = sum(len(_text(m.get("content")).split()) + 4 for m in messages)
    output_tokens = len(json.dumps(message).split())
    return {
        "id": "resp_" + digest[:29],
        "object": "response",
        "created_at": CREATED,
        "status": "completed",
        "model": model,
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


class FakeOpenAIServer(ThreadingHTTPServer):
    """The HTTP server: routes to :func:`complete` and counts what it served."""

    daemon_threads = True
    # socketserver's default backlog of 5 resets connections when an agent
    # fires dozens of requests at once (asyncio.gather over tool calls).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], *, verbose: bool = False) -> None:
        super().__init__(address, _Handler)
        self.verbose = verbose
        self.lock = threading.Lock()
        self.chat_completions = 0  # answered with a completion
        self.responses = 0  # answered with a response (the Responses API)
        self.rejected = 0  # answered with an error

    @property
    def url(self) -> str:
        """The base URL to give the SDK (``base_url=``), ``/v1`` included."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAIServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's connection pool expects

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-request-id", "req_" + _digest(payload)[:24])
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/calls":
            with self.server.lock:
                counts = {
                    "chat_completions": self.server.chat_completions,
                    "responses": self.server.responses,
                    "rejected": self.server.rejected,
                }
            self._send(200, counts)
        else:
            self._send(404, RequestError(404, f"no route GET {self.path}").body)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            route = self.path.rstrip("/")
            if route not in ("/v1/chat/completions", "/v1/responses"):
                raise RequestError(404, f"no route POST {self.path}")
            if not (self.headers.get("Authorization") or "").startswith("Bearer "):
                raise RequestError(401, "You didn't provide an API key (Authorization: Bearer).")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise RequestError(400, f"the body is not JSON: {exc}") from None
            answer = respond(body) if route == "/v1/responses" else complete(body)
        except RequestError as exc:
            with self.server.lock:
                self.server.rejected += 1
            self._send(exc.status, exc.body)
            return
        with self.server.lock:
            if route == "/v1/responses":
                self.server.responses += 1
            else:
                self.server.chat_completions += 1
        self._send(200, answer)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


def make_server(
    host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False
) -> FakeOpenAIServer:
    """A server bound to ``host``:``port`` (0: any free port), not yet serving."""
    return FakeOpenAIServer((host, port), verbose=verbose)


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted; prints the base URL once it listens."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any free)")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port, verbose=args.verbose)
    print(f"fake OpenAI server listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
