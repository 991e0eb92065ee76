"""Pure-torch references for the Triton kernels in this package, one or more functions per kernel.

They define what each kernel computes: tests compare kernels against them, benchmarks time them as the plain-torch
baseline where that is the best torch way, and the kernels' wrappers call them on a CPU run without the Triton
interpreter. Keep them plain, obviously correct torch code (speed is secondary), documented by their docstrings.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

# ---------------------------------------------------------------------------------------------------------------
# streamtrain_kernels/grad_accum.py
# ---------------------------------------------------------------------------------------------------------------


SQ_NORM_CHUNK = 1 << 24  # elements squared per fp64 temporary (256 MiB of temporaries at most, not 16 B/element)


def sq_norms_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor sum of squares in fp64: fp64 tensor [len(tensors)] on the first tensor's device (CPU when the list
    is empty). Each square of an fp32 / bf16 / fp16 value is exact in fp64; torch sums them in fp64 per chunk of
    `SQ_NORM_CHUNK` elements, then the chunks' sums in order. This is the gradient norm's definition
    (`engine.optim.sq_norms`), so both engines call it; the chunks bound the fp64 temporary for a large embedding."""
    if not len(tensors):
        return torch.zeros(0, dtype=torch.float64)

    def one(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([c.double().square().sum() for c in t.detach().reshape(-1).split(SQ_NORM_CHUNK)]).sum()

    return torch.stack([one(t) for t in tensors])


def accumulate_reference(flat: torch.Tensor, grads: Sequence[torch.Tensor], offsets: Sequence[int],
                         scale: float = 1.0, first: bool = False,
                         sq_norms_out: Optional[torch.Tensor] = None) -> None:
    """`flat[off_i : off_i + n_i] (+)= scale * grads[i]` with torch `copy_` / `add_` on views of the fp32 `flat`.

    With scale == 1 this is the sequence the kernel must match bit for bit; otherwise the gradient is first scaled
    in fp32 (`g.float() * scale`), then copied or added. `sq_norms_out`, if given, receives each tensor's sum of
    squares of the result (computed in fp64, stored fp32)."""
    views: List[torch.Tensor] = []
    for g, off in zip(grads, offsets):
        view = flat[off:off + g.numel()]
        src = g.detach().reshape(-1)
        if scale != 1.0:
            src = src.float() * scale
        if first:
            view.copy_(src)
        else:
            view.add_(src)
        views.append(view)
    if sq_norms_out is not None:
        sq_norms_out.copy_(sq_norms_reference(views).to(torch.float32))


_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_M32 = 0xFFFFFFFF


def _mul_hi_lo_u32(a: torch.Tensor, b: int):
    """(high, low) 32-bit words of the 64-bit product of uint32 values `a` (held in int64) and the constant `b`,
    exactly, without int64 overflow: split b into 16-bit halves."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    t_lo = a * b_lo  # < 2**48
    t_hi = a * b_hi  # < 2**48; a * b = t_hi * 2**16 + t_lo
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (t_lo + ((t_hi & 0xFFFF) << 16)) & _M32
    return hi & _M32, lo


def philox_reference(seed: int, counter: torch.Tensor):
    """Philox-4x32-10 of counters (counter mod 2**32, counter >> 32, 0, 0) under key (seed low, seed high 32 bits):
    the generator of streamtrain_kernels/grad_accum.py. `counter`: int64 tensor of non-negative values. Returns four
    int64 tensors holding uint32 words."""
    seed = int(seed) & (2**64 - 1)
    c0 = counter & _M32
    c1 = (counter >> 32) & _M32
    c2 = torch.zeros_like(counter)
    c3 = torch.zeros_like(counter)
    k0, k1 = seed & _M32, seed >> 32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo_u32(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo_u32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def stochastic_bits_reference(seed: int, numel: int, offset: int = 0, device=None) -> torch.Tensor:
    """The 16 random bits (int64 in [0, 65536)) that `to_bf16_stochastic` adds to element i: half `k % 2` (low
    half first) of Philox word `(k // 2) % 4` for counter `k // 8`, where k = i + offset."""
    k = torch.arange(numel, dtype=torch.int64, device=device) + int(offset)
    words = torch.stack(philox_reference(seed, k >> 3))  # [4, numel]
    word = words.gather(0, ((k >> 1) & 3).unsqueeze(0)).squeeze(0)
    return (word >> ((k & 1) * 16)) & 0xFFFF


def stochastic_round_reference(x: torch.Tensor, seed: int = 0, offset: int = 0,
                               random_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 -> bf16 with stochastic rounding by the integer trick: bf16 bits = (fp32 bits + r) >> 16 with r a
    16-bit random integer (`random_bits`, or the kernel's Philox stream for (seed, offset)). Unbiased: rounds up
    with probability (dropped 16 bits) / 65536. NaN -> NaN with the quiet bit set (sign, top payload kept); Inf,
    ±0 unchanged. Returns a new bf16 tensor of x's shape."""
    flat = x.detach().reshape(-1)
    if flat.dtype != torch.float32:
        raise ValueError(f"stochastic_round_reference: x must be float32, got {flat.dtype}")
    bits = flat.contiguous().view(torch.int32).to(torch.int64) & _M32
    if random_bits is None:
        random_bits = stochastic_bits_reference(seed, flat.numel(), offset, device=flat.device)
    rounded = ((bits + random_bits.reshape(-1).to(torch.int64)) >> 16) & 0xFFFF
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    hi = torch.where(is_nan, (bits >> 16) | 0x40, rounded)
    hi = torch.where(hi >= 0x8000, hi - 0x10000, hi)  # as signed int16
    return hi.to(torch.int16).view(torch.bfloat16).reshape(x.shape)


# ---------------------------------------------------------------------------------------------------------------
# streamtrain_kernels/attention.py
# They materialise the [B, Hq, Tq, Tk] scores: tests and small shapes only. Same semantics as the kernel: query
# row i at key position p_i = q_offset + i (default Tk - Tq); key j visible iff j <= p_i (causal) and
# j > p_i - window (window: HF / gpt-oss `sliding_window_overlay`); sinks [Hq] are extra logits with zero value
# appended to each softmax row; GQA: query head j reads kv head j // (Hq // Hkv). Packed rows (doc_start [B, Tq],
# engine/batch.py's `doc_start_BT`): key j is visible to query row i only if also j >= doc_start[b, i].
# ---------------------------------------------------------------------------------------------------------------


def attention_mask(Tq: int, Tk: int, causal: bool = True, window: int | None = None,
                   q_offset: int | None = None, device=None) -> torch.Tensor:
    """Boolean [Tq, Tk], True where query row i may see key j."""
    q_offset = Tk - Tq if q_offset is None else q_offset
    pos = torch.arange(Tq, device=device)[:, None] + q_offset
    j = torch.arange(Tk, device=device)[None, :]
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= pos
    if window is not None:
        mask &= j > pos - window
    return mask


def doc_attention_mask(doc_start: torch.Tensor, Tk: int | None = None, causal: bool = True,
                       window: int | None = None, q_offset: int | None = None) -> torch.Tensor:
    """Boolean [B, Tq, Tk] for packed rows: `attention_mask` and j >= doc_start[b, i] (doc_start int [B, Tq]).
    With causal and Tq == Tk: query i sees key j iff doc_start[b, i] <= j <= i (and j > i - window)."""
    B, Tq = doc_start.shape
    Tk = Tq if Tk is None else Tk
    j = torch.arange(Tk, device=doc_start.device)
    docs = j[None, None, :] >= doc_start.long()[:, :, None]
    return docs & attention_mask(Tq, Tk, causal, window, q_offset, device=doc_start.device)[None]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        window: int | None = None, sinks: torch.Tensor | None = None,
                        scale: float | None = None, q_offset: int | None = None,
                        upcast: bool = True, doc_start: torch.Tensor | None = None):
    """Returns (out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] in the compute dtype).

    upcast=True computes in fp32 (fp64 for fp64 inputs); upcast=False computes every op in the input dtype
    (PyTorch's own low-precision attention, the baseline of the tests' error rule). doc_start (int [B, Tq]): packed
    rows, see `doc_attention_mask` (a row that sees no key: out 0, lse -inf, or the sink). Differentiable."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    cdt = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    qc, kc, vc = (t.to(cdt) for t in (q, k, v))
    if Hkv != Hq:
        kc = kc.repeat_interleave(Hq // Hkv, dim=1)
        vc = vc.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    if doc_start is None:
        mask = attention_mask(Tq, Tk, causal, window, q_offset, device=q.device)
    else:
        mask = doc_attention_mask(doc_start.to(q.device), Tk, causal, window, q_offset)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(cdt).view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)
        s = torch.cat([s, sink_col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    if sinks is not None:
        p = p[..., :Tk]
    out = torch.matmul(p, vc)
    return out.to(q.dtype), lse


def merge_reference(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor):
    """Attention over the union of two disjoint key sets from each part's (out, lse), in fp64 then cast back."""
    l1, l2 = lse1.double(), lse2.double()
    lse = torch.logaddexp(l1, l2)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(l1 - ref)[..., None] * out1.double() + torch.exp(l2 - ref)[..., None] * out2.double()
    return out.to(out1.dtype), lse.to(lse1.dtype)


