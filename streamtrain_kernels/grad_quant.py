"""Gradients held in one byte per parameter: blockwise 8-bit floats with unbiased stochastic rounding.

The engine holds every unit's gradient from its backward until the global clipping norm is known and the optimizer
consumes it. `quantize_grad_int8(flat_fp32, codes_out, scales_out, seed, block_size)` stores a unit's flat fp32
gradient as int8 codes plus one fp32 scale per `block_size` elements (block j = [j * bs, (j + 1) * bs); the last
block may be partial); `adamw_update` reads the codes directly (its `grad_scales` / `grad_block_size`), and
`dequantize_grad_int8` turns them back into fp32 where something else needs the values.

Format: the int8 Adam moment m's code (streamtrain_kernels/adamw_update.py): scale = absmax / 1.875 (the top code
value), correctly rounded; a value is normalised as y = |x| * fp32(1 / scale) (scale 0: every y is 0) and stored as
sign + e4m3 magnitude: exponent field e >= 1 encodes 2**(e - 15) * (1 + f / 8), e == 0 encodes f * 2**-17; the int8's
sign bit is set for a negative value whose magnitude code is > 0. Decoding is sign * value(code) * scale, the fp32
product (`decode_signed_m_code`, `dequantize_blocks_reference(..., signed=True)`).

Rounding: the moments round to nearest; a gradient rounds stochastically, so that what the optimizer sees is
unbiased however small a value is against its block's absmax (nearest rounding would flush everything below about
2**-19 of it to 0, every step, the same way). y lies between adjacent code values lo <= y <= hi, hi - lo = 2**(e - 18)
in binade e and 2**-17 below the smallest normal code, at q = (y - lo) / (hi - lo) of the step; the code is hi with
probability q resolved to 16 random bits, exactly floor(2**16 * q) / 2**16: the expected value is low by less than
2**-16 of a step. The arithmetic is exact integer arithmetic on the code position p = code(lo) + q in fixed point
with 20 fraction bits: for y >= 2**-14 p is y's fp32 bits less the code's exponent bias (a binade's code step is
linear in the mantissa, whose 20 bits below the code's 3 are the fraction), below it p = floor(y * 2**37) (y in
units of 2**-17, times 2**20: a power-of-two scaling, exact, then one float -> int conversion). p is clamped to the
top code (y is above 1.875 by the rounding of |x| * (1 / scale), or NaN), and code = (p + 16 * r) >> 20 for the
element's 16 random bits r. The bits are those of `to_bf16_stochastic(seed)` (streamtrain_kernels/grad_accum.py):
Philox-4x32-10 keyed by `seed`, counter = element index // 8, 16 bits per element (`stochastic_bits_reference`), so
GPU, interpreter and the torch reference `quantize_grad_int8_reference` give the same bits. Variance per element:
(hi - lo)**2 * q * (1 - q), at most a quarter step squared: a standard deviation <= 2**-4 of |x| in the normal
range.

Non-finite values: a NaN makes its block's scale NaN (one integer max over the bits, `_block_scale`), so the whole
block decodes to NaN. An inf makes the scale inf and 1 / scale 0: the inf decodes to inf, the block's finite values
(0 * inf) to NaN. Either way the sum of squares of the decoded gradient is non-finite and the engine skips the step.
A block whose absmax is below about 2**-127 (~6e-39) has 1 / scale = inf: its values decode to +-absmax (zeros
to +absmax), an error below 2**-126 that the moments' encoding shares.

Bytes per element: quantize reads 4 and writes 1 (+ 4 / block_size of scales; + 4 with `dequantized_out`);
dequantize reads 1 and writes 4. Held: 1 + 4 / block_size B per parameter (256: 1.016 B) instead of 2 (bf16) or 4
(fp32); adamw_update reads the gradient as 1 B + scales instead of 4 / 2. A qwen7b layer (233 M elements): 237 MB
held, quantized in ~0.4 ms at 3 TB/s. Compute per element: one Philox-4x32-10 per 8 elements (~5 integer
multiplies and ~10 other integer ops per element, as in `to_bf16_stochastic`) and ~20 more operations (absmax,
normalise, position, code, sign), one of them a float -> int conversion: at 5 B per element this is near the
issue rate of an H100 SM, so the kernel may be compute-bound; see TILE_GPU.

Without a GPU and without TRITON_INTERPRET=1 the torch references run instead, with the same bits.
"""

