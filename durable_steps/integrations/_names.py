"""Journal names for an agent framework's tool calls, kept within the journal's limit.

A tool call is recorded under ``<prefix>tool:<call id>``: the id comes from
the (recorded) model response, so the name is the same on every re-run of
the step. Providers choose the ids, and some make them long (a few hundred
characters of encoded reasoning state), while a journal name has at most
:data:`~durable_steps._journal.MAX_NAME` characters. A long id is therefore
shortened to its first characters and a digest of the whole id: still the
same on every re-run, still different for every other id, and still
recognisable where a name is shown (a title beside it says which tool and
which arguments). Names made by earlier versions are unaffected: an id short
enough was never shortened, and a longer one could not be recorded at all.
"""

from __future__ import annotations

import hashlib

from .._journal import MAX_NAME

__all__ = ["tool_call_name"]

_ROOM = 24
"""Characters left for what a caller appends (``@2`` for a reused id)."""
_KEPT = 40
"""Leading characters of a long id kept in its shortened form."""


def tool_call_name(prefix: str, call_id: str) -> str:
    """``<prefix>tool:<call_id>``, with ``call_id`` shortened when the name would be too long."""
    name = f"{prefix}tool:{call_id}"
    if len(name) <= MAX_NAME - _ROOM:
        return name
    digest = hashlib.blake2b(call_id.encode("utf-8", "surrogatepass"), digest_size=12)
    return f"{prefix}tool:{call_id[:_KEPT]}~{digest.hexdigest()}"
