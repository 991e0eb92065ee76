"""Gradient accumulation into the host optimizer's flat fp32 layout, and fp32 -> bf16 stochastic rounding.

`accumulate(flat, grads, offsets)` does `flat[off_i : off_i + n_i] += scale * grads[i]` for every gradient of a
unit in ONE launch (`first=True` overwrites, so a fresh accumulator needs no zeroing pass). Gradients may mix
bf16 / fp16 / fp32 (a layer's matmul gradients arrive in the compute dtype, its norm and bias gradients in fp32).
The launch machinery is streamtrain_kernels/tiles.py's: a cached tensor table of (address, numel, offset, first block,
dtype code), one program per BLOCK elements of the total, an unmasked path for every full block, alignment hints
when all addresses are 16-byte aligned and every offset is a multiple of 8 elements (UnitLayout offsets are
multiples of 64). Padding between tensors is never touched.

Exactness contract: with `scale == 1.0` no multiply is compiled in (so nothing can fuse into an FMA): the result
is `flat + float32(g)` rounded once, bit-identical to torch's `flat_view.add_(g)` (and `first=True` to
`flat_view.copy_(g)`), for bf16, fp16 and fp32 `g`. With another scale the value is `flat + scale * g` with two
fp32 roundings (or one, if the compiler contracts it into an FMA): equal to torch within an fp32 ulp.

With `sq_norms_out` (fp32 [len(grads)]), each tensor's sum of squares of the RESULT is written there, from the
values already in registers: on the last micro-batch that is the clipping norm without another pass. Per-block
fp32 partials, then a fixed-order fp64 sum per tensor: deterministic run to run for a given launch config, and equal
to the definition (`sq_norms_reference`, fp64 throughout: the engines' `optim.sq_norms`) to rounding only, so the
streaming engine asks for them on the GPU and not on the CPU, where it must match engine=reference bit for bit
(engine/streaming/gradients.py).

Bytes per element: bf16 grad, accumulate: read 2 + 4, write 4 = 10 B (first: 6 B); fp32 grad: 12 B (first: 8 B).
A qwen7b layer (233 M elements) in bf16, non-first: 2.3 GB -> ~0.6 ms at 3.7 TB/s.

`to_bf16_stochastic(flat_fp32, out_bf16, seed, offset)` rounds fp32 to bf16 stochastically: an element with fp32
bits `b` becomes `(b + r) >> 16`, r a uniform random 16-bit integer. If the 16 dropped bits are `f`, the result is
rounded up iff `r >= 65536 - f`, i.e. with probability `f / 65536`, exactly the fraction of the bf16 ulp: the
rounding is unbiased, and the arithmetic is integer-only, so CPU interpreter and GPU give identical bits. Inf and
±0 stay as they are (their low 16 bits are zero); NaNs stay NaN (quiet bit forced on, sign and top payload kept);
finite values above the largest bf16 round up to Inf with the same unbiased probability.
Random bits: Philox-4x32-10 (implemented here, not tl.randint, so triton 3.6 and 3.9 agree), keyed by `seed`
(64 bit), counter = logical element index `k = i + offset` divided by 8; one Philox call gives 128 bits = 16 bits
for each of 8 consecutive elements (element k takes half `k % 2` of word `(k // 2) % 4`). Results depend only on
(seed, i + offset): converting a buffer in chunks with `offset = chunk start` gives the same bits as one call.
Bytes per element: read 4, write 2 = 6 B. One Philox call (10 rounds of 2 mul.hi + 2 mul.lo) serves 8
elements: ~5 integer multiplies and ~10 other integer ops per element, about half the memory time on H100/H200
(112 registers at 8 warps, no spills), so the kernel stays memory-bound.

No autograd.Function: these ops update optimizer-side buffers outside any differentiated graph.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import triton
import triton.language as tl

from streamtrain_kernels.tiles import (as_pointer, check_flat, check_tensors, find_tensor, launch_config, load_tile,
                                  store_tile, sum_partials, tensor_entry, tensor_table, to_fp32, uses_triton)

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# stochastic rounding launch config: ROWS groups of 8 elements per program
SR_ROWS_GPU = 1024
SR_NUM_WARPS_GPU = 8
SR_ROWS_INTERPRET = 1024


@triton.jit
def _accumulate_tile(g_ptr, acc_ptr, idx, numel, full, scale, partial_ptr, FIRST: tl.constexpr,
                     HAS_SCALE: tl.constexpr, WITH_NORMS: tl.constexpr):
    g = to_fp32(load_tile(g_ptr, idx, numel, full))
    if HAS_SCALE:
        g = g * scale
    if FIRST:
        result = g
    else:
        result = load_tile(acc_ptr, idx, numel, full) + g
    store_tile(acc_ptr, idx, numel, full, result)
    if WITH_NORMS:
        tl.store(partial_ptr, tl.sum(result * result, axis=0))


@triton.jit
def _accumulate_kernel(table_ptr, flat_ptr, partial_ptr, scale, n_tensors, NT_POW2: tl.constexpr,
                       BLOCK: tl.constexpr, FIRST: tl.constexpr, HAS_SCALE: tl.constexpr, WITH_NORMS: tl.constexpr,
                       ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    t = find_tensor(table_ptr, n_tensors, pid, NT_POW2)
    addr, numel, offset, first_block, code = tensor_entry(table_ptr, n_tensors, t, ALIGNED)
    start = (pid - first_block) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    full = start + BLOCK <= numel
    acc_ptr = flat_ptr + offset
    partial_ptr += pid
    if code == 0:
        _accumulate_tile(as_pointer(addr, tl.float32, ALIGNED), acc_ptr, idx, numel, full, scale, partial_ptr,
                         FIRST, HAS_SCALE, WITH_NORMS)
    elif code == 1:
        _accumulate_tile(as_pointer(addr, tl.bfloat16, ALIGNED), acc_ptr, idx, numel, full, scale, partial_ptr,
                         FIRST, HAS_SCALE, WITH_NORMS)
    else:
        _accumulate_tile(as_pointer(addr, tl.float16, ALIGNED), acc_ptr, idx, numel, full, scale, partial_ptr,
                         FIRST, HAS_SCALE, WITH_NORMS)


def accumulate(flat_fp32: torch.Tensor, grads: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0,
               first: bool = False, sq_norms_out: Optional[torch.Tensor] = None) -> None:
    """`flat_fp32[off_i : off_i + n_i] (+)= scale * grads[i]` for all gradients in one launch.

    flat_fp32: 1-D contiguous fp32. grads: contiguous bf16 / fp16 / fp32 tensors on the same device, inside
    `flat_fp32`, not overlapping. `first=True` overwrites instead of adding. `scale == 1.0` is bit-identical to
    torch `add_` / `copy_`. `sq_norms_out`: optional fp32 [len(grads)] receiving each tensor's sum of squares of the
    accumulated result. Raises ValueError before launching on a bad argument."""
    _accumulate("accumulate", flat_fp32, grads, offsets, scale, first, sq_norms_out)


def _accumulate(op, flat, grads, offsets, scale, first, sq_norms_out, labels=None) -> None:
    check_flat(op, flat, "flat_fp32", dtypes=(torch.float32,))
    grads = list(grads)
    offs = check_tensors(op, grads, offsets, flat, "flat_fp32", labels, dtypes=GRAD_DTYPES)
    if sq_norms_out is not None:
        check_flat(op, sq_norms_out, "sq_norms_out", dtypes=(torch.float32,))
        if sq_norms_out.numel() != len(grads) or sq_norms_out.device != flat.device:
            raise ValueError(f"{op}: sq_norms_out must hold {len(grads)} elements on {flat.device}, got "
                             f"{sq_norms_out.numel()} on {sq_norms_out.device}")
    if isinstance(scale, torch.Tensor) and scale.device.type != "cpu":
        raise ValueError(f"{op}: scale must be a Python number (a {scale.device} tensor would sync the host)")
    scale = float(scale)
    if not uses_triton(flat.device):
        from streamtrain_kernels.reference import accumulate_reference
        accumulate_reference(flat, grads, offs, scale, first, sq_norms_out)
        return
    block, num_warps = launch_config(flat.device)
    tt = tensor_table(grads, offs, flat, block) if grads else None
    if tt is None or tt.total_blocks == 0:
        if sq_norms_out is not None:
            sq_norms_out.zero_()
        return
    with_norms = sq_norms_out is not None
    partials = torch.empty(tt.total_blocks if with_norms else 1, dtype=torch.float32, device=flat.device)
    _accumulate_kernel[(tt.total_blocks,)](tt.table, flat, partials, scale, tt.n_tensors, NT_POW2=tt.nt_pow2,
                                           BLOCK=block, FIRST=bool(first), HAS_SCALE=scale != 1.0,
                                           WITH_NORMS=with_norms, ALIGNED=tt.aligned, num_warps=num_warps)
    if with_norms:
        sum_partials(tt, partials, sq_norms_out, block)


def accumulate_layout(layout, flat_fp32: torch.Tensor, grads: Dict[str, torch.Tensor], scale: float = 1.0,
                      first: bool = False, sq_norms_out: Optional[torch.Tensor] = None) -> None:
    """`accumulate` of gradients given by name, into a flat buffer of a `UnitLayout`.

    `grads` may hold a subset of the layout's names (e.g. only a tied embedding); they are taken in
    `layout.specs` order, which is also the order of `sq_norms_out`. `first` applies to the given tensors only."""
    unknown = sorted(set(grads) - set(layout.names))
    if unknown:
        raise ValueError(f"accumulate_layout: grads {unknown} are not in layout {layout.prefix!r}")
    tensors, offsets, labels = [], [], []
    for s, off in zip(layout.specs, layout.offsets):
        if s.name in grads:
            g = grads[s.name]
            if not isinstance(g, torch.Tensor) or g.numel() != s.numel:
                got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise ValueError(f"accumulate_layout: {s.name!r} has shape {got}, layout says {s.shape}")
            tensors.append(g)
            offsets.append(off)
            labels.append(s.name)
    _accumulate("accumulate_layout", flat_fp32, tensors, offsets, scale, first, sq_norms_out, labels)


# ---------------------------------------------------------------------------------------------------------------
# stochastic rounding
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def philox_4x32(c0, c1, k0, k1):
    """Philox-4x32, 10 rounds, counter (c0, c1, 0, 0), key (k0, k1); all uint32. Returns 4 uint32 words."""
    c2 = c0 * 0
    c3 = c2
    for _ in tl.static_range(10):
        prev0 = c0
        prev2 = c2
        c0 = tl.umulhi(prev2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(prev0, 0xD2511F53) ^ c3 ^ k1
        c1 = prev2 * 0xCD9E8D57
        c3 = prev0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit(do_not_specialize=["group0", "seed_lo", "seed_hi"])
def _stochastic_round_kernel(bits_in_ptr, bits_out_ptr, numel, group0, seed_lo, seed_hi, SHIFT: tl.constexpr,
                             ROWS: tl.constexpr):
    # program b covers logical indices k = 8 * (group0 + b * ROWS + row) + col; element i = k - offset
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, 8)
    group = group0 + b * ROWS + rows
    r0, r1, r2, r3 = philox_4x32((group & 0xFFFFFFFF).to(tl.uint32), (group >> 32).to(tl.uint32),
                                 seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
    c = cols[None, :]
    word = tl.where(c < 2, r0[:, None], tl.where(c < 4, r1[:, None], tl.where(c < 6, r2[:, None], r3[:, None])))
    rnd = (word >> ((c & 1) * 16).to(tl.uint32)) & 0xFFFF
    start = b * (ROWS * 8) - SHIFT
    idx = start + rows[:, None] * 8 + c
    full = (start >= 0) & (start + ROWS * 8 <= numel)
    if full:
        x = tl.load(bits_in_ptr + idx)
    else:
        x = tl.load(bits_in_ptr + idx, mask=(idx >= 0) & (idx < numel), other=0)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + rnd) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
    y = hi.to(tl.uint16).to(tl.int16, bitcast=True)
    if full:
        tl.store(bits_out_ptr + idx, y)
    else:
        tl.store(bits_out_ptr + idx, y, mask=(idx >= 0) & (idx < numel))


def to_bf16_stochastic(flat_fp32: torch.Tensor, out_bf16: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """Round fp32 to bf16 stochastically (unbiased), reproducibly for (seed, element index + offset).

    flat_fp32: contiguous fp32; out_bf16: contiguous bf16 with the same number of elements, same device (any
    shapes). seed: any integer (taken mod 2**64); offset: non-negative integer, the logical index of element 0.
    Returns out_bf16."""
    op = "to_bf16_stochastic"
    for name, t, dtype in (("flat_fp32", flat_fp32, torch.float32), ("out_bf16", out_bf16, torch.bfloat16)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or not t.is_contiguous():
            got = f"{t.dtype}, contiguous={t.is_contiguous()}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a contiguous {dtype} tensor, got {got}")
    if out_bf16.numel() != flat_fp32.numel() or out_bf16.device != flat_fp32.device:
        raise ValueError(f"{op}: out_bf16 ({out_bf16.numel()} elements on {out_bf16.device}) must match flat_fp32 "
                         f"({flat_fp32.numel()} elements on {flat_fp32.device})")
    seed, offset = int(seed) & (2**64 - 1), int(offset)
    if offset < 0:
        raise ValueError(f"{op}: offset must be >= 0, got {offset}")
    if not uses_triton(flat_fp32.device):
        from streamtrain_kernels.reference import stochastic_round_reference
        out_bf16.view(-1).copy_(stochastic_round_reference(flat_fp32.view(-1), seed, offset))
        return out_bf16
    numel = flat_fp32.numel()
    if numel == 0:
        return out_bf16
    rows = SR_ROWS_GPU if flat_fp32.device.type == "cuda" else SR_ROWS_INTERPRET
    num_warps = SR_NUM_WARPS_GPU if flat_fp32.device.type == "cuda" else 1
    shift = offset % 8
    grid = (triton.cdiv(numel + shift, rows * 8),)
    _stochastic_round_kernel[grid](flat_fp32.view(-1).view(torch.int32), out_bf16.view(-1).view(torch.int16), numel,
                                   offset // 8, seed & 0xFFFFFFFF, seed >> 32, SHIFT=shift, ROWS=rows,
                                   num_warps=num_warps)
    return out_bf16
