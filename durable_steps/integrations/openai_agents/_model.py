"""Each model response a journaled call: a wrapper of the agent's own model.

The SDK picks an agent's model in one place (``get_model``): the run's
``RunConfig.model`` if set, else the agent's ``model`` if it is a ``Model``,
else ``RunConfig.model_provider.get_model(name)``. So a run is journaled by
wrapping all three: the run config's model, each agent's ``Model`` (on the
clones the runner makes of the agent graph) and the provider, whose models
are wrapped as it hands them out. A string model name stays a string — the
SDK's default settings for that name (a reasoning model's) still apply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agents import Model, ModelProvider, ModelResponse
from openai.types.responses import ResponseStreamEvent

from ...errors import DefinitionError
from ._items import dump_response, load_response

if TYPE_CHECKING:
    from ._binding import Binding

__all__ = ["JournaledModel", "JournaledProvider"]


def _label(model: Model) -> str:
    name = getattr(model, "model", None)
    return name if isinstance(name, str) and name else type(model).__name__


class JournaledModel(Model):
    """A model whose responses are journaled calls of ``binding``'s step.

    Responses are numbered in the order the run asks for them, counting only
    those that arrived: a request that failed (and that an SDK-managed retry
    repeats) records nothing, its retry is ``model:N.2`` (see the package
    docstring for what that means after a crash).
    """

    def __init__(self, wrapped: Model, binding: Binding) -> None:
        self.wrapped = wrapped
        self.binding = binding

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        """The recorded response (replayed if the step recorded it before)."""
        binding = self.binding
        name = binding.model_name()

        async def live() -> Any:
            return dump_response(await self.wrapped.get_response(*args, **kwargs))

        title = f"{_label(self.wrapped)}: response {binding.responses + 1}"
        try:
            recorded = await binding.ctx._acall(name, live, (), {}, title=title)
        except Exception:
            binding.tries += 1
            raise
        binding.responses += 1
        binding.tries = 0
        return load_response(recorded)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[ResponseStreamEvent]:
        """Refused: a streamed run is not journaled (see ``DurableRunner.run_streamed``)."""
        ctx = self.binding.ctx
        raise DefinitionError(
            f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: a streamed model response "
            "cannot be journaled. Use `await runner.run(agent, input, ctx=ctx)` (or "
            "runner.run_sync) and read result.new_items after it.",
            run=f"{ctx.workflow}/{ctx.run_id}",
            step=ctx.step,
        )

    async def close(self) -> None:
        """Close the wrapped model."""
        await self.wrapped.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.wrapped._cleanup_on_run_end(owner)

    def get_retry_advice(self, request: Any) -> Any:
        """The wrapped model's advice."""
        return self.wrapped.get_retry_advice(request)


class JournaledProvider(ModelProvider):
    """A provider whose models are :class:`JournaledModel` s of one run."""

    def __init__(self, wrapped: ModelProvider, binding: Binding) -> None:
        self.wrapped = wrapped
        self.binding = binding

    def get_model(self, model_name: str | None) -> Model:
        """The wrapped provider's model, journaled."""
        return JournaledModel(self.wrapped.get_model(model_name), self.binding)

    async def aclose(self) -> None:
        """Nothing: the provider is the user's, and outlives this run."""
