"""Every python block of the documentation runs: docs/**/*.md and README.md.

Each page is a small program. Its fenced python blocks run in a fresh
temporary directory, in a child process with this checkout on
``PYTHONPATH`` and no ``$DURABLE_STEPS_STORE`` or signing key set (a
newcomer's environment):

- a block with a title (```` ```python {title="agent.py"} ````) is a file:
  it is written under that name first, so later blocks can import it;
- the untitled blocks, in page order, are concatenated into one script and
  run, so a page can build an example up block by block (a setup block, the
  snippet the text is about, then a block that runs and checks it);
- a page with titled blocks only runs each file as a script, in order;
- ```` ```python {test="skip"} ```` is not run: it needs a server, a cloud
  account or a paid API. Everything else must exit 0.

Blocks assert what the text around them claims, so a page whose example
stops doing what it says fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.s3servers import S3Server

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(
    r"^```(?:python|py)(?:[ \t]+\{(?P<attrs>[^}\n]*)\})?[ \t]*\n(?P<code>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
ATTR = re.compile(r'(\w+)="([^"]*)"')
ANY_PYTHON_FENCE = re.compile(r"^[ \t]*```(?:python|py)\b", re.MULTILINE)
UNSET = ("DURABLE_STEPS_STORE", "DURABLE_STEPS_SIGNING_KEY")


@dataclass(frozen=True)
class Block:
    code: str
    title: str | None
    skip: bool


def blocks(page: Path) -> list[Block]:
    """The page's python blocks, in order."""
    found = []
    for match in FENCE.finditer(page.read_text()):
        attrs = dict(ATTR.findall(match["attrs"] or ""))
        found.append(Block(match["code"], attrs.get("title"), attrs.get("test") == "skip"))
    return found


def runnable(page: Path) -> bool:
    return any(not b.skip for b in blocks(page))


