"""Finding runs in a store and reading one: what every command looks at first.

A ``running`` run no live process owns (``leases.is_live``) is shown as
``stopped`` -- or ``in_doubt`` when it holds an unresolved intent: its
non-idempotent step may have fired before the crash. One that crashed in a
process still alive looks owned to other processes until its lease ends:
only its own process knows that it is over.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .._fleet import signals as _signals
from .._fleet.leases import is_live, lease_end
from .._record import checkpoint as ckpt
from ..errors import CorruptCheckpoint
from ..serializers import SIGNED_SUFFIX, SIGNING_KEY_ENV, JSONSerializer, SignedSerializer
from ..stores import Store
from ._base import EXIT_NOT_FOUND, EXIT_REFUSED, CommandError, cmd
from ._format import clean, human_age, run_size

FINISHED = ("completed", "deleted")  # "deleted": a tombstone, see _cleanup


def next_step(header: dict[str, Any]) -> str | None:
    """The name of the step an unfinished run resumes at (``None``: done or unknown)."""
    steps, index = header.get("steps") or [], header.get("next_step")
    if header.get("status") in FINISHED or not isinstance(index, int):
        return None
    return str(steps[index]) if 0 <= index < len(steps) else None


__all__ = [
    "FIRED_SKIPS_STEP",
    "RunInfo",
    "effect_label",
    "find_runs",
    "load",
    "owner_text",
    "peek_header",
    "pinned",
    "run_status",
    "status_of",
    "with_signals",
]


FIRED_SKIPS_STEP = (
    "resolving a step as fired skips it, so its changes to the state are lost (a flag it "
    "sets stays unset, and a later pass may do its work again). If the service "
    "deduplicates by the key, resolving as not fired re-runs the step with the same key "
    "and keeps them; otherwise make the side effect a ctx.effect inside the step (the step "
    "then re-runs and gets the effect's recorded result) or give the step reconcile= to set "
    "the state (see concepts/idempotency.md)"
)
"""Said wherever a person resolves a *step* in doubt as fired (``show``'s hint,
``resolve``'s message, the page's form): what ``fired=True`` drops. An effect
in doubt is different: its step runs again and gets the recorded result."""


def peek_header(data: bytes, workflow: str, run_id: str) -> dict[str, Any] | None:
    """The first-line header if ``data`` is a durable_steps checkpoint of this run.

    Only the header line is parsed (the payload may be damaged), and the run
    it names must be the one the key says: this is what ``rm`` and ``prune``
    require before deleting anything.
    """
    split = ckpt.split_header(data)
    record = split[0] if split else None
    if record is None or not isinstance(record.get("format"), int):
        return None
    if record.get("workflow") != workflow or record.get("run_id") != run_id:
        return None
    return record


@dataclass(frozen=True)
class RunInfo:
    """A run found in the store: its raw header (``None`` if unreadable)."""

    workflow: str
    run_id: str
    key: str
    size: int  # the head's bytes and its parts' (format 2)
    header: dict[str, Any] | None
    status: str  # the status shown (see run_status), or "corrupt"
    problem: str | None
    version: str  # as read: deletes are conditional on it
    signals: frozenset[str] = frozenset()  # the names of the signals sent to it

    @classmethod
    def parse(cls, workflow: str, run_id: str, key: str, data: bytes, version: str) -> RunInfo:
        """Describe the object ``data`` found at ``key``, readable or not."""
        raw = peek_header(data, workflow, run_id)
        status, problem = "corrupt", None
        try:
            header, _ = ckpt.decode(data, where=f"run {workflow}/{run_id}: checkpoint {key!r}")
            if raw is None:
                problem = f"{key!r} holds the checkpoint of another run ({header.run})"
            else:
                status = status_of(header)
        except CorruptCheckpoint as exc:
            problem = exc.message
        return cls(workflow, run_id, key, run_size(len(data), raw), raw, status, problem, version)

    @property
    def name(self) -> str:
        """``workflow/run_id``."""
        return f"{self.workflow}/{self.run_id}"


def with_signals(store: Store, run: RunInfo, sent: frozenset[str]) -> RunInfo:
    """``run`` with the names of the signals the store holds for it (``sent``: from a
    LIST or the index's nudges), less the one it waits for if that one would not
    wake it: sent to an earlier run under the id, or a payload its wait does not take
    (``"approve"`` for an approval). So ``ls`` and the page say "(sent)" only for a
    signal that wakes the run, at one GET per waiting run whose signal is there.
    """
    h = run.header or {}
    wait = h.get("wait")
    if h.get("status") != "waiting" or not isinstance(wait, dict):
        return replace(run, signals=sent)
    signal = wait.get("signal")
    if signal in sent:
        found = store.get(_signals.signal_key(run.workflow, run.run_id, str(signal)))
        nonce = h.get("run_nonce")
        if found is None or not _signals.wakes(found[0], str(nonce), wait.get("accepts")):
            sent = sent - {signal}
    return replace(run, signals=sent)


def _run_keys(store: Store, workflow: str | None) -> list[tuple[str, str, str]]:
    """``(workflow, run_id, key)`` of every checkpoint key under ``workflow/``: one LIST."""
    return _listing(store, workflow)[0]


def _listing(
    store: Store, workflow: str | None
) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], set[str]]]:
    """One LIST: the checkpoint keys (as :func:`_run_keys`), and the names of the
    signals sent, by ``(workflow, run_id)``.
    """
    keys: list[tuple[str, str, str]] = []
    signals: dict[tuple[str, str], set[str]] = {}
    for info in store.list(f"{workflow}/" if workflow else ""):
        parts = info.key.split("/")
        if parts[0].startswith("_"):  # _index/: no run's (no workflow name starts with _)
            continue
        if len(parts) == 3 and parts[2] == ckpt.CHECKPOINT_OBJECT:
            keys.append((parts[0], parts[1], info.key))
        elif len(parts) == 4 and parts[2] == "signals" and parts[3]:
            signals.setdefault((parts[0], parts[1]), set()).add(parts[3])
    return keys, signals


def find_runs(store: Store, workflow: str | None) -> list[RunInfo]:
    """Every run under ``workflow/`` (or the whole store): one LIST, one GET per run."""
    keys, signals = _listing(store, workflow)

    def fetch(item: tuple[str, str, str]) -> RunInfo | None:
        found = store.get(item[2])
        if found is None:
            return None
        sent = frozenset(signals.get(item[:2], ()))
        return with_signals(store, RunInfo.parse(*item, *found), sent)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(keys)))) as pool:
        return [run for run in pool.map(fetch, keys) if run is not None]


def status_of(header: ckpt.Checkpoint) -> str:
    """:func:`run_status` of a decoded head."""
    return run_status(
        header.status,
        header.owner,
        header.intent,
        since=header.updated_at,
        journal=header.journal,
        committed=header.committed,
    )


def run_status(
    status: str,
    owner: dict[str, Any] | None,
    intent: object,
    *,
    since: object = None,
    journal: object = None,
    committed: object = None,
) -> str:
    """The status to show: a ``running`` run no live process owns is ``stopped``,
    or ``in_doubt`` if its ``intent``, or an effect its ``journal`` lists as
    open, is unresolved (it may have fired), or ``queued`` when it was never
    started (submitted: no owner ever, no step committed). ``since`` is the
    header's ``updated_at``, which bounds the lease.
    """
    if status != "running" or is_live(owner, since=since):
        return status
    pending = isinstance(intent, dict) and intent.get("resolution") is None
    if pending or open_effects(journal):
        return "in_doubt"
    return "queued" if owner is None and committed == 0 else "stopped"


def effect_label(entry: dict[str, Any]) -> str:
    """How an effect is named to a person: the title its caller gave (an
    integration's tool and arguments), else its journal name, quoted.
    """
    title = entry.get("title")
    return clean(title) if isinstance(title, str) else repr(entry.get("name"))


def open_effects(journal: object) -> list[dict[str, Any]]:
    """The effects a header's ``journal`` lists as in doubt (intent, no result, unresolved)."""
    if not isinstance(journal, dict) or not isinstance(journal.get("open"), list):
        return []
    return [e for e in journal["open"] if isinstance(e, dict) and e.get("resolution") is None]


def owner_text(owner: dict[str, Any] | None, status: str, *, since: object = None) -> str:
    """Who runs a run: ``host:pid (lease ends in 42s)``, ``host:pid (gone)``, ``none``."""
    if not owner:
        return "none (stopped)" if status == "running" else "none"
    who = f"{owner.get('host')}:{owner.get('pid')}"
    left = lease_end(owner, since=since) - time.time()
    if is_live(owner, since=since):
        return f"{who} (lease ends in {left:.0f}s)"
    # Not live with its lease left: an owner on this host whose process is gone.
    return f"{who} (gone)" if left > 0 else f"{who} (lease ended {human_age(-left)})"


def load(store: Store, workflow: str, run_id: str) -> tuple[ckpt.Checkpoint, bytes, bytes]:
    """A run's decoded header and payload, and the stored bytes; exit 3 when missing."""
    name, key = f"{workflow}/{run_id}", ckpt.checkpoint_key(workflow, run_id)
    found = store.get(key)
    if found is None:
        raise CommandError(
            f"run {name} not found (no checkpoint at {key!r}); list runs with `{cmd()} ls`",
            EXIT_NOT_FOUND,
        )
    where = f"run {name}: checkpoint {key!r}"
    header, payload = ckpt.decode(found[0], where=where)
    key_set = os.environ.get(SIGNING_KEY_ENV)
    if key_set and header.serializer.endswith(SIGNED_SUFFIX):
        # With the key at hand, what is shown (and resolved) is what was signed:
        # a header edited by someone without the key is refused, not displayed.
        ckpt.decode(found[0], where=where, signer=SignedSerializer(JSONSerializer(), key_set))
    if (header.workflow, header.run_id) != (workflow, run_id):
        raise CorruptCheckpoint(f"{key!r} holds the checkpoint of another run ({header.run})")
    return header, payload, found[0]


def pinned(args: argparse.Namespace, run: str, nonce: object) -> None:
    """Refuse (exit 4, nothing changed) when ``run`` is not the run a confirmation was
    shown for: the web page passes the nonce of the run its page showed
    (``expect_nonce``), and an id deleted and created again has another one.
    """
    expected = getattr(args, "expect_nonce", None)
    if expected is not None and nonce != expected:
        now = "it is gone" if nonce is None else "it was deleted and created again"
        raise CommandError(
            f"run {run} changed since you confirmed ({now}: another run under that id); "
            "nothing was changed: reload the run's page and decide again",
            EXIT_REFUSED,
        )
