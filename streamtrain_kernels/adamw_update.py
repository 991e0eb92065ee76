"""One fused AdamW step over a unit's flat state, in any of the training-state formats (fp32 or bf16 master, fp32,
bf16 or int8 moments).

`adamw_update(master, m, v, grad, lr=, clip=, step=, ...)` reads the master weights, both moments (dequantizing),
the gradient, the clip scale and the learning rate (0-d device tensors: no host round trip), applies AdamW in fp32,
writes master and moments back (rounding or quantizing) and, optionally, the bf16 compute weights for the next
forward, in one pass.

Arithmetic: torch's fused CPU AdamW (`FusedAdamKernel.cpp`, vectorised path), each step one correctly rounded fp32
operation (equal to torch's to at most 1 ulp: whether torch's build contracts v's update into an fma is up to its
compiler; with torch 2.13's CPU wheel 4 of 10,007 elements of v differ by 1 ulp, the master and m none):
g = grad * clip; p = p * fp32(1 - lr * wd) (fp64 product, as torch's double);
m = fma(w, g - m, m), w = fp32(1 - beta1) (torch's `lerp_`; fma(w - 1, g - m, g) when w >= 0.5);
v = fma(fp32(1 - beta2) * g, g, v * beta2) (the contraction torch's compiler makes);
p = p + (fp32(-lr / bc1) * m) / (sqrt(v) / fp32(sqrt(bc2)) + eps), with lr / bc1 in fp64. The kernel uses
`div_rn`, `sqrt_rn` and explicit `fma`, and launches with `enable_fp_fusion=False`, so the GPU contracts nothing
else and GPU, interpreter and the torch reference give the same bits. Divisions by a number fixed for the launch
(fp32(sqrt(bc2)), an int8 code's top value) are `_div_by_constant`: an fp64 product with the host's fp64
reciprocal, rounded to fp32, which is the correctly rounded quotient without `div_rn`'s instruction sequence and
branch. torch's CUDA fused AdamW orders the operations differently (`p -= lr * wd * p`,
`m = beta1 * m + (1 - beta1) * g`), so it agrees to rounding only.
Bias corrections bc1 = 1 - beta1**step, bc2 = 1 - beta2**step are computed on the host from the Python int `step`
(the engine counts steps on the host); they reach the kernel as fp64 bits, lr and clip are read in the kernel.

Formats (master x moments, any combination; grad fp32, bf16 or int8 with any of them):
- fp32: exact AdamW as above.
- bf16 master / bf16 moments: upcast, the same fp32 update, stored with stochastic rounding (unbiased, the
  integer trick of `to_bf16_stochastic`), random bits from Philox keyed per stream by `adamw_stream_seeds(seed)`
  (master, m and v decorrelated) with counter (offset + i) // 8, as `stochastic_bits_reference` says: the result
  depends only on (seed, offset + i). The update uses the fp32 moments before rounding, as torch's bf16 path.
  `offset` must be a multiple of 8 so that a tile's 8-element Philox groups line up with its elements.
- int8 moments (m int8, v uint8, fp32 scales, one per `block_size` elements, block j = [j * bs, (j + 1) * bs)):
  8-bit floats normalised by the block's absmax, decoded with the old scale and re-encoded with a new one (scale =
  absmax / top code value; a value is normalised as |x| * fp32(1 / scale), one division per block). m: sign + e4m3
  magnitude; v: unsigned e5m3 (v >= 0 needs no sign bit, so its exponent gets a bit more). e = exponent field, f =
  mantissa: e >= 1 encodes 2**(e - emax) * (1 + f / 8), e == 0 encodes f * 2**(1 - emax - 3) (subnormals), emax =
  2**E - 1; the top code is 1.875. Nearest rounding (ties away from zero, deterministic) gives a relative error <=
  2**-4 for normalised values >= 2**(1 - emax) and an absolute error <= 2**(-emax - 3) * scale below (v: 2**(-emax -
  2) * scale, see below): m keeps 18 binades below its block's max, v 34 (a gradient 2**-17 of its block's largest
  still has a non-zero v code). Why not linear absmax codes: a v far below its block's max would round to 0 and its
  update m / (sqrt(0) + eps) would explode. For the same reason a positive v never encodes to 0: it rounds up to the
  smallest code at worst (its update shrinks, it never explodes). Encoding is integer arithmetic on the fp32 bits,
  decoding builds the bits: exact on every device. Neither converts between int and float (conversions issue at a
  quarter of the rate of fp32 arithmetic): a subnormal code is decoded as a normal one with an fma, and encoded as
  the normal code of x + 2**(1 - emax) less 8 (`_code_decode`, `_code_encode`). A program owns whole blocks (a tile
  of [rows, block_size]) so it computes each new absmax in registers. A block may span segments of different weight
  decay: decay is per element.
- int8 grad (streamtrain_kernels/grad_quant.py: m's signed code, stochastically rounded, fp32 `grad_scales`, one per
  `grad_block_size` elements): decoded as sign * value(code) * scale, the same fp32 value `dequantize_grad_int8`
  gives, so the update equals the one from the dequantized fp32 gradient bit for bit. Its block size is its own:
  when it equals the tile's row (the int8 moments' block, or the whole tile otherwise) a row reads one scale,
  else each element gathers its block's scale at (tile start + i) >> log2(grad_block_size) (one more load per
  element, from a few scales per tile that stay in L1). A constexpr selects the decode, so the other formats
  compile as before.

Segments: `(start, numel, weight_decay)` tiling [0, numel) in order. Adjacent segments of equal decay are merged
(a decoder layer becomes two runs: its matrices, then its vectors) into a device table of run starts and decays,
cached per (device, stream, runs) like streamtrain_kernels/tiles.py's tensor tables (one pinned, non-blocking upload on
a miss). One launch covers the unit: each program finds the run of its first element and walks forward while a
run boundary falls inside its tile (usually never), filling a per-element decay factor. Launching per segment
instead would split int8 blocks that span two segments and cost a launch per tensor.

Bytes per parameter (read + write; + 2 with weights_out, fp32 grad; a bf16 grad reads 2 fewer, an int8 grad 3
fewer plus 4 / grad_block_size of scales):
  master fp32, moments fp32: 16 + 12 = 28 B      master bf16, moments fp32: 14 + 10 = 24 B
  master fp32, moments bf16: 12 + 8  = 20 B      master bf16, moments bf16: 10 + 6  = 16 B
  master fp32, moments int8: 10 + 6  = 16 B      master bf16, moments int8:  8 + 4  = 12 B
  (+ 16 B of scales per block per moment pair). A qwen7b layer (233 M) in fp32 with weights_out: 7 GB, ~1.6 ms
  at 4.5 TB/s. Compute per element: ~25 fp32 ops, plus one Philox-4x32-10 per 8 elements per stochastically
  rounded stream (up to 3) and ~20 integer ops per int8 moment.

Non-finite values propagate as in torch (no checks, no syncs): a NaN gradient makes p, m, v NaN; for int8 a NaN
makes its block's scale NaN. Without a GPU and without TRITON_INTERPRET=1 the torch reference
`adamw_update_reference` runs instead, with the same bits.
"""

