"""Deploys that change the code under stored runs.

* :mod:`.positions` — a stored run's position mapped onto the current code by
  step name: renames, versions and migrations, the serializer check;
* :mod:`.fingerprints` — which steps' code changed since a run's last commit;
* :mod:`.fork` — a new run from another run's last committed state.

May import: the top-level foundations, ``_execution``, ``_fleet``,
``_record``, ``errors``, ``serializers``, ``stores``. Never ``_protocol``,
which consults :mod:`.positions` when it opens a run.
"""
