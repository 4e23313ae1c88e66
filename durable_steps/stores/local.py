"""A directory on the local disk: the embedded default store.

Writes are atomic and durable: the bytes go to a temporary file *in the same
directory* (so the rename cannot cross filesystems), which is fsynced,
renamed over the target with ``os.replace``, after which the directory is
fsynced so the rename itself survives a power cut. A reader therefore sees
the old checkpoint or the new one, never half of either.

Compare-and-swap across processes on one host: each write holds an exclusive
``flock`` on the object's directory while it checks the current version and
renames. A version is the object's ``inode:mtime_ns:size``; to make it unique
over the object's whole history (an inode number can be reused as soon as the
old file is gone), each write stamps its file with an mtime strictly greater
than the one it replaces. Checking a version therefore costs one ``stat``,
never a read of the file.

POSIX only (``fcntl``). Network filesystems with weak ``flock`` (some NFS
setups) do not give the single-writer guarantee: use an S3 store there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointConflict, StoreError
from ._protocol import ObjectInfo

__all__ = ["LocalStore"]

_TEMP_PREFIX = ".tmp-"
_PATH_CACHE = 1024  # keys whose validated path is remembered


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino:x}:{st.st_mtime_ns:x}:{st.st_size:x}"


class LocalStore:
    """Checkpoints as files under ``root`` (created on first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self._paths: dict[str, Path] = {}  # a run writes one key over and over

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
        self._paths[key] = path
        return path

    def get(self, key: str) -> tuple[bytes, str] | None:
        """Return ``(data, version)`` or ``None``."""
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                # fstat of the open file: the version of exactly the bytes read,
                # even if a writer renames a new file over the path meanwhile.
                return f.readall(), _version(os.fstat(f.fileno()))
        except FileNotFoundError:
            return None
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
                current = _stat_or_none(path, name, dir_fd)
                if match is None and current is not None:
                    raise CheckpointConflict(f"{path} already exists; another writer created it")
                if match is not None and (current is None or _version(current) != match):
                    raise CheckpointConflict(
                        f"{path} is not at version {match} any more; another writer changed it"
                    )
                version = self._write_new(dir_fd, name, data, current)
                os.fsync(dir_fd)
                return version
        except (CheckpointConflict, StoreError):
            raise
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}") from exc

    def _write_new(
        self, dir_fd: int, name: str, data: bytes, current: os.stat_result | None
    ) -> str:
        """Write ``data`` to a temporary file in ``dir_fd``, stamp, fsync, rename over ``name``."""
        temp = f"{_TEMP_PREFIX}{name}-{secrets.token_hex(6)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
        try:
            written = os.write(fd, data)
            if written < len(data):  # short write (huge objects): finish without copying
                view = memoryview(data)[written:]
                while view:
                    view = view[os.write(fd, view) :]
            floor = current.st_mtime_ns if current is not None else 0
            stamp = max(time.time_ns(), floor + 1)
            os.utime(fd, ns=(stamp, stamp))
            st = os.fstat(fd)
            if st.st_mtime_ns <= floor:  # a filesystem with coarse timestamps
                os.utime(fd, ns=(floor + 1_000_000_000, floor + 1_000_000_000))
                st = os.fstat(fd)
                if st.st_mtime_ns <= floor:
                    raise StoreError(f"{self.root}: this filesystem cannot order file versions")
            # fsync changes no attribute the version is made of, so ``st``
            # (taken before it) is the version of what lands.
            os.fsync(fd)
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
        return _version(st)

    @contextlib.contextmanager
    def _locked_dir(self, directory: Path) -> Iterator[int]:
        """Hold an exclusive flock on ``directory``, creating it if needed."""
        for _ in range(10):
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:  # first write here, or removed by a concurrent delete
                directory.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_nlink == 0:  # removed while we waited for the lock
                    continue
                yield fd
                return
            finally:
                os.close(fd)  # closing releases the lock
        raise StoreError(f"cannot lock {directory}: it keeps being removed")

    def delete(self, key: str, *, match: str | None = None) -> None:
        """Remove ``key``, temporary files a killed writer left for it, and
        its directory once empty.
        """
        path = self._path(key)
        try:
            with self._locked_dir(path.parent) as dir_fd:
                current = _stat_or_none(path, path.name, dir_fd)
                if match is not None and current is not None and _version(current) != match:
                    raise CheckpointConflict(
                        f"{path} is not at version {match} any more; not deleted"
                    )
                # Temporary files a killed writer left behind go with the object.
                leftovers = [
                    n for n in os.listdir(dir_fd) if n.startswith(f"{_TEMP_PREFIX}{path.name}-")
                ]
                for name in [path.name, *leftovers]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
                os.fsync(dir_fd)
                with contextlib.suppress(OSError):  # not empty, or already gone
                    os.rmdir(path.parent)
        except CheckpointConflict:
            raise
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc}") from exc

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield the objects whose keys start with ``prefix``, in key order."""
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.root.joinpath(*base.split("/")) if base else self.root
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in sorted(filenames):
                key = name if rel == "." else f"{rel}/{name}"
                if name.startswith(".") or not key.startswith(prefix):
                    continue
                st = _stat_or_none(Path(dirpath, name), name, None)
                if st is not None:
                    yield ObjectInfo(key, _version(st), st.st_size, st.st_mtime_ns / 1e9)

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"


def _stat_or_none(path: Path, name: str, dir_fd: int | None) -> os.stat_result | None:
    """Stat ``name`` in ``dir_fd`` (or ``path`` when ``dir_fd`` is None); None if missing."""
    try:
        return os.stat(name if dir_fd is not None else path, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except NotADirectoryError as exc:
        raise StoreError(f"{path}: a parent is not a directory") from exc
