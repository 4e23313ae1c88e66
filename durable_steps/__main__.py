"""``python -m durable_steps``: the ``durable-steps`` command (see :mod:`durable_steps.cli`)."""

from .cli import main

raise SystemExit(main())