from __future__ import annotations

import math
import operator
import struct
import threading
from collections import OrderedDict
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from streamtrain_kernels.grad_accum import philox_4x32
from streamtrain_kernels.tiles import load_tile, store_tile, to_fp32, uses_triton
from streamtrain_kernels.reference import M_CODE, V_CODE, adamw_stream_seeds

MASTER_DTYPES = (torch.float32, torch.bfloat16)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # int8: with grad_scales and grad_block_size
MOMENT_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.int8: torch.uint8}  # m -> v
MOMENTS_FP32, MOMENTS_BF16, MOMENTS_INT8 = 0, 1, 2
BLOCK_SIZE_RANGE = (8, 16384)  # int8 moment block sizes: powers of two in this range (a tile holds whole blocks)

# Elements per program and warps, fixed from H200 sweeps (bench/bench_adamw_update.py --sweep / --configs), not
# autotuned. Without int8 moments: 1024 elements on 4 warps, the fastest or within 1% of it in every such format at
# qwen7b/32b/72b layer sizes (bench/results/adamw_update_h200_2026-12-04.jsonl: fp32 state 0.98 of the device-to-
# device copy rate; fewer than 8 elements per thread loses up to 0.2 with bf16 state). With int8 moments: one warp
# per 256 elements of a block (8 per thread), a block never split across warps, so its absmax reduction stays in
# the warp: 256 elements on 1 warp gave 0.66-0.67 (fp32 master) and 0.54 (bf16 master) against 0.55 and 0.49-0.50
# for 1024 on 4 warps (adamw_update_h200_2026-12-04e.jsonl). One integer max per block for the scale and its NaN
# (`_block_scale`) instead of two float reductions: 0.67 (fp32 master) and 0.61 (bf16 master), from 0.66 and 0.57
# (adamw_update_h200_2026-12-06.jsonl against -04f.jsonl).
# With int8 moments a program is one warp, so the SM holds at most 32 of them, and fewer at the ~90 registers per
# thread the compiler picks: capped at 64 registers, 0.87 (bf16 master) and 0.97 (fp32 master) of the copy rate
# against 0.81 and 0.91 uncapped (H100, qwen7b layer, adamw_ablation_h100_2026-12-06.jsonl; 48: spills, 0.85 and
# 0.87). 56 beat 64 in three H100 leases (bf16 master 0.879 / 0.886 / 0.890 against 0.872 / 0.865 / 0.870, fp32
# master 0.971 / 0.973 / 0.983 against 0.966 / 0.963 / 0.971; adamw_ablation_h100_2026-12-06{,b,c}.jsonl), hence 56.
# The other formats gain nothing from a cap (0.96-1.0 capped, 0.99-1.0 not).
# A program updating 4 consecutive tiles, its prologue (lr, the fp64 step size, the run table, the Philox keys)
# read once, counts fewer instructions per element (bf16 + int8: 117 against 136 by bench/sass_count.py) but
# spills under the cap and ran slower: 0.71 / 0.82 against 0.87 / 0.96 (-06b.jsonl). The loop that allowed it,
# even at one tile a program, changed the compiled schedule: bf16 + bf16 0.93 with it, 1.0 without (-06c.jsonl).
TILE_GPU = 1024
NUM_WARPS_GPU = 4
INT8_ELEMS_PER_WARP = 256
MAX_REGISTERS_INT8 = 56
MAX_WARPS = 16
SWEEP_OVERRIDE: Optional[Tuple[int, int]] = None  # (tile, num_warps) for every format: benchmark sweeps only
TILE_INTERPRET = 65536  # the interpreter pays per program (a CPU test of the int8 format: 24 s at 8192, 14 s here)


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _code_constants(e_bits: int, m_bits: int) -> tuple:
    """Constants of an (e_bits, m_bits) code, precomputed (the interpreter cannot do arithmetic on constexprs):
    (SHIFT, EXP_BIAS, N_SUB, HALF, CODE_BIAS, SUB_BIAS, MAX_CODE, INV_TOP_BITS, MIN_NORMAL, NEG_MIN_NORMAL);
    INV_TOP_BITS: the fp64 bits of 1 / TOP, TOP = 2 - 2**-m_bits the top code's value."""
    emax = 2**e_bits - 1
    code_bias = (127 - emax) << m_bits
    consts = (23 - m_bits, (127 - emax) << 23, 1 << m_bits, 1 << (22 - m_bits), code_bias, code_bias + (1 << m_bits),
              2**(e_bits + m_bits) - 1, _f64_bits(1.0 / (2.0 - 2.0**-m_bits)), 2.0 ** (1 - emax), -2.0 ** (1 - emax))
    return tuple(tl.constexpr(c) for c in consts)


