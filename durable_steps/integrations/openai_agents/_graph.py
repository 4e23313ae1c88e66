"""The agent graph of one run, copied with every seam journaled.

The SDK has no per-run override of an agent's tools or model (pydantic-ai's
``Agent.override`` has no counterpart), and the agents a run reaches are
only known by walking its handoffs. So a durable run works on *copies*:
every agent reachable from the starting one (handoff targets, and a
``Handoff``'s target when it is invoked) is cloned once per run, with

- each ``FunctionTool`` copied, its ``on_invoke_tool`` a journaled call — or
  an effect, or left alone for ``live`` tools;
- a ``Model`` instance wrapped (a string name is the provider's to wrap);
- each input and output guardrail a journaled call;
- its handoffs pointing at the copies.

The user's agents are never changed: another run of the same agents, in
another thread or task, or a plain ``Runner.run`` of them, sees them as they
were. The SDK checks the things it needs by name (the run state, tool
approvals), which the copies keep.

A ``Handoff`` (``handoff(agent, on_handoff=...)``) is a journaled call too,
``handoff:N``: its callback runs once, and a replay goes straight to its
target. Not journaled: tools that are not function tools (a computer, a
shell, a local MCP server's tools, which are listed at run time), and a
custom ``Handoff`` whose target is only known by invoking it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from agents import Agent, FunctionTool, Handoff, InputGuardrail, Model, OutputGuardrail

from ._binding import Binding, errors_var, key_var
from ._items import dump_guardrail, dump_tool_result, load_guardrail, tool_title
from ._model import JournaledModel

__all__ = ["Graph", "wrap_guardrails"]


class Graph:
    """The journaled copies of one run's agents, made as they are reached."""

    def __init__(self, binding: Binding) -> None:
        self.binding = binding
        self.copies: dict[int, Agent[Any]] = {}
        self.originals: dict[int, Agent[Any]] = {}
        """By the id of a copy: the user's agent it was made from."""
        self._keep: list[Agent[Any]] = []  # ids are only unique while both stay alive

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        """The journaled copy of ``agent`` (made once per run)."""
        if id(agent) in self.originals:  # already a copy (a handoff's own target)
            return agent
        found = self.copies.get(id(agent))
        if found is not None:
            return found
        changes: dict[str, Any] = {
            "tools": [self._tool(t) for t in agent.tools],
            "input_guardrails": wrap_guardrails(agent.input_guardrails, self.binding, "input"),
            "output_guardrails": wrap_guardrails(agent.output_guardrails, self.binding, "output"),
            "handoffs": [],
        }
        if isinstance(agent.model, Model):
            # model_settings given: clone() would otherwise reset them to the new model's defaults
            changes["model"] = JournaledModel(agent.model, self.binding)
            changes["model_settings"] = agent.model_settings
        clone = agent.clone(**changes)
        self.copies[id(agent)] = clone
        self.originals[id(clone)] = agent
        self._keep += (agent, clone)
        # After the copy is known: handoffs may lead back to this agent.
        clone.handoffs = [self._handoff(h) for h in agent.handoffs]
        return clone

    def original(self, agent: Agent[Any]) -> Agent[Any]:
        """The user's agent a copy was made from (``agent`` itself if not a copy)."""
        return self.originals.get(id(agent), agent)

    def tool_names(self, agent: Agent[Any]) -> tuple[set[str], bool]:
        """The function tools reachable from ``agent``, and whether that is all of them
        (False when an agent has MCP servers, whose tools are listed at run time).
        """
        names: set[str] = set()
        complete = True
        seen: set[int] = set()
        todo = [agent]
        while todo:
            here = todo.pop()
            if id(here) in seen:
                continue
            seen.add(id(here))
            names |= {t.name for t in here.tools if isinstance(t, FunctionTool)}
            complete = complete and not here.mcp_servers
            for target in here.handoffs:
                if isinstance(target, Agent):
                    todo.append(target)
                else:
                    ref = target._agent_ref() if target._agent_ref is not None else None
                    if isinstance(ref, Agent):
                        todo.append(ref)
                    else:
                        complete = False
        return names, complete

    def _handoff(self, target: Agent[Any] | Handoff[Any, Any]) -> Any:
        if isinstance(target, Agent):
            return self.agent(target)
        invoke = target.on_invoke_handoff
        ref = target._agent_ref() if target._agent_ref is not None else None
        known = ref if isinstance(ref, Agent) else None
        binding = self.binding

        async def on_invoke_handoff(run_ctx: Any, arguments: str) -> Agent[Any]:
            if known is None:  # its target is only known by calling it: it runs every time
                return self.agent(await invoke(run_ctx, arguments))

            async def call() -> Any:
                return {"agent": (await invoke(run_ctx, arguments)).name}

            # Its callback (on_handoff) runs once; a replay goes to the target it names.
            title = f"handoff to {target.agent_name}"
            name = binding.numbered("handoff")
            await binding.ctx._acall(name, call, (), {}, title=title)
            return self.agent(known)

        clone = dataclasses.replace(target, on_invoke_handoff=on_invoke_handoff)
        if known is not None:
            clone._agent_ref = weakref.ref(self.agent(known))
        return clone

    def _tool(self, tool: Any) -> Any:
        if not isinstance(tool, FunctionTool) or tool.name in self.binding.live:
            return tool
        clone = copy.copy(tool)  # FunctionTool.__copy__ keeps its own invoker bound right
        clone.on_invoke_tool = _journaled_invoker(tool.name, clone.on_invoke_tool, self.binding)
        return clone


