"""Pure-torch references for the Triton kernels in this package, one or more functions per kernel.

They define what each kernel computes: tests compare kernels against them, benchmarks time them as the plain-torch
baseline where that is the best torch way, and the kernels' wrappers call them on a CPU run without the Triton
interpreter. Keep them plain, obviously correct torch code (speed is secondary), documented by their docstrings.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

# ---------------------------------------------------------------------------------------------------------------
# engine/kernels/pack.py
# ---------------------------------------------------------------------------------------------------------------


def sq_norms_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor sum of squares, computed in fp64: fp64 tensor [len(tensors)] on the first tensor's device (CPU
    when the list is empty)."""
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    return torch.stack([t.detach().double().pow(2).sum() for t in tensors]) if len(tensors) else \
        torch.zeros(0, dtype=torch.float64, device=device)


def pack_reference(tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
                   compute_sq_norms: bool = False) -> Optional[torch.Tensor]:
    """`out[off_i : off_i + n_i] = tensors[i].flatten()` cast to out.dtype (torch rounding: nearest even); the
    padding is left untouched. With `compute_sq_norms`, also returns the fp32 per-tensor sums of squares of the
    source values (computed in fp64, rounded once)."""
    for t, off in zip(tensors, offsets):
        out[off:off + t.numel()].copy_(t.detach().reshape(-1))
    if not compute_sq_norms:
        return None
    return sq_norms_reference(tensors).to(device=out.device, dtype=torch.float32)


def unpack_reference(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """`outs[i].view(-1)[:] = flat[off_i : off_i + n_i]` cast to each out's dtype, in place."""
    for o, off in zip(outs, offsets):
        o.view(-1).copy_(flat[off:off + o.numel()])


# ---------------------------------------------------------------------------------------------------------------
# engine/kernels/grad_accum.py
# ---------------------------------------------------------------------------------------------------------------


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
    the generator of engine/kernels/grad_accum.py. `counter`: int64 tensor of non-negative values. Returns four int64
    tensors holding uint32 words."""
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
# engine/kernels/attention.py
# They materialise the [B, Hq, Tq, Tk] scores: tests and small shapes only. Same semantics as the kernel: query
# row i at key position p_i = q_offset + i (default Tk - Tq); key j visible iff j <= p_i (causal) and
# j > p_i - window (window: HF / gpt-oss `sliding_window_overlay`); sinks [Hq] are extra logits with zero value
# appended to each softmax row; GQA: query head j reads kv head j // (Hq // Hkv).
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


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        window: int | None = None, sinks: torch.Tensor | None = None,
                        scale: float | None = None, q_offset: int | None = None,
                        upcast: bool = True):
    """Returns (out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] in the compute dtype).

    upcast=True computes in fp32 (fp64 for fp64 inputs); upcast=False computes every op in the input dtype
    (PyTorch's own low-precision attention, the baseline of the tests' error rule). Differentiable."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    cdt = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    qc, kc, vc = (t.to(cdt) for t in (q, k, v))
    if Hkv != Hq:
        kc = kc.repeat_interleave(Hq // Hkv, dim=1)
        vc = vc.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    mask = attention_mask(Tq, Tk, causal, window, q_offset, device=q.device)
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
# engine/kernels/cross_entropy.py
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
