"""The scenes of ``tests/pydaiscenes.py`` killed with SIGKILL and resumed: as plainly.

A child process (a fork of ``tests/forkserver.py``) runs one scene through
``DurableAgent`` and SIGKILLs itself right after the first tool call was
recorded; a second child resumes the run.
Its outcome (output, messages, usage, streamed events) must equal the plain
agent's in this process: the recorded tool results replay as their types,
the usage of a sub-agent run inside a tool is counted though it did not run
again, a live tool runs again so the toolset it picks is there, and a
streamed response streams back with its deltas, and an agent that runs
itself plainly inside its own tool gets the same final answer (its inner
run is part of the tool's recorded result, not numbered among the outer
run's requests), and a model request refused once and retried by the agent
replays the retry's answer (asked anew, it would have been answered afresh),
and one that failed and was answered by a hook replays the hook's answer,
recorded before the tool it called ran (the kill comes right after that tool).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forkserver import ForkServer
from tests.pydaiscenes import RETRIES, build, outcome

pytestmark = pytest.mark.pydantic_ai

SCENES = Path(__file__).with_name("pydaiscenes.py")
_forks = ForkServer(SCENES)


def child(tmp: Path, scene: str, *, crash: bool) -> subprocess.CompletedProcess[str]:
    """The scene's child on run r1 in ``tmp``, a fresh fork of a server that imported it."""
    args = ["--store", str(tmp / "store"), "--run", "r1", "--scene", scene]
    return _forks.run(args + (["--crash"] if crash else []), cwd=tmp, out=tmp / "child")


NEEDS_RETRIES = pytest.mark.skipif(not RETRIES, reason="a pydantic-ai without RetryModelRequest")


@pytest.mark.parametrize(
    "scene",
    [
        "subagent",
        "multimodal",
        "live",
        "stream",
        "self",
        pytest.param("overload", marks=NEEDS_RETRIES),
        "answered",
    ],
)
def test_a_killed_scene_resumes_to_the_plain_outcome(tmp_path: Path, scene: str) -> None:
    """SIGKILL after the first recorded tool call, resume: what the plain agent gives."""
    agent, _, plain_calls = build(scene, tmp_path / "plain-overloaded")
    plain = asyncio.run(outcome(agent, scene))
    killed = child(tmp_path, scene, crash=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = child(tmp_path, scene, crash=False)
    assert resumed.returncode == 0, resumed.stderr
    final = json.loads(resumed.stdout)
    if scene == "overload":
        # The one difference, documented: live, pydantic-ai lists the refused try on the
        # response that answered (failed_attempts); replayed, that try did not happen again.
        assert plain["messages"][1].pop("failed_attempts")[0]["outcome"] == "error"
        assert final["outcome"]["messages"][1].pop("failed_attempts") is None
    assert final["outcome"] == plain
    # The resumed process asked the model only what the killed one had not recorded.
    assert final["model_calls"] < plain_calls["model"]
    if scene == "subagent":
        assert plain["usage"]["requests"] == 4
    if scene == "self":  # the tool's plain run of the same agent is inside its result
        assert plain["usage"]["requests"] == 3
        assert plain["output"] == "done: ['inner answer after 0']"
    if scene == "overload":  # refused, retried, answered: the failed try counts nothing
        assert plain_calls["model"] == 3
        assert plain["usage"]["requests"] == 2
    if scene == "answered":  # the hook's lookup, not the one the model would ask for
        assert plain["output"] == "done: [{'order': 7, 'total': 20}]"


def test_a_typed_result_recorded_in_another_process_replays_typed(tmp_path: Path) -> None:
    """A model with a set field, recorded by a process with one hash seed and replayed by
    one with another (its set dumps in another order): it comes back as the model class,
    as in the plain run, not as the dict it was recorded as."""
    agent, _, _ = build("tags")
    plain = asyncio.run(outcome(agent, "tags"))
    assert plain["output"] == "done: ['Tagged']"
    args = [sys.executable, str(SCENES), "--store", str(tmp_path / "store"), "--run", "r1"]
    runs = []
    for seed, crash in (("1", ["--crash"]), ("2", [])):
        runs.append(
            subprocess.run(
                [*args, "--scene", "tags", *crash],
                check=False,
                env={**os.environ, "PYTHONHASHSEED": seed},
                capture_output=True,
                text=True,
                cwd=tmp_path,
                timeout=120,
            )
        )
    killed, done = runs
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outcome"]["output"] == plain["output"]