(M_SHIFT, M_EXP_BIAS, M_N_SUB, M_HALF, M_CODE_BIAS, M_SUB_BIAS, M_MAX_CODE, M_INV_TOP_BITS, M_MIN_NORMAL,
 M_NEG_MIN_NORMAL) = _code_constants(*M_CODE)
(V_SHIFT, V_EXP_BIAS, V_N_SUB, V_HALF, V_CODE_BIAS, V_SUB_BIAS, V_MAX_CODE, V_INV_TOP_BITS, V_MIN_NORMAL,
 V_NEG_MIN_NORMAL) = _code_constants(*V_CODE)


# ---------------------------------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _bf16_bits_to_fp32(x_i16):
    return (x_i16.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _stochastic_bf16_bits(x, c0, c1, k_lo, k_hi, col):
    """fp32 [R, G, 8] -> bf16 bits (int16): (bits + r) >> 16, r the 16 random bits of column `col` of Philox
    counter (c0, c1) under key (k_lo, k_hi); NaN stays NaN (quiet bit set)."""
    r0, r1, r2, r3 = philox_4x32(c0, c1, k_lo, k_hi)
    r0, r1, r2, r3 = r0[:, :, None], r1[:, :, None], r2[:, :, None], r3[:, :, None]
    word = tl.where(col < 2, r0, tl.where(col < 4, r1, tl.where(col < 6, r2, r3)))
    rnd = (word >> ((col & 1) * 16).to(tl.uint32)) & 0xFFFF
    bits = x.to(tl.uint32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = tl.where(is_nan, (bits >> 16) | 0x40, (bits + rnd) >> 16)
    return hi.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _nearest_bf16_bits(x):
    """fp32 -> bf16 bits, round to nearest even (torch's rule, NaN -> 0x7FC0); the interpreter's cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = tl.where(is_nan, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return hi.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _code_decode(code, SHIFT: tl.constexpr, EXP_BIAS: tl.constexpr, N_SUB: tl.constexpr,
                 NEG_MIN_NORMAL: tl.constexpr):
    """fp32 value of mini-float codes (int32); the constants come from `_code_constants`. A code below N_SUB
    (exponent field 0) read as a normal number is MIN_NORMAL / 2 * (1 + f / N_SUB); twice that minus MIN_NORMAL is
    its subnormal value f * MIN_NORMAL / N_SUB, exactly (one fma, no int -> float conversion)."""
    normal = ((code << SHIFT) + EXP_BIAS).to(tl.float32, bitcast=True)
    return tl.where(code < N_SUB, tl.fma(normal, 2.0, NEG_MIN_NORMAL), normal)


@triton.jit
def decode_signed_m_code(code, scale):
    """fp32 value of int8 codes in m's format (int32, sign-extended from the int8) with their scales: the
    magnitude code's value times scale, negated where the int8's sign bit is set (int8 moment m and int8
    gradients, streamtrain_kernels/grad_quant.py)."""
    mag = _code_decode(code & 0x7F, M_SHIFT, M_EXP_BIAS, M_N_SUB, M_NEG_MIN_NORMAL) * scale
    return tl.where(code < 0, -mag, mag)


@triton.jit
def _code_encode(x, SHIFT: tl.constexpr, HALF: tl.constexpr, CODE_BIAS: tl.constexpr, SUB_BIAS: tl.constexpr,
                 MAX_CODE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """Nearest code of fp32 x >= 0 (ties away from zero), saturating at MAX_CODE (NaN too). Below MIN_NORMAL the
    code of x is that of x + MIN_NORMAL (fp32 sum) less N_SUB (SUB_BIAS = CODE_BIAS + N_SUB): integer arithmetic
    only, no float -> int conversion."""
    sub = x < MIN_NORMAL
    y = tl.where(sub, x + MIN_NORMAL, x)
    code = ((y.to(tl.int32, bitcast=True) + HALF) >> SHIFT) - tl.where(sub, SUB_BIAS, CODE_BIAS)
    return tl.minimum(code, MAX_CODE)


@triton.jit
def _block_scale(val, INV_TOP_BITS: tl.constexpr):
    """Per-row absmax / TOP of [R, G, 8] values, NaN if a row holds a NaN. One integer max over the bits of |val|
    finds both: for non-negative floats the int32 order of the bits is the order of the values, and every NaN lies
    above +inf (a float max may drop a NaN). The division is `_div_by_constant` (correctly rounded), also for a
    subnormal amax = k * 2**-149: k / TOP = 8k / 15 (TOP = 15 / 8 for both codes) stays at least 1/30 of the
    subnormal step away from a rounding midpoint, far more than the fp64 product's error."""
    amax = tl.max(tl.max(tl.abs(val).to(tl.int32, bitcast=True), axis=2), axis=1).to(tl.float32, bitcast=True)
    return _div_by_constant(amax, tl.full([], INV_TOP_BITS, tl.int64).to(tl.float64, bitcast=True))


@triton.jit
def _div_by_constant(x, inv64):
    """fp32 x / c, correctly rounded, for fp32 x and c with inv64 = fp64(1 / c): fp32(fp64(x) * inv64). The fp64
    product is within 2**-52 (relative) of x / c, and x / c of two fp32 numbers is never closer than 2**-50 to a
    midpoint between fp32 neighbours (x = mid * c would need a 25-bit odd significand times c's to fit in 24
    bits), so rounding the product to fp32 rounds x / c. Valid while x / c is a normal fp32 number or 0, inf or
    NaN (x = inf gives inf, as x / c does). Two conversions and a multiply, against ~11 instructions and a branch
    for a `div_rn`."""
    return (x.to(tl.float64) * inv64).to(tl.float32)


@triton.jit
def _normalised(val, scale):
    """|val| / scale as |val| * (1 / scale): one correctly rounded division per block instead of one per element."""
    inv = tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0))[:, None, None]
    return tl.abs(val) * inv


