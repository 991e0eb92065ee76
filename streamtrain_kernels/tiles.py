"""Launch machinery shared by the kernels over flat buffers: one Triton launch covering many tensors.

streamtrain_kernels/grad_accum.py adds a unit's gradients (a dozen tensors of mixed dtypes) into the unit's flat fp32
buffer in one launch; streamtrain_kernels/adamw_update.py shares the tile helpers. This module provides:
- host side: `check_flat` / `check_tensors` (a ValueError naming the tensor and the problem, raised before any
  launch), `tensor_table` (the cached device-side table below), `launch_config` (BLOCK and warps per device),
  `uses_triton` / `INTERPRETED` (kernel or torch fallback), `sum_partials` (deterministic per-tensor sums);
- jit side: `find_tensor`, `tensor_entry`, `as_pointer` (a program's tensor, its table row, a typed pointer to
  it), `load_tile` / `store_tile` (masked only in a tensor's tail block), `to_fp32` (exact upcast).

How one launch covers many tensors
----------------------------------
The wrapper builds a small int64 *tensor table* (column-major, one column per tensor): the tensor's address
(`data_ptr()`), the element count, the element offset in the flat buffer, the index of the tensor's first block,
and a dtype code. The grid is one program per BLOCK elements of the *total* element count: tensor i owns
`ceil(n_i / BLOCK)` consecutive programs, so a layer's grid is sized by its total size, never by
`max(n_i) * len(tensors)`. A program finds its tensor by comparing its id against the first-block column (one
vector load of one int64 per tensor, served from L1/L2), then turns the address into a typed pointer
(`int64 -> tl.pointer_type(...)`, the technique of Triton's grouped-GEMM tutorial; it works in triton 3.6, 3.9 and
the interpreter). Tensors of different dtypes (a layer's bf16 matmul gradients next to its fp32 norm/bias
gradients) share the one launch: the kernel branches on the dtype code into one of three compiled paths; a
program never straddles two tensors, so the branch is uniform across it and costs no divergence. Tables are cached
per (device, stream, block, flat-buffer alignment, pointers, sizes, offsets, dtypes), so a steady-state call with
the same buffers uploads nothing; a miss costs one pinned, non-blocking 40-byte-per-tensor host-to-device copy on
the current stream (never a host sync). The cache holds the last 256 tables.

Speed (memory-bound)
--------------------
Every program but a tensor's last handles exactly BLOCK elements and takes an unmasked path; only the tail block
is masked. That matters: a mask `idx < n` with `n` loaded from memory has unknown divisibility and would force the
compiler to scalar (one-element) accesses. When every address is 16-byte aligned and every flat offset is a multiple of
8 elements (always true for `UnitLayout`, whose offsets are multiples of 64, and for tensors from the caching
allocator), the table says `aligned` and the kernel is compiled with `tl.multiple_of` hints, so that full blocks
can load and store in 16-byte vectors (`ld.global.v4` / `st.global.v4`; tail blocks stay scalar); otherwise a
hint-free variant runs (correct, slower). BLOCK = 8192 elements, 4 warps: 64 elements per thread. Measured on an
H100 (bench/results/grad_accum_h100_2026-12-05.jsonl, `bench_grad_accum --sweep`): 8 warps reached only 0.76-0.86 of
the copy rate on bf16 gradients, 4 warps 0.96-1.0 (fp32 0.99).

Norms: deterministic two-stage reduction
----------------------------------------
A kernel that wants per-tensor sums of squares writes the fp32 sum of its block to a partials buffer (one slot per
program, no atomics); `sum_partials` then launches one program per tensor that adds that tensor's partials in a
fixed order, in fp64, and writes the fp32 result: 4 B of partials per BLOCK elements, and a launch of n_tensors
programs. For a given BLOCK / num_warps (fixed here, deliberately not autotuned: an autotuner could pick another
config in another process) the result is bit-identical from run to run. The interpreter uses the same BLOCK, but
its in-block reduction order differs, so CPU and GPU norms agree to rounding, not bit for bit.

Without a GPU and without TRITON_INTERPRET=1 (a plain CPU run of the engine), `uses_triton` is False and the ops
call their torch references in streamtrain_kernels/reference.py instead.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# GPU launch config. Fixed (no autotune) so that norms are reproducible run to run; bench/bench_grad_accum.py
# --sweep measures alternatives.
BLOCK_GPU = 8192
NUM_WARPS_GPU = 4
BLOCK_INTERPRET = 8192  # as on the GPU: the interpreter pays per program and per jit-helper call
SEGMENT_CHUNK = 1024  # partials summed per iteration by the per-tensor reduction kernel

# tensor-table columns (each column holds one int64 per tensor)
_COL_ADDR = tl.constexpr(0)
_COL_NUMEL = tl.constexpr(1)
_COL_OFFSET = tl.constexpr(2)
_COL_FIRST_BLOCK = tl.constexpr(3)
_COL_DTYPE = tl.constexpr(4)


# ---------------------------------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def find_tensor(table_ptr, n_tensors, pid, NT_POW2: tl.constexpr):
    """Index of the tensor owning program `pid`: the number of tensors after the first whose first block <= pid."""
    rows = tl.arange(0, NT_POW2)
    first_block = tl.load(table_ptr + _COL_FIRST_BLOCK * n_tensors + rows,
                          mask=(rows >= 1) & (rows < n_tensors), other=2**62)
    return tl.sum((first_block <= pid).to(tl.int32), axis=0)


@triton.jit
def tensor_entry(table_ptr, n_tensors, t, ALIGNED: tl.constexpr):
    """(address, numel, flat offset, first block, dtype code) of tensor `t`; the offset hinted if promised."""
    addr = tl.load(table_ptr + _COL_ADDR * n_tensors + t)
    numel = tl.load(table_ptr + _COL_NUMEL * n_tensors + t)
    offset = tl.load(table_ptr + _COL_OFFSET * n_tensors + t)
    first_block = tl.load(table_ptr + _COL_FIRST_BLOCK * n_tensors + t)
    code = tl.load(table_ptr + _COL_DTYPE * n_tensors + t)
    if ALIGNED:
        offset = tl.multiple_of(offset, 8)
    return addr, numel, offset, first_block, code


@triton.jit
def as_pointer(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointer from an int64 address. The 16-byte hint must sit on the int -> pointer cast itself: a hint on
    the integer does not survive the cast, and one on a jit function's parameter is silently dropped."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def to_fp32(x):
    """Exact upcast to fp32. bf16 goes through its bits (sign-extend, shift): the interpreter's own bf16 -> fp32
    conversion mangles subnormals; on the GPU this is the same shift the conversion instruction does."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def load_tile(ptr, idx, numel, full):
    if full:
        x = tl.load(ptr + idx)
    else:
        x = tl.load(ptr + idx, mask=idx < numel, other=0)
    return x


