"""The openai-agents internals this integration reads, checked once when it is imported.

Everything else comes from the SDK's public names (``from agents import ...``).
openai-agents 0.24 and 0.25 have no public counterpart for these, so the
``openai-agents`` extra pins ``<0.26``, and :func:`require` refuses, at import, an SDK that lacks
one — an ``ImportError`` naming the SDK's version and what is missing, rather
than an ``AttributeError`` in the middle of a step (or, worse, a hook that is
silently never called):

``Handoff._agent_ref``
    The target agent of a ``handoff(agent, ...)``, a weak reference (the
    SDK's turn resolution reads it too). The integration reads it to reach
    the target when it copies the agent graph (so the target's tools are
    journaled, and a misspelt ``effects`` name is refused), and sets it on
    the copied ``Handoff`` to point at the copied target.
``Model._cleanup_on_run_end``
    The hook the SDK's run loop calls on every model it used once a run
    ends. The journaled model wraps the user's model, so it forwards the
    hook; otherwise a model holding run-scoped resources would keep them.
``RunResult._last_agent``
    ``last_agent`` has no setter, and a run over copies ends at a copy. The
    integration puts the user's agent back, so ``result.last_agent`` is the
    user's agent and a later plain ``Runner.run(result.last_agent, ...)``
    does not run a copy whose tools are bound to a finished step.
``agents.usage.serialize_usage`` / ``deserialize_usage``
    Not exported from ``agents``: the SDK's own JSON form of a ``Usage``,
    the one its public ``RunState.to_json``/``from_json`` write and read
    back across versions. A recorded model response keeps its usage in that
    form, so a journal written today replays under a later SDK.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

import agents

__all__ = ["INTERNALS", "missing", "require"]

SUPPORTED = ">=0.24,<0.26"


def _usage(name: str) -> bool:
    try:
        module = importlib.import_module("agents.usage")
    except ImportError:
        return False
    return callable(getattr(module, name, None))


INTERNALS: dict[str, Callable[[], bool]] = {
    "Handoff._agent_ref": lambda: hasattr(agents.Handoff, "_agent_ref"),
    "Model._cleanup_on_run_end": lambda: callable(
        getattr(agents.Model, "_cleanup_on_run_end", None)
    ),
    "RunResult._last_agent": lambda: (
        "_last_agent" in getattr(agents.RunResult, "__dataclass_fields__", {})
    ),
    "agents.usage.serialize_usage": lambda: _usage("serialize_usage"),
    "agents.usage.deserialize_usage": lambda: _usage("deserialize_usage"),
}
"""Each internal the integration reads, and how to tell the installed SDK has it."""


def version() -> str:
    """The installed openai-agents version, as its distribution says."""
    try:
        return importlib.metadata.version("openai-agents")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(agents, "__version__", "unknown"))


def missing() -> list[str]:
    """The internals of :data:`INTERNALS` the installed SDK lacks."""
    return [name for name, present in INTERNALS.items() if not present()]


def require() -> None:
    """Raise ``ImportError`` when the installed SDK lacks an internal the integration reads."""
    gone = missing()
    if gone:
        raise ImportError(
            f"durable_steps.integrations.openai_agents cannot run on openai-agents {version()}: "
            f"it reads SDK internals that version does not have ({', '.join(gone)}). "
            f"Install a supported SDK: pip install 'openai-agents{SUPPORTED}' (what the "
            "durable-steps[openai-agents] extra pins), or a durable-steps release that "
            f"supports openai-agents {version()}."
        )


require()
