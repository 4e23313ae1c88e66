"""A child process that runs one version of a workflow module (deploy tests).

Run it by path, with the directory of that version's module::

    python tests/deploychild.py APP_DIR RUN_ID

It imports ``deployapp`` from ``APP_DIR`` (each version of the code is its
own directory, as a deploy replaces the files), runs ``deployapp.wf.run``
and prints the final state as JSON. The module itself (written by
``tests/test_deploys.py``) reads its store, its executions log and where to
SIGKILL itself from the environment. Exit status: 0 done, 3
``StepInDoubt``, 5 ``WorkflowChanged``, 6 another ``DurableStepsError``
(``StepFailed``, a failed migration), each with ``Name: message`` on stderr.
"""

from __future__ import annotations

import json
import sys

import durable_steps as ds

EXIT_IN_DOUBT, EXIT_CHANGED, EXIT_ERROR = 3, 5, 6


def main(argv: list[str]) -> int:
    """Run the workflow of ``argv[0]``'s ``deployapp`` on run ``argv[1]``."""
    app_dir, run_id = argv
    sys.path.insert(0, app_dir)
    import deployapp  # type: ignore[import-not-found]

    codes = ((ds.StepInDoubt, EXIT_IN_DOUBT), (ds.WorkflowChanged, EXIT_CHANGED))
    try:
        final = deployapp.wf.run(run_id, {"trail": [], "passes": 0})
    except ds.DurableStepsError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return next((code for kind, code in codes if isinstance(exc, kind)), EXIT_ERROR)
    print(json.dumps(final, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
