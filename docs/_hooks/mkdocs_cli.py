"""MkDocs hooks: the command-line reference, generated from the real parser.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; this
hook replaces it with the ``--help`` of ``durable-steps`` and of each of its
commands, as ``durable_steps.cli._main.build_parser()`` prints them, so the
page can never drift from the code.

The docstrings that mkdocstrings renders are written for Sphinx as well
(``:class:`Workflow```); Markdown turns the role's argument into code and
leaves the role's name in front of it, which ``on_page_content`` removes.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

MARKER = "<!-- cli-reference -->"
WIDTH = "96"  # argparse wraps to $COLUMNS: a fixed width gives the same page everywhere
# A role, and the "~" that tells Sphinx to show only the last dotted part.
SPHINX_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|exc|data|mod|obj|const):<code>(?:~(?:[\w.]*\.)?)?"
)


def render() -> str:
    """Markdown for the whole command line: the global help, then one section per command."""
    os.environ["COLUMNS"] = WIDTH
    from durable_steps.cli._main import build_parser

    parser = build_parser()
    parts = ["## durable-steps", "", "```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts += [f"## {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the marker with the generated reference."""
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown


def on_page_content(html: str, **kwargs: Any) -> str:
    """Drop the names of Sphinx roles left in front of code by the docstrings."""
    return SPHINX_ROLE.sub("<code>", html)
