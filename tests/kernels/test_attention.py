"""Flash attention kernel (streamtrain_kernels/attention.py) against the pure-torch reference.

Rule (flash-attn's): against a truth computed in fp64 on the (upcast) inputs, the kernel's max abs error must be
at most 2x the error of PyTorch's own attention in the same low precision (the reference run op by op in bf16 /
fp16; on the GPU also SDPA's flash backend) plus a small atol, for out and every gradient. fp32 inputs are
compared tightly (the baseline is the reference in fp32). CPU tests run the kernels under TRITON_INTERPRET=1
(tests/conftest.py) with tiny shapes; `gpu` tests run real shapes and skip without CUDA.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_attention.py          # CPU (interpreter)
    python -m pytest -q -m gpu tests/kernels/test_attention.py                       # GPU machine
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import streamtrain_kernels.attention as A
from streamtrain_kernels.reference import attention_mask, attention_reference, merge_reference
from streamtrain_kernels.attention import flash_attention, flash_attention_with_lse, merge_attention

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
ATOL = {bf16: 2e-3, fp16: 3e-4, fp32: 1e-5}


def _inputs(B, Hq, Hkv, Tq, D, dtype, sinks=False, Tk=None, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    Tk = Tq if Tk is None else Tk
    q = torch.randn(B, Hq, Tq, D, generator=g)
    k = torch.randn(B, Hkv, Tk, D, generator=g)
    v = torch.randn(B, Hkv, Tk, D, generator=g)
    do = torch.randn(B, Hq, Tq, D, generator=g)
    # sinks around log(T): the sink takes a sizeable share of each row, so its gradient is not negligible
    s = torch.randn(Hq, generator=g) * 2 + 2 if sinks else None
    q, k, v, do = (t.to(device=device, dtype=dtype) for t in (q, k, v, do))
    return q, k, v, (s.to(device) if sinks else None), do


def _run(fn, q, k, v, sinks, do, dlse=None, **kw):
    """(out, lse, [dq, dk, dv, (dsinks)]) of fn with fresh leaves; loss = <out, do> (+ <lse, dlse>)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out, lse = fn(q, k, v, sinks=s, **kw)
    loss = (out.float() * do.float()).sum()
    if dlse is not None:
        loss = loss + (lse.float() * dlse).sum()
    loss.backward()
    return out, lse, [q.grad, k.grad, v.grad] + ([s.grad] if s is not None else [])


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _check(name, got, truth, base, atol):
    err, berr = _err(got, truth), _err(base, truth)
    assert err <= 2 * berr + atol, f"{name}: kernel err {err:.3g} > 2 x baseline err {berr:.3g} + {atol:g}"


