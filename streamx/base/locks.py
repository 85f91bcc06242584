"""One writer at a time: an OS lock on a file beside what is written (a store's part, a convert folder).

Two processes writing one part tear its shards (a double launch of the same command is the usual
way). The lock is `fcntl.flock`, which the kernel drops when its process ends, however it ends: a
killed run never blocks its re-run. The file holds who took it, for the refusal's message. Its name is
predictable and its folder may be others' to write: a lock file that is a symlink, a hard link or no plain
file is refused, never written through, and one another user owns is locked but not rewritten. Object
stores have no such lock: one writer per part is then the user's to keep (torchrun ranks write
their own parts). On network filesystems flock is as good as the mount's lock support.

The lock file sits beside the folder it guards (`.NAME.streamx-lock`), not in it: a folder's own checks
and --overwrite then never meet it. Where the folder's parent is not ours to write (a store at a
filesystem's mount root), it sits inside the folder (`.streamx-lock`), at the top, where zarr does not
list it, and every check and --overwrite of the folder passes it over (`is_lock`).

A command leaves no lock file behind, however it ends but killed: its holder removes it on release, while still
holding it. A process that opened the file just before is refused while it is held, and once it gets the lock
finds the file no longer at the path and takes the one there now (a new file, which one process alone locks).

flock is not everywhere a lock: on Lustre mounted with localflock, BeeGFS and NFS without locks it
succeeds on every node alike, and object stores have none. The store's writers fence themselves as
well (pipeline.writer: each commit names its writer, and a writer that finds another's commit stops).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import sys
import time
import warnings
from pathlib import Path

from .durable import KEPT as INSIDE  # the name a lock inside its folder begins with
from .durable import make_dirs

_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOLCK}  # flock not offered by the filesystem


class LockedError(RuntimeError):
    """Another process holds the lock; the message names it."""


class Lock:
    """An exclusive lock on `path`, taken at once or refused; released by `release()`, on leaving a `with`
    block, or when this process ends. A release removes the lock file (this user's, while it is still held), and
    a process taking the lock checks that its file is still the one at `path`."""

    def __init__(self, path: Path, what: str):
        self.path, self.fd, self.held, self.pid = path, None, False, os.getpid()
        for _ in range(100):  # a file its holder removed between our open and our flock: open the new one
            self._take(what)
            if not self.held or self._is_current():
                return
            self._close()
        raise LockedError(f"{what} is being locked by other processes, again and again; wait for them to end, then "
                          "run again")

    def _is_current(self) -> bool:
        try:
            return os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def _take(self, what: str) -> None:
        path = self.path
        try:
            make_dirs(path.parent)
            self.fd = _open(path)
        except OSError as err:
            raise OSError(f"cannot lock {what} ({path}): {err.strerror or err}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in _UNSUPPORTED:  # e.g. Lustre mounted without -o flock: run, but say so
                warnings.warn(f"{path}: this filesystem has no flock ({err.strerror}); nothing stops a second "
                              f"process writing {what}", stacklevel=2)
                return
            if not isinstance(err, BlockingIOError):
                self._close()
                raise OSError(f"cannot lock {what} ({path}): {err.strerror or err}") from None
            holder = os.pread(self.fd, 1024, 0).decode(errors="replace").strip() or "a process that did not say"
            self._close()
            raise LockedError(f"{what} is being written by another process ({holder}); wait for it to end or stop "
                              "it, then run again") from None
        self.held = True
        if os.fstat(self.fd).st_uid == os.geteuid():  # another user's file is locked as it is, never rewritten
            _write_holder(self.fd)

    def release(self) -> None:
        if self.fd is not None:
            if self._removable():
                self.path.unlink(missing_ok=True)  # while held: whoever locks this file next finds it gone
            self._close()  # closing the last descriptor drops the flock

    def _removable(self) -> bool:
        """Whether the file at `path` is this lock's own to remove: flocked here (not where flock is missing,
        nor in a forked child, whose parent still holds it), this user's, and still the file at the path."""
        return self.held and os.getpid() == self.pid and os.fstat(self.fd).st_uid == os.geteuid() \
            and self._is_current()

    def _close(self) -> None:
        """Give up the descriptor, and with it the lock where it was taken; the file stays."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd, self.held = None, False

    def __del__(self) -> None:  # a lock no one holds any more is given back, as its process's end would
        self.release()

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open(path: Path) -> int:
    """The lock file's descriptor, the file created when missing. Its name is predictable and may sit in a folder
    others write: a symlink (followed, even dangling, it would create or write another file), a hard link (the
    same file as another name) or anything but a plain file is refused, never opened for writing into."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EISDIR):
            raise _planted("a symlink" if err.errno == errno.ELOOP else "a folder") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise _planted("not a regular file" if not stat.S_ISREG(info.st_mode)
                       else f"a file with {info.st_nlink} names (hard links)")
    return fd


def _planted(what: str) -> OSError:
    """The refusal, one line after the path that `_take` names: what is there, and what to do."""
    return OSError(f"it is {what}, not a lock file streamx made, and streamx will not write through it; remove it "
                   "and run again")


def _write_holder(fd: int) -> None:
    """Who holds the lock, for a refused process's message."""
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200] if sys.argv else "python"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {command}\n".encode(), 0)


def lock_file(folder: str | Path, part: str = "") -> Path:
    """The lock file of `folder` (a part of it, when `part` is given): beside it, or, where its parent is not
    ours to write (a store at a filesystem's mount root), inside it."""
    folder = Path(folder).resolve()
    suffix = f"-{part}" if part else ""
    if folder.parent.exists() and not os.access(folder.parent, os.W_OK):
        return folder / f"{INSIDE}{suffix}"
    return folder.parent / f".{folder.name}.streamx-lock{suffix}"


def is_lock(name: str) -> bool:
    """Whether a file in a folder is a lock inside it (`lock_file`'s fallback)."""
    return name.startswith(INSIDE)
