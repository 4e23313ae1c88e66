"""Loading a workflow by name (``module:attribute``), for the CLI and for Ray.

``durable-steps worker --app agent:wf``, ``plan``, ``show --app``, ``fork
--app`` and Ray's tasks on other nodes all need the user's ``Workflow``
object from a string; this is the one place that turns one into the other.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ._workflow import Workflow
from .errors import DefinitionError

__all__ = ["load_app"]


def load_app(spec: str) -> Workflow:
    """Import ``module:attribute`` (from the current directory too) as a Workflow."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise DefinitionError(f"--app {spec!r}: use module:attribute, e.g. myagent:workflow")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise DefinitionError(f"--app {spec!r}: cannot load it ({exc})") from exc
    if not isinstance(target, Workflow):
        raise DefinitionError(f"--app {spec!r} is a {type(target).__name__}, not a Workflow")
    return target
