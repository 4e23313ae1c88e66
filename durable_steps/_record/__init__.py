"""The stored record: what the bytes of a run are, and nothing else.

Everything that knows how a run looks in the store lives here, below the
writer (:class:`durable_steps._execution.run_state.RunState`) that alone uses it to write:

* :mod:`.checkpoint` — the header record of every format (its fields, their
  checks in :mod:`.checks`), encoding, decoding, keys and idempotency keys;
* :mod:`.format2` — the head and its immutable parts: a commit writes what
  changed, not the whole state;
* :mod:`.finders` — finding what changed in a state (JSON ops from
  :mod:`.delta`; top-level values for pickle) and turning it into records.

Nothing here performs I/O: reads and writes are the effects of
:mod:`durable_steps._drivers`, yielded to whoever drives them.
"""
