"""The fleet: many runs in one bucket, and the workers that share them.

* :mod:`.index` — the index of runs: the names of its entries (live runs by
  class, newest finished runs, nudges) and the writes that keep them in line
  with runs as they change class; :mod:`.registry`, which workflows it
  covers and in which layout; :mod:`.listing` reads it (one LIST) and
  repairs a stale entry that a reader found;
* :mod:`.finding` — a worker's scan for claimable runs (through the index, or
  by listing every run), and what it remembers between scans;
* :mod:`.leases` — who holds a run, until when, and whether they still do;
* :mod:`.pacing` — head writes paced for stores that allow one write per name
  per interval (GCS);
* :mod:`.signals` — messages to a waiting run: create-only objects beside it,
  and the nudge of its index entry that makes a scan find it; :mod:`.approval`,
  the one payload shape an approval takes (what a wait may accept);
* :mod:`.clearing` — deleting what a run keeps beside its head.

May import: the top-level foundations (``_drivers``, ``_events``, ``_step``),
``_record``, ``errors``, ``serializers``, ``stores``. Nothing here knows about
one execution of a run (``_execution``) or the protocol above it.
"""
