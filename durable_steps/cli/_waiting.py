"""``signal``, and what a waiting run waits for (the WAITING FOR of ``ls``, ``show``).

A run whose step called ``ctx.sleep``/``ctx.wait_for`` is *waiting*: its
header's ``wait`` says for what (a time, a signal, or a signal with a
timeout). ``ls`` learns which signals were sent from the one LIST it
already makes (a signal is an object beside the checkpoint); ``show``
reads the one signal key.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from .._fleet import signals as _signals
from .._fleet.approval import APPROVAL, SHAPE, approval
from .._record import checkpoint as ckpt
from ..errors import DurableStepsError, SerializationError, SignalRefused, StoreError
from ..serializers import SIGNED_SUFFIX, SIGNING_KEY_ENV, JSONSerializer, SignedSerializer
from ..stores import Store
from ._base import (
    APP,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    RUN_HELP,
    CommandError,
    arg,
    cmd,
    json_argument,
    run_ref,
)
from ._format import Style, clean, echo, human_age, timestamp
from ._indexed import locate
from ._runs import load, pinned

__all__ = ["accepts", "register", "signal_sent", "wait_hint", "wait_lines", "waiting_for"]


def _resume() -> str:
    return f"rerun the workflow or let `{cmd()} worker --app {APP.get()}` resume it"


def _clock(epoch: float, now: float) -> str:
    """``14:05`` today (local time), else ``2026-12-02 14:05``."""
    today = time.localtime(now)[:3] == time.localtime(epoch)[:3]
    return time.strftime("%H:%M" if today else "%Y-%m-%d %H:%M", time.localtime(epoch))


def _moment(epoch: float, now: float) -> str:
    """``2026-12-01 14:05:00 (in 38m)``, or ``(3m ago)`` once it has passed."""
    if epoch <= now:
        return timestamp(epoch, now)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    return f"{when} (in {human_age(epoch - now).removesuffix(' ago')})"


def _wait(status: object, wait: object) -> dict[str, Any] | None:
    """A header's ``wait`` record if the run is waiting, else None."""
    return wait if status == "waiting" and isinstance(wait, dict) else None


def waiting_for(header: dict[str, Any] | None, sent: frozenset[str], now: float) -> str:
    """What a run waits for, in a few words (``signal approval (until 14:05)``); ``""`` if it
    does not wait. ``sent`` are the signals the store holds for it.
    """
    h = header or {}
    wait = _wait(h.get("status"), h.get("wait"))
    if wait is None:
        return ""
    signal, until = wait.get("signal"), wait.get("until")
    due = isinstance(until, (int, float)) and until <= now
    if signal is None:
        return f"until {_clock(until, now)}{' (due)' if due else ''}" if until else "?"
    if signal in sent:
        return f"signal {signal} (sent)"
    if until is None:
        return f"signal {signal}"
    return f"signal {signal} (until {_clock(until, now)}{', due' if due else ''})"


def signal_sent(store: Store, header: ckpt.Checkpoint) -> float | None:
    """When the signal a waiting run waits for was sent (None: not yet, or no signal,
    or one sent ahead whose payload the wait does not accept: it decides nothing, and
    one of the right shape may still be sent).
    """
    wait = _wait(header.status, header.wait)
    if wait is None or wait.get("signal") is None:
        return None
    found = store.get(_signals.signal_key(header.workflow, header.run_id, wait["signal"]))
    if found is None or not _signals.wakes(found[0], header.run_nonce, wait.get("accepts")):
        return None
    split = ckpt.split_header(found[0])  # a signal is one JSON line, as a header is
    sent_at = split[0].get("sent_at") if split else None
    return float(sent_at) if isinstance(sent_at, (int, float)) else time.time()


def wait_lines(
    header: ckpt.Checkpoint, sent_at: float | None, style: Style, now: float
) -> list[str]:
    """The ``waiting for`` section of ``show``: what the run waits for, since when."""
    wait = _wait(header.status, header.wait)
    if wait is None:
        return []
    signal, until = wait.get("signal"), wait.get("until")
    pairs = [("step", f"{wait.get('step')} (iteration {wait.get('iteration')})")]
    if signal is not None:
        got = f"sent {_moment(sent_at, now)}" if sent_at is not None else "not sent yet"
        pairs.append(("signal", f"{signal!r}: {got}"))
        pairs.append(("accepts", accepts(wait)))
    if until is not None:
        label = "timeout" if signal is not None else "until"
        pairs.append((label, _moment(float(until), now)))
    pairs.append(("since", timestamp(float(wait.get("since", now)), now)))
    width = max(len(label) for label, _ in pairs)
    lines = [f"  {style.dim(label.ljust(width))}  {clean(value)}" for label, value in pairs]
    return ["", style.bold("waiting for"), *lines]


