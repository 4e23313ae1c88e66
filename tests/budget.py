"""How many examples a property test tries: a fifth in a plain run, all with --full.

``tests/conftest.py`` sets ``DURABLE_STEPS_FULL`` when pytest runs with
``--full`` (CI, once), before the test modules, whose ``@settings`` read this,
are imported.
"""

from __future__ import annotations

import os

FULL_ENV = "DURABLE_STEPS_FULL"


def examples(full: int) -> int:
    """``full`` under ``pytest --full``; else a fifth of it (at least 10)."""
    return full if os.environ.get(FULL_ENV) else max(10, full // 5)
