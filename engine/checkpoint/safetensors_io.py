"""safetensors files (an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw tensors): reading through the `safetensors` library, writing with an own streaming writer.

Reading: `SafetensorsFile` opens a file with `safetensors.safe_open(..., framework="pt", backend="pread")`, which
checks the whole header against the file on open (header length, JSON, dtypes, offsets that tile the data section
exactly up to the end of the file), so a truncated file or a corrupt header is refused before any weight is read.
The library's `SafetensorError` is turned into a CheckpointError that names the file and says what is wrong in
plain words (truncated, corrupt header), with the library's own text after it. The pread backend reads each tensor
with pread(2) into one freshly allocated tensor: no mmap, so the file's pages are not mapped into (and charged to)
the process, and a read costs exactly one tensor of host memory in the file's dtype. The backend needs
safetensors >= 0.8.

Writing: `write_safetensors` is our own because it streams and hashes in the same pass: each tensor is produced
by a callable only when its turn comes, copied to the host if it lives elsewhere, written in 64 MiB pieces and
dropped, while sha256 runs over the same bytes on a worker thread (hashlib and file writes both release the GIL).
The library's writers take a complete dict of tensors and return no hash, which would mean holding a unit (or a
5 GiB shard) at once and reading every file back to checksum it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from safetensors import SafetensorError, safe_open

from engine.checkpoint.common import CheckpointError

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
WRITE_CHUNK_BYTES = 64 << 20
HASH_INLINE_BYTES = 1 << 20  # pieces smaller than this are hashed on the writing thread: a handoff costs more

# What the library's messages mean for someone holding the file; anything else is passed on verbatim.
LIBRARY_MESSAGES = (
    ("header too small", "truncated: too short to be a safetensors file"),
    ("invalid header length", "truncated or not a safetensors file: its header length does not fit the file"),
    ("header too large", "not a safetensors file: its header length is over 100 MB"),
    ("file not fully covered", ("truncated (or has bytes appended): the tensors its header lists do not span "
                                "the file exactly")),
    ("fill whole buffer", "truncated while a tensor was read"),
    ("deserializing header", "corrupt safetensors header"),
)


def library_error(path: Path, err: SafetensorError) -> CheckpointError:
    text = str(err)
    meaning = next((m for key, m in LIBRARY_MESSAGES if key in text), "not a readable safetensors file")
    return CheckpointError(f"{path}: {meaning} (safetensors: {text})")


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class TensorInfo:
    """A tensor as the header describes it."""
    dtype: str  # safetensors code, e.g. "BF16"
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(ST_DTYPES[self.dtype])


class SafetensorsFile:
    """A safetensors file open for reading: `entries` (name -> TensorInfo) and `metadata` come from the header,
    validated on open; `get` reads one tensor. Every failure is a CheckpointError naming the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stack = ExitStack()
        try:
            self._file = self._stack.enter_context(safe_open(self.path, framework="pt", backend="pread"))
        except SafetensorError as e:
            raise library_error(self.path, e) from None
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: missing") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot be opened as a safetensors file ({e})") from None
        self.metadata: Dict[str, str] = self._file.metadata() or {}
        self.entries: Dict[str, TensorInfo] = {}
        for name in self._file.keys():
            view = self._file.get_slice(name)
            self.entries[name] = TensorInfo(view.get_dtype(), tuple(view.get_shape()))

    def keys(self) -> List[str]:
        return list(self.entries)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: no tensor named {name}")
        try:
            return self._file.get_tensor(name)
        except SafetensorError as e:
            raise library_error(self.path, e) from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Readers:
    """Open SafetensorsFile handles by path, for the duration of an import or export."""

    def __init__(self):
        self.open: Dict[Path, SafetensorsFile] = {}

    def __call__(self, path: Path) -> SafetensorsFile:
        if path not in self.open:
            self.open[path] = SafetensorsFile(path)
        return self.open[path]

    def close(self) -> None:
        for r in self.open.values():
            r.close()
        self.open.clear()


class LazyTensors(Mapping):
    """name -> tensor, produced by `fetch(name)` only when asked for and not kept: lets `engine.load_unit_state`
    pull one tensor at a time from a file, and an exporter produce one tensor at a time."""

    def __init__(self, names: Sequence[str], fetch: Callable[[str], torch.Tensor]):
        self._names, self._fetch = list(names), fetch

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._fetch(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# an item to write: (name, dtype, shape, tensor or zero-argument callable producing it)
WriteItem = Tuple[str, torch.dtype, Tuple[int, ...], Any]


def write_safetensors(path: str | Path, items: Sequence[WriteItem], metadata: Optional[Dict[str, str]] = None
                      ) -> Tuple[int, str]:
    """Write a safetensors file tensor by tensor (each produced, written and dropped in turn), fsync it, return
    (bytes, sha256 hex). Tensors may live on any device; a non-CPU one is copied to the host one at a time."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, _ in items:
        n = math.prod(shape) * itemsize(dtype)
        header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        def put(piece) -> None:
            nonlocal size
            if len(piece) < HASH_INLINE_BYTES:
                digest.update(piece)
                f.write(piece)
            else:
                pending = hasher.submit(digest.update, piece)
                f.write(piece)
                pending.result()
            size += len(piece)

        put(struct.pack("<Q", len(header_bytes)))
        put(header_bytes)
        for name, dtype, shape, src in items:
            t = (src() if callable(src) else src).detach()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, header says {dtype} "
                                 f"{list(shape)}")
            t = t.to("cpu").contiguous()
            mv = bytes_view(t)
            for i in range(0, len(mv), WRITE_CHUNK_BYTES):
                put(mv[i:i + WRITE_CHUNK_BYTES])
            del t, mv
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()
