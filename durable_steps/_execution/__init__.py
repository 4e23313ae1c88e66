"""One execution of a run: what it holds, and everything that writes for it.

* :mod:`.plan` — what an execution needs from its workflow (the Plan), so
  nothing below ``_workflow`` reaches back into it;
* :mod:`.run_state` — the run being executed (RunState) and the one writer
  of its head;
* :mod:`.journal` — a step's journaled calls (``ctx.call``, ``ctx.effect``),
  over :mod:`.log`, the journal as the run stores it and its writes;
  :mod:`.firing` keeps an effect from firing twice in this process;
* :mod:`.waits` — the step's side of waiting: ``ctx.sleep``,
  ``ctx.sleep_until``, ``ctx.wait_for`` (the runner's side, suspending and
  waking a run, is :mod:`durable_steps._protocol.suspending`);
* :mod:`.context` — the Context a step gets.

May import: the top-level foundations, ``_fleet``, ``_record``, ``errors``,
``serializers``, ``stores``. Never ``_deploys`` or ``_protocol``, which
drive an execution from above.
"""