def run_page(page: Path, workdir: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run the page's blocks as the module docstring says; return each process."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["PYTHONPATH"] = str(ROOT)
    live = [b for b in blocks(page) if not b.skip]
    files = [b for b in live if b.title]
    for block in files:
        (workdir / block.title).write_text(block.code)  # type: ignore[operator]
    script = "\n\n".join(b.code for b in live if not b.title)
    if script:
        (workdir / "_page.py").write_text(script)
        scripts = ["_page.py"]
    else:
        scripts = [b.title for b in files if b.title and b.title.endswith(".py")]
    return [
        subprocess.run(
            [sys.executable, name],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        for name in scripts
    ]


@pytest.mark.slow  # a child process per page: about a second each
@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if runnable(p)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_page_s_python_blocks_run(page: Path, tmp_path: Path) -> None:
    """Every python block of the page that is not marked test="skip" runs and exits 0."""
    for done in run_page(page, tmp_path):
        assert done.returncode == 0, f"{page.relative_to(ROOT)}:\n{done.stdout}\n{done.stderr}"


def test_every_python_block_is_seen_by_the_harness() -> None:
    """No python fence escapes the harness: none indented, none with a syntax it misses."""
    for page in PAGES:
        text = page.read_text()
        assert len(ANY_PYTHON_FENCE.findall(text)) == len(blocks(page)), page


def test_the_harness_runs_blocks_and_fails_on_a_broken_one(tmp_path: Path) -> None:
    """The harness itself: titled blocks become files, skip is honoured, a failure is seen."""
    page = tmp_path / "page.md"
    page.write_text(
        '```python {title="helper.py"}\nVALUE = 41\n```\n\n'
        "```python\nfrom helper import VALUE\n```\n\n"
        '```python {test="skip"}\nraise SystemExit(9)\n```\n\n'
        "```python\nassert VALUE + 1 == 42\nraise SystemExit(3)\n```\n"
    )
    assert [b.skip for b in blocks(page)] == [False, False, True, False]
    work = tmp_path / "work"
    work.mkdir()
    (done,) = run_page(page, work)
    assert done.returncode == 3, done.stderr  # the skipped block's 9 never ran
    assert (work / "helper.py").read_text() == "VALUE = 41\n"


def tutorial_agent() -> str:
    """Tutorial 1's agent.py."""
    (agent,) = [b for b in blocks(ROOT / "docs" / "tutorial" / "first-agent.md") if b.title]
    assert agent.title == "agent.py"
    return agent.code


def kill_and_resume(workdir: Path, env: dict[str, str]) -> None:
    """Run agent.py killed inside `reply` (after sending), then again: one email in all."""
    env = {**{k: v for k, v in env.items() if k not in UNSET}, "PYTHONPATH": str(ROOT)}

    def run(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "agent.py"],
            cwd=workdir,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    killed = run(CRASH="reply")
    assert killed.returncode == -9, killed.stderr
    assert killed.stdout.splitlines()[-1] == "reply: killed (SIGKILL)"
    resumed = run()
    assert resumed.returncode == 0, resumed.stderr
    assert "draft: written" not in resumed.stdout  # committed: skipped
    assert "reply: sent (the outbox holds 1 email(s))" in resumed.stdout  # same key, deduped
    assert "same idempotency key" in resumed.stderr


@pytest.mark.slow
def test_the_tutorial_agent_resumes_after_a_sigkill_and_emails_once(tmp_path: Path) -> None:
    """Tutorial 1's agent.py, killed inside `reply` after sending: the rerun sends nothing new."""
    (tmp_path / "agent.py").write_text(tutorial_agent())
    kill_and_resume(tmp_path, dict(os.environ))
    assert (tmp_path / "runs" / "support-agent" / "ticket-4411").is_dir()


@pytest.mark.s3
@pytest.mark.slow
def test_the_s3_tutorial_runs_against_a_local_s3_server(tmp_path: Path, moto: S3Server) -> None:
    """Tutorial 2 as written: create the bucket, change agent.py's one line, kill and resume."""
    page = ROOT / "docs" / "tutorial" / "s3.md"
    (create,) = [b.code for b in blocks(page) if "create_bucket" in b.code]
    (line,) = [b.code.strip() for b in blocks(page) if b.code.startswith("wf = ")]
    env = moto.child_env()
    bucket = subprocess.run(
        [sys.executable, "-c", create],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bucket.returncode == 0, bucket.stderr
    agent = tutorial_agent()
    (original,) = [x for x in agent.splitlines() if x.startswith("wf = ")]
    (tmp_path / "agent.py").write_text(agent.replace(original, line))
    kill_and_resume(tmp_path, env)
    assert not (tmp_path / "runs").exists()  # the checkpoints went to the bucket
    listed = subprocess.run(
        [sys.executable, "-m", "durable_steps", "--store", "s3://agent-checkpoints/tutorial", "ls"],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "support-agent  ticket-4411  completed" in listed.stdout, listed.stderr


def test_the_readme_is_a_front_door() -> None:
    """The README stays short (at most 300 lines) and links into the site."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "docs/" in text


LOOPBACK_WEED = ("-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false")


def test_a_weed_mini_command_in_the_docs_listens_on_loopback_without_telemetry() -> None:
    """`weed mini` listens on every interface and phones home by default: a command the
    docs give passes the flags tests/s3servers.py passes to keep it on loopback and quiet."""
    assert all(
        f'"{flag}"' in (ROOT / "tests" / "s3servers.py").read_text() for flag in LOOPBACK_WEED
    )
    commands = [
        command
        for page in PAGES
        for command in re.findall(r"^weed mini\b(?:.*\\\n)*.*$", page.read_text(), re.MULTILINE)
    ]
    assert commands  # the S3 tutorial has one
    for command in commands:
        assert all(flag in command.split() for flag in LOOPBACK_WEED), command


def test_an_extra_installed_from_an_index_is_also_shown_from_a_checkout() -> None:
    """The package installs from its repository (README, docs/install.md): a page that
    shows `pip install 'durable-steps[x]'` also shows `pip install -e '.[x]'`."""
    for page in PAGES:
        text = page.read_text()
        for extra in re.findall(r"pip install 'durable-steps\[([^\]]+)\]'", text):
            assert f"pip install -e '.[{extra}]'" in text, f"{page.name}: {extra}"


def hooks() -> Any:
    """docs/_hooks/mkdocs_cli.py, the site's MkDocs hooks."""
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import mkdocs_cli  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "docs" / "_hooks"))
    return mkdocs_cli


def test_the_api_reference_drops_sphinx_roles() -> None:
    """`:class:`~durable_steps.errors.StepInDoubt`` renders as the code StepInDoubt alone."""
    page = hooks().on_page_content(
        "stops with :class:<code>~durable_steps.errors.StepInDoubt</code>, "
        ":meth:<code>Workflow.step</code> and :<code>x</code>"
    )
    assert (
        page
        == "stops with <code>StepInDoubt</code>, <code>Workflow.step</code> and :<code>x</code>"
    )


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    """The MkDocs hook renders every command of build_parser() into the reference page."""
    mkdocs_cli = hooks()
    from durable_steps.cli._main import build_parser

    rendered = mkdocs_cli.on_page_markdown("# CLI\n\n" + mkdocs_cli.MARKER + "\n")
    assert mkdocs_cli.MARKER not in rendered
    names = re.findall(r"^## (\S+)$", rendered, re.MULTILINE)
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    assert names == ["durable-steps", *commands.choices]  # type: ignore[attr-defined]
    assert "--older-than" in rendered  # a subcommand's own options, not just its name
    assert (ROOT / "docs" / "reference" / "cli.md").read_text().count(mkdocs_cli.MARKER) == 1
