"""Steps: plain functions plus the options that say how to run them durably."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

import tenacity

from ._checkpoint import validate_name
from .errors import DefinitionError

__all__ = ["Context", "Retry", "Step", "step"]

P = ParamSpec("P")
R = TypeVar("R")
InDoubt = Literal["refire", "raise"]


@dataclass(frozen=True)
class Retry:
    """How often to retry a failing step, and how long to wait between tries.

    ``attempts`` counts every try, the first included. The wait before try
    *n* grows exponentially from ``wait`` up to ``max_wait`` seconds, with
    random jitter so that many runs failing together do not retry together;
    ``wait=0`` retries at once. Only exceptions that are instances of ``on``
    are retried (by default ``TimeoutError``; pass ``on=Exception`` to retry
    everything); anything else fails the step at once.

    Every try starts from the last committed state and uses the same
    idempotency key; ``ctx.attempt`` says which try it is.
    """

    attempts: int = 3
    wait: float = 0.5
    max_wait: float = 30.0
    on: type[Exception] | tuple[type[Exception], ...] = (TimeoutError,)

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise DefinitionError(
                f"Retry(attempts={self.attempts!r}): attempts must be an int >= 1"
            )
        if self.wait < 0 or self.max_wait < self.wait:
            raise DefinitionError(
                f"Retry(wait={self.wait!r}, max_wait={self.max_wait!r}): need 0 <= wait <= max_wait"
            )
        kinds = self.on if isinstance(self.on, tuple) else (self.on,)
        if not kinds or not all(isinstance(k, type) and issubclass(k, Exception) for k in kinds):
            raise DefinitionError(
                f"Retry(on={self.on!r}): on must be an Exception subclass or a tuple of them"
            )

    def _policy(self) -> tenacity.Retrying:
        """The tenacity policy; the runner drives it through ``iter`` so that
        sleeping stays with the (sync or async) driver.
        """
        wait: tenacity.wait.wait_base = (
            # jitter up to one base wait: spreads retries without dwarfing a short wait
            tenacity.wait_exponential_jitter(initial=self.wait, max=self.max_wait, jitter=self.wait)
            if self.wait > 0
            else tenacity.wait_none()
        )
        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=wait,
            retry=tenacity.retry_if_exception_type(self.on),
            reraise=True,
        )


@dataclass(eq=False)
class Context:
    """What a step knows about where it runs. Read-only for steps.

    ``idempotency_key`` is the same on every retry and every resume of this
    step in this pass, and differs for every other step, pass and run. For a
    step declared ``idempotent=False`` it is written to the checkpoint before
    the step fires: pass it to the API the step calls, so that a re-fire is
    deduplicated there.
    """

    run_id: str
    workflow: str
    step: str
    iteration: int
    """The pass number, from 0."""
    attempt: int
    """The try number within this process, from 1."""
    idempotency_key: str
    in_doubt: bool = False
    """True when an earlier process may already have fired this step."""
    _finish: bool = field(default=False, repr=False)

    def finish(self) -> None:
        """Complete the run when this step commits: no further steps or passes run."""
        self._finish = True


class Step(Generic[P, R]):
    """A function with durable-run options; still callable as the function.

    Make one with :func:`step` or :meth:`Workflow.step`.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        idempotent: bool = True,
        name: str | None = None,
        retry: Retry | None = None,
        in_doubt: InDoubt | None = None,
        reconcile: Callable[..., Any] | None = None,
    ) -> None:
        label = name if name is not None else getattr(fn, "__name__", repr(fn))
        if not callable(fn):
            raise DefinitionError(f"step {label!r}: {fn!r} is not callable")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise DefinitionError(
                f"step {label!r} is a generator function; a step runs once and returns "
                "(or mutates) the state. Collect the items in a list instead."
            )
        try:
            validate_name(label, "step name")
        except DefinitionError:
            raise DefinitionError(
                f"step name {label!r} is not valid: pass name= with 1-200 characters from "
                "letters, digits and '._@=+:-'"
            ) from None
        if retry is not None and not isinstance(retry, Retry):
            raise DefinitionError(f"step {label!r}: retry must be a ds.Retry, not {retry!r}")
        if idempotent and (in_doubt is not None or reconcile is not None):
            raise DefinitionError(
                f"step {label!r}: in_doubt= and reconcile= apply only to non-idempotent "
                "steps; add idempotent=False or remove them"
            )
        if in_doubt not in (None, "refire", "raise"):
            raise DefinitionError(
                f"step {label!r}: in_doubt must be 'refire' or 'raise', not {in_doubt!r}"
            )
        if reconcile is not None and in_doubt == "raise":
            raise DefinitionError(
                f"step {label!r}: reconcile= already decides in-doubt cases; "
                "drop in_doubt='raise' or drop reconcile="
            )
        if reconcile is not None and not callable(reconcile):
            raise DefinitionError(f"step {label!r}: reconcile must be callable")
        self.fn = fn
        self.name = label
        self.idempotent = idempotent
        self.retry = retry
        self.in_doubt: InDoubt = in_doubt or "refire"
        self.reconcile = reconcile
        self.takes_context = _count_positional(fn, label) == 2
        self.is_async = inspect.iscoroutinefunction(fn) or (
            reconcile is not None and inspect.iscoroutinefunction(reconcile)
        )
        self.__name__ = label
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the plain function (for unit tests); nothing is checkpointed."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        kind = "idempotent" if self.idempotent else "non-idempotent"
        return f"<Step {self.name!r} ({kind})>"