def _check_all(q, k, v, sinks, do, dlse=None, **kw):
    dtype = q.dtype
    out, lse, grads = _run(flash_attention_with_lse, q, k, v, sinks, do, dlse, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
    assert lse.shape == q.shape[:3]
    def d(t):
        return None if t is None else t.double()
    t_out, t_lse, t_grads = _run(attention_reference, d(q), d(k), d(v), d(sinks), do.double(), dlse, **kw)
    b_out, _, b_grads = _run(attention_reference, q, k, v, sinks, do, dlse,
                                 upcast=dtype == torch.float32, **kw)
    atol = ATOL[dtype]
    _check("out", out, t_out, b_out, atol)
    for name, g, t, b in zip(["dq", "dk", "dv", "dsinks"], grads, t_grads, b_grads):
        _check(name, g, t, b, atol * max(1.0, t.abs().max().item()) if name == "dsinks" else atol)
    if sinks is not None:  # the sink gradient also against the truth alone
        assert _err(grads[3], t_grads[3]) <= 1e-2 * t_grads[3].abs().max().item() + atol
    lse_tol = 1e-5 if dtype == torch.float32 else 1e-4  # lse is fp32 math on the given inputs
    finite = torch.isfinite(t_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert _err(lse[finite], t_lse[finite]) <= lse_tol
    return out, lse, grads


# B, Hq, Hkv, T, D, causal, window, sinks, dtype -- every feature appears with several others; the T are ragged
CASES = [
    (1, 2, 2, 37, 16, True, None, False, bf16),
    (2, 4, 2, 50, 32, True, None, True, bf16),
    (1, 3, 1, 100, 64, True, 16, False, bf16),
    (1, 6, 2, 50, 32, True, 5, True, fp16),
    (1, 2, 1, 37, 32, False, None, True, bf16),
    (1, 4, 4, 64, 16, False, None, False, fp16),
    (1, 2, 2, 50, 16, False, 16, False, bf16),
    (1, 1, 1, 20, 128, True, None, True, bf16),
    (1, 2, 1, 1, 16, True, None, False, bf16),
    (1, 4, 2, 37, 32, True, 5, True, fp32),
    (1, 3, 3, 50, 64, False, None, False, fp32),
    (1, 3, 1, 100, 16, True, 16, True, fp32),
    (1, 2, 2, 37, 16, True, 1, True, fp32),
]


def _case_id(c):
    B, Hq, Hkv, T, D, causal, window, sinks, dtype = c
    return (f"B{B}-h{Hq}/{Hkv}-T{T}-D{D}-{'causal' if causal else 'full'}-w{window}"
            f"-{'sinks' if sinks else 'nosink'}-{str(dtype).split('.')[-1]}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case):
    B, Hq, Hkv, T, D, causal, window, sinks, dtype = case
    q, k, v, s, do = _inputs(B, Hq, Hkv, T, D, dtype, sinks)
    _check_all(q, k, v, s, do, causal=causal, window=window)


@pytest.mark.skipif(not A.INTERPRET, reason="fixed block configs exist under the interpreter only")
@pytest.mark.parametrize("blocks", [(16, 16), (16, 32)], ids=["16x16", "m16-n32"])
def test_other_block_shapes(monkeypatch, blocks):
    """The block-range arithmetic with square blocks and with the orientation flipped."""
    m, n = blocks
    for name, (bm, bn) in [("fwd", (m, n)), ("dq", (m, n)), ("dkdv", (n, m))]:
        monkeypatch.setitem(A._FIXED, name, dict(A._FIXED[name], BLOCK_M=bm, BLOCK_N=bn))
    q, k, v, s, do = _inputs(1, 4, 2, 45, 16, fp32, sinks=True)
    _check_all(q, k, v, s, do, causal=True, window=20)


def test_lse_gradient():
    """A loss on lse too (what merging chunks does): delta -= dlse in the backward."""
    q, k, v, s, do = _inputs(1, 4, 2, 40, 16, fp32, sinks=True)
    dlse = torch.randn(1, 4, 40, generator=torch.Generator().manual_seed(1))
    _check_all(q, k, v, s, do, dlse=dlse, causal=True, window=12)


def test_chunked_queries_q_offset():
    """Tq != Tk: the last 23 queries against all 50 keys (default q_offset = Tk - Tq), and an explicit offset."""
    q, k, v, s, do = _inputs(1, 4, 2, 23, 32, fp32, sinks=True, Tk=50)
    _check_all(q, k, v, s, do, causal=True, window=9)
    _check_all(q, k, v, s, do, causal=True, q_offset=5)
    full = _inputs(1, 4, 2, 50, 32, fp32, sinks=True, seed=3)
    out_full = flash_attention(*full[:3], causal=True, sinks=full[3])
    out_tail = flash_attention(full[0][:, :, 27:], full[1], full[2], causal=True, sinks=full[3])
    assert _err(out_tail, out_full[:, :, 27:]) <= 1e-6


@pytest.mark.parametrize("window", [None, 7])
def test_merge_two_kv_halves(window):
    """Attention over keys [0, c) and [c, T) merged through the lse equals attention over all keys, forward and
    backward (the sink goes with one half; rows that see nothing in the second half have lse -inf there)."""
    T, c = 50, 23
    q, k, v, s, do = _inputs(1, 4, 2, T, 16, fp32, sinks=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
    ql, kl, vl, sl = leaves
    o1, l1 = flash_attention_with_lse(ql, kl[:, :, :c], vl[:, :, :c], True, window, sl, q_offset=0)
    o2, l2 = flash_attention_with_lse(ql, kl[:, :, c:], vl[:, :, c:], True, window, None, q_offset=-c)
    assert torch.isneginf(l2[:, :, :c]).all() and (o2[:, :, :c] == 0).all()
    out, lse = merge_attention(o1, l1, o2, l2)
    (out * do).sum().backward()
    ref_out, ref_lse, ref_grads = _run(flash_attention_with_lse, q, k, v, s, do, causal=True, window=window)
    assert _err(out, ref_out) <= 1e-5 and _err(lse, ref_lse) <= 1e-5
    for g, r in zip([t.grad for t in leaves], ref_grads):
        assert _err(g, r) <= 1e-5
    m_out, m_lse = merge_reference(o1.detach(), l1.detach(), o2.detach(), l2.detach())
    assert _err(m_out, out) <= 1e-6 and _err(m_lse, lse) <= 1e-6


def test_rows_that_see_nothing():
    """Keys entirely in the future of every query: out 0, lse -inf (= sink with sinks), zero finite grads."""
    q, k, v, s, do = _inputs(1, 2, 1, 20, 16, fp32, sinks=True, Tk=30)
    for sinks in (None, s):
        out, lse, grads = _run(flash_attention_with_lse, q, k, v, sinks, do, causal=True, q_offset=-31)
        assert (out == 0).all()
        if sinks is None:
            assert torch.isneginf(lse).all()
        else:
            assert torch.allclose(lse, sinks.view(1, 2, 1).expand_as(lse))
            assert grads[3].abs().max() == 0  # delta = rowsum(dO * 0) = 0
        for g in grads[:3]:
            assert (g == 0).all()


def test_window_semantics():
    """HF / gpt-oss sliding window: a query sees exactly `window` keys including itself (fewer at the start);
    window=1 returns the own value row; a window >= T is plain causal attention."""
    T, W = 12, 4
    mask = attention_mask(T, T, causal=True, window=W)
    assert mask.sum(-1).tolist() == [min(i + 1, W) for i in range(T)]
    assert mask[7].nonzero().flatten().tolist() == [4, 5, 6, 7]
    q, k, v, _, _ = _inputs(1, 4, 2, 33, 16, fp32)
    assert _err(flash_attention(q, k, v, window=1), v.repeat_interleave(2, dim=1)) <= 1e-6
    assert _err(flash_attention(q, k, v, window=33), flash_attention(q, k, v)) <= 1e-6


def test_noncontiguous_and_scale():
    """[B, T, H, D] storage seen as [B, H, T, D] (what the layer passes) and a custom scale."""
    q, k, v, s, do = _inputs(1, 4, 2, 30, 16, fp32, sinks=True)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    a = _run(flash_attention_with_lse, qt, kt, vt, s, do, causal=True, scale=0.3)
    b = _run(flash_attention_with_lse, q, k, v, s, do, causal=True, scale=0.3)
    for x, y in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        assert torch.equal(x, y)
    r = attention_reference(q.double(), k.double(), v.double(), causal=True, sinks=s.double(), scale=0.3)
    assert _err(a[0], r[0]) <= 1e-5


def test_rejects_bad_inputs():
    q, k, v, _, _ = _inputs(1, 4, 2, 8, 16, fp32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16))
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q[..., :12], k[..., :12], v[..., :12])
    with pytest.raises(ValueError, match="dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="sinks"):
        flash_attention(q, k, v, sinks=torch.zeros(3))


def test_merge_reference_matches_reference_split():
    """merge_reference on two halves of the reference = the reference (checks the helper itself)."""
    q, k, v, s, _ = _inputs(1, 2, 1, 10, 16, torch.float64, sinks=True)
    o1, l1 = attention_reference(q, k[:, :, :4], v[:, :, :4], True, None, s, q_offset=0)
    o2, l2 = attention_reference(q, k[:, :, 4:], v[:, :, 4:], True, None, None, q_offset=-4)
    o, lse = merge_reference(o1, l1, o2, l2)
    ro, rl = attention_reference(q, k, v, True, None, s)
    assert _err(o, ro) <= 1e-12 and _err(lse, rl) <= 1e-12


@pytest.mark.parametrize("window, sinks", [(None, False), (7, True)])
def test_layer_op_compiles_into_one_graph(window, sinks):
    """The layer's custom op: torch.compile traces the attention call with fullgraph=True (no graph break), and
    outputs and all four gradients equal the eager op's bit for bit (the same kernel runs); opcheck validates its
    fake implementation and autograd registration. Layer-shaped inputs: strided [B, H, T, D] views, GQA 2:1."""
    from engine.model.attention import causal_attention

    torch.manual_seed(0)
    B, Hq, Hkv, T, D = 1, 4, 2, 37, 16
    q, k, v = (torch.randn(B, T, h, D).transpose(1, 2).requires_grad_() for h in (Hq, Hkv, Hkv))
    s = torch.randn(Hq).requires_grad_() if sinks else None
    inputs = [t for t in (q, k, v, s) if t is not None]

    def attend(q, k, v, s):
        return causal_attention(q, k, v, backend="triton", window=window, sinks=s)

    eager = attend(q, k, v, s)
    dout = torch.randn_like(eager)
    grads = torch.autograd.grad(eager, inputs, dout)
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, s)
    assert torch.equal(compiled, eager)
    for got, want in zip(torch.autograd.grad(compiled, inputs, dout), grads):
        assert torch.equal(got, want)
    torch.library.opcheck(A.layer_attention_forward, (q, k, v, window, s),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ----------------------------------------------------------------------------------------------------------------
# packed rows: document masking (doc_start)
# Interpreter blocks: forward / dQ 32 queries x 16 keys, dK/dV 32 keys x 16 queries. The layouts put boundaries
# inside and on block edges, documents of length 1, documents spanning several blocks, and one document per row.
# ----------------------------------------------------------------------------------------------------------------

def _doc_start(rows, T):
    """int32 [len(rows), T] from each row's document lengths (summing to T)."""
    out = []
    for lens in rows:
        assert sum(lens) == T
        starts = [sum(lens[:i]) for i in range(len(lens))]
        out.append(torch.cat([torch.full((n,), s0, dtype=torch.int32) for s0, n in zip(starts, lens)]))
    ds = torch.stack(out)
    A.check_doc_start(ds)
    return ds


ROWS53 = [[1, 20, 1, 31], [53], [5] * 10 + [3], [30, 23]]
ROWS97 = [[40, 1, 56], [16, 16, 16, 16, 16, 17], [97]]

# Hq, Hkv, T, rows, window, sinks, dtype
DOC_CASES = [
    (4, 2, 53, ROWS53, None, True, fp32),
    (4, 2, 53, ROWS53, 7, True, fp32),
    (4, 1, 53, ROWS53, None, False, bf16),
    (6, 2, 53, ROWS53, 12, True, fp16),
    (2, 2, 97, ROWS97, None, True, bf16),
    (4, 2, 97, ROWS97, 20, False, fp32),
]


@pytest.mark.parametrize("case", DOC_CASES, ids=lambda c: f"h{c[0]}/{c[1]}-T{c[2]}-w{c[4]}-"
                         f"{'sinks' if c[5] else 'nosink'}-{str(c[6]).split('.')[-1]}")
def test_docs_match_reference(case):
    """out, lse, dq, dk, dv (dsinks) with doc_start against the reference's doc mask, by the 2x rule."""
    Hq, Hkv, T, rows, window, sinks, dtype = case
    q, k, v, s, do = _inputs(len(rows), Hq, Hkv, T, 16, dtype, sinks)
    _check_all(q, k, v, s, do, causal=True, window=window, doc_start=_doc_start(rows, T))


@pytest.mark.parametrize("dtype, window", [(fp32, None), (bf16, 6)])
def test_docs_packed_equals_per_document(dtype, window):
    """A packed row through the kernel = each document's slice through the kernel on its own (doc_start=None),
    concatenated: out, lse and all gradients (dsinks summed over the documents) by the 2x rule against the fp64
    truth, and within fp32 rounding of each other in fp32."""
    rows, T = [[1, 20, 1, 31], [30, 23]], 53
    q, k, v, s, do = _inputs(len(rows), 4, 2, T, 16, dtype, sinks=True)
    ds = _doc_start(rows, T)
    out, lse, grads = _run(flash_attention_with_lse, q, k, v, s, do, causal=True, window=window, doc_start=ds)
    sep = [torch.zeros_like(t) for t in (out, lse, *grads[:3])] + [torch.zeros_like(grads[3])]
    for b, lens in enumerate(rows):
        s0 = 0
        for n in lens:
            sl = (slice(b, b + 1), slice(None), slice(s0, s0 + n))
            o, l, g = _run(flash_attention_with_lse, q[sl], k[sl], v[sl], s, do[sl], causal=True, window=window)
            for acc, part in zip(sep[:5], (o, l, *g[:3])):
                acc[sl] = part
            sep[5] += g[3]
            s0 += n
    t_out, t_lse, t_grads = _run(attention_reference, q.double(), k.double(), v.double(), s.double(), do.double(),
                                 causal=True, window=window, doc_start=ds)
    atol = ATOL[dtype]
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    for name, got, t, base in zip(names, (out, lse, *grads), (t_out, t_lse, *t_grads), sep):
        _check(name, got, t, base, atol * max(1.0, t.abs().max().item()) if name == "dsinks" else atol)
        if dtype == fp32:
            assert _err(got, base) <= 1e-5 * max(1.0, t.abs().max().item()), name


def test_docs_single_document_is_bitwise_unpacked():
    """doc_start = 0 everywhere (one document per row) runs the same blocks unmasked as doc_start=None: identical
    bits (the unpacked path itself is the HAS_DOCS=False specialisation, i.e. the kernels as they were)."""
    q, k, v, s, do = _inputs(2, 4, 2, 45, 16, bf16, sinks=True)
    ds = torch.zeros(2, 45, dtype=torch.int32)
    for window in (None, 7):
        a = _run(flash_attention_with_lse, q, k, v, s, do, causal=True, window=window)
        b = _run(flash_attention_with_lse, q, k, v, s, do, causal=True, window=window, doc_start=ds)
        for x, y in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
            assert torch.equal(x, y)


@pytest.mark.skipif(not A.INTERPRET, reason="the block layout below assumes the interpreter's fixed blocks")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN rows the planted values legitimately reach
def test_docs_skip_blocks_outside_the_document():
    """Key blocks wholly before a query block's documents are never visited (forward, dQ), nor are query blocks
    past the last query that sees a key block (dK/dV): NaN planted there stays out of the results (a visited but
    masked block would spread it: 0 * NaN). Row: documents [0, 40) and [40, 90)."""
    T, ds = 90, _doc_start([[40, 50]], 90)
    q, k, v, s, do = _inputs(1, 2, 1, T, 16, fp32, sinks=True)
    # forward / dQ: query block [64, 96) starts its key loop at doc_start 40 -> block 32: keys [0, 32) unseen
    kn, vn = k.clone(), v.clone()
    kn[:, :, :32] = float("nan")
    vn[:, :, :32] = float("nan")
    out, lse, grads = _run(flash_attention_with_lse, q, kn, vn, s, do, causal=True, doc_start=ds)
    assert torch.isfinite(out[:, :, 64:]).all() and torch.isfinite(lse[:, :, 64:]).all()
    assert torch.isfinite(grads[0][:, :, 64:]).all()
    # dK/dV: key block [0, 32) is seen by queries < 40 only: query blocks from 48 on are never visited
    qn, don = q.clone(), do.clone()
    qn[:, :, 48:] = float("nan")
    don[:, :, 48:] = float("nan")
    out, lse, grads = _run(flash_attention_with_lse, qn, k, v, None, don, causal=True, doc_start=ds)
    assert torch.isfinite(grads[1][:, :, :32]).all() and torch.isfinite(grads[2][:, :, :32]).all()
    assert torch.isfinite(out[:, :, :48]).all()


@pytest.mark.skipif(not A.INTERPRET, reason="fixed block configs exist under the interpreter only")
@pytest.mark.parametrize("blocks", [(16, 16), (16, 32)], ids=["16x16", "m16-n32"])
def test_docs_other_block_shapes(monkeypatch, blocks):
    m, n = blocks
    for name, (bm, bn) in [("fwd", (m, n)), ("dq", (m, n)), ("dkdv", (n, m))]:
        monkeypatch.setitem(A._FIXED, name, dict(A._FIXED[name], BLOCK_M=bm, BLOCK_N=bn))
    q, k, v, s, do = _inputs(2, 4, 2, 45, 16, fp32, sinks=True)
    _check_all(q, k, v, s, do, causal=True, window=9, doc_start=_doc_start([[16, 1, 28], [3, 17, 25]], 45))


def test_docs_lse_gradient():
    """A loss on lse too, with documents."""
    q, k, v, s, do = _inputs(2, 4, 2, 40, 16, fp32, sinks=True)
    dlse = torch.randn(2, 4, 40, generator=torch.Generator().manual_seed(1))
    _check_all(q, k, v, s, do, dlse=dlse, causal=True, doc_start=_doc_start([[7, 1, 32], [20, 20]], 40))


@pytest.mark.parametrize("window, sinks", [(None, False), (7, True)])
def test_docs_layer_op(window, sinks):
    """The layer op with doc_start: one opaque node under torch.compile(fullgraph=True), bit-equal to eager and to
    flash_attention_with_lse; opcheck validates the schema, fake implementation and autograd registration."""
    torch.manual_seed(0)
    B, Hq, Hkv, T, D = 2, 4, 2, 37, 16
    q, k, v = (torch.randn(B, T, h, D).transpose(1, 2).requires_grad_() for h in (Hq, Hkv, Hkv))
    s = torch.randn(Hq).requires_grad_() if sinks else None
    ds = _doc_start([[10, 1, 26], [37]], T)
    inputs = [t for t in (q, k, v, s) if t is not None]

    def attend(q, k, v, s, ds):
        return A.layer_attention_forward(q, k, v, window, s, ds)[0]

    eager = attend(q, k, v, s, ds)
    dout = torch.randn_like(eager)
    grads = torch.autograd.grad(eager, inputs, dout)
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, s, ds)
    assert torch.equal(compiled, eager)
    for got, want in zip(torch.autograd.grad(compiled, inputs, dout), grads):
        assert torch.equal(got, want)
    direct = flash_attention_with_lse(q, k, v, True, window, s, doc_start=ds)[0]
    assert torch.equal(direct, eager)
    torch.library.opcheck(A.layer_attention_forward, (q, k, v, window, s, ds),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("window, sinks, docs", [(None, False, False), (9, True, True)],
                         ids=["plain", "window+sinks+docs"])
def test_the_backward_over_out_equals_the_layer_ops(window, sinks, docs):
    """`attention_backward_over_out` writes dq over the output's storage and gives the layer op's gradients bit for
    bit (the output is read by the first pass only)."""
    B, Hq, Hkv, T, D = 2, 4, 2, 37, 16
    q, k, v, s, do = _inputs(B, Hq, Hkv, T, D, torch.float32, sinks=sinks)
    ds = _doc_start([[10, 1, 26], [37]], T) if docs else None
    out, lse = A.layer_attention_forward(q, k, v, window, s, ds)
    want = A.layer_attention_backward(do, None, q, k, v, out, lse, window, s, ds)
    dq, dk, dv, dsinks = A.attention_backward_over_out(do, q, k, v, out, lse, window, s, ds)
    assert dq.data_ptr() == out.data_ptr()
    for got, ref in zip((dq, dk, dv), want[:3]):
        assert torch.equal(got, ref)
    assert (dsinks is None) if not sinks else torch.equal(dsinks, want[3])
    with pytest.raises(ValueError, match="cannot hold dq"):
        A.attention_backward_over_out(do, q, k, v, out[:, :, :5], lse, window, s, ds)


def test_docs_rejects_bad_inputs():
    q, k, v, _, _ = _inputs(2, 4, 2, 8, 16, fp32)
    ds = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="causal"):
        flash_attention(q, k, v, causal=False, doc_start=ds)
    with pytest.raises(ValueError, match="Tq == Tk"):
        flash_attention(q[:, :, 3:], k, v, doc_start=ds[:, 3:])
    with pytest.raises(ValueError, match="Tq == Tk"):
        A.layer_attention_forward(q[:, :, 3:], k, v, None, None, ds[:, 3:])
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        flash_attention(q, k, v, doc_start=ds[:1])
    with pytest.raises(ValueError, match="int32"):
        flash_attention(q, k, v, doc_start=ds.float())
    A.check_doc_start(torch.tensor([[0, 0, 2, 3, 3], [0, 1, 1, 1, 1]]))
    for bad in ([[1, 1, 2]], [[0, 1, 0]], [[0, 0, 1]]):
        with pytest.raises(ValueError, match="contiguous"):
            A.check_doc_start(torch.tensor(bad))


# ----------------------------------------------------------------------------------------------------------------
# GPU: real shapes, the same 2x rule against SDPA's flash backend
# ----------------------------------------------------------------------------------------------------------------

def _sdpa(q, k, v, causal, backend):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        if k.shape[1] != q.shape[1]:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            except RuntimeError:
                G = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_run(q, k, v, do, causal, backend, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = _sdpa(q, k, v, causal, backend)
    (out.float() * do.float()).sum().backward()
    return out, [q.grad, k.grad, v.grad]


def _lse_chunked(q, k, causal, scale, rows=512):
    G = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(G, dim=1)
    T = q.shape[2]
    out = []
    for s0 in range(0, T, rows):
        sc = torch.matmul(q[:, :, s0:s0 + rows].float(), kk.transpose(-1, -2)) * scale
        if causal:
            i = torch.arange(s0, min(s0 + rows, T), device=q.device)[:, None]
            sc = sc.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > i, float("-inf"))
        out.append(torch.logsumexp(sc, -1))
    return torch.cat(out, dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("T,Hq,Hkv,D,causal", [(4096, 32, 8, 128, True), (16384, 32, 8, 128, True),
                                                (4133, 24, 8, 64, False), (8192, 28, 4, 128, True)])
def test_gpu_vs_sdpa_flash(T, Hq, Hkv, D, causal):
    from torch.nn.attention import SDPBackend

    q, k, v, _, do = _inputs(1, Hq, Hkv, T, D, bf16, device="cuda")
    out, lse, grads = _run(flash_attention_with_lse, q, k, v, None, do, causal=causal)
    b_out, b_grads = _sdpa_run(q, k, v, do, causal, SDPBackend.FLASH_ATTENTION, bf16)
    # truth: fp32 inputs through the memory-efficient backend (O(T) memory, fp32 math)
    t_out, t_grads = _sdpa_run(q, k, v, do, causal, SDPBackend.EFFICIENT_ATTENTION, fp32)
    _check("out", out, t_out, b_out, 1e-3)
    for name, g, t, b in zip(["dq", "dk", "dv"], grads, t_grads, b_grads):
        _check(name, g, t, b, 1e-3)
    t_lse = _lse_chunked(q, k, causal, D ** -0.5)
    assert _err(lse, t_lse) <= 1e-3


@pytest.mark.gpu
def test_gpu_window_sinks_gpt_oss():
    """gpt-oss sliding layer shape: 64/8 heads, D=64, window 128, sinks (SDPA has neither: the reference)."""
    q, k, v, s, do = _inputs(1, 64, 8, 4096, 64, bf16, sinks=True, device="cuda")
    out, lse, grads = _run(flash_attention_with_lse, q, k, v, s, do, causal=True, window=128)
    t_out, t_lse, t_grads = _run(attention_reference, q.float(), k.float(), v.float(), s.float(), do.float(),
                                 causal=True, window=128)
    b_out, _, b_grads = _run(attention_reference, q, k, v, s, do, causal=True, window=128, upcast=False)
    _check("out", out, t_out, b_out, 1e-3)
    for name, g, t, b in zip(["dq", "dk", "dv", "dsinks"], grads, t_grads, b_grads):
        _check(name, g, t, b, 1e-3 * max(1.0, t.abs().max().item()) if name == "dsinks" else 1e-3)
    assert _err(grads[3], t_grads[3]) <= 1e-2 * t_grads[3].abs().max().item()
    assert _err(lse, t_lse) <= 1e-3


@pytest.mark.gpu
def test_gpu_fp32_and_fp16_small():
    for dtype in (fp32, fp16):
        q, k, v, s, do = _inputs(2, 6, 2, 333, 64, dtype, sinks=True, device="cuda")
        _check_all(q, k, v, s, do, causal=True, window=100)
        _check_all(q, k, v, s, do, causal=False)


def test_deterministic_mode_launches_the_fixed_configs(monkeypatch):
    """Under torch's deterministic mode (`train.deterministic`) the kernels skip their autotuned variants, whose
    choice follows timings (and another block shape sums in another order)."""
    class Tuned:
        def __getitem__(self, grid):
            raise AssertionError("the autotuned kernel ran")

    monkeypatch.setattr(A, "_TUNED", {name: Tuned() for name in ("fwd", "dkdv", "dq")})
    q, k, v, _, do = _inputs(1, 2, 1, 40, 16, bf16)
    with pytest.raises(AssertionError, match="autotuned"):
        flash_attention(q, k, v)
    torch.use_deterministic_algorithms(True)
    try:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        flash_attention(q, k, v).backward(do)
    finally:
        torch.use_deterministic_algorithms(False)
    assert q.grad is not None and k.grad is not None


@pytest.mark.gpu
def test_gpu_deterministic_backward():
    q, k, v, s, do = _inputs(1, 32, 8, 4096, 128, bf16, sinks=True, device="cuda")
    a = _run(flash_attention_with_lse, q, k, v, s, do, causal=True)
    b = _run(flash_attention_with_lse, q, k, v, s, do, causal=True)
    for x, y in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_gpu_memory_linear_in_t():
    """fwd+bwd at 64K tokens allocates about the inputs, outputs and grads (no T x T anything)."""
    T, Hq, Hkv, D = 65536, 8, 2, 128
    q, k, v, _, do = _inputs(1, Hq, Hkv, T, D, bf16, device="cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    flash_attention(q, k, v).backward(do)  # autotuning (and its benchmark buffers) happens here, not below
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = flash_attention(q, k, v)
    out.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # out + dq (q-sized) + dk + dv (k-sized) + lse/delta + slack; a T x T fp32 score matrix alone would be 16 GiB
    budget = 2 * q.numel() * 2 + 2 * k.numel() * 2 + 4 * Hq * T * 4 + (64 << 20)
    assert extra <= budget, f"{extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def test_long_calls_tune_on_a_proxy_first(monkeypatch):
    """The first tuned call longer than the T-bucket cap runs each kernel on the first `_T_BUCKET_CAP` positions
    first (where the autotuner times its configs cheaply, under the same key), then once at full length; later
    calls of the same kind go straight to full length, and the results equal the untuned path's."""
    cap, T, launches = 32, 80, []

    def programs(name, t):  # a launch's programs along T: query blocks (fwd, dq) or key blocks (dkdv)
        return -(-t // A._FIXED[name]["BLOCK_N" if name == "dkdv" else "BLOCK_M"])

    class Recording:  # stands in for triton.autotune: records each launch, runs the fixed config
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                fixed = A._FIXED[self.name]
                launches.append((self.name, grid(fixed)[0]))
                A._KERNELS[self.name][grid(fixed)](*args, **kwargs, **fixed)
            return launch

    q, k, v, _, do = _inputs(1, 4, 2, T, 16, bf16)
    ds = torch.tensor([[0] * 50 + [50] * 30], dtype=torch.int32)
    want = _run(flash_attention_with_lse, q, k, v, None, do, causal=True, doc_start=ds)
    monkeypatch.setattr(A, "_TUNED", {name: Recording(name) for name in ("fwd", "dkdv", "dq")})
    monkeypatch.setattr(A, "_T_BUCKET_CAP", cap)
    monkeypatch.setattr(A, "_TUNED_ON_PROXY", set())
    got = _run(flash_attention_with_lse, q, k, v, None, do, causal=True, doc_start=ds)
    for x, y in zip([want[0], want[1], *want[2]], [got[0], got[1], *got[2]]):
        assert torch.equal(x, y)
    assert launches == [("fwd", programs("fwd", cap)), ("fwd", programs("fwd", T)),
                        ("dkdv", programs("dkdv", cap)), ("dq", programs("dq", cap)),
                        ("dkdv", programs("dkdv", T)), ("dq", programs("dq", T))]
    launches.clear()
    _run(flash_attention_with_lse, q, k, v, None, do, causal=True, doc_start=ds)
    assert launches == [("fwd", programs("fwd", T)), ("dkdv", programs("dkdv", T)), ("dq", programs("dq", T))]