def _journaled_invoker(
    tool: str, invoke: Callable[[Any, str], Awaitable[Any]], binding: Binding
) -> Callable[[Any, str], Awaitable[Any]]:
    """``on_invoke_tool`` as a journaled call, or an effect for a tool in ``effects``.

    It wraps the SDK's own invoker, failure handler included: an exception
    the SDK turns into a message to the model is recorded as that message
    (the model was told it), one it lets through records nothing.
    """
    effect = tool in binding.effects
    ctx = binding.ctx

    async def on_invoke_tool(tool_ctx: Any, arguments: str) -> Any:
        call_id = getattr(tool_ctx, "tool_call_id", None) or tool
        name = binding.tool_name(call_id)
        title = tool_title(tool, arguments)

        async def call() -> Any:
            errors: list[BaseException] = []
            token = errors_var.set(errors)
            try:
                result = await invoke(tool_ctx, arguments)
            finally:
                errors_var.reset(token)
            if errors:  # ours, which the SDK's failure handler made a message: raise it
                raise errors[0]
            return dump_tool_result(result, tool, ctx, effect=effect)

        async def fire(*, idempotency_key: str) -> Any:
            token = key_var.set((call_id, idempotency_key))
            try:
                return await call()
            finally:
                key_var.reset(token)

        if effect:
            return await ctx._aeffect(name, fire, (), {}, title=title)
        return await ctx._acall(name, call, (), {}, title=title)

    return on_invoke_tool


def wrap_guardrails(guardrails: list[Any] | None, binding: Binding, kind: str) -> list[Any]:
    """Copies of input or output guardrails whose verdicts are journaled calls.

    A guardrail that runs a model of its own costs that model call once; its
    verdict (``tripwire_triggered`` and ``output_info`` as JSON) replays.
    """
    wrapped = []
    for guardrail in guardrails or ():
        if not isinstance(guardrail, (InputGuardrail, OutputGuardrail)):
            wrapped.append(guardrail)
            continue
        check = guardrail.guardrail_function
        label = guardrail.get_name()

        def journaled(
            run_ctx: Any, agent: Any, data: Any, check: Any = check, label: str = label
        ) -> Awaitable[Any]:
            name = binding.numbered(f"guardrail:{kind}:{label}")

            async def verdict() -> Any:
                output = check(run_ctx, agent, data)
                if inspect.isawaitable(output):
                    output = await output
                return dump_guardrail(output)

            async def run() -> Any:
                title = f"{kind} guardrail {label}"
                return load_guardrail(await binding.ctx._acall(name, verdict, (), {}, title=title))

            return run()

        wrapped.append(dataclasses.replace(guardrail, guardrail_function=journaled, name=label))
    return wrapped
