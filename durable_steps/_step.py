"""Steps: plain functions plus the options that say how to run them durably."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

import tenacity

from ._record.checkpoint import validate_name
from .errors import DefinitionError

__all__ = ["Fired", "Retry", "Step", "callable_with", "is_async_callable", "step"]

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


@dataclass(frozen=True)
class Fired:
    """``reconcile``'s answer for an effect that happened, with what it returned.

    Asked about an effect in doubt (``ctx.effect_in_doubt`` names it),
    ``reconcile`` returns ``False`` (it did not happen: fire it again with its
    key), ``True`` (it happened: ``ctx.effect`` returns ``None`` for it), or
    ``ds.Fired(result)``: it happened and returned ``result`` — recorded like
    any effect's result, so ``ctx.effect`` returns it and the step's code
    written for the live result works on the recovery path too. A step's own
    ``reconcile`` (a non-idempotent step in doubt) answers ``True`` or
    ``False`` and records the outcome in the state.
    """

    result: Any = None


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
        renamed_from: str | Sequence[str] = (),
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
        if reconcile is not None and not callable_with(reconcile, 2):
            raise DefinitionError(
                f"step {label!r}: reconcile must take (state, ctx); its signature is "
                f"{inspect.signature(reconcile)}"
            )
        self.fn = fn
        self.name = label
        self.idempotent = idempotent
        self.retry = retry
        self.in_doubt: InDoubt = in_doubt or "refire"
        self.reconcile = reconcile
        self.renamed_from = _old_names(label, renamed_from)
        """Earlier names of this step: a run stored under one resumes here."""
        self.takes_context = _takes_context(fn, label)
        self.is_async = is_async_callable(fn) or (
            reconcile is not None and is_async_callable(reconcile)
        )
        self.__name__ = label
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the plain function (for unit tests); nothing is checkpointed."""
        return self.fn(*args, **kwargs)

    def wrong_return(self, state: Any, result: Any) -> DefinitionError | None:
        """Why ``result``, which this step returned, cannot replace ``state``
        (``None`` when it can, or when nothing was returned).

        A non-``None`` return replaces the whole state, so a value of another
        kind (a string for a dict), or a *new* dict that lacks keys the state
        had, is nearly always a helper's result returned by mistake — and
        would silently lose the transcript. Returning the state itself, or a
        dict that keeps every key, is fine.
        """
        if result is None or result is state:
            return None
        old, new = type(state), type(result)
        if not (issubclass(new, old) or (new is not object and issubclass(old, new))):
            problem = f"returned {_a(new)}, but the state is {_a(old)}"
        elif isinstance(state, dict) and isinstance(result, dict):
            missing = [key for key in state if key not in result]
            if not missing:
                return None
            shown = ", ".join(repr(key) for key in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problem = f"returned a new dict without the state's keys {shown}{more}"
        else:
            return None
        return DefinitionError(
            f"step {self.name!r} {problem}. A non-None return replaces the whole state: "
            "mutate the state in place and return None, or replace it on purpose with "
            "state.clear(); state.update(new) (or return a dict with every key).",
            step=self.name,
        )

    def __repr__(self) -> str:
        kind = "idempotent" if self.idempotent else "non-idempotent"
        return f"<Step {self.name!r} ({kind})>"


def _old_names(label: str, renamed_from: str | Sequence[str]) -> tuple[str, ...]:
    """``renamed_from`` as a tuple of valid step names, none the step's own."""
    olds = (renamed_from,) if isinstance(renamed_from, str) else tuple(renamed_from)
    for old in olds:
        try:
            validate_name(old, "step name")
        except DefinitionError:
            raise DefinitionError(
                f"step {label!r}: renamed_from={old!r} is not a step name (1-200 characters "
                "from letters, digits and '._@=+:-')"
            ) from None
        if old == label:
            raise DefinitionError(f"step {label!r}: renamed_from names the step itself")
    if len(set(olds)) < len(olds):
        raise DefinitionError(f"step {label!r}: renamed_from={olds!r} repeats a name")
    return olds


def _a(kind: type) -> str:
    """``a dict``, ``an int``: a type's name for a message."""
    return f"{'an' if kind.__name__[:1].lower() in 'aeiou' else 'a'} {kind.__name__}"


SHAPES = "fn(state) or fn(state, ctx)"


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def callable_with(fn: Callable[..., Any], count: int) -> bool:
    """Whether ``fn`` accepts ``count`` positional arguments and nothing else
    (every other parameter has a default). True when Python cannot say.
    """
    signature = _signature(fn)
    if signature is None:
        return True
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def _takes_context(fn: Callable[..., Any], label: str) -> bool:
    """True for ``fn(state, ctx)``, False for ``fn(state)``; anything else is
    refused here, at definition, rather than failing when the step first runs.

    ``ctx`` is passed by position, as the second argument. Parameter names
    are free, with two exceptions that would silently swap the arguments: a
    first parameter named ``self``/``cls`` (a method taken from its class
    body) and a first parameter named ``ctx``/``context`` followed by one
    named ``state``.
    """
    signature = _signature(fn)
    if signature is None:  # a builtin: assume fn(state)
        return False
    names = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if names[:2] in (["ctx", "state"], ["context", "state"]):
        raise DefinitionError(
            f"step {label!r} takes {signature}: the state comes first. A step is {SHAPES}; "
            "swap the two parameters."
        )
    if names[:1] in (["self"], ["cls"]):
        raise DefinitionError(
            f"step {label!r} takes {signature}: it looks like a method taken from its class, "
            f"which would get the state as {names[0]}. A step is {SHAPES}: register the "
            "bound method (ds.step(obj.method)) or a function."
        )
    if callable_with(fn, 2):
        return True
    if callable_with(fn, 1):
        return False
    keyword_only = [
        p.name
        for p in signature.parameters.values()
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty
    ]
    hint = (
        f" ctx is passed by position, so {', '.join(map(repr, keyword_only))} must not be "
        "keyword-only (drop the '*') or needs a default."
        if keyword_only
        else " Every other parameter needs a default."
    )
    raise DefinitionError(f"step {label!r} must be {SHAPES}; its signature is {signature}.{hint}")


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine: an ``async def`` function or
    method, an object whose ``__call__`` is one, a staticmethod or a
    ``functools.partial`` of any of these.
    """
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        else:
            break
    if inspect.iscoroutinefunction(fn):
        return True
    # An instance's __call__ (looked up on its type, as calling it does; a class's
    # own __call__ is not what calling the class runs).
    if inspect.isfunction(fn) or inspect.ismethod(fn) or isinstance(fn, type):
        return False
    return callable(fn) and inspect.iscoroutinefunction(type(fn).__call__)


@overload
def step(
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
    fn: Callable[P, R] | None = None,
    *,
    idempotent: bool = True,
    name: str | None = None,
    retry: Retry | None = None,
    in_doubt: InDoubt | None = None,
    reconcile: Callable[..., Any] | None = None,
    renamed_from: str | Sequence[str] = (),
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

    ``renamed_from`` names what this step was called before (a name or a
    tuple of names): a run stored under an old name — at that step, with its
    intent pending, its journal or its wait — resumes here, with the same
    idempotency keys and its recorded calls replayed.
    """

    def make(f: Callable[P, R]) -> Step[P, R]:
        return Step(
            f,
            idempotent=idempotent,
            name=name,
            retry=retry,
            in_doubt=in_doubt,
            reconcile=reconcile,
            renamed_from=renamed_from,
        )

    return make if fn is None else make(fn)