@triton.jit
def store_tile(ptr, idx, numel, full, x):
    if full:
        tl.store(ptr + idx, x)
    else:
        tl.store(ptr + idx, x, mask=idx < numel)


@triton.jit
def segment_sum_kernel(table_ptr, partial_ptr, out_ptr, n_tensors, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       N_CHUNKS: tl.constexpr):
    """out[t] = sum of tensor t's per-block partials, in a fixed order (fp64 accumulation): deterministic."""
    t = tl.program_id(0)
    numel = tl.load(table_ptr + _COL_NUMEL * n_tensors + t)
    first_block = tl.load(table_ptr + _COL_FIRST_BLOCK * n_tensors + t)
    n_blocks = (numel + BLOCK - 1) // BLOCK
    acc = tl.zeros((CHUNK,), dtype=tl.float64)
    # a compile-time trip count (a power of two >= the largest tensor's chunks): triton 3.6's interpreter cannot
    # take range() of a run-time value
    for c in range(0, N_CHUNKS):
        j = c * CHUNK + tl.arange(0, CHUNK)
        acc += tl.load(partial_ptr + first_block + j, mask=j < n_blocks, other=0.0).to(tl.float64)
    tl.store(out_ptr + t, tl.sum(acc, axis=0).to(tl.float32))


# ---------------------------------------------------------------------------------------------------------------
# host side: validation, launch config and the tensor table
# ---------------------------------------------------------------------------------------------------------------
INTERPRETED = type(segment_sum_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 when triton was imported


def uses_triton(device: torch.device) -> bool:
    """True when kernels launch (CUDA tensors, or CPU tensors under the interpreter); False: torch fallback."""
    if device.type == "cuda":
        if INTERPRETED:
            raise RuntimeError("streamtrain_kernels: CUDA tensors with TRITON_INTERPRET=1: the tensor table holds "
                               "device addresses the interpreter cannot read; run with TRITON_INTERPRET=0")
        return True
    return INTERPRETED


def launch_config(device: torch.device) -> tuple:
    if device.type == "cuda":
        return BLOCK_GPU, NUM_WARPS_GPU
    return BLOCK_INTERPRET, 1


def _label(labels: Optional[Sequence[str]], i: int) -> str:
    return f"tensor {i} ({labels[i]!r})" if labels is not None else f"tensor {i}"


def check_flat(op: str, flat, name: str, dtypes=SUPPORTED_DTYPES) -> None:
    if not isinstance(flat, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(flat).__name__}")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{op}: {name} must be 1-D and contiguous, got shape {tuple(flat.shape)} "
                         f"stride {flat.stride()}")
    if flat.dtype not in dtypes:
        raise ValueError(f"{op}: {name} has dtype {flat.dtype}; supported: {', '.join(map(str, dtypes))}")