# ---------------------------------------------------------------------------------------------------------------
# streamtrain_kernels/cross_entropy.py
# ---------------------------------------------------------------------------------------------------------------


def cross_entropy_grad_reference(z_CV: torch.Tensor, labels_C: torch.Tensor, scale: float,
                                 ignore_index: int = -100, with_grad: bool = True) -> torch.Tensor:
    """The fused head's per-chunk step: fp32 per-row loss lse(z) - z[label] (0 where label == ignore_index, NaN
    for another label outside [0, V)); with `with_grad`, z_CV is overwritten in place by
    scale * (softmax(z) - onehot(label)) computed in fp32 and rounded to z's dtype (0 rows for ignored labels)."""
    V = z_CV.shape[1]
    z = z_CV.float()
    lse = torch.logsumexp(z, dim=1)
    valid = labels_C != ignore_index
    in_range = (labels_C >= 0) & (labels_C < V)
    safe = torch.where(in_range, labels_C, 0).unsqueeze(1)
    loss = torch.where(in_range, lse - z.gather(1, safe).squeeze(1), float("nan"))
    loss = torch.where(valid, loss, 0.0)
    if with_grad:
        onehot = torch.zeros_like(z).scatter_(1, safe, in_range.unsqueeze(1).float())
        row_scale = torch.where(valid, scale, 0.0).unsqueeze(1)
        z_CV.copy_((torch.exp(z - lse.unsqueeze(1)) - onehot) * row_scale)
    return loss


