"""A fault-injecting HTTP reverse proxy for S3 tests (stdlib, and botocore to re-sign).

Put it in front of one real S3-compatible server on loopback, point a boto3
client at :attr:`FaultProxy.endpoint_url`, and queue faults for upcoming
requests::

    proxy = FaultProxy(server.endpoint_url).start()
    proxy.drop_after(method="PUT")      # the next PUT lands, its response is lost
    ...
    proxy.stop()

Requests are forwarded faithfully: the original ``Host`` header is kept (SigV4
signs it, and SeaweedFS verifies signatures), every end-to-end header and the
exact body bytes are passed on. ``Expect: 100-continue`` (boto3 sends it on
every PutObject) is answered by the proxy itself and not forwarded (it is a
hop-by-hop expectation, and unsigned). Bodies are read by ``Content-Length``;
a ``Transfer-Encoding: chunked`` body is de-chunked and forwarded with a
``Content-Length`` (boto3 does not use it over plain http: PutObject bodies
come with a ``Content-Length``, and ``aws-chunked`` content encoding, which
boto3 uses only over https, would still be framed by ``Content-Length``).
Responses are read whole and re-sent with a ``Content-Length``.

Faults (each consumed by the first request that matches ``method`` and, when
given, has ``key`` in its path):

``drop_before``   close the client's connection without forwarding;
``drop_after``    forward, then close the client's connection without replying;
``status``        answer 500 ``InternalError`` / 503 ``ServiceUnavailable``;
``slowdown``      answer 503 ``SlowDown``;
``conflict409``   answer 409 ``ConditionalRequestConflict``;
``not_implemented`` answer 501 ``NotImplemented`` (Backblaze B2's answer to
                  conditional-write headers);
``delay``         wait ``seconds`` (past the client's read timeout), then forward;
``truncate``      forward, then send the response with its full ``Content-Length``
                  but only half its body, and close the connection.

Modes (until changed, for every request):

``date_offset``   seconds added to the ``Date`` header of every forwarded response
                  (a service whose clock is that far ahead of ours);
``rate_limit(seconds)`` answer 429 to a write of an object name (an upload, a PUT,
                  a DELETE) less than ``seconds`` after the last write of that name
                  the proxy forwarded: GCS's limit of about one write per second
                  per object. :attr:`FaultProxy.limited` counts the 429s,
                  :attr:`FaultProxy.refused` lists their ``(monotonic, name)``
                  and :attr:`FaultProxy.writes` those of the writes forwarded
                  (kept with or without a limit).
                  A GCS multipart upload's name is read from its metadata part
                  (the JSON API puts it in the body, not the URL);
``strip_conditions()`` remove ``If-None-Match`` / ``If-Match`` before forwarding
                  (a service that ignores conditional writes). SigV4 signs those
                  headers, so the request is re-signed with the credentials given
                  to :class:`FaultProxy` (SeaweedFS verifies signatures).
"""

from __future__ import annotations

import email.utils
import http.client
import json
import re
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import parse_qs, unquote, urlparse

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

__all__ = ["Fault", "FaultProxy", "SeenRequest"]

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",  # recomputed from the bytes actually sent
    }
)
_CONDITIONS = frozenset({"if-none-match", "if-match"})
_SIGNATURE = frozenset({"authorization", "x-amz-date", "x-amz-content-sha256"})
_ERRORS = {
    429: "TooManyRequests",
    500: "InternalError",
    501: "NotImplemented",
    503: "ServiceUnavailable",
    409: "ConditionalRequestConflict",
}


@dataclass
class Fault:
    """One queued fault."""

    kind: str
    method: str | None = "PUT"
    key: str | None = None
    seconds: float = 0.0
    status: int = 0
    code: str = ""

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.key is None or self.key in path
        )


