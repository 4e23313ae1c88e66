"""A user's session (``session=``) whose reads and writes are journaled calls.

The SDK reads a session's history before a run and adds each turn's items
to it as the run goes. Both are I/O outside the run's checkpoint, and a
re-run of the step would repeat them: history read again (now holding the
crashed attempt's items, so the model would see another transcript) and
items added twice. So each operation is a journaled call, numbered in
order: a read replays what the first attempt read, a write that was
recorded is not made again. A crash between a write and its record makes
it once more (at least once, as for any journaled call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic_core import to_jsonable_python

if TYPE_CHECKING:
    from agents import TResponseInputItem

    from ._binding import Binding

__all__ = ["JournaledSession"]


class JournaledSession:
    """The SDK's ``Session`` protocol over a user's session, each operation recorded."""

    def __init__(self, wrapped: Any, binding: Binding) -> None:
        self.wrapped = wrapped
        self.binding = binding
        self.session_id = wrapped.session_id
        self.session_settings = getattr(wrapped, "session_settings", None)

    def __getattr__(self, name: str) -> Any:
        # What the SDK reads beyond the protocol (compaction hooks...) is the session's own.
        return getattr(self.wrapped, name)

    async def _recorded(self, op: str, fn: Any, *args: Any) -> Any:
        async def call() -> Any:
            return to_jsonable_python(await fn(*args))

        name = self.binding.numbered(f"session:{op}")
        title = f"session {self.session_id}: {op}"
        return await self.binding.ctx._acall(name, call, (), {}, title=title)

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The session's items, as first read by this step."""
        items: list[TResponseInputItem] = await self._recorded(
            "get_items", self.wrapped.get_items, limit
        )
        return items

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Add ``items``, once per step (a re-run replays the write)."""
        await self._recorded("add_items", self.wrapped.add_items, items)

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove and return the latest item, once per step."""
        item: TResponseInputItem | None = await self._recorded("pop_item", self.wrapped.pop_item)
        return item

    async def clear_session(self) -> None:
        """Clear the session, once per step."""
        await self._recorded("clear_session", self.wrapped.clear_session)
