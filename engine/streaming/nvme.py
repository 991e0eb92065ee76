"""The NVMe tier: Adam moments of host-updated units in a file on a local disk instead of host RAM.

When host RAM cannot hold the fp32 training state, the planner may put the m and v of the last N host-updated decoder
layers (`engine.nvme_units`; `hardware.nvme_dir`, `hardware.nvme_gib`) in one file. The master weights stay in RAM
(every forward streams them to the GPU), so each such unit costs 4 instead of 12 bytes per parameter of host RAM;
the disk holds 8.

Layout: unit by unit, m then v, each region padded to 4 KiB, so one unit is two sequential reads and two sequential
writes per step. The file is preallocated (`posix_fallocate`: a full disk is refused before training starts) and
removed at the end of the run; it is scratch, not a checkpoint (checkpoints read the moments back from it). A run
killed before it could remove its file leaves it behind. Each run holds an flock on its own file for the file's
life, so the next run with the same directory deletes only files whose process is gone from this machine and whose
lock it can take (`remove_stale_files`; a live run of another machine sharing the disk keeps its file), and says so
in its log.

Pipeline (the host optimizer pass, engine/streaming/engine.py): three page-aligned staging buffers, each the size of
the largest disk unit's m + v, rotate over the disk units in update order. While unit k is updated, unit k+1 is read
into the next buffer and unit k-1 is written back from the previous one; a buffer is reused for unit k+3 only after
unit k's write has finished. Reads and writes run on two I/O threads (the GIL is released during preadv/pwritev),
so the disk works while the CPU runs AdamW. Host RAM for the tier: 3 x 8 bytes x the largest unit's parameters.

Page cache: with `hardware.nvme_direct_io=true` (default) the file is opened with O_DIRECT and the kernel copies
straight between the disk and the staging buffers, so streaming tens of GB per step does not grow the page cache
(and evict what the run needs). Filesystems without O_DIRECT (tmpfs, some overlays) refuse it at open: the run
stops with an error that names `hardware.nvme_direct_io=false`, which uses buffered I/O and, after each unit's
write, fdatasync + POSIX_FADV_DONTNEED to drop the unit's pages again (one flush per unit and step).

I/O accounting: every read and write adds its bytes and its seconds (wall time of the preadv / pwritev calls, the
flushes of buffered mode included) to per-direction totals; `take_io_stats` returns and resets them, so the engine
logs each optimizer pass's disk traffic and the bandwidth achieved while the disk was busy (`nvme_read_gbps`,
`nvme_write_gbps`), the figure to hold against `hardware.nvme_gbps`.

Failures stop the run with `NvmeError` naming the file, the unit and the OS error: a full disk, an I/O error, or the
file removed under the run (checked once per optimizer pass; an unlinked file would otherwise keep working until the
run ends and then vanish). The run's last checkpoint is untouched by any of this and resumes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from engine.fileio import free_gib

ALIGN_BYTES = 4096  # O_DIRECT: buffer address, file offset and length multiples of the logical block size
IO_CHUNK_BYTES = 256 << 20  # one preadv / pwritev call moves at most this much
STAGING_BUFFERS = 3


class NvmeError(RuntimeError):
    """The NVMe tier cannot go on; the message names the file, the unit and the cause."""


FILE_PREFIX = "streamtrain-moments-"


def remove_stale_files(directory: str) -> List[Path]:
    """Delete tier files left in `directory` by runs that died without closing (SIGKILL, a machine reset): those
    whose owning process (the pid in the name) does not exist on this machine and whose lock (every MomentFile holds
    an flock on its file for its life) can be taken. The lock is what protects a live run of another machine on a
    shared disk, whose pid means nothing here; the kernel drops it when its process dies. Returns what was
    removed."""
    removed = []
    for path in Path(directory).expanduser().glob(f"{FILE_PREFIX}*.bin"):
        pid = path.name[len(FILE_PREFIX):].split("-")[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        try:
            fd = os.open(path, os.O_RDWR)  # read-write: an exclusive lock over NFS needs a writable descriptor
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
            removed.append(path)
        except OSError:  # locked: its run is alive elsewhere (or it was removed meanwhile)
            pass
        finally:
            os.close(fd)
    return removed


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _aligned_empty(numel: int) -> torch.Tensor:
    """An fp32 CPU tensor of `numel` elements whose first byte is ALIGN_BYTES-aligned."""
    raw = torch.empty(numel + ALIGN_BYTES // 4, dtype=torch.float32)
    skip = (-raw.data_ptr() % ALIGN_BYTES) // 4
    return raw[skip:skip + numel]


def nvme_layers(n_units: int, first_host_unit: int, n: int) -> List[int]:
    """The units whose moments `engine.nvme_units=n` puts on disk: the last n host-updated decoder layers (units
    first_host_unit.. of the embedding, the layers and the head; the head, the largest unit, stays in RAM)."""
    layers = list(range(max(first_host_unit, 1), n_units - 1))
    return layers[len(layers) - n:] if n else []


def file_bytes(numels: List[int]) -> int:
    """Disk bytes of the tier for units of these flat sizes (fp32 m and v, each padded)."""
    return sum(2 * _padded(4 * n) for n in numels)


def _no_io() -> Dict[str, list]:
    """Per-direction I/O totals, empty: direction -> [bytes, seconds]."""
    return {"read": [0, 0.0], "write": [0, 0.0]}


class MomentFile:
    def __init__(self, directory: str, numels: Dict[int, int], direct_io: bool):
        """`numels`: unit index -> flat numel of the units whose moments live here (in update order)."""
        self.units = list(numels)
        self.numels = dict(numels)
        self.direct_io = direct_io
        self.offsets: Dict[int, int] = {}
        offset = 0
        for u in self.units:
            self.offsets[u] = offset
            offset += 2 * _padded(4 * numels[u])
        self.size = offset
        directory_path = Path(directory).expanduser()
        if not directory_path.is_dir():
            raise NvmeError(f"hardware.nvme_dir={directory}: not a directory")
        self.stale_removed = remove_stale_files(directory)
        self.path = directory_path / f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct_io else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            hint = (" (this filesystem does not support O_DIRECT: set hardware.nvme_direct_io=false for buffered I/O "
                    "that drops its pages after each write)" if direct_io and e.errno == errno.EINVAL else "")
            raise NvmeError(f"cannot create the NVMe tier file {self.path}: {e.strerror}{hint}") from e
        try:  # held until `_remove`: `remove_stale_files` of other runs leaves a locked file alone
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(self.fd).st_nlink == 0:
                raise FileNotFoundError(errno.ENOENT, "removed while it was being created")
        except OSError as e:
            self._remove()
            raise NvmeError(f"cannot lock the NVMe tier file {self.path}: {e.strerror} (another run's cleanup of "
                            f"hardware.nvme_dir={directory} took it as stale; start the run again)") from e
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as e:
            self._remove()
            raise NvmeError(f"hardware.nvme_dir={directory}: cannot reserve {self.size / 2**30:.2f} GiB for the "
                            f"moments of {len(self.units)} units ({e.strerror}); {free_gib(directory_path):.2f} GiB "
                            "are free there. "
                            "Free space, lower engine.nvme_units, or point hardware.nvme_dir at a larger disk") from e
        largest = max(numels.values())
        self.staging = [_aligned_empty(2 * _padded(4 * largest) // 4) for _ in range(STAGING_BUFFERS)]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-io")
        self._reads: Dict[int, Future] = {}
        self._writes: Dict[int, Future] = {}  # buffer index -> its pending write
        self._buffer_of: Dict[int, int] = {}
        self._next_buffer = 0
        self._io_lock = threading.Lock()  # the two I/O threads add to the totals
        self._io = _no_io()  # direction -> [bytes, seconds] since take_io_stats

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.staging)

    # ---- raw I/O on one unit ------------------------------------------------------------------------------------
    def _views(self, unit: int, buf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        n, region = self.numels[unit], _padded(4 * self.numels[unit]) // 4
        return buf[:n], buf[region:region + n]

    def _transfer(self, unit: int, buf: torch.Tensor, write: bool) -> None:
        nbytes = 2 * _padded(4 * self.numels[unit])
        mem = memoryview(buf.numpy()).cast("B")[:nbytes]
        offset, done = self.offsets[unit], 0
        op = "writing" if write else "reading"
        start = time.perf_counter()
        try:
            while done < nbytes:
                part = mem[done:done + IO_CHUNK_BYTES]
                n = os.pwritev(self.fd, [part], offset + done) if write else os.preadv(self.fd, [part], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"{'pwritev' if write else 'preadv'} moved {n} bytes")
                done += n
            if write and not self.direct_io:
                os.fdatasync(self.fd)
                os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            elif not self.direct_io:
                os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise NvmeError(f"NVMe tier: {op} the Adam moments of unit {unit} ({nbytes / 2**20:.1f} MiB at offset "
                            f"{offset}) in {self.path} failed: {e.strerror or e}") from e
        with self._io_lock:
            total = self._io["write" if write else "read"]
            total[0] += nbytes
            total[1] += time.perf_counter() - start

    def take_io_stats(self) -> Dict[str, float]:
        """Bytes moved (GB), busy seconds and achieved GB/s per direction since the last call; resets the totals.
        Keys: nvme_{read,write}_gb, nvme_{read,write}_s, nvme_{read,write}_gbps (absent without traffic)."""
        with self._io_lock:
            io, self._io = self._io, _no_io()
        stats: Dict[str, float] = {}
        for direction, (nbytes, seconds) in io.items():
            if nbytes:
                stats.update({f"nvme_{direction}_gb": nbytes / 1e9, f"nvme_{direction}_s": seconds,
                              f"nvme_{direction}_gbps": nbytes / 1e9 / seconds if seconds > 0 else float("inf")})
        return stats

    def staging_views(self, unit: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(m, v) views of the first staging buffer at `unit`'s sizes: placeholders to build an optimizer over."""
        return self._views(unit, self.staging[0])

    # ---- the optimizer pass's pipeline --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if the file was removed under the run (once per optimizer pass)."""
        try:
            links = os.fstat(self.fd).st_nlink
        except OSError as e:
            raise NvmeError(f"NVMe tier file {self.path}: {e.strerror}") from e
        if links == 0:
            raise NvmeError(f"the NVMe tier file {self.path} was removed while the run used it; the Adam moments "
                            "of the units it held are gone from disk. Resume from the last checkpoint")

    def prefetch(self, unit: int) -> None:
        """Start reading `unit` into the next staging buffer (once that buffer's pending write has finished)."""
        if unit in self._reads:
            return
        b = self._next_buffer
        self._next_buffer = (b + 1) % STAGING_BUFFERS
        self._buffer_of[unit] = b
        previous_write = self._writes.pop(b, None)

        def read() -> None:
            if previous_write is not None:
                previous_write.result()
            self._transfer(unit, self.staging[b], write=False)

        self._reads[unit] = self._pool.submit(read)

    def acquire(self, unit: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(m, v) of `unit` in its staging buffer, once read."""
        self.prefetch(unit)
        self._reads.pop(unit).result()
        return self._views(unit, self.staging[self._buffer_of[unit]])

    def release(self, unit: int) -> None:
        """Write `unit`'s (updated) moments back from its staging buffer, in the background."""
        b = self._buffer_of.pop(unit)
        self._writes[b] = self._pool.submit(self._transfer, unit, self.staging[b], True)

    def drain(self) -> None:
        """Wait for every pending write (and read); the first failure is raised."""
        pending = list(self._reads.values()) + list(self._writes.values())
        self._writes.clear()
        for f in pending:
            f.result()
        for unit in list(self._reads):
            self._buffer_of.pop(unit, None)
        self._reads.clear()

    # ---- whole-unit access outside the pass (checkpoints, tests) -------------------------------------------------
    def read_copy(self, unit: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fresh CPU copies of `unit`'s m and v (between optimizer passes)."""
        m, v = self.acquire(unit)
        out = (m.clone(), v.clone())
        self._buffer_of.pop(unit)
        return out

    def _remove(self) -> None:
        """Unlink the file, then close it: the lock is held until the file is gone."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)
            self._remove()
