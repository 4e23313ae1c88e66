"""Workflow: an ordered list of steps, the loop around them, and where runs live."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, overload

from ._deploys import fingerprints as _fingerprints
from ._deploys import fork as _fork
from ._drivers import drive_async, drive_sync
from ._events import Subscriber
from ._execution.plan import Plan
from ._fleet import signals as _signals
from ._fleet.pacing import write_interval
from ._protocol import resolving
from ._protocol import runner as _runner
from ._record.checkpoint import validate_name
from ._step import InDoubt, Retry, Step, callable_with, is_async_callable
from .errors import DefinitionError, RunNotFound, RunSuspended
from .serializers import Serializer, SignedSerializer, resolve_serializer
from .stores import STORE_ENV, command_hint, open_store

if TYPE_CHECKING:
    from .stores import Store

__all__ = ["Workflow"]

P = ParamSpec("P")
R = TypeVar("R")


class Workflow:
    """Steps that run in order, checkpointed after each one.

    ``until(state) -> bool`` makes the steps one *pass* of a loop: passes
    repeat while it is false (checked before each pass). Without ``until``
    the steps run once.

    ``store`` is where runs are checkpointed (a URL, a path or a store
    object; see :mod:`durable_steps.stores`). ``serializer`` is ``"json"``
    (default) or ``"pickle"``; pickles are signed with ``signing_key`` (or
    ``$DURABLE_STEPS_SIGNING_KEY``) when one is given. ``on_complete="mark"``
    keeps a finished run's checkpoint as a terminal marker holding the final
    state, which a rerun returns; ``"delete"`` replaces it with a tombstone
    without state, so a rerun (or :meth:`resume`) runs nothing and returns
    ``None``. ``on_event``
    subscribers receive an :class:`~durable_steps.Event` for everything that
    happens in a run. ``lease`` is how long (seconds) a run stays owned by a
    process that stopped renewing it before another may take it over; see
    :meth:`run`.

    A run made by other code resumes by step *name* (steps added after its
    position run, steps it has not reached that are gone are skipped; see
    ``durable-steps plan``). ``version`` names this code's version; it is
    stored with every run, and a run of another version first has its state
    upgraded by ``migrate(state, from_version)`` (in place, or by returning
    a new state).
    """

    def __init__(
        self,
        name: str,
        *,
        steps: Iterable[Step[..., Any] | Callable[..., Any]] | None = None,
        store: str | os.PathLike[str] | Store | None = None,
        serializer: str | Serializer = "json",
        until: Callable[[Any], bool] | None = None,
        on_complete: Literal["mark", "delete"] = "mark",
        signing_key: bytes | str | None = None,
        on_event: Sequence[Subscriber] = (),
        lease: float = 60.0,
        version: str | None = None,
        migrate: Callable[[Any, str | None], Any] | None = None,
    ) -> None:
        self.name = validate_name(name, "workflow name")
        if until is not None and not callable(until):
            raise DefinitionError(f"workflow {name!r}: until must be callable, not {until!r}")
        if until is not None and is_async_callable(until):
            raise DefinitionError(
                f"workflow {name!r}: until must be a plain function of the state "
                "(it is checked between steps, also under arun), not async"
            )
        if until is not None and not callable_with(until, 1):
            raise DefinitionError(f"workflow {name!r}: until must take (state), like until(state)")
        if on_complete not in ("mark", "delete"):
            raise DefinitionError(
                f"workflow {name!r}: on_complete must be 'mark' or 'delete', not {on_complete!r}"
            )
        if not 0 < lease < math.inf:
            raise DefinitionError(
                f"workflow {name!r}: lease must be a finite number of seconds > 0, not {lease!r}"
            )
        _check_version(name, version, migrate)
        self.version = version
        self.migrate = migrate
        self._code: tuple[tuple[Step[..., Any], ...], dict[str, str]] = ((), {})
        self.until = until
        self.lease = float(lease)
        self.on_complete = on_complete
        self.serializer = resolve_serializer(serializer, signing_key)
        self.store = open_store(store)
        # Nobody chose this store: a rerun elsewhere would not find its runs.
        self._implicit_store = store is None and not os.environ.get(STORE_ENV)
        self.on_event = tuple(on_event)
        self._steps: list[Step[..., Any]] = []
        for s in steps or ():
            self._add(s if isinstance(s, Step) else Step(s))

    @property
    def steps(self) -> tuple[Step[..., Any], ...]:
        """The steps, in the order they run."""
        return tuple(self._steps)

    def _add(self, new: Step[..., Any]) -> None:
        if any(s.name == new.name for s in self._steps):
            raise DefinitionError(
                f"workflow {self.name!r} already has a step named {new.name!r}; step names "
                "identify steps in checkpoints, so give this one another name= "
            )
        for step in self._steps:  # an old name is one step's, and no step's own
            for a, b in ((new, step), (step, new)):
                if b.name in a.renamed_from:
                    raise DefinitionError(
                        f"workflow {self.name!r}: step {a.name!r} has renamed_from={b.name!r}, "
                        f"but {b.name!r} is a step of the workflow too: a run stored at "
                        f"{b.name!r} could not tell which one it is at. Drop the old name "
                        "from renamed_from, or rename the other step."
                    )
            shared = set(new.renamed_from) & set(step.renamed_from)
            if shared:
                raise DefinitionError(
                    f"workflow {self.name!r}: steps {step.name!r} and {new.name!r} both have "
                    f"renamed_from={sorted(shared)[0]!r}: an old name belongs to one step. "
                    "Keep it on the step that took that name's place."
                )
        self._steps.append(new)

    @overload
    def step(
        self,
        fn: Callable[P, R],
        *,
        idempotent: bool = ...,
        name: str | None = ...,
        retry: Retry | None = ...,
        in_doubt: InDoubt | None = ...,
        reconcile: Callable[..., Any] | None = ...,
        renamed_from: str | Sequence[str] = ...,
    ) -> Step[P, R]: ...

    @overload
    def step(
        self,
        fn: None = None,
        *,
        idempotent: bool = ...,
        name: str | None = ...,
        retry: Retry | None = ...,
        in_doubt: InDoubt | None = ...,
        reconcile: Callable[..., Any] | None = ...,
        renamed_from: str | Sequence[str] = ...,
    ) -> Callable[[Callable[P, R]], Step[P, R]]: ...

    def step(
        self,
        fn: Callable[P, R] | None = None,
        *,
        idempotent: bool = True,
        name: str | None = None,
        retry: Retry | None = None,
        in_doubt: InDoubt | None = None,
        reconcile: Callable[..., Any] | None = None,
        renamed_from: str | Sequence[str] = (),
    ) -> Step[P, R] | Callable[[Callable[P, R]], Step[P, R]]:
        """Make a step (options as :func:`durable_steps.step`) and append it."""

        def make(f: Callable[P, R]) -> Step[P, R]:
            new = Step(
                f,
                idempotent=idempotent,
                name=name,
                retry=retry,
                in_doubt=in_doubt,
                reconcile=reconcile,
                renamed_from=renamed_from,
            )
            self._add(new)
            return new

        return make if fn is None else make(fn)

    def _plan(
        self,
        run_id: str,
        *,
        asynchronous: bool,
        takeover: bool = False,
        stop: threading.Event | None = None,
        claim: bool = False,
    ) -> Plan:
        validate_name(run_id, "run id")
        if not self._steps:
            raise DefinitionError(f"workflow {self.name!r} has no steps; add some with @wf.step()")
        interval = write_interval(self.store)
        if self.lease < 3 * interval:  # the heartbeat renews it every lease/3, paced
            raise DefinitionError(
                f"workflow {self.name!r}: lease={self.lease:g} s is too short for "
                f"{self.store!r}, which allows one write of an object every {interval:g} s: "
                f"the lease is renewed every third of it. Use lease={3 * interval:g} or more, "
                f"and more than {interval:g} s plus twice the time a write takes to land "
                "(a slow link: see docs/stores/gcs.md)."
            )
        if not asynchronous:
            for s in self._steps:
                if s.is_async:
                    raise DefinitionError(
                        f"step {s.name!r} of workflow {self.name!r} is async: "
                        "run the workflow with `await wf.arun(...)`"
                    )
        return Plan(
            self.name,
            self.steps,
            self.serializer,
            self.until,
            self.on_complete,
            self.on_event,
            self.store,
            self.lease,
            takeover,
            stop,
            claim or takeover,
            self._implicit_store,
            self.version,
            self.migrate,
            self._fingerprints(),
        )

    def _fingerprints(self) -> dict[str, str]:
        """The steps' code fingerprints, computed once per list of steps."""
        steps, code = self._code
        if steps != self.steps:
            self._code = steps, code = self.steps, _fingerprints.fingerprints(self.steps)
        return code

    def run(
        self, run_id: str, state: Any = None, *, takeover: bool = False, wait: bool = False
    ) -> Any:
        """Run ``run_id`` to completion and return its final state.

        A new run starts from ``state`` (``{}`` when ``None``); an unfinished
        run resumes from its checkpoint (``state`` is then ignored); a
        completed run returns its final state and runs nothing. Code that
        means to resume a run it started earlier calls :meth:`resume`, which
        never creates one: a mistyped id then raises instead of starting a
        new run whose effects fire again under new keys.

        A run being executed by another live process raises
        :class:`~durable_steps.RunLocked`. A crashed owner frees the run at
        once on the same host, and elsewhere when its lease ends;
        ``takeover=True`` takes the run anyway (the other process, if alive,
        is then fenced off at its next write).

        A step that waits (``ctx.sleep``, ``ctx.wait_for``) suspends the run:
        :class:`~durable_steps.RunSuspended` is raised, and nothing holds the
        run until it is run again. ``wait=True`` instead blocks here until
        the time is due or the signal has come (polling the signal's key,
        after 0.5 s then backing off to once per 30 s), and goes on.
        """
        return self._execute(run_id, state, takeover=takeover, wait=wait, create=True)

    def resume(self, run_id: str, *, takeover: bool = False, wait: bool = False) -> Any:
        """:meth:`run` for a run that exists: resume it (or, completed, return its
        final state), and never create one.

        An id the store has no run for raises :class:`~durable_steps.RunNotFound`
        naming the run and the store, and nothing is written. A run completed
        under ``on_complete="delete"`` returns ``None``, as a rerun does: its
        tombstone says it ran (so it is no unknown id), but no state is kept to
        return. ``takeover`` and ``wait`` are :meth:`run`'s.
        """
        return self._execute(run_id, None, takeover=takeover, wait=wait, create=False)

    def _execute(self, run_id: str, state: Any, *, takeover: bool, wait: bool, create: bool) -> Any:
        while True:
            plan = self._plan(run_id, asynchronous=False, takeover=takeover)
            try:
                return drive_sync(_runner.execute(plan, run_id, state, create=create), self.store)
            except _runner.RunGone as gone:
                raise self._not_found(run_id) from gone
            except RunSuspended as waiting:
                if not wait:
                    raise
                _signals.await_wake(self.store, self.name, run_id, waiting)

    async def arun(
        self, run_id: str, state: Any = None, *, takeover: bool = False, wait: bool = False
    ) -> Any:
        """:meth:`run` under asyncio: ``async def`` steps are awaited, sync
        steps run on the event loop, store calls run in a worker thread.
        """
        return await self._aexecute(run_id, state, takeover=takeover, wait=wait, create=True)

    async def aresume(self, run_id: str, *, takeover: bool = False, wait: bool = False) -> Any:
        """:meth:`resume` under asyncio (see :meth:`arun`)."""
        return await self._aexecute(run_id, None, takeover=takeover, wait=wait, create=False)

    async def _aexecute(
        self, run_id: str, state: Any, *, takeover: bool, wait: bool, create: bool
    ) -> Any:
        while True:
            plan = self._plan(run_id, asynchronous=True, takeover=takeover)
            protocol = _runner.execute(plan, run_id, state, create=create)
            try:
                return await drive_async(protocol, self.store)
            except _runner.RunGone as gone:
                raise self._not_found(run_id) from gone
            except RunSuspended as waiting:
                if not wait:
                    raise
                await _signals.await_wake_async(self.store, self.name, run_id, waiting)

    def _not_found(self, run_id: str) -> RunNotFound:
        """The error of :meth:`resume` for an id with no run in this workflow's store."""
        where = getattr(self.store, "url", None) or repr(self.store)
        return RunNotFound(
            f"run {self.name}/{run_id} does not exist in {where}, so it was not resumed "
            f"(nothing was written). Check the id (`{command_hint(self.store)} ls --workflow "
            f"{self.name}` lists the runs) and the store; start a new run with "
            "wf.run(run_id, state).",
            run=f"{self.name}/{run_id}",
            store=where,
        )

    def signal(self, run_id: str, name: str, payload: Any = None) -> bool:
        """Send signal ``name`` with a JSON ``payload`` to run ``run_id``.

        A create-only object beside the run's checkpoint — never a write to
        the checkpoint itself, so it cannot conflict with the run's owner.
        ``ctx.wait_for(name)`` returns the payload; a signal sent before the
        run waits for it is kept. False if ``name`` was already sent to this
        run (a name is delivered once). Refused when the run does not exist or
        has finished, or the payload is not JSON or over 256 KB.
        """
        signer = self.serializer if isinstance(self.serializer, SignedSerializer) else None
        return _signals.send(self.store, self.name, run_id, name, payload, signer)

    def submit(self, run_id: str, state: Any = None) -> bool:
        """Create run ``run_id`` from ``state`` without running it.

        A :class:`~durable_steps.worker.Worker` (or ``durable-steps worker``)
        picks it up. Returns False, changing nothing, if the run exists.
        """
        plan = self._plan(run_id, asynchronous=True)
        return drive_sync(_runner.submit(plan, run_id, state), self.store)

    def resolve(
        self, run_id: str, *, fired: bool, force: bool = False, result: Any = resolving.NO_RESULT
    ) -> None:
        """Tell an in-doubt run whether its pending step's (or effect's) effect happened.

        ``fired=True``: the next run counts the step as done (without
        calling it) and goes on; an effect in doubt (``ctx.effect``) is not
        fired again, and its ``ctx.effect`` returns ``result`` (``None`` if
        not given: give the value the effect returned, so the transcript gets
        the tool's result). ``fired=False``: the next run fires it again with
        the same idempotency key. The run itself is not started here. A run
        that a live process owns raises :class:`~durable_steps.RunLocked`
        (its step may be firing right now); ``force=True`` overrides.

        Resolving a *step* (``@step(idempotent=False)``, not an effect) as
        fired skips it: its changes to the state are lost (a flag it sets
        stays unset, and a later pass may do its work again under a new key).
        If the service deduplicates by the key, ``fired=False`` is the safe
        answer; to keep what the step computes, record the side effect with
        ``ctx.effect`` or give the step ``reconcile=`` (see the idempotency
        concepts page).
        """
        signer = self.serializer if isinstance(self.serializer, SignedSerializer) else None
        resolving.resolve(
            self.store,
            self.name,
            validate_name(run_id, "run id"),
            fired=fired,
            force=force,
            signer=signer,
            result=result,
            serializer=self.serializer,
        )

    def fork(self, run_id: str, new_run_id: str) -> None:
        """Start run ``new_run_id`` from run ``run_id``'s last committed state
        and position, without running it; ``run_id`` is left as it is.

        The new run has a new nonce, so its non-idempotent steps get new
        idempotency keys (a step the source may have fired is not
        deduplicated against it: a warning says so). Run it with
        ``wf.run(new_run_id)``, which resumes it under this code by step name.
        Refuses (writing nothing) if ``new_run_id`` exists or the source has
        finished.
        """
        plan = self._plan(validate_name(new_run_id, "run id"), asynchronous=True)
        drive_sync(_fork.fork(plan, validate_name(run_id, "run id"), new_run_id), self.store)

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self._steps)
        return f"<Workflow {self.name!r} [{names}] store={self.store!r}>"


def _check_version(name: str, version: object, migrate: object) -> None:
    """Refuse a ``version``/``migrate`` pair that cannot work, at definition time."""
    if version is not None and not (isinstance(version, str) and 0 < len(version) <= 200):
        raise DefinitionError(
            f"workflow {name!r}: version must be a string of 1-200 characters, not {version!r}"
        )
    if migrate is None:
        return
    if version is None:
        raise DefinitionError(
            f"workflow {name!r}: migrate= upgrades runs of other versions, so it needs "
            "version= (the version this code is)"
        )
    if not callable(migrate) or is_async_callable(migrate) or not callable_with(migrate, 2):
        raise DefinitionError(
            f"workflow {name!r}: migrate must be a plain function taking (state, "
            "from_version), like migrate(state, from_version)"
        )