def wait_hint(header: ckpt.Checkpoint, sent_at: float | None, now: float) -> str | None:
    """The ``next:`` advice for a waiting run: the command that unblocks it (None: not waiting)."""
    wait = _wait(header.status, header.wait)
    if wait is None:
        return None
    signal, until = wait.get("signal"), wait.get("until")
    step = wait.get("step")
    if sent_at is not None or (until is not None and until <= now):
        why = f"signal {signal!r} has been sent" if sent_at is not None else "its time has come"
        return f"{why}: {_resume_at(step)}"
    if signal is None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until))
        return f"it sleeps: it runs again after {when} ({_resume()} then)"
    timeout = ""
    if until is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until))
        timeout = f" (without it, ctx.wait_for raises SignalTimeout after {when})"
    data, then = "JSON", ""
    if wait.get("accepts") == APPROVAL:
        data, then = """'{"approved": true}'""", """ (or '{"approved": false, "message": "why"}')"""
    return (
        f"it waits for signal {signal!r}{timeout}: send it with "
        f"`{cmd()} signal {header.run} {signal} --data {data}`{then}, then {_resume()}"
    )


def accepts(wait: dict[str, Any]) -> str:
    """What payload a wait for a signal accepts, in words (``show``, the web page)."""
    if wait.get("accepts") == APPROVAL:
        return f"an approval: {SHAPE}"
    return "any JSON payload"


def _resume_at(step: object) -> str:
    return f"{_resume()} to go on at step {step!r}"


@arg
def _signal_name(text: str) -> str:
    return ckpt.validate_name(text, "signal name")


def _cmd_signal(args: argparse.Namespace, store: Store, style: Style) -> int:
    payload = None if args.data is None else json_argument(args.data, "--data")
    workflow, run_id = locate(store, args.run)
    header, _, _ = load(store, workflow, run_id)  # exit 3 when it does not exist
    pinned(args, header.run, header.run_nonce)
    key = os.environ.get(SIGNING_KEY_ENV)
    if not key and header.serializer.endswith(SIGNED_SUFFIX):
        # Unsigned, it would take the name for good and be refused by the run.
        raise CommandError(
            f"run {header.run} is signed ({header.serializer}), so it refuses an unsigned "
            f"signal: set {SIGNING_KEY_ENV} to its key; nothing was sent",
            EXIT_USAGE,
        )
    signer = SignedSerializer(JSONSerializer(), key) if key else None
    try:
        expected = getattr(args, "expect_nonce", None)
        sent = _signals.send(
            store, workflow, run_id, args.name, payload, signer, expect_nonce=expected
        )
    except _signals.RunChanged as exc:  # pinned on send's own read of the run
        pinned(args, header.run, exc.nonce)
        raise
    except (SerializationError, SignalRefused) as exc:  # too large, wrong shape: the user's
        raise CommandError(exc.message, EXIT_USAGE) from exc
    except StoreError:
        raise
    except DurableStepsError as exc:  # the run is gone or finished: nothing can receive it
        raise CommandError(exc.message, EXIT_NOT_FOUND) from exc
    if not sent:
        raise CommandError(
            f"signal {args.name!r} was already sent to run {header.run}; nothing was changed "
            "(a signal name is delivered once per run)",
            EXIT_REFUSED,
        )
    wait = _wait(header.status, header.wait)
    if wait is not None and wait.get("signal") == args.name:
        then = f"run {header.run} waits for it at step {wait.get('step')!r}: {_resume()}"
    elif wait is not None and wait.get("signal"):
        then = (
            f"note: run {header.run} waits for signal {wait['signal']!r}, not "
            f"{args.name!r} (a typo?); this one is kept until a step waits for it"
        )
    elif approval(payload) is None:  # a wait for an approval would not take it
        then = (
            f"run {header.run} does not wait for it now; it is kept, and "
            f"ctx.wait_for({args.name!r}) returns it at once, unless that wait takes an "
            f"approval ({SHAPE}): then this payload decides nothing and the run waits on; "
            "an approval sent under the same name replaces it"
        )
    else:
        then = (
            f"run {header.run} does not wait for it now; it is kept, and "
            f"ctx.wait_for({args.name!r}) returns it at once"
        )
    echo(f"sent signal {args.name!r} to {header.run}. {then}.")
    return EXIT_OK


def register(command: Callable[..., Any]) -> None:
    """Add the ``signal`` subcommand through build_parser's ``command`` factory."""
    sig = command(
        "signal",
        _cmd_signal,
        "send a signal (a JSON payload) to a run that waits for it",
        "Send signal NAME to a run: ctx.wait_for(NAME) in its step returns the payload. The "
        "signal is a create-only object beside the run's checkpoint; the run goes on when "
        "it is run again or a worker resumes it. A name is delivered once: sending it again "
        "is refused (exit 4). A run that waits for an approval takes only "
        f"{SHAPE.replace('%', '%%')}: another payload is refused (exit 2). The run must exist "
        "and not be finished (exit 3). With "
        f"${SIGNING_KEY_ENV} set the signal is signed, as a workflow with that key requires.",
    )
    sig.add_argument("run", metavar="RUN", type=run_ref, help=RUN_HELP)
    sig.add_argument("name", metavar="NAME", type=_signal_name, help="the signal's name")
    sig.add_argument(
        "--data",
        metavar="JSON",
        help="the payload: JSON, or @file to read it from a file (default: null; at most "
        f"{_signals.MAX_PAYLOAD // 1024} KB)",
    )
