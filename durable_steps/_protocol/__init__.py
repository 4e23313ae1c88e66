"""The run protocol: load, resume, intent, fire, commit, terminal marker.

* :mod:`.runner` — the protocol itself, one generator that yields effects;
* :mod:`.opening` — opening a run that exists: checks, mapping onto the
  current code, its state rebuilt;
* :mod:`.failures` — recording a step's failure;
* :mod:`.doubt` — deciding what happened to a step or an effect that may have
  fired before a crash; :mod:`.resolving` is a person telling a run that,
  without running it;
* :mod:`.suspending` — the runner's side of waiting: suspending a run that
  waits and waking it (the step's side is :mod:`durable_steps._execution.waits`).

May import: everything below it (the top-level foundations, ``_fleet``,
``_execution``, ``_deploys``, ``_record``). Only ``_workflow``, ``worker``,
the command line and the web page (resolving an in-doubt step) import it.
"""
