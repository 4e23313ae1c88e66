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

Another process may take a run over when :func:`judge` says the owner is
not ``"live"``:

``"none"``
    No owner: the run was never claimed, or it stopped cleanly (released by
    a worker, failed, in doubt).
``"gone"``
    The owner provably runs no more: it is on this host (same hostname, boot
    and PID namespace) and its process is gone, a zombie nobody reaped, or
    was replaced (a SIGKILL, an OOM kill), or it is an execution in this
    very process that has ended.
``"expired"``
    The lease ended, but the owner is on another host (or its record is
    malformed), so it may still be alive: paused past its lease (SIGSTOP, a
    frozen VM) and about to wake. A process that takes such a run over
    *claims it with a write before running anything*, so the straggler's
    next write is refused and it stops; without that claim, a straggler that
    woke before the taker's first write would win and both would run the
    step at once.

Clocks. Leases are wall-clock times written by one host and read by another,
so they rely on the clocks agreeing. Each process measures its own clock
against the store's (``Store.clock_skew()``: S3 answers carry a ``Date``
header; a local store shares this host's clock) and records that skew in
its owner record; a reader translates the owner's ``until`` into the store's
clock with it, and its own "now" likewise. So an owner 120 s behind does not
look expired to everyone else, nor one 120 s ahead alive long after it died.
A process whose own clock is off by more than a quarter of the lease refuses
to take over an expired run (the error names the skew), since its judgement
of "expired" cannot be trusted. A record's ``until`` is capped at its own
``updated_at`` plus its lease (an honest owner writes both at once), so a
malformed ``until`` of 1e308 never locks a run for good.

Hosts are told apart by hostname, boot id and PID namespace: containers that
share a hostname but not a PID namespace are different hosts here.
``$DURABLE_STEPS_HOST``, when set, replaces the hostname: processes that share
a machine but stand for different hosts (the nodes of a test cluster, pods
with a borrowed hostname and a shared PID namespace) then judge each other as
another host would — by the lease alone, never by probing a PID.
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
from typing import Any, Literal

from .._events import logger
from ..errors import CheckpointConflict

__all__ = [
    "HOST_ENV",
    "Heartbeat",
    "Owner",
    "Ownership",
    "describe",
    "is_live",
    "judge",
    "lease_end",
    "store_skew",
]

Ownership = Literal["none", "live", "gone", "expired"]

HOST_ENV = "DURABLE_STEPS_HOST"
_HOST = os.environ.get(HOST_ENV) or socket.gethostname()
_PID_MAX = 2**22  # Linux's ceiling for pid_max: anything above is no pid
_SKEW_MAX = 86_400.0  # a recorded skew beyond a day is noise, not a clock
_LEASE_MAX = 86_400.0  # no lease record is believed for longer than a day
_active_tokens: set[str] = set()  # executions running in this process now
_active_lock = threading.Lock()


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


# This host's identity beyond its name: another machine has another boot id, and a
# container with a borrowed hostname has a PID namespace of its own.
_BOOT = _read_text("/proc/sys/kernel/random/boot_id")
_PIDNS = _pid_namespace()


def _proc_stat(pid: int) -> tuple[bytes, float] | None:
    """``pid``'s state letter and start time (seconds since boot) from
    ``/proc/<pid>/stat``, or None where that cannot be read (no ``/proc``, as
    on macOS; a ``hidepid`` mount; the process is gone).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0], int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _process_started(pid: int) -> float | None:
    """When ``pid`` started (seconds since boot), where the OS says; this tells
    a live owner from an unrelated process that reused its pid.
    """
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


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


def _number(value: object) -> float | None:
    """``value`` as a finite float, or None for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class Owner:
    """This process's claim on one run: a token, renewed to ``lease`` seconds ahead.

    ``skew`` returns this host's clock skew against the store (see the module
    docstring), recorded with every lease so readers can translate it.
    """

    def __init__(self, lease: float, skew: Callable[[], float | None] = lambda: 0.0) -> None:
        self.lease = lease
        self.token = secrets.token_hex(8)
        self._skew = skew
        self.stamped = time.monotonic()
        """When the lease last written was computed (monotonic): it runs from here."""

    def record(self) -> dict[str, Any]:
        """The header's ``owner`` field, with the lease renewed from now."""
        self.stamped = time.monotonic()
        skew = self._skew()
        return {
            "host": _HOST,
            "pid": os.getpid(),
            "started": _STARTED,
            "token": self.token,
            "until": round(time.time() + self.lease, 3),
            "lease": self.lease,
            "skew": None if skew is None else round(skew, 3),
            "boot": _BOOT,
            "pidns": _PIDNS,
        }

    def remaining(self) -> float:
        """Seconds left of the lease last written (negative once it ran out)."""
        return self.stamped + self.lease - time.monotonic()

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