from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from streamtrain_kernels.adamw_update import (BLOCK_SIZE_RANGE, M_INV_TOP_BITS, _block_scale, _normalised,
                                              decode_signed_m_code)
from streamtrain_kernels.grad_accum import philox_4x32
from streamtrain_kernels.reference import M_CODE
from streamtrain_kernels.tiles import check_flat, load_tile, store_tile, uses_triton


def _position_constants(e_bits: int, m_bits: int) -> tuple:
    """Constants of the code position p (20 fraction bits for m's e4m3), precomputed as constexprs (the interpreter
    cannot do arithmetic on constexprs): (FRAC_BITS, POS_BIAS, MIN_NORMAL_BITS, SUB_POS_SCALE, MAX_POS,
    RND_SHIFT). POS_BIAS: the fp32 bits of 2**-emax, so that bits(y) - POS_BIAS = p * 2**FRAC_BITS for normal
    codes; MIN_NORMAL_BITS: the bits of the smallest normal code value; SUB_POS_SCALE: 2**FRAC_BITS over the
    subnormal step; RND_SHIFT: places the 16 random bits at the top of the fraction."""
    emax = 2**e_bits - 1
    frac_bits = 23 - m_bits
    consts = (frac_bits, (127 - emax) << 23, (128 - emax) << 23, 2.0 ** (emax - 1 + m_bits + frac_bits),
              (2**(e_bits + m_bits) - 1) << frac_bits, frac_bits - 16)
    return tuple(tl.constexpr(c) for c in consts)


FRAC_BITS, POS_BIAS, MIN_NORMAL_BITS, SUB_POS_SCALE, MAX_POS, RND_SHIFT = _position_constants(*M_CODE)

# GPU launch: a program owns whole blocks (a tile of [rows, block_size]) so that each block's absmax is reduced in
# registers and the codes are written in the same pass. TILE_GPU elements on NUM_WARPS_GPU warps: 16 elements per
# thread (four 16-byte loads, one 16-byte store of codes), a Philox call per 8. Chosen from the byte and
# instruction counts above and adamw_update's int8 measurements; not measured on a GPU (none was available when
# this was written): bench it before relying on the rate.
TILE_GPU = 2048
NUM_WARPS_GPU = 4
ELEMS_PER_THREAD_GPU = 16  # a block larger than TILE_GPU gets more warps, up to MAX_WARPS, then more per thread
MAX_WARPS = 16
TILE_INTERPRET = 16384  # the interpreter pays per program


