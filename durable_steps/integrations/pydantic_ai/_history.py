"""The conversation kept in the state, at the cost of each turn's new messages.

``state[history_key]`` is a list of messages as JSON (pydantic-ai's
``ModelMessagesTypeAdapter`` form). A turn must cost what it adds, not what
the conversation holds, and three things would otherwise cost the whole of
it every turn: parsing the stored history into ``ModelMessage``s, dumping
all the run's messages back, and the commit then comparing a list of freshly
made strings with the committed ones.

- **Writing**: the run's messages are the history's (the very objects it was
  given) plus the new ones. Only the new ones are dumped, and *appended* to
  the state's own list: format 2 then finds the change as one ``ext`` op at
  the end of the list (see ``_record/delta.py``), and the unchanged messages
  are the same dict objects as before, which the commit's comparison passes
  over at the cost of a pointer each. The last message of the history is
  dumped again and compared, because pydantic-ai may complete it in place
  (a suspended response resumed); from the first message that differs (or
  is not the object given), the list is replaced from there on.
- **Reading**: the messages parsed for a run's last turn are kept (per
  ``DurableAgent``, per run, a few dozen runs at most) with the stored dicts
  they came from and a structural copy of each (its *twin*: containers
  copied, leaves shared, made once per new item). The next turn takes the
  kept messages for the stored items that are still the same objects (an
  identity check per item) *and still equal their twins*, and parses only
  the rest. The twin check is what makes an item edited in place (a
  redaction: ``state["messages"][0]["parts"][0]["content"] = "..."``) reach
  the model as it will after a resume, which parses the stored form: from
  the first edited item on, the history is parsed again. It is one list
  comparison in C that passes each leaf by identity (about 9 ms for 800
  messages on the shared development machine, against ~1 ms to parse a
  turn's four new ones); a keyed fingerprint per item would have to dump or
  walk the item in Python, which costs more. A state decoded anew (a
  resume, a retried step) has new objects: it is parsed once, and kept from
  then on.

The state changes only when the agent run finished, so a step that crashed
halfway commits nothing of it; its re-run replays the requests. The
history may be edited between runs in any way (items replaced, removed,
changed in place): the next run sees what the state holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

from ...errors import DefinitionError

if TYPE_CHECKING:
    from ..._execution.context import Context

_KEPT_RUNS = 64


@dataclass
class _Kept:
    stored: list[Any]
    """The state's list the messages were parsed from or written to."""
    items: list[Any]
    """Its items then (the same objects)."""
    twins: list[Any]
    """A structural copy of each item then (containers copied, leaves shared)."""
    messages: list[ModelMessage]


def _twin(value: Any) -> Any:
    """``value`` with every dict and list copied and the leaves shared."""
    if type(value) is dict:
        return {k: _twin(v) for k, v in value.items()}
    if type(value) is list:
        return [_twin(v) for v in value]
    return value


def _unedited(items: list[Any], twins: list[Any]) -> int:
    """How many leading ``items`` still equal their twins (were not edited in place)."""
    if items == twins:  # the usual case: one comparison in C, leaves by identity
        return len(items)
    return next(i for i, (a, b) in enumerate(zip(items, twins)) if a != b)  # noqa: B905


def _same_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items of ``a`` and ``b`` are the very same objects."""
    n = 0
    for x, y in zip(a, b):  # noqa: B905 - the shorter one ends the prefix
        if x is not y:
            break
        n += 1
    return n


class Histories:
    """The parsed histories of recent runs, for :class:`Turn` (thread-safe)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str, str], _Kept] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, str]) -> _Kept | None:
        with self._lock:
            return self._kept.get(key)

    def put(self, key: tuple[str, str, str], kept: _Kept) -> None:
        with self._lock:
            self._kept[key] = kept
            self._kept.move_to_end(key)
            while len(self._kept) > _KEPT_RUNS:
                self._kept.popitem(last=False)


class Turn:
    """One agent run's reading and writing of ``state[history_key]``."""

    def __init__(
        self,
        histories: Histories,
        ctx: Context,
        state: MutableMapping[str, Any],
        history_key: str,
    ) -> None:
        self.histories = histories
        self.ctx = ctx
        self.state = state
        self.history_key = history_key
        self.key = (ctx.workflow, ctx.run_id, history_key)
        self.stored: list[Any] | None = None
        self.items: list[Any] = []
        self.twins: list[Any] = []
        self.messages: list[ModelMessage] = []

    def read(self) -> list[ModelMessage]:
        """The history to give the run as ``message_history``."""
        stored = self.state.get(self.history_key)
        if stored is None:
            return []
        if not isinstance(stored, list):
            raise self._not_history(f"a {type(stored).__name__}, not a list")
        kept = self.histories.get(self.key)
        same = _same_prefix(stored, kept.items) if kept and kept.stored is stored else 0
        if kept and same:
            same = _unedited(stored[:same], kept.twins[:same])
        known = kept.messages[:same] if kept else []
        try:
            fresh = ModelMessagesTypeAdapter.validate_python(stored[same:])
        except ValueError as exc:
            raise self._not_history(str(exc)) from exc
        twins = kept.twins[:same] if kept else []
        self.twins = twins + [_twin(item) for item in stored[same:]]
        self.stored, self.items, self.messages = stored, list(stored), known + fresh
        return list(self.messages)

    def keep(self, all_messages: list[ModelMessage]) -> None:
        """Write the run's messages back: the new ones appended, nothing else touched."""
        given = self.messages
        same = _same_prefix(all_messages, given)
        if same == len(given) and same and _dump([all_messages[same - 1]]) != [self.items[-1]]:
            same -= 1  # completed in place by the run
        new = _dump(all_messages[same:])
        found = self.state.get(self.history_key)
        stored: list[Any]
        if (
            isinstance(found, list)
            and found is self.stored
            and len(found) == len(self.items)
            and _same_prefix(found, self.items) == len(found)
        ):
            stored = found
            del stored[same:]
            stored.extend(new)
            twins = self.twins[:same] + [_twin(item) for item in new]
        else:  # no history yet, or the step replaced it during the run
            stored = self.items[:same] + new if found is self.stored else _dump(all_messages)
            self.state[self.history_key] = stored
            twins = [_twin(item) for item in stored]
        self.histories.put(self.key, _Kept(stored, list(stored), twins, list(all_messages)))

    def _not_history(self, why: str) -> DefinitionError:
        ctx = self.ctx
        return DefinitionError(
            f"run {ctx.workflow}/{ctx.run_id}: step {ctx.step!r}: "
            f"state[{self.history_key!r}] is not a pydantic-ai message history ({why}). "
            "Leave that key to DurableAgent, or give it another history_key=.",
            run=f"{ctx.workflow}/{ctx.run_id}",
            step=ctx.step,
        )


def _dump(messages: Sequence[ModelMessage]) -> list[Any]:
    dumped: list[Any] = ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")
    return dumped
