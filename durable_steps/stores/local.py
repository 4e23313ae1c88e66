"""A directory on the local disk: the embedded default store.

Layout. The object ``wf/run/checkpoint`` is a symbolic link
``wf/run/checkpoint -> .v-checkpoint-<token>``, and the file it names holds
the bytes; ``cat wf/run/checkpoint`` prints the checkpoint. Every write makes
a new file under a new random 128-bit *token* and never changes it again.

Versions are unique by construction. A version is
``<token>:<inode>:<mtime_ns>:<size>`` of the file the link names. The token
alone never repeats for a key (nor for any other key): it is fresh random bits
per write, where the old ``inode:mtime_ns:size`` could repeat after a delete
on a filesystem with 1-second timestamps (ext4 with 128-byte inodes) once the
inode was reused, letting a straggler's compare-and-swap succeed over a newer
run. The stat part is there for hand edits: a file changed in place gets a
new version, so a worker notices the repair of a quarantined run.

Reads pair bytes and version exactly. ``get`` reads the link, then opens the
file the link names *by that name* (``O_NOFOLLOW``): the token comes from the
name it opened and the stat part from ``fstat`` of the open file, so both
describe the bytes it reads. A writer that swaps the link meanwhile leaves the
old file in place until after the swap; if the reader's open comes after the
old file is removed, it gets ``ENOENT`` and reads the new link again. A reader
never sees a new link with an old file or the reverse. ``list`` costs a
``readlink`` and a ``stat`` per object, no read; its version is exact unless
the object changes between the two calls, which is all a change detector
needs. A plain file at a key (a checkpoint copied in by hand) reads with an
empty token and is replaced by a link on its next write; a link whose file was
removed by hand reads (and lists) as an empty object, so the run is reported
as corrupt and ``durable-steps rm --force`` removes it.

Writes are atomic and durable: the new file is created in the same directory,
written and fsynced, a link to it is made under a temporary name and renamed
over the key (``rename`` replaces atomically), and the directory is fsynced,
which makes the rename survive a power cut. The file's own fsync precedes the
link and persists its name on the journaling filesystems this runs on (ext4,
XFS, btrfs, APFS), so a durable link never names a missing file. Only then is
the previous file removed; if a crash loses that removal, the file is a stale
leftover. Directories a write creates are fsynced into their parents.

Compare-and-swap across processes on one host: each write holds an exclusive
``flock`` on the object's directory while it checks the current version and
swaps the link. The wait for the lock is bounded (``lock_timeout``): a holder
that is stopped (``SIGSTOP``, a debugger) gives a :class:`StoreError` saying so,
not a hang. A lock belongs to its open file description, which ``fork``
shares, so a child forked while a write holds it (a ``multiprocessing`` pool
started during a heartbeat) would keep it after the parent lets go: the child
closes its copies of the lock descriptors at once (``os.register_at_fork``).

Leftovers of killed writers (a temporary link, a file no link names) are
removed under the lock, when no writer of that directory can be mid-write: on
the first write of each key by this store object (the process that resumes a
crashed run) and when the key is deleted. Later writes by the same object skip
the directory listing, so a write costs what it did.

POSIX only (``fcntl``). Network filesystems with weak ``flock`` (some NFS
setups) do not give the single-writer guarantee: use an S3 store there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointConflict, StoreError
from ._protocol import ObjectInfo

__all__ = ["LocalStore"]

_TEMP_PREFIX = ".tmp-"  # a link not yet renamed over its key
_DATA_PREFIX = ".v-"  # the file a key's link names: ``.v-<name>-<token>``
_PATH_CACHE = 1024  # keys whose validated path is remembered
_READ_TRIES = 20  # a reader outrun by this many writes in a row gives up
_TOKEN_HEX = 32  # hex digits of a data file's token: 128 random bits
_TEMP_HEX = 12
_HEX = frozenset("0123456789abcdef")
DEFAULT_LOCK_TIMEOUT = 30.0

# Descriptors of directories opened for locking. A forked child closes its
# copies at once: a copy would keep the parent's flock alive after the parent
# releases it. The guard makes "open and record" atomic with respect to fork.
_lock_fds: set[int] = set()
_fork_guard = threading.Lock()


def _close_inherited_lock_fds() -> None:
    for fd in list(_lock_fds):
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy only: the parent's lock stays held
    _lock_fds.clear()
    _fork_guard.release()


os.register_at_fork(
    before=_fork_guard.acquire,
    after_in_parent=_fork_guard.release,
    after_in_child=_close_inherited_lock_fds,
)


def _version(link: str | None, st: os.stat_result) -> str:
    token = "" if link is None else link.rpartition("-")[2]
    return f"{token}:{st.st_ino:x}:{st.st_mtime_ns:x}:{st.st_size:x}"


def _readlink(name: str | Path, dir_fd: int | None = None) -> str | None:
    """The link text at ``name``; None for a plain file; FileNotFoundError if absent."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # not a link: a plain file copied in
            return None
        raise