def launch_config(device: torch.device, block_size: int) -> Tuple[int, int, int]:
    """(rows, groups, num_warps) of a program's [rows, groups, 8] tile: groups * 8 = block_size, whole blocks."""
    if device.type != "cuda":
        tile, num_warps = max(block_size, TILE_INTERPRET), 1
    else:
        tile = max(block_size, TILE_GPU)
        num_warps = max(NUM_WARPS_GPU, min(MAX_WARPS, tile // (32 * ELEMS_PER_THREAD_GPU)))
    return tile // block_size, block_size // 8, num_warps


@triton.jit
def _tile(numel, R: tl.constexpr, G: tl.constexpr):
    """This program's [R, G, 8] tile of whole blocks (block = G * 8 elements): its start, the int32 offsets of its
    elements from there, the column index [1, 1, 8], the elements it holds (rem), whether it is full, its blocks'
    indices [R] and the number of blocks."""
    pid = tl.program_id(0).to(tl.int64)
    tile_start = pid * (R * G * 8)
    col = tl.arange(0, 8)[None, None, :]
    offs = tl.arange(0, R)[:, None, None] * (G * 8) + tl.arange(0, G)[None, :, None] * 8 + col
    rem = tl.minimum(numel - tile_start, R * G * 8).to(tl.int32)
    blocks = pid * R + tl.arange(0, R)
    n_blocks = (numel + G * 8 - 1) // (G * 8)
    return tile_start, offs, col, rem, rem == R * G * 8, blocks, n_blocks


@triton.jit(do_not_specialize=["numel", "seed_lo", "seed_hi"])
def _quantize_kernel(x_ptr, code_ptr, scale_ptr, deq_ptr, numel, seed_lo, seed_hi, R: tl.constexpr,
                     G: tl.constexpr, WITH_DEQ: tl.constexpr):
    tile_start, offs, col, rem, full, blocks, n_blocks = _tile(numel, R, G)
    x = load_tile(x_ptr + tile_start, offs, rem, full)  # the tail reads 0: no effect on the absmax

    scale = _block_scale(x, M_INV_TOP_BITS)
    y = _normalised(x, scale)
    y_bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # a NaN's sign bit is no magnitude
    normal = y_bits >= MIN_NORMAL_BITS  # an integer compare: a NaN takes this branch and clamps to the top
    sub_pos = (tl.where(normal, 0.0, y) * SUB_POS_SCALE).to(tl.int32)  # exact, < 2**23: no overflow, no NaN
    pos = tl.minimum(tl.where(normal, y_bits - POS_BIAS, sub_pos), MAX_POS)

    # 16 random bits per element: half (col & 1) of Philox word col // 2 for the element's group of 8
    counter = tile_start // 8 + tl.arange(0, R)[:, None] * G + tl.arange(0, G)[None, :]
    r0, r1, r2, r3 = philox_4x32((counter & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32),
                                 seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
    r0, r1, r2, r3 = r0[:, :, None], r1[:, :, None], r2[:, :, None], r3[:, :, None]
    word = tl.where(col < 2, r0, tl.where(col < 4, r1, tl.where(col < 6, r2, r3)))
    rnd = ((word >> ((col & 1) * 16).to(tl.uint32)) & 0xFFFF).to(tl.int32, bitcast=True)

    mag_code = (pos + (rnd << RND_SHIFT)) >> FRAC_BITS
    # the int8 code, sign-extended: the sign bit (+128) on a negative value with a magnitude code > 0
    code = tl.where((x < 0) & (mag_code > 0), mag_code - 128, mag_code)
    store_tile(code_ptr + tile_start, offs, rem, full, code.to(tl.int8))
    tl.store(scale_ptr + blocks, scale, mask=blocks < n_blocks)
    if WITH_DEQ:
        store_tile(deq_ptr + tile_start, offs, rem, full, decode_signed_m_code(code, scale[:, None, None]))


@triton.jit(do_not_specialize=["numel"])
def _dequantize_kernel(code_ptr, scale_ptr, out_ptr, numel, R: tl.constexpr, G: tl.constexpr):
    tile_start, offs, _, rem, full, blocks, n_blocks = _tile(numel, R, G)
    code = load_tile(code_ptr + tile_start, offs, rem, full).to(tl.int32)
    scale = tl.load(scale_ptr + blocks, mask=blocks < n_blocks, other=0.0)[:, None, None]
    store_tile(out_ptr + tile_start, offs, rem, full, decode_signed_m_code(code, scale))


# ---------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------
def _check_block_size(op: str, block_size) -> None:
    lo, hi = BLOCK_SIZE_RANGE
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not lo <= block_size <= hi \
            or block_size & (block_size - 1):
        raise ValueError(f"{op}: block_size must be a power of two in [{lo}, {hi}], got {block_size!r}")


def _check_like(op: str, name: str, t, dtype: torch.dtype, numel: int, device: torch.device, what: str) -> None:
    check_flat(op, t, name, dtypes=(dtype,))
    if t.numel() != numel or t.device != device:
        raise ValueError(f"{op}: {name} must hold {numel} elements ({what}) on {device}, got {t.numel()} on "
                         f"{t.device}")


def _span(t: torch.Tensor) -> Tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _check_disjoint(op: str, named) -> None:
    """Outputs must not overlap each other or the input (empty tensors never do)."""
    named = [(n, t) for n, t in named if t.numel() > 0]
    for i, (name_a, a) in enumerate(named):
        for name_b, b in named[i + 1:]:
            (a0, a1), (b0, b1) = _span(a), _span(b)
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{op}: {name_a} and {name_b} overlap in memory")


def quantize_grad_int8(flat_fp32: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor, seed: int,
                       block_size: int, dequantized_out: Optional[torch.Tensor] = None) -> None:
    """Quantize a flat fp32 gradient to int8 codes with per-block fp32 scales, stochastically rounded (see the
    module docstring for the format and its arithmetic).

    flat_fp32: 1-D contiguous fp32, n elements (any n >= 0). codes_out: 1-D contiguous int8 [n]. scales_out: 1-D
    contiguous fp32 [ceil(n / block_size)]. seed: any integer (taken mod 2**64), keys the random bits of element
    i by (seed, i) alone. block_size: a power of two in [8, 16384]. dequantized_out: optional 1-D contiguous fp32
    [n], receives the decoded values (what `dequantize_grad_int8` returns); it may be flat_fp32 itself (in place),
    but no other output may overlap the input or each other. All on one device. Raises ValueError, before
    launching anything, on a bad argument."""
    op = "quantize_grad_int8"
    check_flat(op, flat_fp32, "flat_fp32", dtypes=(torch.float32,))
    n, device = flat_fp32.numel(), flat_fp32.device
    _check_block_size(op, block_size)
    n_blocks = -(-n // block_size)
    _check_like(op, "codes_out", codes_out, torch.int8, n, device, "one per element")
    _check_like(op, "scales_out", scales_out, torch.float32, n_blocks, device, f"one per block of {block_size}")
    named = [("flat_fp32", flat_fp32), ("codes_out", codes_out), ("scales_out", scales_out)]
    if dequantized_out is not None:
        _check_like(op, "dequantized_out", dequantized_out, torch.float32, n, device, "one per element")
        if dequantized_out.data_ptr() != flat_fp32.data_ptr():
            named.append(("dequantized_out", dequantized_out))
    _check_disjoint(op, named)
    try:
        seed = operator.index(seed) & (2**64 - 1)
    except TypeError:
        raise ValueError(f"{op}: seed must be an integer, got {seed!r}") from None

    if not uses_triton(device):
        from streamtrain_kernels.reference import dequantize_blocks_reference, quantize_grad_int8_reference
        codes, scales = quantize_grad_int8_reference(flat_fp32, seed, block_size)
        if dequantized_out is not None:
            dequantized_out.copy_(dequantize_blocks_reference(codes, scales, block_size, signed=True))
        codes_out.copy_(codes)
        scales_out.copy_(scales)
        return
    if n == 0:
        return
    R, G, num_warps = launch_config(device, block_size)
    # + 2**32: both halves reach the kernel as int64 whatever their value (Triton types an int argument by its
    # value, and would compile another variant for a half below 2**31); the kernel's uint32 cast drops the 2**32
    _quantize_kernel[(triton.cdiv(n, R * G * 8),)](
        flat_fp32, codes_out, scales_out, dequantized_out if dequantized_out is not None else flat_fp32, n,
        (seed & 0xFFFFFFFF) + 2**32, (seed >> 32) + 2**32, R=R, G=G, WITH_DEQ=dequantized_out is not None,
        num_warps=num_warps)


def dequantize_grad_int8(codes: torch.Tensor, scales: torch.Tensor, block_size: int,
                         out_fp32: torch.Tensor) -> torch.Tensor:
    """fp32 values of `quantize_grad_int8`'s codes: sign * value(code) * scale of its block, written to out_fp32
    (1-D contiguous fp32 [n], not overlapping the inputs) and returned. codes: 1-D contiguous int8 [n]; scales:
    1-D contiguous fp32 [ceil(n / block_size)]; block_size as when quantizing."""
    op = "dequantize_grad_int8"
    check_flat(op, codes, "codes", dtypes=(torch.int8,))
    n, device = codes.numel(), codes.device
    _check_block_size(op, block_size)
    n_blocks = -(-n // block_size)
    _check_like(op, "scales", scales, torch.float32, n_blocks, device, f"one per block of {block_size}")
    _check_like(op, "out_fp32", out_fp32, torch.float32, n, device, "one per element")
    _check_disjoint(op, [("codes", codes), ("scales", scales), ("out_fp32", out_fp32)])
    if not uses_triton(device):
        from streamtrain_kernels.reference import dequantize_blocks_reference
        out_fp32.copy_(dequantize_blocks_reference(codes, scales, block_size, signed=True))
        return out_fp32
    if n == 0:
        return out_fp32
    R, G, num_warps = launch_config(device, block_size)
    _dequantize_kernel[(triton.cdiv(n, R * G * 8),)](codes, scales, out_fp32, n, R=R, G=G, num_warps=num_warps)
    return out_fp32