def linear_cross_entropy_reference(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor,
                                   scale: float = 1.0, ignore_index: int = -100,
                                   chunk_tokens: int | None = None) -> torch.Tensor:
    """The unfused head the fused kernel replaces: per chunk of tokens (default: all at once),
    `F.cross_entropy(F.linear(h, W).float(), labels, reduction="sum")`, summed over chunks, times scale. Logits in
    the inputs' dtype, softmax in fp32; differentiable by autograd (which keeps every chunk's logits)."""
    N = h_ND.shape[0]
    chunk = N if chunk_tokens is None else chunk_tokens
    total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
    for start in range(0, N, max(chunk, 1)):
        z = torch.nn.functional.linear(h_ND[start:start + chunk], weight_VD)
        total = total + torch.nn.functional.cross_entropy(z.float(), labels_N[start:start + chunk],
                                                          ignore_index=ignore_index, reduction="sum")
    return total * scale


# ---------------------------------------------------------------------------------------------------------------
# streamtrain_kernels/adamw_update.py
# Every operation below is one correctly rounded fp32 operation, as in the kernel: torch's CPU `sqrt` is not
# correctly rounded (a fast approximation), so the reference takes the square root through fp64 and fixes the
# rounding; fp32 FMAs go through fp64 with round-to-odd, which makes the final rounding to fp32 exact.
# ---------------------------------------------------------------------------------------------------------------

