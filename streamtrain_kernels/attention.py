"""Flash attention (forward + backward) in Triton: causal, GQA, sliding window, attention sinks, returns the LSE.

    out = flash_attention(q, k, v, causal=True, window=None, sinks=None, scale=None)
    out, lse = flash_attention_with_lse(q, k, v, ...)      # lse [B, Hq, Tq] fp32, natural log, sink included
    out = flash_attention(q, k, v, doc_start=ds)            # packed rows: ds int32 [B, T], see "Documents"
    out, lse = merge_attention(out1, lse1, out2, lse2)      # combine attention over two disjoint KV chunks

Shapes: q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D] (any strides with the last dim contiguous, e.g. the
`.transpose(1, 2)` views of engine/model/dense.py), bf16 / fp16 (fp32 allowed: exact IEEE dots, for tests).
Query head j reads kv head j // (Hq // Hkv) (HF repeat_kv / SDPA enable_gqa grouping); any ratio. D is a power
of two in 16..128. Usually Tq == Tk; they may differ for chunked attention (see `q_offset`).

Masking. Query row i sits at position p_i = q_offset + i on the key axis (default q_offset = Tk - Tq, i.e. the
last query is aligned with the last key, the flash-attn convention; 0 when Tq == Tk). Key j is visible iff
    j <= p_i                  when causal
    j >  p_i - window         when window is given (HF / gpt-oss `sliding_window_overlay`: kv_idx > q_idx - W),
so a causal window-W row sees exactly W keys including itself (fewer at the start). Without `causal` the window
only bounds the past (the future stays visible). A row that sees no key returns 0 and lse = -inf (lse = sink
with sinks), which `merge_attention` handles.

Documents (packed rows). `doc_start` int32 [B, T] (engine/batch.py's `doc_start_BT`: for each position the index
where its document begins; documents are contiguous runs, so doc_start never decreases along a row and
doc_start[i] <= i) adds j >= doc_start[b, i] to the mask: query i sees doc_start[b, i] <= j <= i, and j > i - window
with a window; sinks still apply to every row. A packed row then computes what each document computes alone
(tests: packed = per-document slices). It needs causal=True and Tq == Tk with q_offset 0 (chunked attention over
packed rows is refused with a ValueError). Its values are trusted, not read on the host (that would sync the GPU):
`check_doc_start` validates a batch where wanted; an invalid one gives wrong numbers, never an out-of-bounds access.
It is a constexpr specialisation (HAS_DOCS): doc_start=None compiles and runs exactly the kernels without it.
  How: row i's lowest visible key becomes max(i - window + 1, doc_start[i]); both terms are non-decreasing in i, so
a query block (forward, dQ) starts its key loop at its first row's bound (one scalar load) and its unmasked range
at its last valid row's: key blocks wholly before the block's documents are never loaded. The rows that see key j
are j <= i < min(j + window, doc_end[j]), doc_end[j] = the start of the next document (or T): the backward wrapper
computes doc_end once per call (a suffix minimum over [B, T]: a few tiny torch ops, no sync, one int32 [B, T]
temporary; the forward needs none), and a dK/dV key block stops its query loop at its last valid key's doc_end and
runs unmasked up to its first key's. So blocks wholly inside one document and below the diagonal run unmasked,
as before; only blocks touching a document start (plus the diagonal, window edge and ragged end as before) build
the mask, at one int32 load per query row and a compare per tile.
  Cost: each query block visits the keys from its first row's document start to its diagonal. With documents
longer than the blocks (64-128 rows on the GPU) that is the per-document causal work plus, at each boundary, one
block row over the previous document (the block straddling the boundary): about what separate per-document calls
cost, in one launch and without their padding or launch overhead. With documents shorter than a block, a block
spanning several documents also visits (masked) the keys of its earlier documents: towards BLOCK_M x (BLOCK_M +
previous document) per block, still far below causal attention over the whole row.

Sinks (gpt-oss): `sinks` fp32 [Hq] is an extra logit per head in every softmax row with a zero value vector:
p = softmax([s_i1..s_iT, sink_h]), out_i = sum_j p_ij v_j, lse_i = log(sum_j exp(s_ij) + exp(sink_h)).
Its gradient: dL/dsink_h = -sum_{b,i} p_sink_i * (rowsum(dO_i * O_i) - dlse_i), p_sink_i = exp(sink_h - lse_i)
(from dO_i/dsink = -p_sink_i O_i and dlse_i/dsink = p_sink_i).

Algorithm. Forward: one program per (BLOCK_M query rows, batch, query head); online softmax in fp32 (exp2 with
scale*log2(e) folded); K/V of the kv head read in place (GQA costs no copy). Backward (FA2): a preprocess
kernel computes delta_i = rowsum(dO_i * O_i) - dlse_i; a dK/dV kernel with one program per (BLOCK_N keys, batch,
kv head) loops over the G = Hq/Hkv query heads of its group and over their query blocks, accumulating dK and dV
of the group in fp32 registers and storing them once: no atomics, no [B, Hq, Tk, D] partial buffers (zero extra
memory for GQA), at the price of G times more work per program (fewer, longer programs: fine from ~16K tokens
up). dQ comes from a separate kernel (one program per query block, like the forward) that recomputes P, so the
whole backward is deterministic (bitwise reproducible run to run). Memory is O(T): never a T x T tensor; the
backward keeps only out and lse [B, Hq, Tq] fp32 (plus delta of the same size).

Block skipping: each program computes the range of key blocks (forward, dQ) or query blocks (dK/dV) that its
causal/window band touches and visits only those; blocks fully inside the band run without any masking, only
the diagonal, window-edge and ragged last blocks build a mask. Causal costs half of full attention, a window W
costs O(T * W).

Tensor-core use: on the GPU the dots take bf16/fp16 operands with fp32 accumulation. Under the Triton
interpreter (TRITON_INTERPRET=1, CPU tests) every load is upcast to fp32 at once and the dots run in fp32
(bf16 dots are wrong there), and there is exactly one small config per kernel (32 x 16 / 16 x 32 blocks).

Autotuning (GPU): a small config set per kernel keyed on (D, T bucket, causal, window is None); the T bucket is
next_pow2(T) capped at 16K, so all long sequences share one tuned config per kernel. Triton's autotuner times every
config about 8 times on the call that meets a key first; at 512K tokens (qwen7b: 5-13 s per kernel call) that is
over ten minutes. So the first call longer than the cap tunes on a proxy first: the same kernel on the first 16K
positions of its own inputs (same key; causal rows there see only keys there, so the slice is a valid problem), in a
fraction of a second, and then runs once at full length with the tuned config. STREAMTRAIN_ATTN_AUTOTUNE=0 skips
tuning and uses one default config per kernel, as does torch's deterministic mode (`train.deterministic`); fp32
inputs always use a fixed small config. A fresh machine compiles ~14 configs per (D, causal, window, sinks) combination on first use (about a
minute).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HEAD_DIMS = (16, 32, 64, 128)  # head_dim: a power of two in 16..128
AUTOTUNE = os.environ.get("STREAMTRAIN_ATTN_AUTOTUNE", "1") != "0" and not INTERPRET
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_NEG_INF = float("-inf")

__all__ = ["FlashAttention", "check_doc_start", "flash_attention", "flash_attention_with_lse", "merge_attention"]


# ----------------------------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _split_range(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Block starts [a, b) masked, [b, c) unmasked, [c, hi) masked, covering [lo, hi). All inputs >= 0."""
    a = (lo // BLOCK) * BLOCK
    b = ((full_lo + BLOCK - 1) // BLOCK) * BLOCK
    b = tl.minimum(tl.maximum(b, a), tl.maximum(hi, a))
    c = (full_hi // BLOCK) * BLOCK
    c = tl.maximum(c, b)
    return a, b, c


@triton.jit
def _kv_range(start_m, q_offset, Tk, W, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Keys a query block [start_m, start_m + BLOCK_M) can see: [lo, hi); fully visible to every row: [flo, fhi)."""
    pmin = start_m + q_offset
    pmax = pmin + BLOCK_M - 1
    hi = Tk + 0 * pmin
    fhi = Tk + 0 * pmin
    if CAUSAL:
        hi = tl.maximum(tl.minimum(hi, pmax + 1), 0)
        fhi = tl.maximum(tl.minimum(fhi, pmin + 1), 0)
    lo = 0 * pmin
    flo = 0 * pmin
    if HAS_WINDOW:
        lo = tl.maximum(pmin - W + 1, 0)
        flo = tl.maximum(pmax - W + 1, 0)
    return lo, flo, fhi, hi


@triton.jit
def _doc_kv_bounds(DS, start_m, Tq, lo, flo, BLOCK_M: tl.constexpr):
    """Documents (q_offset = 0): raise the key range of query block [start_m, start_m + BLOCK_M) to its first row's
    doc_start (the smallest, doc_start never decreases along a row) and its fully visible range to the last valid
    row's (the largest)."""
    lo = tl.maximum(lo, tl.load(DS + start_m))
    flo = tl.maximum(flo, tl.load(DS + tl.minimum(start_m + BLOCK_M, Tq) - 1))
    return lo, flo


@triton.jit
def _doc_q_bounds(DE, start_n, Tk, fhi, hi, BLOCK_N: tl.constexpr):
    """Documents (q_offset = 0): the queries that see key j end at doc_end[j] (exclusive): cap the query range of key
    block [start_n, start_n + BLOCK_N) at its last valid key's doc_end and the fully visible range at its first's."""
    hi = tl.minimum(hi, tl.load(DE + tl.minimum(start_n + BLOCK_N, Tk) - 1))
    fhi = tl.minimum(fhi, tl.load(DE + start_n))
    return fhi, hi


@triton.jit
def _q_range(start_n, q_offset, Tq, W, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query rows that see some key of [start_n, start_n + BLOCK_N): [lo, hi); that see all of it: [flo, fhi)."""
    jmin = start_n
    jmax = start_n + BLOCK_N - 1
    lo = 0 * jmin
    flo = 0 * jmin
    if CAUSAL:
        lo = tl.maximum(jmin - q_offset, 0)
        flo = tl.maximum(jmax - q_offset, 0)
    hi = Tq + 0 * jmin
    fhi = Tq + 0 * jmin
    if HAS_WINDOW:
        hi = tl.minimum(hi, tl.maximum(jmax + W - q_offset, 0))
        fhi = tl.minimum(fhi, tl.maximum(jmin + W - q_offset, 0))
    return lo, flo, fhi, hi


# ----------------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset, qk_scale, Tk, W,
               n_lo, n_hi, ds_m,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
               BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    for start_n in range(n_lo, n_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        ld = (offs_n < Tk)[:, None]
        k = tl.load(K + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(V + offs_n[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=ld, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # unscaled: the scale folds into one FMA below
        if MASK:
            pos_q = offs_m + q_offset
            vis = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
            if CAUSAL:
                vis = vis & (offs_n[None, :] <= pos_q[:, None])
            if HAS_WINDOW:
                vis = vis & (offs_n[None, :] > pos_q[:, None] - W)
            if HAS_DOCS:
                vis = vis & (offs_n[None, :] >= ds_m[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, S, O, LSE, DS,
              stride_qb, stride_qh, stride_qt,
              stride_kb, stride_kh, stride_kt,
              stride_vb, stride_vh, stride_vt,
              stride_ob, stride_oh, stride_ot,
              Hq, G, Tq, Tk, q_offset, W, qk_scale, T_BUCKET,
              HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
              HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the heaviest (last) query blocks first: better tail balance
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    start_m = pid_m * BLOCK_M
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    O += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    LSE += bh.to(tl.int64) * Tq

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    q = tl.load(Q + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if HAS_SINKS:  # the sink is a key with logit sink and value 0: start the running max/sum with it
        sink = tl.load(S + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    lo, flo, fhi, hi = _kv_range(start_m, q_offset, Tk, W, BLOCK_M, CAUSAL, HAS_WINDOW)
    ds_m = offs_m  # placeholder without documents (unused)
    if HAS_DOCS:
        DS += b.to(tl.int64) * Tq
        ds_m = tl.load(DS + offs_m, mask=row_ok, other=0)
        lo, flo = _doc_kv_bounds(DS, start_m, Tq, lo, flo, BLOCK_M)
    a, bb, c = _split_range(lo, flo, fhi, hi, BLOCK_N)
    if HAS_WINDOW or HAS_DOCS:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset,
                                   qk_scale, Tk, W, a, bb, ds_m, True, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N, UPCAST,
                                   PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset,
                               qk_scale, Tk, W, bb, c, ds_m, False, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N, UPCAST, PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset,
                               qk_scale, Tk, W, c, hi, ds_m, True, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N, UPCAST, PREC)

    empty = l_i == 0.0  # no key and no sink: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + offs_m[:, None].to(tl.int64) * stride_ot + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(O, DO, DLSE, DELTA,
                    stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot,
                    Hq, Tq, HEAD_DIM: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None].to(tl.int64) * stride_ot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None].to(tl.int64) * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh.to(tl.int64) * Tq + offs_m, mask=row_ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * Tq + offs_m, delta, mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qt, stride_dot, offs_m0, offs_d, offs_n, qk_scale,
                q_offset, Tq, Tk, W, m_lo, m_hi,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
                BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    for start_m in range(m_lo, m_hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        row_ok = offs_m < Tq
        q = tl.load(Q + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + offs_m[:, None].to(tl.int64) * stride_dot + offs_d[None, :], mask=row_ok[:, None],
                     other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # lse in log2 units, +inf for rows out of range or that saw nothing (p = 0 there)
        lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        pT = tl.math.exp2(sT - lse[None, :])
        if MASK:  # [N, M] orientation
            pos_q = offs_m + q_offset
            vis = (offs_m[None, :] < Tq) & (offs_n[:, None] < Tk)
            if CAUSAL:
                vis = vis & (offs_n[:, None] <= pos_q[None, :])
            if HAS_WINDOW:
                vis = vis & (offs_n[:, None] > pos_q[None, :] - W)
            if HAS_DOCS:
                ds_m = tl.load(DS + offs_m, mask=row_ok, other=0)
                vis = vis & (offs_n[:, None] >= ds_m[None, :])
            pT = tl.where(vis, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DS, DE,
                   stride_qb, stride_qh, stride_qt,
                   stride_kb, stride_kh, stride_kt,
                   stride_vb, stride_vh, stride_vt,
                   stride_dob, stride_doh, stride_dot,
                   stride_dkb, stride_dkh, stride_dkt,
                   stride_dvb, stride_dvh, stride_dvt,
                   Hq, Hkv, G, Tq, Tk, q_offset, W, qk_scale, scale, T_BUCKET,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
                   UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # causal: the first key blocks are the heaviest and run first
    bh = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Tk
    K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    k = tl.load(K + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + offs_n[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    lo, flo, fhi, hi = _q_range(start_n, q_offset, Tq, W, BLOCK_N, CAUSAL, HAS_WINDOW)
    if HAS_DOCS:
        DS += b.to(tl.int64) * Tq
        DE += b.to(tl.int64) * Tk
        fhi, hi = _doc_q_bounds(DE, start_n, Tk, fhi, hi, BLOCK_N)
    a, bb, c = _split_range(lo, flo, fhi, hi, BLOCK_M)
    if not HAS_WINDOW:
        # Without a window only the diagonal needs a mask here: rows past Tq load q = dO = 0 and lse = +inf, so
        # they add exactly 0 to dK and dV and the ragged last query block can run unmasked (one loop less).
        # With documents the same holds for a key block whose first key is in the row's last document.
        if HAS_DOCS:
            c = tl.where(fhi >= Tq, tl.maximum(hi, bb), c)
        else:
            c = tl.maximum(hi, bb)
    for g in range(G):  # the query heads of this kv head's group
        h = hk * G + g
        Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        DOh = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        LSEh = LSE + (b * Hq + h).to(tl.int64) * Tq
        DELTAh = DELTA + (b * Hq + h).to(tl.int64) * Tq
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DS, stride_qt, stride_dot, offs_m0, offs_d,
                                 offs_n, qk_scale, q_offset, Tq, Tk, W, a, bb, True, CAUSAL, HAS_WINDOW, HAS_DOCS,
                                 BLOCK_M, UPCAST, PREC)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DS, stride_qt, stride_dot, offs_m0, offs_d, offs_n,
                             qk_scale, q_offset, Tq, Tk, W, bb, c, False, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_M, UPCAST,
                             PREC)
        if HAS_WINDOW or HAS_DOCS:
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DS, stride_qt, stride_dot, offs_m0, offs_d,
                                 offs_n, qk_scale, q_offset, Tq, Tk, W, c, hi, True, CAUSAL, HAS_WINDOW, HAS_DOCS,
                                 BLOCK_M, UPCAST, PREC)
    dk = dk * scale
    DK += b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    DV += b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
    tl.store(DK + offs_n[:, None].to(tl.int64) * stride_dkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=col_ok[:, None])
    tl.store(DV + offs_n[:, None].to(tl.int64) * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset, qk_scale, Tk, W,
              n_lo, n_hi, ds_m,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
              BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    for start_n in range(n_lo, n_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        ld = (offs_n < Tk)[:, None]
        k = tl.load(K + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(V + offs_n[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=ld, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            pos_q = offs_m + q_offset
            vis = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
            if CAUSAL:
                vis = vis & (offs_n[None, :] <= pos_q[:, None])
            if HAS_WINDOW:
                vis = vis & (offs_n[None, :] > pos_q[:, None] - W)
            if HAS_DOCS:
                vis = vis & (offs_n[None, :] >= ds_m[:, None])
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, DS,
                 stride_qb, stride_qh, stride_qt,
                 stride_kb, stride_kh, stride_kt,
                 stride_vb, stride_vh, stride_vt,
                 stride_dob, stride_doh, stride_dot,
                 stride_dqb, stride_dqh, stride_dqt,
                 Hq, G, Tq, Tk, q_offset, W, qk_scale, scale, T_BUCKET,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
                 UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    DO += b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    q = tl.load(Q + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None].to(tl.int64) * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh.to(tl.int64) * Tq + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * Tq + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, flo, fhi, hi = _kv_range(start_m, q_offset, Tk, W, BLOCK_M, CAUSAL, HAS_WINDOW)
    ds_m = offs_m  # placeholder without documents (unused)
    if HAS_DOCS:
        DS += b.to(tl.int64) * Tq
        ds_m = tl.load(DS + offs_m, mask=row_ok, other=0)
        lo, flo = _doc_kv_bounds(DS, start_m, Tq, lo, flo, BLOCK_M)
    a, bb, c = _split_range(lo, flo, fhi, hi, BLOCK_N)
    if HAS_WINDOW or HAS_DOCS:
        dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset,
                       qk_scale, Tk, W, a, bb, ds_m, True, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N, UPCAST, PREC)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset,
                   qk_scale, Tk, W, bb, c, ds_m, False, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N, UPCAST, PREC)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, offs_n0, offs_d, offs_m, Tq, q_offset,
                   qk_scale, Tk, W, c, hi, ds_m, True, CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N, UPCAST, PREC)
    dq = dq * scale
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    tl.store(DQ + offs_m[:, None].to(tl.int64) * stride_dqt + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------------------

_KEY = ["HEAD_DIM", "T_BUCKET", "CAUSAL", "HAS_WINDOW", "HAS_DOCS"]


def _cfgs(rows):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in rows]


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward and dQ: BLOCK_M query rows per program, BLOCK_N keys per
# step. dK/dV: BLOCK_N keys per program, BLOCK_M query rows per step. Chosen from sm_90 compiles (ptxas -v, triton
# 3.6 and 3.9) of these kernels: all software-pipelined (cp.async), none spilling more than a few bytes at D=128
# (two fp32 [128, D] dK/dV accumulators fill the registers, hence BLOCK_M 16/32 there).
_FWD_ROWS = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]
_DKDV_ROWS = [(32, 128, 8, 3), (16, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 3)]
_DQ_ROWS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)]
_DEFAULT = {"fwd": (128, 64, 8, 3), "dkdv": (32, 128, 8, 3), "dq": (128, 64, 8, 3)}
# Interpreter: exactly one small config per kernel (it cannot autotune). BLOCK_M != BLOCK_N, oriented like the
# GPU configs, so the CPU tests cover the asymmetric block-range arithmetic.
_INTERPRET = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
_PRE_BLOCK = 16 if INTERPRET else 128


# fp32 inputs (IEEE dots, tests only), STREAMTRAIN_ATTN_AUTOTUNE=0 and torch's deterministic mode (a tuned choice
# follows timings, and another block shape sums in another order) use the fixed config of each kernel.
_FIXED = {name: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
          for name, (m, n, w, s) in (_INTERPRET if INTERPRET else _DEFAULT).items()}
# fp32 tiles take twice the shared memory: smaller fixed blocks (any D up to 128 fits).
_FIXED_FP32 = _FIXED if INTERPRET else {
    name: dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=2)
    for name, (m, n) in {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32)}.items()}
_KERNELS = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}
_ROWS = {"fwd": _FWD_ROWS, "dkdv": _DKDV_ROWS, "dq": _DQ_ROWS}
_TUNED = {name: triton.autotune(configs=_cfgs(_ROWS[name]), key=_KEY)(fn) for name, fn in _KERNELS.items()} \
    if AUTOTUNE else {}


_T_BUCKET_CAP = 16384  # every T above shares the autotune key of T = 16K, and long calls tune on a 16K proxy
_TUNED_ON_PROXY: set = set()  # the (kernels, dtype, device, D, causal, window?, docs?) long calls already tuned


def _t_bucket(t: int) -> int:
    return min(triton.next_power_of_2(max(t, 16)), _T_BUCKET_CAP)


def _autotuned(dtype: torch.dtype) -> bool:
    """Whether launches of `dtype` inputs pick an autotuned config (else the fixed one of `_launch`)."""
    return bool(_TUNED) and dtype != torch.float32 and not torch.are_deterministic_algorithms_enabled()


def _first_long_call(kernels: str, q, k, causal, window, doc_start) -> bool:
    """True once per (kernels, dtype, device, D, causal, window?, docs?) for a tuned call over more than
    `_T_BUCKET_CAP` positions: the caller then tunes on a proxy of `_T_BUCKET_CAP` positions (module docstring)."""
    if not _autotuned(q.dtype) or min(q.shape[2], k.shape[2]) <= _T_BUCKET_CAP:
        return False
    key = (kernels, q.dtype, q.device, q.shape[3], causal, window is not None, doc_start is not None)
    if key in _TUNED_ON_PROXY:
        return False
    _TUNED_ON_PROXY.add(key)
    return True


def _proxy(t: torch.Tensor) -> torch.Tensor:
    """The first `_T_BUCKET_CAP` positions of a [B, H, T, D] tensor (a view) or a [B, H, T] / [B, T] one (a
    contiguous copy: the kernels address lse, delta and doc_start as contiguous rows of their T)."""
    if t.dim() == 4:
        return t[:, :, :_T_BUCKET_CAP]
    return t[..., :_T_BUCKET_CAP].contiguous()


def _launch(name, dtype, grid_fn, *args, **kwargs):
    if _autotuned(dtype):
        _TUNED[name][lambda meta: grid_fn(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **kwargs)
    else:
        fixed = (_FIXED_FP32 if dtype == torch.float32 else _FIXED)[name]
        _KERNELS[name][grid_fn(fixed["BLOCK_M"], fixed["BLOCK_N"])](*args, **kwargs, **fixed)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------

def _check(q, k, v, sinks, window, scale):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k and v must be [B, Hkv, Tk, D] with q's B and D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim must be a power of two in 16..128, got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among bf16/fp16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1 (keys seen per query, itself included), got {window}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != Hq):
        raise ValueError(f"sinks must be [Hq] = [{Hq}], got {tuple(sinks.shape)}")


def _check_docs(q, k, doc_start, causal, q_offset):
    """Shape/dtype/device checks of doc_start (no look at its values: that would sync the GPU; see
    `check_doc_start`). Returns it as contiguous int32 [B, T]."""
    B, _, Tq, _ = q.shape
    Tk = k.shape[2]
    if not causal:
        raise ValueError("doc_start needs causal=True (a token attends to doc_start[i] <= j <= i)")
    if Tq != Tk or q_offset != 0:
        raise ValueError(f"doc_start needs Tq == Tk and q_offset == 0 (one packed row as queries and keys); got "
                         f"Tq={Tq}, Tk={Tk}, q_offset={q_offset}")
    if doc_start.dim() != 2 or tuple(doc_start.shape) != (B, Tq):
        raise ValueError(f"doc_start must be [B, T] = [{B}, {Tq}], got {tuple(doc_start.shape)}")
    if doc_start.dtype not in (torch.int32, torch.int64) or doc_start.device != q.device:
        raise ValueError(f"doc_start must be an int32 (or int64) tensor on q's device; got {doc_start.dtype} on "
                         f"{doc_start.device}")
    return doc_start.to(torch.int32).contiguous()


def check_doc_start(doc_start: torch.Tensor) -> None:
    """Raise ValueError unless doc_start [B, T] is a valid packing: every row is a run of contiguous documents and
    doc_start[b, i] is the first index of i's document (doc_start[b, 0] = 0, and doc_start[b, i] is either
    doc_start[b, i - 1] or i). Reads the values (a device sync on the GPU): for data pipelines and tests; the
    kernels trust their input (an invalid doc_start gives wrong results, never an out-of-bounds access)."""
    if doc_start.dim() != 2:
        raise ValueError(f"doc_start must be [B, T], got {tuple(doc_start.shape)}")
    if doc_start.shape[1] == 0:
        return
    ds = doc_start.long()
    idx = torch.arange(ds.shape[1], device=ds.device)
    prev = torch.cat([ds[:, :1], ds[:, :-1]], dim=1)
    ok = (ds[:, 0] == 0).all() & ((ds == prev) | (ds == idx)).all()
    if not bool(ok):
        raise ValueError("doc_start: each row must hold contiguous documents, doc_start[i] being the index where "
                         "i's document begins (0 at i = 0, then either doc_start[i - 1] or i)")


def _doc_end(ds: torch.Tensor) -> torch.Tensor:
    """int32 [B, T]: the end (exclusive) of each position's document, i.e. the next document's start or T. A
    handful of tiny [B, T] torch ops, no sync: the dK/dV kernel reads it for the last query that sees a key."""
    B, T = ds.shape
    idx = torch.arange(1, T, device=ds.device, dtype=torch.int32)
    starts = torch.where(ds[:, 1:] != ds[:, :-1], idx, T)  # [B, T - 1]: k where a document starts at k >= 1, else T
    nxt = torch.cat([starts, torch.full((B, 1), T, device=ds.device, dtype=torch.int32)], dim=1)
    # doc_end[j] = min(nxt[j:]) (nxt[j] is about position j + 1): a suffix minimum
    return torch.flip(torch.cummin(torch.flip(nxt, [1]), dim=1).values, [1]).to(torch.int32).contiguous()


def _flags(q):
    upcast = INTERPRET
    prec = "ieee" if INTERPRET or q.dtype == torch.float32 else "tf32"  # tf32 is moot for bf16/fp16 operands
    return upcast, prec


def _forward(q, k, v, sinks, causal, window, scale, q_offset, doc_start=None):
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    out = torch.empty((B, Hq, Tq, D), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, Hq, Tq), device=q.device, dtype=torch.float32)
    if Tq == 0 or B * Hq == 0:
        return out, lse
    if _first_long_call("fwd", q, k, causal, window, doc_start):
        _forward(_proxy(q), _proxy(k), _proxy(v), sinks, causal, window, scale, 0,
                 _proxy(doc_start) if doc_start is not None else None)
    upcast, prec = _flags(q)
    has_sinks = sinks is not None
    _launch("fwd", q.dtype, lambda bm, bn: (triton.cdiv(Tq, bm), B * Hq),
            q, k, v, sinks if has_sinks else lse, out, lse, doc_start if doc_start is not None else lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            Hq, Hq // Hkv, Tq, Tk, q_offset, window or 0, scale * LOG2E, _t_bucket(max(Tq, Tk)),
            HEAD_DIM=D, CAUSAL=causal, HAS_WINDOW=window is not None, HAS_SINKS=has_sinks,
            HAS_DOCS=doc_start is not None, UPCAST=upcast, PREC=prec)
    return out, lse


def _backward(do, dlse, q, k, v, out, lse, sinks, causal, window, scale, q_offset, doc_start=None, dq=None):
    """dq: where to write dq (allocated when None; `out` itself may serve, see `attention_backward_over_out`)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if _first_long_call("bwd", q, k, causal, window, doc_start):
        _backward(_proxy(do), _proxy(dlse) if dlse is not None else None, _proxy(q), _proxy(k), _proxy(v),
                  _proxy(out), _proxy(lse), sinks, causal, window, scale, 0,
                  _proxy(doc_start) if doc_start is not None else None)
    if dq is None:
        dq = torch.empty((B, Hq, Tq, D), device=q.device, dtype=q.dtype)
    dk = torch.empty((B, Hkv, Tk, D), device=q.device, dtype=k.dtype)
    dv = torch.empty((B, Hkv, Tk, D), device=q.device, dtype=v.dtype)
    delta = torch.empty_like(lse)
    upcast, prec = _flags(q)
    bucket = _t_bucket(max(Tq, Tk))
    has_window = window is not None
    W = window or 0
    has_docs = doc_start is not None and Tq > 0
    doc_end = _doc_end(doc_start) if has_docs else None
    if Tq > 0 and B * Hq > 0:
        _bwd_preprocess[(triton.cdiv(Tq, _PRE_BLOCK), B * Hq)](
            out, do, dlse if dlse is not None else lse, delta,
            out.stride(0), out.stride(1), out.stride(2), do.stride(0), do.stride(1), do.stride(2),
            Hq, Tq, HEAD_DIM=D, HAS_DLSE=dlse is not None, BLOCK_M=_PRE_BLOCK)
    if Tk > 0 and B * Hkv > 0:
        _launch("dkdv", q.dtype, lambda bm, bn: (triton.cdiv(Tk, bn), B * Hkv),
                q, k, v, do, lse, delta, dk, dv, doc_start if has_docs else lse, doc_end if has_docs else lse,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                do.stride(0), do.stride(1), do.stride(2),
                dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2),
                Hq, Hkv, Hq // Hkv, Tq, Tk, q_offset, W, scale * LOG2E, scale, bucket,
                HEAD_DIM=D, CAUSAL=causal, HAS_WINDOW=has_window, HAS_DOCS=has_docs, UPCAST=upcast, PREC=prec)
    if Tq > 0 and B * Hq > 0:
        _launch("dq", q.dtype, lambda bm, bn: (triton.cdiv(Tq, bm), B * Hq),
                q, k, v, do, lse, delta, dq, doc_start if has_docs else lse,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                do.stride(0), do.stride(1), do.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2),
                Hq, Hq // Hkv, Tq, Tk, q_offset, W, scale * LOG2E, scale, bucket,
                HEAD_DIM=D, CAUSAL=causal, HAS_WINDOW=has_window, HAS_DOCS=has_docs, UPCAST=upcast, PREC=prec)
    dsinks = None
    if sinks is not None:
        # dL/dsink_h = -sum_{b,i} exp(sink_h - lse_bhi) * delta_bhi   (delta already holds rowsum(dO*O) - dlse)
        dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum(dim=(0, 2))
    return dq, dk, dv, dsinks


class FlashAttention(torch.autograd.Function):
    """(q, k, v, sinks, causal, window, scale, q_offset[, doc_start]) -> (out, lse); differentiable in q, k, v,
    sinks, and through both outputs (a gradient on lse enters the backward as delta -= dlse). doc_start: already
    checked contiguous int32 [B, T] (see `_check_docs`), or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, window, scale, q_offset, *doc_start):
        ctx.set_materialize_grads(False)  # an unused out / lse gives None, not a zero tensor
        ctx.n_doc_args = len(doc_start)
        ds = doc_start[0] if doc_start else None
        s32 = sinks.detach().float().contiguous() if sinks is not None else None
        out, lse = _forward(q, k, v, s32, causal, window, scale, q_offset, ds)
        ctx.save_for_backward(q, k, v, out, lse, s32, ds)
        ctx.cfg = (causal, window, scale, q_offset)
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, s32, ds = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dout = _last_dim_contiguous(dout)
        if dlse is not None:
            dlse = dlse.float().contiguous()
        dq, dk, dv, dsinks = _backward(dout, dlse, q, k, v, out, lse, s32, *ctx.cfg, ds)
        if dsinks is not None:
            dsinks = dsinks.to(ctx.sinks_dtype)
        return (dq, dk, dv, dsinks, None, None, None, None) + (None,) * ctx.n_doc_args


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                             window: int | None = None, sinks: torch.Tensor | None = None,
                             scale: float | None = None, q_offset: int | None = None,
                             doc_start: torch.Tensor | None = None):
    """Returns (out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] fp32, natural log, sink included).

    window: each query sees the keys j with p_i - window < j (<= p_i when causal): `window` keys, itself included.
    sinks: fp32 [Hq] logits appended to every softmax row (gpt-oss). scale: default D**-0.5.
    q_offset: key position of query row 0 (default Tk - Tq; pass it for chunked attention, e.g. 0 for the first
    KV chunk and -c for a KV chunk starting at c).
    doc_start: int32 [B, T] (engine/batch.py's `doc_start_BT`; int64 is converted) for packed rows: query i also
    needs j >= doc_start[b, i]. Needs causal=True and Tq == Tk with q_offset 0 (ValueError otherwise: chunked
    attention over packed rows is not supported). Its values are trusted (see `check_doc_start`)."""
    _check(q, k, v, sinks, window, scale)
    D = q.shape[-1]
    scale = float(D ** -0.5 if scale is None else scale)
    q_offset = int(k.shape[2] - q.shape[2] if q_offset is None else q_offset)
    window = None if window is None else int(window)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if doc_start is None:
        return FlashAttention.apply(q, k, v, sinks, bool(causal), window, scale, q_offset)
    ds = _check_docs(q, k, doc_start, bool(causal), q_offset)
    return FlashAttention.apply(q, k, v, sinks, bool(causal), window, scale, q_offset, ds)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    scale: float | None = None, q_offset: int | None = None,
                    doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [B, Hq, Tq, D]; see flash_attention_with_lse."""
    return flash_attention_with_lse(q, k, v, causal, window, sinks, scale, q_offset, doc_start)[0]


# ----------------------------------------------------------------------------------------------------------------
# the layer's op, for torch.compile
# ----------------------------------------------------------------------------------------------------------------
# The layer templates call the kernel through two torch.library custom ops (causal, default scale and alignment),
# with a fake (shape-only) implementation each and the backward registered as the forward's autograd formula.
# torch.compile then keeps the whole layer in one graph with the kernel as an opaque node: it fuses the RoPE and
# layout work around it and its partitioner decides what the backward saves, where `torch.compiler.disable` split
# the layer into two graphs with eager code between them. Packed rows pass doc_start (int32 [B, T]) as one more
# optional tensor input of both ops (not differentiable; Tq == Tk required); the ops stay single opaque nodes.

@torch.library.custom_op("streamtrain::flash_attention_fwd", mutates_args=())
def layer_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int],
                            sinks: Optional[torch.Tensor], doc_start: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, T, D], lse [B, Hq, T] fp32) of causal attention with the default scale; see
    flash_attention_with_lse. Differentiable in q, k, v and sinks (not doc_start). doc_start: int32 [B, T] of a
    packed row, or None; with it Tq must equal Tk (ValueError otherwise)."""
    _check(q, k, v, sinks, window, None)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    s32 = sinks.detach().float().contiguous() if sinks is not None else None
    q_offset = k.shape[2] - q.shape[2]
    ds = _check_docs(q, k, doc_start, True, q_offset) if doc_start is not None else None
    return _forward(q, k, v, s32, True, window, q.shape[-1] ** -0.5, q_offset, ds)


@layer_attention_forward.register_fake
def _(q, k, v, window, sinks, doc_start=None):
    B, Hq, Tq, D = q.shape
    return q.new_empty((B, Hq, Tq, D)), q.new_empty((B, Hq, Tq), dtype=torch.float32)


@torch.library.custom_op("streamtrain::flash_attention_bwd", mutates_args=())
def layer_attention_backward(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, window: Optional[int],
                             sinks: Optional[torch.Tensor], doc_start: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks fp32 [Hq], or [0] without sinks) for `layer_attention_forward`."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    s32 = sinks.detach().float().contiguous() if sinks is not None else None
    dlse = dlse.float().contiguous() if dlse is not None else None
    q_offset = k.shape[2] - q.shape[2]
    ds = _check_docs(q, k, doc_start, True, q_offset) if doc_start is not None else None
    dq, dk, dv, dsinks = _backward(_last_dim_contiguous(dout), dlse, q, k, v, out, lse, s32, True, window,
                                   q.shape[-1] ** -0.5, q_offset, ds)
    return dq, dk, dv, dsinks if dsinks is not None else lse.new_empty((0,))


@layer_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, window, sinks, doc_start=None):
    n_sinks = q.shape[1] if sinks is not None else 0
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), lse.new_empty((n_sinks,))


def attention_backward_over_out(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, window: Optional[int],
                                sinks: Optional[torch.Tensor], doc_start: Optional[torch.Tensor] = None):
    """`layer_attention_backward` (no lse gradient) for a caller done with `out`: dq is written over out's storage,
    one [B, Hq, T, D] buffer less at the backward's peak. Safe because only the first pass (delta = rowsum(dO * O))
    reads out, and it completes before the dq pass writes. Returns (dq, which is `out`, dk, dv, dsinks or None).
    Not a custom op (it mutates an input): for eager callers such as the lean layer (engine/model/lean.py)."""
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"attention_backward_over_out: out {tuple(out.shape)} {out.dtype} cannot hold dq "
                         f"{tuple(q.shape)} {q.dtype}")
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    s32 = sinks.detach().float().contiguous() if sinks is not None else None
    ds = _check_docs(q, k, doc_start, True, 0) if doc_start is not None else None
    return _backward(_last_dim_contiguous(dout), None, q, k, v, out, lse, s32, True, window, q.shape[-1] ** -0.5,
                     k.shape[2] - q.shape[2], ds, dq=out)


def _layer_attention_setup(ctx, inputs, output):
    q, k, v, window, sinks = inputs[:5]
    doc_start = inputs[5] if len(inputs) > 5 else None
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, doc_start)
    ctx.window = window
    ctx.n_inputs = len(inputs)


def _layer_attention_grad(ctx, dout, dlse):
    q, k, v, out, lse, sinks, doc_start = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = layer_attention_backward(dout, dlse, q, k, v, out, lse, ctx.window, sinks, doc_start)
    grads = (dq, dk, dv, None, dsinks.to(sinks.dtype) if sinks is not None else None, None)
    return grads[:ctx.n_inputs]


layer_attention_forward.register_autograd(_layer_attention_grad, setup_context=_layer_attention_setup)


def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor):
    """Combine attention over two disjoint key sets: (out [.., T, D] in out1's dtype, lse [.., T] fp32).
    Rows that saw no key in one part (lse = -inf) take the other part; rows empty in both stay 0 / -inf.
    Pure torch, differentiable (gradients reach both parts' out and lse). A sink belongs in exactly one part."""
    lse1, lse2 = lse1.float(), lse2.float()
    lse = torch.logaddexp(lse1, lse2)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - ref).unsqueeze(-1)
    w2 = torch.exp(lse2 - ref).unsqueeze(-1)
    out = (w1 * out1.float() + w2 * out2.float()).to(out1.dtype)
    return out, lse
