"""The ``durable-steps`` command: find, inspect, resolve and clean up runs.

Works on any store: ``--store URL`` (a path, ``file:///path``,
``s3://bucket/prefix`` with boto3's standard configuration), else
``$DURABLE_STEPS_STORE``, else ``./.durable_steps`` -- the library's default::

    durable-steps ls [--workflow W] [--status STATUS] [--json]
    durable-steps show RUN [--state [--unsafe-unpickle]] [--json]
    durable-steps signal RUN NAME [--data JSON | --data @file]
    durable-steps resolve RUN (--fired | --not-fired) [--result JSON] [--force]
    durable-steps rm RUN [--force]
    durable-steps prune (--completed | --failed) --older-than 7d [--workflow W] [--yes]
    durable-steps plan (RUN | --all) --app MODULE:WORKFLOW [--json]
    durable-steps fork RUN NEW_RUN_ID [--app MODULE:WORKFLOW]

``RUN`` is ``WORKFLOW/RUN_ID``, or a bare ``RUN_ID`` when exactly one run in
the store has that id (found with one LIST; a bare id several runs have is a
usage error, exit 2, that names them all).

A ``running`` run that no live process owns is shown as ``stopped``. ``rm``
and ``prune`` delete only checkpoint objects (``<workflow>/<run_id>/checkpoint``
whose first line is a durable_steps header of that run), never anything else
under the prefix. ``rm`` and ``resolve`` refuse without ``--force`` a run a
live process owns; ``rm`` also one with a pending intent (deleting it forgets
the idempotency key, so a new run under that id would fire the step again with
a new key). ``prune`` is a dry run unless ``--yes``.

Exit status: 0 success; 1 error (the store failed, a checkpoint cannot be
read); 2 usage (bad arguments, store URL, run name or duration, a bare run
id that several runs have, a pickle state without ``--unsafe-unpickle`` or
its signing key, a signal's payload not JSON or too large); 3 the run does
not exist (or, for ``signal``, has finished); 4 refused (a live process owns
the run, its status does not allow it without ``--force``, nothing is in
doubt, the object is not a checkpoint, the run changed meanwhile, or the
signal was already sent).
Errors are one line on stderr (``durable-steps: error: ...``);
``--debug`` adds the traceback and the library's debug log.

One module per group of commands (``_ls``: ls; ``_inspect``: show; ``_waiting``:
signal, and what waiting runs wait for; ``_doubt``: resolve; ``_cleanup``:
rm and prune; ``_worker``: worker; ``_deploys``: plan and fork), over
``_runs`` (reading runs from a store), ``_format`` (units, tables, colour)
and ``_base`` (exit statuses, errors, argument types); ``_main`` builds the
parser and runs a command.
"""

from ._base import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from ._main import build_parser, main

__all__ = [
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]
