"""One training run at a time per run dir and per checkpoint root: an exclusive lock held for the run's life.

The lock of a directory is `fcntl.flock` on `<dir>/.streamtrain.lock`, a file holding the holder's JSON {pid, host,
started}, read back to name the holder when a second run is refused. flock rather than the `filelock` library
(installed with torch): the lock file must carry the holder's identity, written through the descriptor that holds
the lock, and its removal must follow the protocol below; filelock hides both behind its own file handling.

The kernel drops a flock when its process dies (SIGKILL, a machine reset on a network filesystem whose server
reclaims the client's locks), so a lock whose holder is gone is free: it is taken over, and the file's previous
JSON names the run that left it. A clean release removes the file while still holding the lock; a run that
opened the file just before the removal finds, once it holds the lock, that the path no longer names its file
(another inode or none) and starts over.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Callable, Optional

from engine.checkpoint.common import CheckpointError
from engine.fileio import json_bytes

LOCK_NAME = ".streamtrain.lock"


class LockHeld(CheckpointError):
    """Another live process holds the lock; the message names its pid and host."""


def holder_of(fd: int) -> Optional[dict]:
    """The JSON a lock file holds, or None (empty: its holder has not written it yet; or not ours)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(holder: Optional[dict]) -> str:
    if holder is None:
        return "a process that has not written its pid yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"


class DirLock:
    """The lock of one directory, held until `release`."""

    def __init__(self, directory: Path, field: str, log: Callable[[str], None] = print):
        """Take the lock of `directory` (created if missing) or raise LockHeld; `field` names the config key that
        chose the directory, for the messages."""
        self.path = Path(directory) / LOCK_NAME
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = holder_of(fd)
                os.close(fd)
                raise LockHeld(f"{field}={directory}: in use by another run, {describe(holder)}. Wait for it to "
                               f"end, or choose another {field}") from None
            if self._still_named(fd):
                break
            os.close(fd)  # released and removed between our open and our lock: try again
        self.fd = fd
        previous = holder_of(fd)
        if previous is not None:
            log(f"{field}={directory}: taking over the lock left by {describe(previous)}, a run that ended without "
                "releasing it")
        mine = json_bytes({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine, 0)
        os.fsync(fd)

    def _still_named(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Remove the lock file, then drop the lock (idempotent)."""
        if self.fd < 0:
            return
        try:
            if self._still_named(self.fd):
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = -1