def lease_end(owner: Any, *, since: object = None, lease: float | None = None) -> float:
    """The lease's end in the store's clock, or 0.0 (long over) for a malformed record.

    ``since`` is the header's ``updated_at``, written with the lease by the
    same clock: the end is capped at it plus the record's lease (or, for a
    record without one, ``lease``, the reader's), and no lease counts for
    more than a day, so no value of ``until`` or ``lease`` locks a run for good.
    """
    until = _number(owner.get("until")) if isinstance(owner, dict) else None
    if until is None:
        return 0.0
    assert isinstance(owner, dict)
    since = _number(since)  # a raw header (the command line's) may hold anything
    if since is not None:
        length = _number(owner.get("lease"))
        if length is None or length <= 0:
            length = lease if lease is not None else _LEASE_MAX
        until = min(until, since + min(length, _LEASE_MAX))
    skew = _number(owner.get("skew"))
    if skew is not None and abs(skew) < _SKEW_MAX:
        until -= skew  # the owner's clock, translated into the store's
    return until


def _same_host(owner: dict[str, Any]) -> bool:
    """Whether ``owner`` ran on this host: the same hostname, PID namespace and boot.

    A different boot id is another host, not this one rebooted: two machines
    may well share a hostname (and every host outside a container has the
    same initial PID namespace), so only the lease can tell when such an
    owner is gone.
    """
    if owner.get("host") != _HOST:
        return False
    for key, mine in (("pidns", _PIDNS), ("boot", _BOOT)):
        theirs = owner.get(key)
        if theirs is not None and mine is not None and theirs != mine:
            return False
    return True


def judge(  # noqa: PLR0911 - one answer per kind of owner
    owner: object,
    *,
    now: float | None = None,
    skew: float | None = None,
    since: object = None,
    lease: float | None = None,
) -> Ownership:
    """Whether ``owner`` (a header's ``owner`` field) may still be running.

    ``skew`` is this process's clock skew against the store (None: unknown,
    taken as 0); ``since`` the header's ``updated_at``; ``lease`` the
    reader's own lease, for a record that gives none. See the module
    docstring for the four answers.
    """
    if not owner:
        return "none"
    if not isinstance(owner, dict):
        return "expired"  # a malformed record never counts as live
    clock = (time.time() if now is None else now) - (skew or 0.0)
    if _same_host(owner):
        pid = owner.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < _PID_MAX:
            return "expired"  # a malformed record never counts as live
        if pid == os.getpid():
            with _active_lock:
                if owner.get("token") not in _active_tokens:
                    return "gone"
        elif not _process_alive(pid, owner.get("started")):
            return "gone"
    if lease_end(owner, since=since, lease=lease) < clock:
        return "expired"
    return "live"


def is_live(
    owner: object,
    *,
    now: float | None = None,
    skew: float | None = None,
    since: object = None,
    lease: float | None = None,
) -> bool:
    """Whether ``owner`` may still be running: :func:`judge` says ``"live"``."""
    return judge(owner, now=now, skew=skew, since=since, lease=lease) == "live"


def _process_alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` on this host is still the process that started at ``started``.

    A zombie (state ``Z``: killed, not yet reaped by its parent — a container
    whose PID 1 does not reap, ``timeout -s KILL`` without ``--foreground``) or
    a dying process (``X``) still answers ``kill(pid, 0)``, but it will never
    write again: it is gone, or its run would stay locked for a whole lease.
    Only when it has no other thread, though: a process whose main thread
    exited (``pthread_exit``) while others run shows ``Z`` too, and is alive.
    Where ``/proc`` cannot be read (macOS), ``kill(pid, 0)`` alone decides.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user: /proc may still tell a zombie
    except (OverflowError, ValueError, OSError):
        return False  # no such pid can exist
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, began = stat
    if state in (b"Z", b"X", b"x") and _threads(pid) == 1:
        return False  # (a Z leader whose other threads still run is a live process)
    return started is None or began == started


def _threads(pid: int) -> int | None:
    """How many threads ``pid`` has (``/proc/<pid>/status``); None where unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(owner: dict[str, Any], *, since: object = None) -> str:
    """``host:pid (lease ends in 42s)`` for messages."""
    left = lease_end(owner, since=since) - time.time()
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

    def __init__(
        self,
        interval: float,
        renew: Callable[[], None],
        name: str,
        *,
        first: float | None = None,
    ) -> None:
        self.lost = False
        self.interval = interval
        self.name = name
        self._renew = renew
        self._stopped = False
        self._lock = threading.Lock()  # held while a renewal writes
        self._in_flight = threading.Lock()  # one renewal at a time per heartbeat
        # ``first`` (monotonic) is when the lease now in the store needs its
        # first renewal: counted from when that lease was stamped, not from
        # now, so a write that was slow to land does not leave the lease to
        # run out while the step runs.
        _BEATER.arm(self, time.monotonic() + interval if first is None else first)

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

    def arm(self, heartbeat: Heartbeat, when: float) -> None:
        with self._wake:
            self._due[heartbeat] = when
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


_SKEW_NOISE = 2.0
"""Seconds of measured clock skew taken for none (a Date header has whole seconds)."""


def store_skew(store: Any) -> float | None:
    """The store's ``clock_skew()``, where it has one (an optional method)."""
    measure = getattr(store, "clock_skew", None)
    if measure is None:
        return None
    try:
        skew = measure()
    except Exception:  # a wrapper's broken method must not stop a run
        return None
    if not isinstance(skew, (int, float)) or isinstance(skew, bool):
        return None
    # A Date header has whole seconds: a measured skew this small is noise,
    # and taking it for real would blur every lease by as much.
    return 0.0 if abs(skew) < _SKEW_NOISE else float(skew)
