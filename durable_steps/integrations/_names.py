"""Journal names for an agent framework's model responses and tool calls.

Model responses
    Response ``N`` of an agent run is recorded as ``<prefix>model:N``. A try
    that fails (the framework retries it: pydantic-ai's
    ``RetryModelRequest`` from ``on_model_request_error``, the Agents SDK's
    ``ModelSettings(retry=...)``) records nothing, and its retry is named
    ``model:N.2``, ``model:N.3``..., N counting the responses that came. A
    re-run of the step (a retry, a resume) must replay the try that
    succeeded, not ask anew: the failed try recorded nothing, so asked
    again it would now get an answer of its own, the run would go on from
    there, and the records made after the retry (the tools the recorded
    answer called, effects with their keys) would meet other names — an
    effect fired twice under two keys. So the first try of response N looks
    for a recorded later try first (:func:`response_name`) and replays it.
    The names of a run without failed tries are what they always were.

Tool calls
    A tool call is recorded under ``<prefix>tool:<call id>``: the id comes
    from the (recorded) model response, so the name is the same on every
    re-run of the step. Providers choose the ids, and some make them long (a
    few hundred characters of encoded reasoning state), while a journal name
    has at most :data:`~durable_steps._execution.journal.MAX_NAME` characters. A long
    id is therefore shortened to its first characters and a digest of the
    whole id: still the same on every re-run, still different for every
    other id, and still recognisable where a name is shown (a title beside
    it says which tool and which arguments). Names made by earlier versions
    are unaffected: a name that fits is never shortened, and one that does
    not could not be recorded at all.

Approval signals
    A tool approval's signal is named after the tool call id as well
    (``approve:<prefix><call id>``), and a signal name has at most 200
    characters: a long id is shortened by the same rule (:func:`shortened`),
    so two ids that share their first characters never share a signal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from .._execution.journal import MAX_NAME

__all__ = ["MAX_TRIES", "response_name", "shortened", "tool_call_name"]

MAX_TRIES = 100
"""Tries of one response a re-run looks for (pydantic-ai stops a request at 100)."""

_KEPT = 40
"""Leading characters of a long id kept in its shortened form."""


def response_name(prefix: str, number: int, tries: int, recorded: Callable[[str], bool]) -> str:
    """The name of try ``tries + 1`` of response ``number`` (see the module docstring):
    the first try's is that of the try recorded for it, if any (``recorded(name)``
    says whether one is), so a re-run replays what the run went on with.
    """
    base = f"{prefix}model:{number}"
    if tries:
        return f"{base}.{tries + 1}"
    if not recorded(base):
        for k in range(2, MAX_TRIES + 1):
            if recorded(f"{base}.{k}"):
                return f"{base}.{k}"
    return base


def tool_call_name(prefix: str, call_id: str, suffix: str = "") -> str:
    """``<prefix>tool:<call_id><suffix>``, ``call_id`` shortened only when the whole
    would be longer than a journal name may be (``suffix``: ``@2`` for a reused id).
    """
    room = MAX_NAME - len(f"{prefix}tool:{suffix}")
    return f"{prefix}tool:{shortened(call_id, room)}{suffix}"


def shortened(text: str, room: int, mark: str = "~") -> str:
    """``text`` if it has at most ``room`` characters, else its first characters,
    ``mark`` and a digest of the whole (65 characters): the same on every re-run,
    different for every other ``text``. A signal name may not hold ``~``: its
    mark is ``=``.
    """
    if len(text) <= room:
        return text
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12)
    return f"{text[:_KEPT]}{mark}{digest.hexdigest()}"