# 8-bit moment codes (E exponent bits, M mantissa bits), see streamtrain_kernels/adamw_update.py
M_CODE = (4, 3)  # m: sign + e4m3 magnitude
V_CODE = (5, 3)  # v: unsigned e5m3
_GOLDEN64 = 0x9E3779B97F4A7C15
_M64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN64) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def adamw_stream_seeds(seed: int):
    """Philox keys of the three stochastic-rounding streams (master, m, v) of one update: splitmix64 of the seed
    and the stream number, so the streams are decorrelated from each other and from `to_bf16_stochastic(seed)`."""
    seed = int(seed) & _M64
    return tuple(_splitmix64(_splitmix64(seed) ^ stream) for stream in (1, 2, 3))


def fma_fp32_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once. a * b is exact in fp64; the fp64 sum is made round-to-odd (an inexact sum gets
    its last bit set, after stepping toward zero if it was rounded away), so rounding it to fp32 is exact."""
    a, b, c = (torch.as_tensor(t, dtype=torch.float32).double() for t in (a, b, c))
    prod = a * b
    s = prod + c
    s_bb = s - prod
    err = (prod - (s - s_bb)) + (c - s_bb)  # TwoSum: s + err == prod + c exactly
    s_bits = s.view(torch.int64)
    inexact = err != 0
    s_bits = torch.where(inexact & ((err < 0) != (s < 0)), s_bits - 1, s_bits)
    s_bits = torch.where(inexact, s_bits | 1, s_bits)
    return s_bits.view(torch.float64).float()


def sqrt_fp32_reference(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (IEEE sqrt, what the kernel's `sqrt_rn` computes)."""
    s = x.double().sqrt().float()
    s_bits = s.view(torch.int32)
    up, down = (s_bits + 1).view(torch.float32), (s_bits - 1).view(torch.float32)
    hi = (s.double() + up.double()) / 2  # midpoints to the neighbours; their squares are exact in fp64
    lo = (s.double() + down.double()) / 2
    xd = x.double()
    finite = torch.isfinite(s) & (s > 0)
    s = torch.where(finite & (xd > hi * hi), up, s)
    return torch.where(finite & (xd < lo * lo), down, s)


def round_bf16_nearest_reference(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 round to nearest even by the bits (torch's rule, NaN -> 0x7FC0)."""
    b = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    hi = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    hi = torch.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, hi)
    return torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16)


def code_decode_reference(code: torch.Tensor, e_bits: int, m_bits: int) -> torch.Tensor:
    """Value of unsigned mini-float codes (int64 in [0, 2**(e_bits + m_bits))): exponent field e, mantissa f;
    e >= 1: 2**(e - emax) * (1 + f / 2**m_bits), e == 0: f * 2**(1 - emax - m_bits), emax = 2**e_bits - 1; the
    largest code is 2 - 2**-m_bits."""
    emax = 2**e_bits - 1
    normal = ((code << (23 - m_bits)) + ((127 - emax) << 23)).to(torch.int32).view(torch.float32)
    sub = code.to(torch.float32) * 2.0 ** (1 - emax - m_bits)
    return torch.where(code < (1 << m_bits), sub, normal)


def code_encode_reference(x: torch.Tensor, e_bits: int, m_bits: int) -> torch.Tensor:
    """Nearest code (ties away from zero) of fp32 x >= 0 in the code of `code_decode_reference`, saturating at the
    largest code (NaN saturates too). int64. Below the smallest normal value n (subnormal codes) x is encoded as
    the normal code of the fp32 sum x + n, less 2**m_bits: the same rounding, in integer arithmetic."""
    emax = 2**e_bits - 1
    min_normal = 2.0 ** (1 - emax)
    sub = x < min_normal
    b = torch.where(sub, x + min_normal, x).view(torch.int32).to(torch.int64)
    code = ((b + (1 << (22 - m_bits))) >> (23 - m_bits)) - ((127 - emax) << m_bits)
    code = torch.where(sub, code - (1 << m_bits), code)
    return code.clamp(max=2**(e_bits + m_bits) - 1)


