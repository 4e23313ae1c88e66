"""``durable-steps ui``: a web page for the people who run agents.

A dashboard over any store, served by the process itself (Starlette on
uvicorn, pages rendered on the server with Jinja2, one small script):

- the runs, live ones first and then the recently finished, filtered by
  workflow and status, found by id, counted per status, refreshed by
  themselves (through the index of runs: at 100,000 finished runs the list
  reads what is live and one page of the finished);
- a run: its status and why, what it waits for and since when, its owner
  and lease, the pending intent and idempotency key, the last error; its
  timeline, pass by pass, with the journaled calls and effects (and their
  keys) of the step in progress; its state as a tree and what the last step
  changed;
- the command line's actions (send a signal, resolve what is in doubt,
  fork, delete), each confirmed first, none in read-only mode.

Install the extra (``pip install 'durable-steps[ui]'``) and run::

    durable-steps ui [--store URL] [--host 127.0.0.1] [--port 8765] [--read-only]

:func:`create_app` returns the ASGI application for another server to
serve; see :mod:`durable_steps.ui._app` for what keeps another site from
acting through the page.
"""

from __future__ import annotations

from ._app import Config, create_app

__all__ = ["Config", "create_app"]
