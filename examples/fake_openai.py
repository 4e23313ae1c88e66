"""A tiny OpenAI-compatible server that plays a scripted support agent, offline.

    python examples/fake_openai.py --port 8765 &
    OPENAI_BASE_URL=http://127.0.0.1:8765/v1 OPENAI_API_KEY=sk-fake python examples/support_agent.py

It answers ``POST /v1/chat/completions`` the way the real API does (a
``chat.completion`` object, ``tool_calls`` with JSON-encoded arguments,
``finish_reason``), so the real ``openai`` SDK talks to it unchanged. The
"model" is a script, and the same list of messages always gets the same
answer, ids included, so a replayed model call and a repeated one can be told
apart only by counting requests: ``GET /calls`` says how many chat
completions were served.

The script, looking only at the messages after the last user message:

1. No tool result yet: for every order number in the user's message
   (``#1001``, ``order 1001``, ``A-1001``), ask for ``lookup_order`` and
   ``refund`` with ``{"order_id": ...}`` (``refund`` also gets a ``reason``),
   all in one turn, as parallel tool calls. A tool the request does not offer
   is not asked for; with no order number, or no tool to use, it asks which
   order the customer means.
2. Tool results present: answer in text, quoting each tool's result.

Like the real API it rejects (400) a transcript in which an assistant's tool
calls are not each answered by exactly one ``tool`` message, so an agent that
loses or repeats a tool result on resume fails here too.

Importable too: :func:`complete` is the script (a request body in, a
completion out) and :func:`make_server` builds the HTTP server without
starting it. Standard library only.
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

__all__ = ["FakeOpenAIServer", "complete", "main", "make_server"]

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
            names.add(str(tool.get("function", {}).get("name")))
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


def _assistant_turn(messages: list[dict[str, Any]], offered: set[str]) -> dict[str, Any]:
    """The scripted assistant message for this transcript."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    user_text = _text(messages[last_user]["content"])
    since = messages[last_user + 1 :]
    results = [m for m in since if m["role"] == "tool"]
    if results:
        lines = [f"- {_text(m.get('content'))}" for m in results]
        content = "Here is what I did for you:\n" + "\n".join(lines)
        return {"role": "assistant", "content": content}
    orders = _orders(user_text)
    wanted = [name for name in SUPPORT_TOOLS if name in offered]
    if not orders or not wanted:
        question = "Which order is this about? Please give me its order number."
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


def complete(body: Any) -> dict[str, Any]:
    """The chat completion the script answers to a request ``body`` (deterministic).

    Raises :class:`RequestError` for a body the real API would reject.
    """
    model, messages = _validate(body)
    if not any(m["role"] == "user" for m in messages):
        raise RequestError(400, "the messages must contain a user message", "messages")
    message = _assistant_turn(messages, _offered(body))
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
                    "rejected": self.server.rejected,
                }
            self._send(200, counts)
        else:
            self._send(404, RequestError(404, f"no route GET {self.path}").body)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            if self.path.rstrip("/") != "/v1/chat/completions":
                raise RequestError(404, f"no route POST {self.path}")
            if not (self.headers.get("Authorization") or "").startswith("Bearer "):
                raise RequestError(401, "You didn't provide an API key (Authorization: Bearer).")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise RequestError(400, f"the body is not JSON: {exc}") from None
            answer = complete(body)
        except RequestError as exc:
            with self.server.lock:
                self.server.rejected += 1
            self._send(exc.status, exc.body)
            return
        with self.server.lock:
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