@triton.jit
def _run_decay(run_ptr, n_runs, r, lr64):
    wd = tl.load(run_ptr + n_runs + 1 + r).to(tl.float64, bitcast=True)
    return (1.0 - lr64 * wd).to(tl.float32)


@triton.jit(do_not_specialize=["numel", "n_runs", "bc1_bits", "inv_bc2_bits", "group0", "kp_lo", "kp_hi", "km_lo",
                               "km_hi", "kv_lo", "kv_hi"])
def _adamw_kernel(p_ptr, m_ptr, v_ptr, g_ptr, w_ptr, ms_ptr, vs_ptr, gs_ptr, lr_ptr, clip_ptr, run_ptr, n_runs,
                  numel, bc1_bits, inv_bc2_bits, lerp_coef, beta2, one_minus_beta2, eps, group0,
                  kp_lo, kp_hi, km_lo, km_hi, kv_lo, kv_hi,
                  R: tl.constexpr, G: tl.constexpr, NR_POW2: tl.constexpr, LERP_SMALL: tl.constexpr,
                  MASTER_BF16: tl.constexpr, MOMENTS: tl.constexpr, WITH_WEIGHTS: tl.constexpr,
                  GRAD_INT8: tl.constexpr, GRAD_SHIFT: tl.constexpr, GRAD_PER_ROW: tl.constexpr):
    TILE: tl.constexpr = R * G * 8
    pid = tl.program_id(0).to(tl.int64)
    tile_start = pid * TILE
    # 32-bit offsets inside the tile from pointers moved to its start: 64-bit index arithmetic per element costs
    # two instructions per add and compare
    col = tl.arange(0, 8)[None, None, :]
    offs = tl.arange(0, R)[:, None, None] * (G * 8) + tl.arange(0, G)[None, :, None] * 8 + col
    rem = tl.minimum(numel - tile_start, TILE).to(tl.int32)
    full = rem == TILE
    p_ptr += tile_start
    m_ptr += tile_start
    v_ptr += tile_start
    g_ptr += tile_start
    w_ptr += tile_start

    lr64 = tl.load(lr_ptr).to(tl.float64)
    # fp64 `/` is correctly rounded on the GPU (div.rn.f64; only fp32 `/` is approximate there)
    step_size = (-(lr64 / bc1_bits.to(tl.int64).to(tl.float64, bitcast=True))).to(tl.float32)
    inv_bc2 = inv_bc2_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if GRAD_INT8:
        # grad block b = [b << GRAD_SHIFT, (b + 1) << GRAD_SHIFT)
        n_grad_blocks = (numel + (1 << GRAD_SHIFT) - 1) >> GRAD_SHIFT
        if GRAD_PER_ROW:  # a grad block is a tile row
            grad_rows = pid * R + tl.arange(0, R)
            g_scale = tl.load(gs_ptr + grad_rows, mask=grad_rows < n_grad_blocks, other=0.0)[:, None, None]
        else:  # gather: the tile may start inside a grad block and hold parts of several
            first = tile_start >> GRAD_SHIFT
            into_first = (tile_start - (first << GRAD_SHIFT)).to(tl.int32)
            g_scale = load_tile(gs_ptr + first, (into_first + offs) >> GRAD_SHIFT, (n_grad_blocks - first).to(tl.int32),
                                full)
        g = decode_signed_m_code(load_tile(g_ptr, offs, rem, full).to(tl.int32), g_scale) * tl.load(clip_ptr)
    else:
        g = to_fp32(load_tile(g_ptr, offs, rem, full)) * tl.load(clip_ptr)
    if MASTER_BF16:
        p = _bf16_bits_to_fp32(load_tile(p_ptr, offs, rem, full))
    else:
        p = load_tile(p_ptr, offs, rem, full)
    if MOMENTS == 2:
        blocks = pid * R + tl.arange(0, R)
        n_blocks = (numel + G * 8 - 1) // (G * 8)
        m_scale = tl.load(ms_ptr + blocks, mask=blocks < n_blocks, other=0.0)[:, None, None]
        v_scale = tl.load(vs_ptr + blocks, mask=blocks < n_blocks, other=0.0)[:, None, None]
        m = decode_signed_m_code(load_tile(m_ptr, offs, rem, full).to(tl.int32), m_scale)
        v = _code_decode(load_tile(v_ptr, offs, rem, full).to(tl.int32), V_SHIFT, V_EXP_BIAS, V_N_SUB,
                         V_NEG_MIN_NORMAL) * v_scale
    elif MOMENTS == 1:
        m = _bf16_bits_to_fp32(load_tile(m_ptr, offs, rem, full))
        v = _bf16_bits_to_fp32(load_tile(v_ptr, offs, rem, full))
    else:
        m = load_tile(m_ptr, offs, rem, full)
        v = load_tile(v_ptr, offs, rem, full)

    # weight decay, per element: the run of the tile's first element, then any run starting inside the tile (rare).
    # Branching around the per-element factor in the usual one-run tile was slower (H100: 0.74 of the copy rate
    # against 0.81 with bf16 master and int8 moments, adamw_ablation_h100_2026-12-06.jsonl).
    run_rows = tl.arange(0, NR_POW2)
    starts = tl.load(run_ptr + run_rows, mask=(run_rows >= 1) & (run_rows < n_runs), other=2**62)
    r = tl.sum((starts <= tile_start).to(tl.int32), axis=0)
    decay = tl.full([R, G, 8], 0.0, tl.float32) + _run_decay(run_ptr, n_runs, r, lr64)
    next_start = tl.load(run_ptr + r + 1)
    while next_start < tile_start + rem:
        r += 1
        decay = tl.where(offs >= (next_start - tile_start).to(tl.int32), _run_decay(run_ptr, n_runs, r, lr64), decay)
        next_start = tl.load(run_ptr + r + 1)
    p = p * decay

    if LERP_SMALL:
        m = tl.fma(lerp_coef, g - m, m)
    else:
        m = tl.fma(lerp_coef, g - m, g)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = _div_by_constant(tl.math.sqrt_rn(v), inv_bc2) + eps
    p = p + tl.math.div_rn(step_size * m, denom)

    # Philox counters of the tile's 8-element groups, [R, G]
    counter = group0 + pid * (TILE // 8) + tl.arange(0, R)[:, None] * G + tl.arange(0, G)[None, :]
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    if MASTER_BF16:
        p_bits = _stochastic_bf16_bits(p, c0, c1, kp_lo.to(tl.uint32), kp_hi.to(tl.uint32), col)
        store_tile(p_ptr, offs, rem, full, p_bits)
        if WITH_WEIGHTS:
            store_tile(w_ptr, offs, rem, full, p_bits)
    else:
        store_tile(p_ptr, offs, rem, full, p)
        if WITH_WEIGHTS:
            store_tile(w_ptr, offs, rem, full, _nearest_bf16_bits(p))
    if MOMENTS == 2:
        m_scale_new = _block_scale(m, M_INV_TOP_BITS)
        code = _code_encode(_normalised(m, m_scale_new), M_SHIFT, M_HALF, M_CODE_BIAS, M_SUB_BIAS, M_MAX_CODE,
                            M_MIN_NORMAL)
        code = tl.where((m < 0) & (code > 0), code + 128, code)
        store_tile(m_ptr, offs, rem, full, code.to(tl.int8))
        v_scale_new = _block_scale(v, V_INV_TOP_BITS)
        code = _code_encode(_normalised(v, v_scale_new), V_SHIFT, V_HALF, V_CODE_BIAS, V_SUB_BIAS, V_MAX_CODE,
                            V_MIN_NORMAL)
        code = tl.where((code == 0) & (v > 0), 1, code)
        store_tile(v_ptr, offs, rem, full, code.to(tl.uint8))
        tl.store(ms_ptr + blocks, m_scale_new, mask=blocks < n_blocks)
        tl.store(vs_ptr + blocks, v_scale_new, mask=blocks < n_blocks)
    elif MOMENTS == 1:
        store_tile(m_ptr, offs, rem, full, _stochastic_bf16_bits(m, c0, c1, km_lo.to(tl.uint32),
                                                                  km_hi.to(tl.uint32), col))
        store_tile(v_ptr, offs, rem, full, _stochastic_bf16_bits(v, c0, c1, kv_lo.to(tl.uint32),
                                                                  kv_hi.to(tl.uint32), col))
    else:
        store_tile(m_ptr, offs, rem, full, m)
        store_tile(v_ptr, offs, rem, full, v)


# ---------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------
_RUN_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_RUN_CACHE_SIZE = 256
_RUN_LOCK = threading.Lock()


def _fp32(x: float) -> float:
    """The nearest fp32 value of a Python float, as a Python float (exact when Triton passes it as fp32)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def _run_table(runs: Tuple[Tuple[int, float], ...], numel: int, device: torch.device) -> torch.Tensor:
    """int64 [2 * n_runs + 1]: the run starts, `numel`, then each run's weight decay as fp64 bits."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, numel, runs)
    with _RUN_LOCK:
        hit = _RUN_CACHE.get(key)
        if hit is not None:
            _RUN_CACHE.move_to_end(key)
            return hit
    host = torch.tensor([s for s, _ in runs] + [numel] + [_f64_bits(wd) for _, wd in runs], dtype=torch.int64)
    # pinned + non_blocking: no host sync; the caching host allocator keeps the buffer until the copy ran
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    with _RUN_LOCK:
        _RUN_CACHE[key] = table
        if len(_RUN_CACHE) > _RUN_CACHE_SIZE:
            _RUN_CACHE.popitem(last=False)
    return table


def _check_flat(name: str, t, dtypes, numel: Optional[int], device) -> None:
    op = "adamw_update"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be 1-D and contiguous, got shape {tuple(t.shape)} stride {t.stride()}")
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{op}: {name} has {t.numel()} elements, master has {numel}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, master on {device}")


def _check_scalar_tensor(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != torch.float32 or t.device != device:
        got = f"{t.dtype} shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"adamw_update: {name} must be a 0-d torch.float32 tensor on {device} (read in the kernel, "
                         f"no host sync), got {got}")


def _merged_runs(segments, numel: int) -> Tuple[Tuple[int, float], ...]:
    """Validate segments (start, numel, weight_decay) tiling [0, numel) in order; merge equal neighbours."""
    op = "adamw_update"
    runs: List[Tuple[int, float]] = []
    expected = 0
    for i, seg in enumerate(segments):
        try:
            start, count, wd = seg
            start, count = operator.index(start), operator.index(count)
            wd = float(wd)
        except (TypeError, ValueError):
            raise ValueError(f"{op}: segments[{i}] is {seg!r}; each segment is (start, numel, weight_decay) with "
                             "integer start and numel") from None
        if start != expected:
            raise ValueError(f"{op}: segments must tile [0, {numel}) in order: segments[{i}] starts at {start}, "
                             f"expected {expected}")
        if count < 0 or not math.isfinite(wd) or wd < 0:
            raise ValueError(f"{op}: segments[{i}] = {seg!r}: numel must be >= 0 and weight_decay finite and >= 0")
        if count == 0:
            continue
        if not runs or runs[-1][1] != wd:
            runs.append((start, wd))
        expected = start + count
    if expected != numel:
        raise ValueError(f"{op}: segments must tile [0, {numel}) in order: they end at {expected}")
    return tuple(runs)


def layout_segments(layout, weight_decay: float) -> List[Tuple[int, int, float]]:
    """Segments of a `UnitLayout`'s flat buffer [0, layout.numel): each tensor with its alignment padding after it,
    `weight_decay` on tensors of two or more dimensions (`spec.decay`), 0 on the rest."""
    ends = layout.offsets[1:] + [layout.numel]
    segments = [(off, end - off, weight_decay if s.decay else 0.0)
                for s, off, end in zip(layout.specs, layout.offsets, ends)]
    if layout.offsets and layout.offsets[0] > 0:
        segments.insert(0, (0, layout.offsets[0], 0.0))
    return segments


class Launch(NamedTuple):
    """The [rows, groups, 8] tile (groups * 8 = the int8 block size, rows blocks a tile; rows = 1 without int8),
    warps and register cap (None: the compiler's choice) of a program."""
    rows: int
    groups: int
    num_warps: int
    maxnreg: Optional[int]


def launch_config(device: torch.device, block_size: Optional[int]) -> Launch:
    """The launch of one update over a unit: fixed per format and device (see TILE_GPU and what follows)."""
    if device.type != "cuda":
        tile, num_warps, maxnreg = TILE_INTERPRET, 1, None
    else:
        maxnreg = None if block_size is None else MAX_REGISTERS_INT8
        if SWEEP_OVERRIDE is not None:
            tile, num_warps = SWEEP_OVERRIDE
        elif block_size is None:
            tile, num_warps = TILE_GPU, NUM_WARPS_GPU
        else:
            num_warps = max(1, min(MAX_WARPS, block_size // INT8_ELEMS_PER_WARP))
            tile = max(block_size, INT8_ELEMS_PER_WARP)
    if block_size is None:
        return Launch(1, tile // 8, num_warps, maxnreg)
    return Launch(max(1, tile // block_size), block_size // 8, num_warps, maxnreg)


def adamw_update(master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, *, lr: torch.Tensor,
                 clip: torch.Tensor, step: int, beta1: float, beta2: float, eps: float,
                 segments: Sequence[Tuple[int, int, float]], weights_out: Optional[torch.Tensor] = None,
                 m_scales: Optional[torch.Tensor] = None, v_scales: Optional[torch.Tensor] = None,
                 block_size: Optional[int] = None, seed: int = 0, offset: int = 0,
                 grad_scales: Optional[torch.Tensor] = None, grad_block_size: Optional[int] = None) -> None:
    """One AdamW step in place over flat state, in one launch (see the module docstring for the arithmetic).

    master: 1-D contiguous fp32 or bf16. m, v: same numel; fp32 / fp32, bf16 / bf16, or int8 / uint8 (blockwise
    8-bit codes, with fp32 `m_scales` / `v_scales` of ceil(numel / block_size) elements and `block_size` a power of
    two in [8, 16384]). grad: fp32, bf16, or int8 (streamtrain_kernels/grad_quant.py's codes, with its fp32
    `grad_scales` of ceil(numel / grad_block_size) elements and `grad_block_size`, a power of two in [8, 16384],
    independent of the moments' block_size). weights_out: optional bf16, receives the new master rounded to nearest
    (for a bf16 master: the same bits). lr, clip: 0-d fp32 tensors on the state's device. step: the Adam step
    count after its increment (Python int >= 1). segments: (start, numel, weight_decay) tiling [0, numel) in
    order (`layout_segments` builds them for a UnitLayout). seed: any int, keys the stochastic rounding of bf16
    state; offset: logical index of element 0 in that random stream, a multiple of 8. Raises ValueError, before
    launching anything, on a bad argument."""
    op = "adamw_update"
    _check_flat("master", master, MASTER_DTYPES, None, None)
    numel, device = master.numel(), master.device
    _check_flat("m", m, tuple(MOMENT_DTYPES), numel, device)
    _check_flat("v", v, (MOMENT_DTYPES[m.dtype],), numel, device)
    _check_flat("grad", grad, GRAD_DTYPES, numel, device)
    if weights_out is not None:
        _check_flat("weights_out", weights_out, (torch.bfloat16,), numel, device)
    _check_scalar_tensor("lr", lr, device)
    _check_scalar_tensor("clip", clip, device)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{op}: step must be a Python int >= 1 (the step count after its increment), got {step!r}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {beta!r}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps!r}")
    quantized = m.dtype == torch.int8
    if quantized:
        lo, hi = BLOCK_SIZE_RANGE
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not lo <= block_size <= hi \
                or block_size & (block_size - 1):
            raise ValueError(f"{op}: int8 moments need block_size, a power of two in [{lo}, {hi}]; got {block_size!r}")
        n_blocks = -(-numel // block_size)
        for name, s in (("m_scales", m_scales), ("v_scales", v_scales)):
            if s is None:
                raise ValueError(f"{op}: int8 moments need {name} (fp32, {n_blocks} elements: one per block)")
            _check_flat(name, s, (torch.float32,), n_blocks, device)
    elif m_scales is not None or v_scales is not None or block_size is not None:
        raise ValueError(f"{op}: m_scales, v_scales and block_size apply to int8 moments only (m is {m.dtype})")
    grad_int8 = grad.dtype == torch.int8
    if grad_int8:
        lo, hi = BLOCK_SIZE_RANGE
        if isinstance(grad_block_size, bool) or not isinstance(grad_block_size, int) \
                or not lo <= grad_block_size <= hi or grad_block_size & (grad_block_size - 1):
            raise ValueError(f"{op}: an int8 grad needs grad_block_size, a power of two in [{lo}, {hi}]; got "
                             f"{grad_block_size!r}")
        n_grad_blocks = -(-numel // grad_block_size)
        if grad_scales is None:
            raise ValueError(f"{op}: an int8 grad needs grad_scales (fp32, {n_grad_blocks} elements: one per block)")
        _check_flat("grad_scales", grad_scales, (torch.float32,), n_grad_blocks, device)
    elif grad_scales is not None or grad_block_size is not None:
        raise ValueError(f"{op}: grad_scales and grad_block_size apply to an int8 grad only (grad is {grad.dtype})")
    seed = int(seed) & (2**64 - 1)
    offset = operator.index(offset)
    if offset < 0 or offset % 8:
        raise ValueError(f"{op}: offset must be a non-negative multiple of 8, got {offset}")
    runs = _merged_runs(segments, numel)

    if not uses_triton(device):
        from streamtrain_kernels.reference import adamw_update_reference
        adamw_update_reference(master, m, v, grad, lr=lr, clip=clip, step=step, beta1=beta1, beta2=beta2, eps=eps,
                               segments=segments, weights_out=weights_out, m_scales=m_scales, v_scales=v_scales,
                               block_size=block_size, seed=seed, offset=offset, grad_scales=grad_scales,
                               grad_block_size=grad_block_size)
        return
    if numel == 0:
        return
    launch = launch_config(device, block_size if quantized else None)
    R, G = launch.rows, launch.groups
    table = _run_table(runs, numel, device)
    w = _fp32(1.0 - beta1)
    lerp_small = abs(w) < 0.5
    lerp_coef = w if lerp_small else _fp32(w - 1.0)  # w - 1 is exact in fp32 for w in [0.5, 1]
    bc2_sqrt = _fp32(math.sqrt(1.0 - beta2 ** float(step)))  # the kernel divides by it as `_div_by_constant`
    keys = adamw_stream_seeds(seed)
    # + 2**32: every half reaches the kernel as an int64 (Triton types an int argument by its value, so a half
    # below 2**31 would be int32 and compile another variant); the kernel's uint32 cast drops the 2**32
    halves = [k + 2**32 for key in keys for k in (key & 0xFFFFFFFF, key >> 32)]
    moments = {torch.float32: MOMENTS_FP32, torch.bfloat16: MOMENTS_BF16, torch.int8: MOMENTS_INT8}[m.dtype]

    def bits16(t):
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    dummy = master  # placeholder pointer for the tensors a format does not use (never dereferenced)
    grid = (triton.cdiv(numel, R * G * 8),)
    _adamw_kernel[grid](bits16(master), bits16(m), bits16(v), grad,
                        weights_out.view(torch.int16) if weights_out is not None else dummy,
                        m_scales if quantized else dummy, v_scales if quantized else dummy,
                        grad_scales if grad_int8 else dummy, lr, clip, table,
                        len(runs), numel, _f64_bits(1.0 - beta1 ** float(step)), _f64_bits(1.0 / bc2_sqrt),
                        lerp_coef, _fp32(beta2), _fp32(1.0 - beta2), _fp32(eps), offset // 8, *halves, R=R, G=G,
                        NR_POW2=max(2, triton.next_power_of_2(len(runs))),
                        LERP_SMALL=lerp_small, MASTER_BF16=master.dtype == torch.bfloat16, MOMENTS=moments,
                        WITH_WEIGHTS=weights_out is not None, GRAD_INT8=grad_int8,
                        GRAD_SHIFT=grad_block_size.bit_length() - 1 if grad_int8 else 0,
                        GRAD_PER_ROW=grad_int8 and grad_block_size == G * 8,
                        num_warps=launch.num_warps, enable_fp_fusion=False,
                        **({} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}))
