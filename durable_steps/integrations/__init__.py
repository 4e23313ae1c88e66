"""Optional integrations, each behind its own extra; ``import durable_steps`` imports none.

* :mod:`durable_steps.integrations.ray` (extra ``ray``): runs as Ray tasks.
* :mod:`durable_steps.integrations.otel` (extra ``otel``): OpenTelemetry spans and metrics.
* :mod:`durable_steps.integrations.pydantic_ai` (extra ``pydantic-ai``): a pydantic-ai
  agent inside a step, its model requests and tool calls journaled.
"""