def _quantize_blocks(val: torch.Tensor, block_size: int, signed: bool):
    """(codes as int8 / uint8, fp32 per-block scales) of fp32 `val`, blockwise: scale = absmax / top code value."""
    e_bits, m_bits = M_CODE if signed else V_CODE
    top = 2.0 - 2.0 ** -m_bits
    n = val.numel()
    n_blocks = -(-n // block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=torch.float32, device=val.device)
    padded[:n] = val
    blocks = padded.view(n_blocks, block_size)
    scale = blocks.abs().amax(dim=1) / top  # amax propagates NaN, like the kernel
    inv = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))  # one division per block, as the kernel
    x = blocks.abs() * inv[:, None]
    code = code_encode_reference(x, e_bits, m_bits)
    if signed:
        code = torch.where((blocks < 0) & (code > 0), code + 128, code)
        code = torch.where(code >= 128, code - 256, code).to(torch.int8)
    else:
        code = torch.where((code == 0) & (blocks > 0), 1, code).to(torch.uint8)
    return code.reshape(-1)[:n], scale


def dequantize_blocks_reference(code: torch.Tensor, scale: torch.Tensor, block_size: int, signed: bool) -> torch.Tensor:
    """fp32 values of blockwise int8 moment codes (m: `signed`, int8; v: uint8) with their per-block scales."""
    e_bits, m_bits = M_CODE if signed else V_CODE
    c = code.to(torch.int64) & 0xFF
    mag = code_decode_reference(c & 0x7F if signed else c, e_bits, m_bits)
    block_scale = scale.repeat_interleave(block_size)[:code.numel()]
    val = mag * block_scale
    return torch.where(c >= 128, -val, val) if signed else val


def adamw_update_reference(master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, *, lr,
                           clip, step: int, beta1: float, beta2: float, eps: float, segments,
                           weights_out: Optional[torch.Tensor] = None, m_scales: Optional[torch.Tensor] = None,
                           v_scales: Optional[torch.Tensor] = None, block_size: Optional[int] = None,
                           seed: int = 0, offset: int = 0, grad_scales: Optional[torch.Tensor] = None,
                           grad_block_size: Optional[int] = None) -> None:
    """`adamw_update` in torch ops, in place, with the kernel's bits (arguments as there, already validated).

    In fp32: g = grad * clip; p = p * fp32(1 - lr * wd) (wd of the element's segment, the product in fp64);
    m = fma(w, g - m, m) with w = fp32(1 - beta1) (torch's lerp; fma(w - 1, g - m, g) when w >= 0.5);
    v = fma((1 - beta2) * g, g, v * beta2); p = p + (fp32(-lr / bc1) * m) / (sqrt(v) / fp32(sqrt(bc2)) + eps):
    the operation order of torch's fused CPU AdamW. bf16 state is upcast, updated, and stochastically rounded
    with the Philox streams of `adamw_stream_seeds(seed)` at logical index offset + i; int8 moments are decoded
    with their block scales and re-encoded with new ones (see `_quantize_blocks`); `weights_out` gets the new
    master rounded to nearest bf16. An int8 `grad` (streamtrain_kernels/grad_quant.py's codes) is first dequantized
    with `grad_scales` / `grad_block_size` (`dequantize_blocks_reference`, signed)."""
    f32 = lambda x: torch.tensor(float(x), dtype=torch.float64).float()  # noqa: E731  (double -> fp32, nearest)
    n = master.numel()
    device = master.device
    lr64 = lr.detach().double().reshape(())
    bc1 = 1 - beta1 ** float(step)
    bc2 = 1 - beta2 ** float(step)
    decay = torch.empty(n, dtype=torch.float32, device=device)
    for start, count, wd in segments:
        decay[start:start + count] = (1 - lr64 * float(wd)).float()
    step_size = (-(lr64 / bc1)).float()

    if grad.dtype == torch.int8:
        grad = dequantize_blocks_reference(grad, grad_scales, grad_block_size, signed=True)
    g = grad.float() * clip.detach().float().reshape(())
    p = master.float()
    if m.dtype == torch.int8:
        m_val = dequantize_blocks_reference(m, m_scales, block_size, signed=True)
        v_val = dequantize_blocks_reference(v, v_scales, block_size, signed=False)
    else:
        m_val, v_val = m.float(), v.float()
    p = p * decay
    w = f32(1 - beta1)
    diff = g - m_val
    if w.abs() < 0.5:
        m_val = fma_fp32_reference(w.expand(n), diff, m_val)
    else:
        m_val = fma_fp32_reference((w - 1).expand(n), diff, g)
    v_val = fma_fp32_reference(f32(1 - beta2) * g, g, v_val * f32(beta2))
    denom = sqrt_fp32_reference(v_val) / f32(math.sqrt(bc2)) + f32(eps)
    p = p + (step_size * m_val) / denom

    seed_p, seed_m, seed_v = adamw_stream_seeds(seed)
    if master.dtype == torch.bfloat16:
        master.copy_(stochastic_round_reference(p, seed_p, offset))
    else:
        master.copy_(p)
    if m.dtype == torch.int8:
        m_code, m_scale = _quantize_blocks(m_val, block_size, signed=True)
        v_code, v_scale = _quantize_blocks(v_val, block_size, signed=False)
        m.copy_(m_code)
        v.copy_(v_code)
        m_scales.copy_(m_scale)
        v_scales.copy_(v_scale)
    elif m.dtype == torch.bfloat16:
        m.copy_(stochastic_round_reference(m_val, seed_m, offset))
        v.copy_(stochastic_round_reference(v_val, seed_v, offset))
    else:
        m.copy_(m_val)
        v.copy_(v_val)
    if weights_out is not None:
        weights_out.copy_(master if master.dtype == torch.bfloat16 else round_bf16_nearest_reference(p))


