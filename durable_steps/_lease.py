"""Run ownership: who is running a run, until when, and whether they still are.

A running run records its *owner* in the checkpoint header::

    "owner": {"host": "worker-7", "pid": 4242, "started": 1795987000.12,
              "token": "9f3c…", "until": 1795987060.5}

``token`` is random per execution; ``until`` is the lease's end (wall-clock
seconds). Every write the runner makes renews the lease (a commit costs
nothing extra), and while one step runs longer than a third of the lease a
:class:`Heartbeat` thread renews it with compare-and-swap writes — so a
heartbeat can never clobber a commit, and a process that lost its run (it
was paused past its lease and another process took over) finds out at its
next write: :class:`CheckpointConflict`, and it stops.

Another process may take a run over when (:func:`is_live` is false):

* the lease has ended; or
* the owner is on this host and its process is gone (a SIGKILL, an OOM kill,
  a reboot): no need to wait for the lease; or
* the owner is this very process and that execution has ended (an exception
  escaped ``wf.run``; the run is free at once).

Leases rely on the hosts' clocks agreeing to well within the lease (60 s by
default); NTP does that. Hosts are told apart by ``socket.gethostname()``:
containers that share a hostname but not a PID namespace must not share a
store prefix without distinct hostnames.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._events import logger
from .errors import CheckpointConflict

__all__ = ["Heartbeat", "Owner", "describe", "is_live", "lease_end"]

_HOST = socket.gethostname()
_active_tokens: set[str] = set()  # executions running in this process now
_active_lock = threading.Lock()


def _process_started(pid: int) -> float | None:
    """When ``pid`` started (seconds since boot), where the OS says; this tells
    a live owner from an unrelated process that reused its pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_STARTED = _process_started(os.getpid())


def _after_fork() -> None:
    # A forked child is another process: its own start time, no live runs.
    global _STARTED  # noqa: PLW0603 - process identity, reset once per fork
    global _active_lock  # noqa: PLW0603 - another thread may have held it at fork
    _STARTED = _process_started(os.getpid())
    _active_lock = threading.Lock()
    _active_tokens.clear()
    _BEATER.__init__()  # type: ignore[misc]  # the parent's thread and locks are not ours


os.register_at_fork(after_in_child=_after_fork)


class Owner:
    """This process's claim on one run: a token, renewed to ``lease`` seconds ahead."""

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self.token = secrets.token_hex(8)

    def record(self) -> dict[str, Any]:
        """The header's ``owner`` field, with the lease renewed from now."""
        return {
            "host": _HOST,
            "pid": os.getpid(),
            "started": _STARTED,
            "token": self.token,
            "until": round(time.time() + self.lease, 3),
        }

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Mark this execution live in this process while the block runs."""
        with _active_lock:
            _active_tokens.add(self.token)
        try:
            yield
        finally:
            with _active_lock:
                _active_tokens.discard(self.token)


def lease_end(owner: Any) -> float:
    """The lease's end, or 0.0 (long over) for an owner record that is malformed."""
    until = owner.get("until") if isinstance(owner, dict) else None
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(until):
        return 0.0
    return float(until)


def is_live(owner: dict[str, Any] | None, *, now: float | None = None) -> bool:
    """Whether ``owner`` (a header's ``owner`` field) may still be running.

    A malformed record never counts as live: it must not lock a run forever.
    """
    if not owner or lease_end(owner) < (time.time() if now is None else now):
        return False
    if owner.get("host") != _HOST:
        return True  # another machine, lease not over: assume it is alive
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        with _active_lock:
            return owner.get("token") in _active_tokens
    return _process_alive(pid, owner.get("started"))


