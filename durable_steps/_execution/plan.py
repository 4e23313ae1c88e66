"""What one execution of a run needs from its workflow: the :class:`Plan`.

The runner, the run's writer and the journal take a Plan rather than the
``Workflow``, so nothing below ``_workflow`` reaches back into it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._events import Subscriber
from .._step import Step

if TYPE_CHECKING:
    from ..serializers import Serializer
    from ..stores import Store

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """What a run needs from its workflow (kept apart so the runner never
    reaches back into ``Workflow``).
    """

    workflow: str
    steps: Sequence[Step[..., Any]]
    serializer: Serializer
    until: Callable[[Any], bool] | None
    on_complete: str
    subscribers: Sequence[Subscriber]
    store: Store
    lease: float
    takeover: bool = False
    stop: threading.Event | None = None
    """Set by a worker to stop the run after its current step (see Released)."""
    claim: bool = False
    """Write a claim before the first step of a resumed run (see execute)."""
    implicit_store: bool = False
    """The store is the default local directory, chosen by nobody."""
    version: str | None = None
    """``Workflow(version=)``, stored with the run (see ``_deploys.positions``)."""
    migrate: Callable[[Any, str | None], Any] | None = None
    code: dict[str, str] = field(default_factory=dict)
    """The steps' code fingerprints, recorded with every commit."""

    def renamed(self) -> dict[str, str]:
        """``{old name: step name}`` of every step's ``renamed_from``."""
        return {old: s.name for s in self.steps for old in s.renamed_from}
