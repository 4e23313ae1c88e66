"""Start ``examples/fake_openai.py`` on loopback: an OpenAI API (chat completions, responses).

The fake server (standard library only, shipped with the examples) runs as a
child process in its own process group on a free 127.0.0.1 port, is stopped
by that group's id, and is ready once ``GET /calls`` answers. Its model is a
script that is deterministic in the messages (see the example's docstring);
:meth:`OpenAIFake.calls` counts the chat completions it served, which is how
a test tells a replayed model call from a repeated one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.s3servers import free_port

__all__ = ["FAKE_OPENAI", "OPENAI_TEST_KEY", "OpenAIFake", "openai_fake", "start_openai_fake"]

READY_DEADLINE = 30.0
FAKE_OPENAI = Path(__file__).resolve().parent.parent / "examples" / "fake_openai.py"
OPENAI_TEST_KEY = "sk-fake-durable-steps"  # the fake wants a Bearer key, any key


@dataclass
class OpenAIFake:
    """A running fake OpenAI server: its process, log and base URL (``.../v1``)."""

    base_url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path = field(repr=False)

    def counts(self) -> dict[str, int]:
        """What the server answered so far: ``chat_completions``, ``responses``
        (Responses API) and ``rejected``.
        """
        root = self.base_url.removesuffix("/v1")
        with urllib.request.urlopen(f"{root}/calls", timeout=10) as response:
            counts: dict[str, int] = json.loads(response.read())
        return counts

    def calls(self) -> int:
        """How many model answers (chat completions and responses) the server has served."""
        counts = self.counts()
        return counts["chat_completions"] + counts.get("responses", 0)

    def env(self) -> dict[str, str]:
        """What a child process needs for ``openai.OpenAI()`` to talk to this server.

        The SDK itself reads both variables.
        """
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": OPENAI_TEST_KEY}

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL) and wait."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.process.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue


def start_openai_fake(tmpdir: Path | str) -> OpenAIFake:
    """Start the fake OpenAI server on a free loopback port and wait until it answers."""
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = tmp / "fake-openai.log"
    cmd = [sys.executable, str(FAKE_OPENAI), "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*cmd, "--verbose"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            start_new_session=True,
        )
    server = OpenAIFake(f"http://127.0.0.1:{port}/v1", process, log_path)
    end = time.monotonic() + READY_DEADLINE
    last: BaseException | None = None
    while time.monotonic() < end and process.poll() is None:
        try:
            server.counts()
            return server
        except OSError as exc:  # refused while it binds: not yet
            last = exc
            time.sleep(0.05)
    code = process.poll()
    server.stop()
    state = f"exited with {code}" if code is not None else f"not ready after {READY_DEADLINE:.0f}s"
    raise RuntimeError(
        f"fake OpenAI server at {server.base_url} {state}; last error: {last!r}\n"
        f"--- tail of {log_path} ---\n{server.log_tail()}"
    )


@pytest.fixture
def openai_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIFake]:
    """A fake OpenAI server of the test's own, so its counts are the test's alone."""
    server = start_openai_fake(tmp_path_factory.mktemp("fake-openai"))
    yield server
    server.stop()