def _process_alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` on this host is still the process that started at ``started``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return started is None or _process_started(pid) in (None, started)


def describe(owner: dict[str, Any]) -> str:
    """``host:pid (lease ends in 42s)`` for messages."""
    left = lease_end(owner) - time.time()
    return f"{owner.get('host')}:{owner.get('pid')} (lease ends in {max(left, 0):.0f}s)"


class Heartbeat:
    """Renews one run's lease while a long step runs.

    ``renew()`` is called every ``interval`` seconds (by the process-wide
    :class:`_Beater` thread) and must do one compare-and-swap write. A
    :class:`CheckpointConflict` means the run was taken over: the heartbeat
    sets ``lost`` and stops for good. Any other failure is logged and retried
    at the next beat — the lease is three beats long, so one failed renewal
    costs nothing.
    """

    def __init__(self, interval: float, renew: Callable[[], None], name: str) -> None:
        self.lost = False
        self.interval = interval
        self.name = name
        self._renew = renew
        self._stopped = False
        self._lock = threading.Lock()  # held while a renewal writes
        self._in_flight = threading.Lock()  # one renewal at a time per heartbeat
        _BEATER.arm(self)

    def beat(self) -> None:
        """Renew once (in a thread the beater starts for it)."""
        with self._lock:
            if self._stopped:
                return
            try:
                self._renew()
            except CheckpointConflict:
                logger.warning("run %s was taken over; its heartbeat stopped", self.name)
                self.lost = self._stopped = True
                _BEATER.disarm(self)
            except Exception as exc:  # a renewal must never kill the beater
                logger.warning("run %s: lease renewal failed (%s); will retry", self.name, exc)

    def _beat_in_thread(self) -> None:
        try:
            self.beat()
        finally:
            self._in_flight.release()

    def stop(self) -> None:
        """Stop beating; returns once no renewal is in flight."""
        _BEATER.disarm(self)
        with self._lock:
            self._stopped = True


class _Beater:
    """One daemon thread that renews the leases of every long step in this
    process. Arming and disarming cost a lock and a dict operation, so a
    step that ends before its first beat (almost all of them) pays ~1 µs
    instead of a thread start and join.
    """

    _IDLE = 1.0  # seconds between looks when nothing is armed

    def __init__(self) -> None:
        self._due: dict[Heartbeat, float] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wakes_at = 0.0  # when the thread will look again by itself

    def arm(self, heartbeat: Heartbeat) -> None:
        with self._wake:
            when = self._due[heartbeat] = time.monotonic() + heartbeat.interval
            if self._thread is None or not self._thread.is_alive():  # first use, or forked
                self._thread = threading.Thread(
                    target=self._run, name="durable-steps heartbeat", daemon=True
                )
                self._thread.start()
            elif when < self._wakes_at:
                # Only a beat due before the thread looks again needs waking it:
                # waking it for every step would cost a context switch each.
                self._wake.notify()

    def disarm(self, heartbeat: Heartbeat) -> None:
        with self._wake:
            self._due.pop(heartbeat, None)

    def _next(self) -> Heartbeat:
        """Wait until a heartbeat is due; reschedule it and return it."""
        with self._wake:
            while True:
                now = time.monotonic()
                if not self._due:
                    self._wakes_at = now + self._IDLE
                    self._wake.wait(self._IDLE)
                    continue
                heartbeat, when = min(self._due.items(), key=lambda item: item[1])
                if when <= now:
                    self._due[heartbeat] = now + heartbeat.interval
                    return heartbeat
                self._wakes_at = min(when, now + self._IDLE)
                self._wake.wait(self._wakes_at - now)

    def _run(self) -> None:
        while True:
            heartbeat = self._next()
            # Each renewal gets a thread of its own (only steps longer than a
            # third of the lease ever get here), so one renewal stuck on a slow
            # store never delays another run's; a heartbeat whose last renewal
            # is still in flight skips this beat.
            if heartbeat._in_flight.acquire(blocking=False):
                threading.Thread(
                    target=heartbeat._beat_in_thread, name=f"renew {heartbeat.name}", daemon=True
                ).start()


_BEATER = _Beater()