class LocalStore:
    """Checkpoints as files under ``root`` (created on first write).

    ``lock_timeout`` bounds the wait, in seconds, for another writer of the
    same run directory; past it a write raises :class:`StoreError`.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        self.lock_timeout = lock_timeout
        self._paths: dict[str, Path] = {}  # a run writes one key over and over
        self._swept: set[str] = set()  # keys whose leftovers this object removed

    def _path(self, key: str) -> Path:
        path = self._paths.get(key)
        if path is not None:
            return path
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise StoreError(f"{self}: refusing unsafe key {key!r}")
        path = self.root.joinpath(*parts)
        if len(self._paths) >= _PATH_CACHE:
            self._paths.clear()
            self._swept.clear()
        self._paths[key] = path
        return path

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(data, version)`` or ``None``."""
        path = self._path(key)
        try:
            for _ in range(_READ_TRIES):
                try:
                    link = _readlink(path)
                except FileNotFoundError:
                    return None
                try:
                    # O_NOFOLLOW: the file opened is the one ``link`` names (or,
                    # for a plain file, not a link made since), so the version
                    # built from ``link`` and its fstat is that of these bytes.
                    fd = os.open(
                        path if link is None else path.parent / link, os.O_RDONLY | os.O_NOFOLLOW
                    )
                except FileNotFoundError:
                    if link is not None and _readlink_or_none(path) == link:
                        # Its file was removed by hand: an empty object, which the
                        # run reports as corrupt and `rm --force` can remove.
                        return b"", f"{link}:missing"
                    continue  # a writer replaced the link and removed the old file
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    continue  # a plain file became a link meanwhile
                with open(fd, "rb", buffering=0) as f:
                    return f.readall(), _version(link, os.fstat(fd))
            raise StoreError(f"cannot read {path}: it changed {_READ_TRIES} times while read")
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc

    def put(self, key: str, data: bytes, *, match: str | None = None) -> str:
        """Create-only (``match=None``) or compare-and-swap write."""
        path = self._path(key)
        name = path.name
        try:
            with self._locked_dir(path.parent) as dir_fd:
                # Names relative to the locked directory's descriptor: no path
                # walks, and every step acts on the directory we hold the lock of.
                link, current = _current(name, dir_fd)
                if match is None and current is not None:
                    raise CheckpointConflict(f"{path} already exists; another writer created it")
                if match is not None and current != match:
                    raise CheckpointConflict(
                        f"{path} is not at version {match} any more; another writer changed it"
                    )
                if key not in self._swept:
                    _remove_leftovers(dir_fd, name, keep=link)
                    self._swept.add(key)
                version = _write_new(dir_fd, name, data)
                os.fsync(dir_fd)
                if link is not None:
                    # After the fsync: the durable link names the new file now.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(link, dir_fd=dir_fd)
                return version
        except (CheckpointConflict, StoreError):
            raise
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}") from exc

    @contextlib.contextmanager
    def _locked_dir(self, directory: Path) -> Iterator[int]:
        """Hold an exclusive flock on ``directory``, creating it if needed."""
        for _ in range(10):
            try:
                with _fork_guard:
                    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                    _lock_fds.add(fd)
            except FileNotFoundError:  # first write here, or removed by a concurrent delete
                _make_dirs(directory)
                continue
            try:
                self._flock(fd, directory)
                if os.fstat(fd).st_nlink == 0:  # removed while we waited for the lock
                    continue
                yield fd
                return
            finally:
                _lock_fds.discard(fd)
                os.close(fd)  # closing releases the lock
        raise StoreError(f"cannot lock {directory}: it keeps being removed")

    def _flock(self, fd: int, directory: Path) -> None:
        """Take the lock, polling with backoff, for at most ``lock_timeout`` seconds."""
        started = time.monotonic()
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= self.lock_timeout:
                    raise StoreError(
                        f"{directory} is locked by another writer; waited {waited:.1f} s "
                        f"(lock_timeout={self.lock_timeout:g}). A process writing this run "
                        "is stopped or hung (SIGSTOP, a debugger, a stuck disk): continue or "
                        "kill it (`fuser -v` on the directory names it), or raise "
                        "LocalStore(lock_timeout=...)"
                    ) from None
                time.sleep(min(delay, self.lock_timeout - waited))
                delay = min(delay * 2, 0.05)
            else:
                return

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key``, what killed writers left for it, and its directory once empty."""
        path = self._path(key)
        try:
            with self._locked_dir(path.parent) as dir_fd:
                _, current = _current(path.name, dir_fd)
                if match is not None and current is not None and current != match:
                    raise CheckpointConflict(
                        f"{path} is not at version {match} any more; not deleted"
                    )
                # The link first, then its file: a reader that read the link just
                # before finds the file gone and the link gone with it (absent),
                # never a link naming a missing file.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path.name, dir_fd=dir_fd)
                _remove_leftovers(dir_fd, path.name, keep=None)
                os.fsync(dir_fd)
                self._swept.discard(key)
                with contextlib.suppress(OSError):  # not empty, or already gone
                    os.rmdir(path.parent)
        except CheckpointConflict:
            raise
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc}") from exc

    def sweep(self, prefix: str) -> None:
        """Remove what killed writers left in the directory ``prefix`` names
        (``wf/run/parts/``): temporary links, and data files no key's link
        names — the files of a key that never became visible, which no
        ``list`` shows and so no ``delete`` reaches. Then the directory, and
        its parent, if that left them empty. Under the directory's lock, so no
        writer of it is mid-write. ``rm``, ``prune`` and a run's tombstone call
        it after deleting what ``list`` shows there.
        """
        directory = self._path(prefix.rstrip("/"))
        if not directory.is_dir():  # its last object's delete removed it: its parent may be empty
            with contextlib.suppress(OSError):
                os.rmdir(directory.parent)
            return
        try:
            with self._locked_dir(directory) as dir_fd:
                for entry in os.listdir(dir_fd):
                    for head in (_TEMP_PREFIX, _DATA_PREFIX):
                        name = entry[len(head) :].rpartition("-")[0]
                        if entry.startswith(head) and _is_leftover(
                            entry, name, keep=_readlink_or_none(name, dir_fd)
                        ):
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry, dir_fd=dir_fd)
                os.fsync(dir_fd)
            for level in (directory, directory.parent):
                os.rmdir(level)
        except OSError as exc:
            if not isinstance(exc, (FileNotFoundError, NotADirectoryError)) and exc.errno not in (
                errno.ENOTEMPTY,
                errno.EEXIST,
            ):
                raise StoreError(f"cannot sweep {directory}: {exc}") from exc

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield the objects whose keys start with ``prefix``, in key order.

        A prefix whose folders would leave the store (``..``, an absolute path)
        or enter a hidden folder is refused, as an unsafe key is: the prefix
        may come from a caller's input (a page's filter), and walking it would
        list files that are not the store's.
        """
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        last = prefix.rsplit("/", 1)[-1]
        folders = base.split("/") if base else []
        if (
            "\0" in prefix
            or last in (".", "..")
            or any(p in ("", ".", "..") or p.startswith(".") for p in folders)
        ):
            raise StoreError(f"{self}: refusing unsafe prefix {prefix!r}")
        top = self.root.joinpath(*base.split("/")) if base else self.root
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in sorted(filenames):
                key = name if rel == "." else f"{rel}/{name}"
                if name.startswith(".") or not key.startswith(prefix):
                    continue
                found = _stat_object(Path(dirpath, name))
                if found is not None:
                    version, st = found
                    size = 0 if version.endswith(":missing") else st.st_size
                    yield ObjectInfo(key, version, size, st.st_mtime_ns / 1e9)

    def clock_skew(self) -> float:
        """0.0: the store's clock is this host's."""
        return 0.0

    def close(self) -> None:
        """Nothing to release."""

    @property
    def url(self) -> str:
        """The path that opens this store again (``--store``, ``store=``)."""
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"


