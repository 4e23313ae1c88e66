"""A fork server: one process imports a child script once, then forks a fresh child per run.

A child that imports a heavy library (pydantic-ai: ~2 s) pays that import on
every run when it is started with ``python script.py``; a crash test starts
two per case. The server imports the script (by path, as a module, not as
``__main__``) once, and for each request forks: the fork sets ``sys.argv``,
its working directory and its stdout/stderr files, calls the script's
``main()``, and exits with what it returns. The fork is a real process: a
``SIGKILL`` it sends itself kills it (and only it) as it would a fresh one,
and it has nothing the script's import did not give it (the server is
single-threaded and runs nothing else).

A module name instead of a script path (``durable_steps.cli``) forks
``python -m``-like runs of its ``main()``. The server also imports boto3
once (an S3 child would import it for its store); the fork's environment is
the request's, so one server serves every store target (but for
:data:`IMPORT_TIME_ENV`, which must match the server's).

Protocol: one JSON request per line on stdin, ``{"argv": [...], "cwd": ...,
"env": {...}, "stdout": path, "stderr": path}``; one JSON answer per line on
stdout, ``{"returncode": n}`` (``-signal`` when killed by one, as
``subprocess`` says).
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMPORT_TIME_ENV = ("DURABLE_STEPS_HOST",)
"""Read once when durable_steps is imported: a fork would keep the server's."""


def _serve(script: str) -> None:
    if not script.endswith(".py"):
        module: Any = importlib.import_module(script)
    else:
        spec = importlib.util.spec_from_file_location(Path(script).stem, script)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    import boto3  # noqa: F401  (what every S3 child imports; the forks share it)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(module, request)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"returncode": code}), flush=True)


def _child(module: Any, request: dict[str, Any]) -> None:
    """In the fork: run the script's ``main()`` as ``python script ARGV`` would; never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)  # the requests pipe is the server's alone
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.argv = [module.__file__, *request["argv"]]
        code = module.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_running: list[ForkServer] = []
"""The servers started in this process, for :func:`close_all`."""


def close_all() -> None:
    """Stop every server this process started (the suite does at its end)."""
    while _running:
        _running.pop().close()


@dataclass
class ForkServer:
    """The server process for one script, and a ``subprocess.run``-like call."""

    script: Path | str
    proc: subprocess.Popen[str] | None = None
    started_env: dict[str, str | None] | None = None

    def run(
        self,
        argv: list[str],
        *,
        cwd: Path,
        out: Path,
        env: dict[str, str] | None = None,
        timeout: float = 90,
    ) -> subprocess.CompletedProcess[str]:
        """Run the script with ``argv`` in a fresh fork (``env`` or ours, in ``cwd``); its
        exit code and output (kept in ``out``.stdout/.stderr). Past ``timeout`` the server
        and its fork are killed and ``subprocess.TimeoutExpired`` raised.
        """
        env = dict(os.environ if env is None else env)
        if self.proc is None:
            self.started_env = {name: os.environ.get(name) for name in IMPORT_TIME_ENV}
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a timeout kills the server and its fork, nothing else
            )
            _running.append(self)
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        assert {name: env.get(name) for name in IMPORT_TIME_ENV} == self.started_env, (
            "this child needs its own process: durable_steps reads these when imported"
        )
        stdout, stderr = out.with_suffix(".stdout"), out.with_suffix(".stderr")
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        server, self.proc = self.proc, None  # put back once it has answered
        assert server.stdout is not None
        if not select.select([server.stdout], [], [], timeout)[0]:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            raise subprocess.TimeoutExpired([str(self.script), *argv], timeout)
        answer = server.stdout.readline()
        self.proc = server
        assert answer, f"the fork server for {self.script} died"
        code = json.loads(answer)["returncode"]
        return subprocess.CompletedProcess(argv, code, stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        """Stop the server (its stdin closed, it exits)."""
        if self.proc is not None:
            assert self.proc.stdin is not None
            assert self.proc.stdout is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc.stdout.close()
            self.proc = None


if __name__ == "__main__":
    _serve(sys.argv[1])
