"""File helpers shared by data preparation, metrics, checkpoints, the trainer and the benchmarks.

Atomicity rule: a file that others read (a checkpoint's JSON, summary.json, metrics.jsonl after a trim, a token
file) is written to `<name>.tmp` next to it, flushed and fsynced, then renamed over the final name, and the parent
directory is fsynced so the rename itself survives a power cut. A crash at any moment leaves the old file or the
new one, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, BinaryIO, Tuple

HASH_BLOCK_BYTES = 16 << 20


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so that renames and new entries inside it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    """`write(f)` into `<path>.tmp`, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def json_bytes(data: Any, indent: int = 1) -> bytes:
    """Strict JSON (NaN and infinity refused, as no JSON reader accepts them), newline-terminated."""
    return (json.dumps(data, indent=indent, allow_nan=False) + "\n").encode()


def atomic_write_json(path: str | Path, data: Any, indent: int = 1) -> None:
    raw = json_bytes(data, indent)
    atomic_write(path, lambda f: f.write(raw))


def write_durable(path: str | Path, raw: bytes) -> Tuple[int, str]:
    """Write `raw` to `path` and fsync it (no rename: for files inside a directory that is itself renamed into
    place); returns (size, sha256 hex)."""
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return len(raw), hashlib.sha256(raw).hexdigest()


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(HASH_BLOCK_BYTES)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(mv[:n])
    return digest.hexdigest()


def free_gib(path: str | Path) -> float:
    """GiB an unprivileged writer may still use on the filesystem holding `path` (for a full-disk message)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**30