def _write_new(dir_fd: int, name: str, data: bytes) -> str:
    """Write ``data`` to a new file in ``dir_fd``, point ``name`` at it; return the version."""
    # One draw for both names (a system call each otherwise): the temporary
    # link's name is random to never meet a killed writer's, not secret.
    random = secrets.token_hex((_TOKEN_HEX + _TEMP_HEX) // 2)
    link = f"{_DATA_PREFIX}{name}-{random[:_TOKEN_HEX]}"
    temp = f"{_TEMP_PREFIX}{name}-{random[_TOKEN_HEX:]}"
    fd = os.open(link, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
    try:
        written = os.write(fd, data)
        if written < len(data):  # short write (huge objects): finish without copying
            view = memoryview(data)[written:]
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        # After fsync: nothing changes the stat fields of the version any more.
        version = _version(link, os.fstat(fd))
        os.symlink(link, temp, dir_fd=dir_fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        # Asked, not assumed: an interrupt may land just after the swap, and
        # then ``link`` is the checkpoint, not a leftover.
        with contextlib.suppress(OSError):
            if _readlink_or_none(name, dir_fd) != link:
                os.unlink(link, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)
    return version


def _current(name: str, dir_fd: int) -> tuple[str | None, str | None]:
    """The link text at ``name`` and its version, under the directory's lock.

    ``(None, None)`` when absent. A link whose file is gone (changed by hand)
    has a version no writer can match; deleting it works.
    """
    try:
        link = _readlink(name, dir_fd)
    except FileNotFoundError:
        return None, None
    except NotADirectoryError as exc:
        raise StoreError(f"{name}: a parent is not a directory") from exc
    try:
        st = os.stat(name if link is None else link, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return link, f"{link}:missing"
    return link, _version(link, st)


def _readlink_or_none(name: str | Path, dir_fd: int | None = None) -> str | None:
    """Like :func:`_readlink`, with None also when ``name`` is absent."""
    with contextlib.suppress(FileNotFoundError):
        return _readlink(name, dir_fd)
    return None


def _stat_object(path: Path) -> tuple[str, os.stat_result] | None:
    """Version and stat of the object at ``path``; None if it is gone."""
    for _ in range(_READ_TRIES):
        try:
            link = _readlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.stat(path if link is None else path.parent / link, follow_symlinks=False)
        except FileNotFoundError:
            if link is None or _readlink_or_none(path) != link:
                continue  # swapped by a writer between the two calls
            try:  # a link whose file was removed by hand: listed, as an empty object
                return f"{link}:missing", os.lstat(path)
            except FileNotFoundError:
                return None
        return _version(link, st), st
    return None


def _is_leftover(entry: str, name: str, keep: str | None) -> bool:
    """Whether ``entry`` is a temporary link or data file of ``name`` other than ``keep``.

    The random tail is matched exactly, so the files of key ``x-1`` are never
    taken for those of key ``x``.
    """
    if entry == keep:
        return False
    for prefix, tail in ((_TEMP_PREFIX, _TEMP_HEX), (_DATA_PREFIX, _TOKEN_HEX)):
        head = f"{prefix}{name}-"
        rest = entry[len(head) :]
        if entry.startswith(head) and len(rest) == tail and all(c in _HEX for c in rest):
            return True
    return False


def _remove_leftovers(dir_fd: int, name: str, *, keep: str | None) -> None:
    """Under the lock: remove temporary links and unnamed data files of ``name``."""
    for entry in os.listdir(dir_fd):
        if _is_leftover(entry, name, keep):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=dir_fd)


def _make_dirs(directory: Path) -> None:
    """Create ``directory`` and missing parents, each fsynced into its parent."""
    missing: list[Path] = []
    level = directory
    while not level.is_dir():
        missing.append(level)
        level = level.parent
    for level in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent writer made it
            level.mkdir()
        # Also when another writer made it: our write must not outlive it.
        fd = os.open(level.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