def check_tensors(op: str, tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor,
                  flat_name: str, labels: Optional[Sequence[str]] = None, dtypes=SUPPORTED_DTYPES) -> List[int]:
    """Validate tensors against a flat buffer before any launch; returns the offsets as Python ints."""
    tensors, offsets = list(tensors), list(offsets)
    if len(tensors) != len(offsets):
        raise ValueError(f"{op}: {len(tensors)} tensors but {len(offsets)} offsets")
    if labels is not None and len(labels) != len(tensors):
        raise ValueError(f"{op}: {len(tensors)} tensors but {len(labels)} labels")
    offs: List[int] = []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        what = _label(labels, i)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {what} is a {type(t).__name__}, not a torch.Tensor")
        try:
            off = operator.index(off)
        except TypeError:
            raise ValueError(f"{op}: offset of {what} is {off!r}; offsets must be non-negative integers") from None
        if isinstance(off, bool) or off < 0:
            raise ValueError(f"{op}: offset of {what} is {off}; offsets must be non-negative integers")
        if t.device != flat.device:
            raise ValueError(f"{op}: {what} is on {t.device} but {flat_name} is on {flat.device}")
        if t.dtype not in dtypes:
            raise ValueError(f"{op}: {what} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                             "pass t.contiguous()")
        end = off + t.numel()
        if end > flat.numel():
            raise ValueError(f"{op}: {what} runs past the end of {flat_name}: offset {off} + {t.numel()} elements "
                             f"= {end} > {flat.numel()}")
        offs.append(off)
    spans = sorted((off, off + t.numel(), i) for i, (t, off) in enumerate(zip(tensors, offs)) if t.numel() > 0)
    for (a0, a1, ia), (b0, b1, ib) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"{op}: {_label(labels, ib)} at [{b0}, {b1}) overlaps {_label(labels, ia)} at "
                             f"[{a0}, {a1}) in {flat_name}")
    return offs


@dataclass
class TensorTable:
    table: torch.Tensor  # int64 [5, n] on the launch device, column-major as the _COL_* constants say
    n_tensors: int
    nt_pow2: int
    total_blocks: int
    max_blocks: int  # of any one tensor
    aligned: bool  # every address 16-byte aligned and every flat offset a multiple of 8 elements


_TABLE_CACHE: "OrderedDict[tuple, TensorTable]" = OrderedDict()
_TABLE_CACHE_SIZE = 256
_TABLE_LOCK = threading.Lock()


def tensor_table(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor,
                 block: int) -> TensorTable:
    """The device-side table of (address, numel, offset, first block, dtype code) for validated tensors."""
    device = flat.device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    rows = tuple((t.data_ptr(), t.numel(), off, DTYPE_CODE[t.dtype]) for t, off in zip(tensors, offsets))
    flat_aligned = flat.data_ptr() % 16 == 0
    key = (device, stream, block, flat_aligned, rows)
    with _TABLE_LOCK:  # the engine calls kernels from its optimizer thread too
        hit = _TABLE_CACHE.get(key)
        if hit is not None:
            _TABLE_CACHE.move_to_end(key)
            return hit
    first_blocks, total, most = [], 0, 0
    for _, numel, _, _ in rows:
        first_blocks.append(total)
        total += -(-numel // block)
        most = max(most, -(-numel // block))
    cols = [[r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], first_blocks, [r[3] for r in rows]]
    host = torch.tensor(cols, dtype=torch.int64)
    if device.type == "cuda":
        # pinned + non_blocking: no host sync; the caching host allocator keeps the buffer until the copy ran
        table = host.pin_memory().to(device, non_blocking=True)
    else:
        table = host
    aligned = (flat_aligned and all(r[0] % 16 == 0 for r in rows)
               and all(r[2] % 8 == 0 for r in rows))
    entry = TensorTable(table, len(rows), max(2, triton.next_power_of_2(len(rows))), total, most, aligned)
    # a table is only reused on the stream that uploaded it, so evicting it is stream-ordered and safe
    with _TABLE_LOCK:
        _TABLE_CACHE[key] = entry
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    return entry


def sum_partials(tt: TensorTable, partials: torch.Tensor, out: torch.Tensor, block: int) -> None:
    n_chunks = triton.next_power_of_2(max(1, -(-tt.max_blocks // SEGMENT_CHUNK)))
    segment_sum_kernel[(tt.n_tensors,)](tt.table, partials, out, tt.n_tensors, BLOCK=block, CHUNK=SEGMENT_CHUNK,
                                        N_CHUNKS=n_chunks)