# ---------------------------------------------------------------------------------------------------------------
# streamtrain_kernels/grad_quant.py
# ---------------------------------------------------------------------------------------------------------------


def quantize_grad_int8_reference(x: torch.Tensor, seed: int, block_size: int):
    """(codes int8 [n], scales fp32 [ceil(n / block_size)]) of fp32 `x` in the int8 moment m's code (sign + e4m3
    magnitude, blockwise scale = absmax / top code as `_quantize_blocks`), the magnitude rounded stochastically.

    y = |x| * fp32(1 / scale) lies between adjacent code values lo <= y <= hi; its position in code units, p = code
    of lo + (y - lo) / (hi - lo), is exact in fixed point with 20 fraction bits: in the normal range the fp32 bits
    of y less the code's exponent bias (the mantissa bits below the code's 3 are the fraction), below it floor(y *
    2**37) (y in units of the subnormal step 2**-17, times 2**20: a power-of-two scaling, then floor). p is clamped
    to the top code (y above it, a NaN), and code = (p + 16 * r) >> 20 with r the element's 16 random bits
    (`stochastic_bits_reference(seed, n)`): hi with probability floor(2**16 * frac) / 2**16. Negative values get
    +128 when their magnitude code is > 0."""
    e_bits, m_bits = M_CODE
    emax = 2**e_bits - 1
    shift = 23 - m_bits
    top = 2.0 - 2.0 ** -m_bits
    n = x.numel()
    n_blocks = -(-n // block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    blocks = padded.view(n_blocks, block_size)
    scale = blocks.abs().amax(dim=1) / top
    inv = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    y = blocks.abs() * inv[:, None]
    y_bits = y.view(torch.int32).to(torch.int64) & 0x7FFFFFFF  # a NaN's sign bit is no magnitude
    normal = y_bits >= ((128 - emax) << 23)  # y >= 2**(1 - emax), the smallest normal code (a NaN too)
    sub_pos = (torch.where(normal, 0.0, y) * 2.0 ** (emax - 1 + m_bits + shift)).to(torch.int64)
    pos = torch.where(normal, y_bits - ((127 - emax) << 23), sub_pos).clamp(max=(2**(e_bits + m_bits) - 1) << shift)
    r = torch.zeros(n_blocks * block_size, dtype=torch.int64, device=x.device)
    r[:n] = stochastic_bits_reference(seed, n, device=x.device)
    code = (pos + (r.view(n_blocks, block_size) << (shift - 16))) >> shift
    code = torch.where((blocks < 0) & (code > 0), code + 128, code)
    code = torch.where(code >= 128, code - 256, code).to(torch.int8)
    return code.reshape(-1)[:n], scale