@dataclass
class SeenRequest:
    """A request the proxy received (faulted or not)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = field(repr=False)
    fault: str | None


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        proxy = self.server.proxy
        sock: socket.socket = self.request
        proxy._track(sock, add=True)
        rfile: BinaryIO = sock.makefile("rb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while not proxy._stopping.is_set():
                line = rfile.readline(65537)
                if not line:
                    return
                if line in (b"\r\n", b"\n"):
                    continue
                method, target, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
                headers = http.client.parse_headers(rfile)
                if headers.get("Expect", "").lower() == "100-continue":
                    sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(rfile, headers)
                fault = proxy._take(method, target)
                if fault is None and proxy._too_soon(method, target, body):
                    fault = Fault("rate429", method, status=429, code=_ERRORS[429])
                forwarded = proxy._conditions_applied(method, target, list(headers.items()), body)
                proxy._record(
                    SeenRequest(
                        method, target, dict(headers.items()), body, fault.kind if fault else None
                    )
                )
                with proxy._busy:
                    if fault is not None and fault.kind == "drop_before":
                        return
                    if fault is not None and fault.status:
                        _send_error(sock, fault.status, fault.code)
                        return
                    if fault is not None and fault.kind == "delay":
                        if proxy._stopping.wait(fault.seconds):
                            return
                    if upstream is None:
                        upstream = http.client.HTTPConnection(
                            proxy.upstream_host, proxy.upstream_port, timeout=120
                        )
                    try:
                        status, reason, resp_headers, data = _forward(
                            upstream, method, target, forwarded, body
                        )
                    except (OSError, http.client.HTTPException):
                        upstream.close()
                        upstream = None
                        _send_error(sock, 502, "BadGateway")
                        return
                    if fault is not None and fault.kind == "drop_after":
                        return
                    resp_headers = proxy._dated(resp_headers)
                    if fault is not None and fault.kind == "truncate":
                        _send_response(sock, method, status, reason, resp_headers, data, half=True)
                        return
                    _send_response(sock, method, status, reason, resp_headers, data)
                if headers.get("Connection", "").lower() == "close":
                    return
        except OSError:
            return  # the client went away (e.g. it timed out during a delay)
        finally:
            if upstream is not None:
                upstream.close()
            rfile.close()
            proxy._track(sock, add=False)
            _hard_close(sock)


_GCS_OBJECT = re.compile(r"/storage/v1/b/[^/]+/o/([^?]+)")


def _written_object(method: str, target: str, body: bytes) -> str | None:
    """The object name a request writes, or None for a read (or what names none).

    GCS: an upload (``POST /upload/storage/v1/b/B/o?uploadType=...``) names its
    object in ``name=`` or, for a multipart upload, in the JSON metadata that
    is the body's first part; a DELETE in its path. Others (S3, Azure): a PUT
    or DELETE of the path.
    """
    url = urlparse(target)
    if method == "POST" and url.path.startswith("/upload/storage/"):
        query = parse_qs(url.query)
        if "name" in query:
            return query["name"][0]
        start = body.find(b"{")
        if start < 0:
            return None
        try:
            meta, _ = json.JSONDecoder().raw_decode(body[start:].decode("utf-8", "replace"))
        except ValueError:
            return None
        name = meta.get("name") if isinstance(meta, dict) else None
        return str(name) if name else None
    if method == "DELETE":
        match = _GCS_OBJECT.search(url.path)
        return unquote(match.group(1)) if match else url.path
    if method == "PUT" and "comp=" not in url.query and "uploadType" not in url.query:
        return url.path
    return None


def _read_body(reader: BinaryIO, headers: http.client.HTTPMessage) -> bytes:
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        chunks: list[bytes] = []
        while True:
            size_line = reader.readline(65537)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while reader.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers are dropped (boto3 sends none over http)
                return b"".join(chunks)
            chunks.append(_read_exact(reader, size))
            reader.readline(65537)
    length = int(headers.get("Content-Length", "0") or 0)
    return _read_exact(reader, length)


def _read_exact(reader: BinaryIO, n: int) -> bytes:
    data = reader.read(n) if n else b""
    if len(data) != n:
        raise OSError("client closed the connection mid-body")
    return bytes(data)


def _forward(
    conn: http.client.HTTPConnection,
    method: str,
    target: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
    for name, value in headers:
        if name.lower() not in _HOP_BY_HOP:
            conn.putheader(name, value)  # Host goes through unchanged
    if body or method in ("PUT", "POST"):
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body or None)
    resp = conn.getresponse()
    data = resp.read()
    headers_out = resp.getheaders()
    if resp.will_close:
        conn.close()
    return resp.status, resp.reason, headers_out, data


def _send_response(
    sock: socket.socket,
    method: str,
    status: int,
    reason: str,
    headers: list[tuple[str, str]],
    data: bytes,
    *,
    half: bool = False,
) -> None:
    bodyless = method == "HEAD" or status in (204, 304) or 100 <= status < 200
    lines = [f"HTTP/1.1 {status} {reason}"]
    for name, value in headers:
        lname = name.lower()
        if lname in _HOP_BY_HOP and not (bodyless and lname == "content-length"):
            continue
        lines.append(f"{name}: {value}")
    if not bodyless:
        lines.append(f"Content-Length: {len(data)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    sock.sendall(head + (b"" if bodyless else data[: len(data) // 2] if half else data))


def _send_error(sock: socket.socket, status: int, code: str) -> None:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by faultproxy</Message>"
        "<RequestId>faultproxy</RequestId></Error>"
    ).encode()
    reason = http.client.responses.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    sock.sendall(head + body)


def _hard_close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """A threaded reverse proxy to one loopback upstream, with a queue of faults."""

    def __init__(self, upstream_url: str, credentials: tuple[str, str, str] | None = None) -> None:
        """Front ``upstream_url``; ``credentials`` (access key, secret, region) re-sign
        requests whose condition headers :meth:`strip_conditions` removes."""
        parsed = urlparse(upstream_url)
        host = parsed.hostname or ""
        if parsed.scheme != "http" or host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"FaultProxy only fronts a plain-http loopback server, not {upstream_url}"
            )
        self.upstream_host = host
        self.upstream_port = parsed.port or 80
        self.credentials = credentials
        self.date_offset = 0.0
        self._strip = False
        self.min_interval = 0.0
        self.limited = 0
        self.writes: list[tuple[float, str]] = []
        self.refused: list[tuple[float, str]] = []
        self._last_write: dict[str, float] = {}
        self.counts: Counter[str] = Counter()
        self.seen: list[SeenRequest] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._busy = _BusyCounter()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> FaultProxy:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.proxy = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="faultproxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def endpoint_url(self) -> str:
        assert self._server is not None, "start() the proxy first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- faults ----------------------------------------------------------------

    def inject(self, fault: Fault, times: int = 1) -> None:
        with self._lock:
            self._faults.extend(Fault(**vars(fault)) for _ in range(times))

    def drop_before(
        self, method: str | None = "PUT", key: str | None = None, times: int = 1
    ) -> None:
        self.inject(Fault("drop_before", method, key), times)

    def drop_after(
        self, method: str | None = "PUT", key: str | None = None, times: int = 1
    ) -> None:
        self.inject(Fault("drop_after", method, key), times)

    def status(
        self, status: int, method: str | None = "PUT", key: str | None = None, times: int = 1
    ) -> None:
        self.inject(
            Fault(f"status{status}", method, key, status=status, code=_ERRORS[status]), times
        )

    def slowdown(self, method: str | None = "PUT", key: str | None = None, times: int = 1) -> None:
        self.inject(Fault("slowdown", method, key, status=503, code="SlowDown"), times)

    def conflict409(
        self, method: str | None = "PUT", key: str | None = None, times: int = 1
    ) -> None:
        self.inject(Fault("conflict409", method, key, status=409, code=_ERRORS[409]), times)

    def not_implemented(
        self, method: str | None = "PUT", key: str | None = None, times: int = 1
    ) -> None:
        self.inject(Fault("not_implemented", method, key, status=501, code=_ERRORS[501]), times)

    def delay(
        self, seconds: float, method: str | None = "PUT", key: str | None = None, times: int = 1
    ) -> None:
        self.inject(Fault("delay", method, key, seconds=seconds), times)

    def truncate(self, method: str | None = "GET", key: str | None = None, times: int = 1) -> None:
        self.inject(Fault("truncate", method, key), times)

    def strip_conditions(self, on: bool = True) -> None:
        """From now on, forward PUTs and DELETEs without If-None-Match / If-Match."""
        if on and self.credentials is None:
            raise ValueError("strip_conditions() re-signs requests: give FaultProxy credentials")
        self._strip = on

    def rate_limit(self, seconds: float = 1.0) -> None:
        """From now on, answer 429 to a second write of one object name within
        ``seconds`` (0: no limit); see the module docstring."""
        with self._lock:
            self.min_interval = seconds
            self._last_write.clear()

    def pending(self) -> int:
        """How many queued faults have not been consumed yet."""
        with self._lock:
            return len(self._faults)

    def clear(self) -> None:
        """Forget queued faults and counts."""
        with self._lock:
            self._faults.clear()
            self.counts.clear()
            self.seen.clear()

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is being forwarded (e.g. a delayed one)."""
        if not self._busy.wait_zero(timeout):
            raise TimeoutError(f"faultproxy still forwarding after {timeout}s")

    # -- internals used by the handler -----------------------------------------

    def _conditions_applied(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> list[tuple[str, str]]:
        if not self._strip or not any(n.lower() in _CONDITIONS for n, _ in headers):
            return headers
        assert self.credentials is not None
        access_key, secret_key, region = self.credentials
        kept = [(n, v) for n, v in headers if n.lower() not in _CONDITIONS | _SIGNATURE]
        host = {n.lower(): v for n, v in headers}.get("host", "")
        request = AWSRequest(method=method, url=f"http://{host}{target}", data=body)
        for name, value in kept:
            request.headers[name] = value
        S3SigV4Auth(Credentials(access_key, secret_key), "s3", region).add_auth(request)
        return list(request.headers.items())

    def _dated(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if not self.date_offset:
            return headers

        def shifted(value: str) -> str:
            when = email.utils.parsedate_to_datetime(value).timestamp() + self.date_offset
            return email.utils.formatdate(when, usegmt=True)

        return [(n, shifted(v) if n.lower() == "date" else v) for n, v in headers]

    def _too_soon(self, method: str, target: str, body: bytes) -> bool:
        """Whether this write of an object comes too soon after the last (and if
        not, remember it as the last)."""
        name = _written_object(method, target, body)
        if name is None:
            return False
        now = time.monotonic()
        with self._lock:
            last = self._last_write.get(name)
            if self.min_interval and last is not None and now - last < self.min_interval:
                self.limited += 1
                self.refused.append((now, name))
                return True
            self._last_write[name] = now
            self.writes.append((now, name))
        return False

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for i, fault in enumerate(self._faults):
                if fault.matches(method, path):
                    return self._faults.pop(i)
        return None

    def _record(self, seen: SeenRequest) -> None:
        with self._lock:
            self.counts[seen.method] += 1
            self.seen.append(seen)

    def _track(self, sock: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)


class _BusyCounter:
    """A context manager counting the requests in flight."""

    def __init__(self) -> None:
        self._n = 0
        self._cond = threading.Condition()

    def __enter__(self) -> None:
        with self._cond:
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    def wait_zero(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout)