def _count_positional(fn: Callable[..., Any], label: str) -> int:
    """1 for ``fn(state)``, 2 for ``fn(state, ctx)``; anything else is refused."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: assume fn(state)
        return 1
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 2
    if len(required) > 2 or not positional:
        raise DefinitionError(
            f"step {label!r} must take (state) or (state, ctx); its signature is "
            f"{inspect.signature(fn)}"
        )
    return min(len(positional), 2)


@overload
def step(
    fn: Callable[P, R],
    *,
    idempotent: bool = ...,
    name: str | None = ...,
    retry: Retry | None = ...,
    in_doubt: InDoubt | None = ...,
    reconcile: Callable[..., Any] | None = ...,
) -> Step[P, R]: ...


@overload
def step(
    fn: None = None,
    *,
    idempotent: bool = ...,
    name: str | None = ...,
    retry: Retry | None = ...,
    in_doubt: InDoubt | None = ...,
    reconcile: Callable[..., Any] | None = ...,
) -> Callable[[Callable[P, R]], Step[P, R]]: ...


def step(
    fn: Callable[P, R] | None = None,
    *,
    idempotent: bool = True,
    name: str | None = None,
    retry: Retry | None = None,
    in_doubt: InDoubt | None = None,
    reconcile: Callable[..., Any] | None = None,
) -> Step[P, R] | Callable[[Callable[P, R]], Step[P, R]]:
    """Make a :class:`Step` without registering it anywhere.

    ``ds.step(fn, ...)`` returns the step; ``@ds.step(...)`` decorates. Pass
    steps to ``ds.Workflow(name, steps=[...])`` in the order they run.

    ``idempotent=False`` marks a step with side effects (a charge, an email):
    its idempotency key is checkpointed before it fires. If a crash leaves it
    in doubt, ``in_doubt="refire"`` (the default) fires it again with the same
    key, ``in_doubt="raise"`` stops with :class:`StepInDoubt` so a person
    decides, and ``reconcile(state, ctx) -> bool`` is asked first whether the
    effect already happened (True: count the step as done).
    """

    def make(f: Callable[P, R]) -> Step[P, R]:
        return Step(
            f, idempotent=idempotent, name=name, retry=retry, in_doubt=in_doubt, reconcile=reconcile
        )

    return make if fn is None else make(fn)
