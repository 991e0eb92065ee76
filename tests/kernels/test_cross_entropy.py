"""Fused LM head + cross-entropy (streamtrain_kernels/cross_entropy.py) against the pure-torch references.

fp32 inputs: loss, dh and dW equal the unfused autograd chain (streamtrain_kernels/reference.py
`linear_cross_entropy_reference`) to fp32 rounding. bf16 inputs, the flash-attention rule: against a truth computed
by the same chain on the inputs upcast to fp32, the fused error (max abs) must be at most 2x the error of PyTorch's
own unfused bf16 chain plus a small atol, for loss, dh and dW. The row kernel alone is compared with
`cross_entropy_grad_reference` (bf16 outputs within one ulp: the interpreter truncates fp32 -> bf16 stores).
CPU tests run the kernel under TRITON_INTERPRET=1 (tests/conftest.py) at tiny shapes (N ~ 50, V <= 1000, D = 72,
chunks that do not divide N, vocabularies that are not powers of two); `gpu` tests run the Qwen2.5-7B head
(N = 8192, D = 3584, V = 152064, bf16) and check the peak memory.

    python -m pytest -q tests/kernels/test_cross_entropy.py                 # CPU (interpreter)
    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_cross_entropy.py   # GPU machine
"""

from __future__ import annotations

import pytest
import torch

import streamtrain_kernels.cross_entropy as CE
from streamtrain_kernels.cross_entropy import default_chunk_tokens, fused_linear_cross_entropy, softmax_ce_grad_
from streamtrain_kernels.reference import cross_entropy_grad_reference, linear_cross_entropy_reference

bf16, fp32 = torch.bfloat16, torch.float32


def _inputs(N, D, V, dtype, n_ignored=0, device="cpu", seed=0):
    """h ~ N(0, 1), W ~ N(0, 1/D): logits of unit scale, so the softmax is neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    W = torch.randn(V, D, generator=g) * D ** -0.5 * 2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.randperm(N, generator=g)[:n_ignored]] = -100
    return h.to(device, dtype), W.to(device, dtype), labels.to(device)


def _run(fn, h, W, labels, **kw):
    """(loss, dh, dW) of fn with fresh leaves."""
    h, W = (t.detach().clone().requires_grad_() for t in (h, W))
    loss = fn(h, W, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, W.grad


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _check_rule(h, W, labels, atol, **kw):
    """bf16: fused error <= 2 x the unfused bf16 chain's error + atol * scale of the truth, for loss, dh, dW
    (+ one bf16 ulp of the largest gradient under the interpreter, whose fp32 -> bf16 stores truncate)."""
    got = _run(fused_linear_cross_entropy, h, W, labels, **kw)
    kw.pop("chunk_tokens", None)
    base = _run(linear_cross_entropy_reference, h, W, labels, **kw)
    truth = _run(linear_cross_entropy_reference, h.float(), W.float(), labels, **kw)
    for name, g, b, t in zip(["loss", "dh", "dW"], got, base, truth):
        assert g.dtype == (fp32 if name == "loss" else h.dtype) and g.shape == t.shape
        err, berr = _err(g, t), _err(b, t)
        tol = 2 * berr + atol * t.abs().max().item()
        if not h.is_cuda and name != "loss":
            tol += _ulp_bf16(t.abs().max()).item()
        assert err <= tol, f"{name}: fused err {err:.3g} > 2 x unfused bf16 err {berr:.3g} + atol ({tol:.3g})"
    return got


def _ulp_bf16(x):
    """One bf16 ulp at |x| (normal range)."""
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, e - 7)


@pytest.mark.parametrize("dtype", [fp32, bf16])
@pytest.mark.parametrize("V", [257, 1000])
def test_row_kernel_matches_reference(dtype, V):
    g = torch.Generator().manual_seed(V)
    z = (torch.randn(11, V, generator=g) * 4).to(dtype)
    labels = torch.randint(0, V, (11,), generator=g)
    labels[2], labels[7], labels[9] = -100, V - 1, 0
    got_z, want_z = z.clone(), z.clone()
    loss = torch.empty(11)
    softmax_ce_grad_(got_z, labels, loss, scale=0.3)
    want = cross_entropy_grad_reference(want_z, labels, scale=0.3)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-5)
    assert loss[2] == 0 and (got_z[2] == 0).all()
    if dtype == fp32:
        torch.testing.assert_close(got_z, want_z, rtol=1e-5, atol=1e-7)
    else:
        assert ((got_z.float() - want_z.float()).abs() <= _ulp_bf16(want_z)).all()


def test_row_kernel_without_grad_leaves_logits():
    z = torch.randn(5, 300)
    labels = torch.tensor([1, -100, 299, 0, 150])
    loss = torch.empty(5)
    before = z.clone()
    softmax_ce_grad_(z, labels, loss, scale=1.0, with_grad=False)
    assert torch.equal(z, before)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(before, labels, reduction="none"))


@pytest.mark.parametrize("N,V,chunk", [(50, 1000, 16), (37, 257, None)])
def test_fp32_matches_unfused_chain(N, V, chunk):
    h, W, labels = _inputs(N, 72, V, fp32, n_ignored=6)
    got = _run(fused_linear_cross_entropy, h, W, labels, scale=1 / 44, chunk_tokens=chunk)
    want = _run(linear_cross_entropy_reference, h, W, labels, scale=1 / 44)
    for name, g, w in zip(["loss", "dh", "dW"], got, want):
        assert g.dtype == fp32 and g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)


def test_bf16_error_rule():
    h, W, labels = _inputs(50, 72, 1000, bf16, n_ignored=5)
    _check_rule(h, W, labels, atol=2e-3, scale=1 / 45, chunk_tokens=16)


def _check_grad_output_scaling(h, W, labels, c, **kw):
    """loss * c backward: the gradients of loss, multiplied by c in fp32 and rounded once (exactly so on the GPU;
    the interpreter truncates, one ulp)."""
    _, dh1, dW1 = _run(fused_linear_cross_entropy, h, W, labels, **kw)
    _, dh, dW = _run(lambda *a, **k: fused_linear_cross_entropy(*a, **k) * c, h, W, labels, **kw)
    want = dh1.float().mul(c)
    if h.is_cuda:
        assert torch.equal(dh, want.to(h.dtype))
    else:
        assert ((dh.float() - want).abs() <= _ulp_bf16(want)).all()
    # dW1 = round(x) of the fp32 sum x, dW = round(x * c): dW is half an ulp of x * c from x * c, dW1 * c is
    # c / 2 ulp of dW1 from it (whole ulps where the interpreter truncates)
    half = 0.5 if h.is_cuda else 1.0
    bound = half * (_ulp_bf16(dW1.float() * c) + c * _ulp_bf16(dW1)) * (1 + 1e-6)
    assert ((dW.float() - dW1.float() * c).abs() <= bound).all()


def test_grad_output_scales_once(monkeypatch):
    monkeypatch.setattr(CE, "SCALE_BLOCK_INTERPRET", 256)  # several programs and a masked tail
    h, W, labels = _inputs(20, 72, 300, bf16, n_ignored=2)
    _check_grad_output_scaling(h, W, labels, 0.37, chunk_tokens=7)


def test_ignored_and_edge_cases():
    h, W, labels = _inputs(9, 72, 300, fp32)
    loss, dh, dW = _run(fused_linear_cross_entropy, h, W, torch.full_like(labels, -100))
    assert loss.item() == 0 and not dh.any() and not dW.any()
    bad = labels.clone()
    bad[4] = 300  # out of range: NaN, no host-side check (it would sync the device)
    assert torch.isnan(fused_linear_cross_entropy(h, W, bad))
    empty = fused_linear_cross_entropy(h[:0], W, labels[:0])
    assert empty.shape == () and empty.item() == 0
    other = fused_linear_cross_entropy(h, W, labels, ignore_index=int(labels[0]))  # any ignore_index value
    want = linear_cross_entropy_reference(h, W, labels, ignore_index=int(labels[0]))
    torch.testing.assert_close(other, want, rtol=1e-6, atol=1e-5)


def test_no_grad_autocast_and_partial_grads():
    h, W, labels = _inputs(12, 72, 300, fp32)
    want = linear_cross_entropy_reference(h, W, labels)
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(h, W, labels), want, rtol=1e-6, atol=1e-5)
    with torch.autocast("cpu", dtype=bf16):  # disabled inside: fp32 matmuls
        torch.testing.assert_close(fused_linear_cross_entropy(h, W, labels), want, rtol=1e-6, atol=1e-5)
    Wg = W.clone().requires_grad_()
    fused_linear_cross_entropy(h, Wg, labels).backward()  # only the weight needs a gradient
    Wr = W.clone().requires_grad_()
    linear_cross_entropy_reference(h, Wr, labels).backward()
    torch.testing.assert_close(Wg.grad, Wr.grad, rtol=1e-5, atol=1e-6)


def test_default_chunk_tokens():
    assert default_chunk_tokens(152064) == 882
    assert default_chunk_tokens(1000) == 2**27 // 1000
    assert default_chunk_tokens(2**28) == 1


@pytest.mark.parametrize("case", ["dtype mix", "fp64", "h 1-D", "D mismatch", "labels float", "labels length",
                                  "labels 2-D", "chunk 0", "empty vocab"])
def test_bad_arguments_raise(case):
    h, W, labels = _inputs(4, 8, 16, fp32)
    args = {"dtype mix": (h, W.to(bf16), labels), "fp64": (h.double(), W.double(), labels),
            "h 1-D": (h[0], W, labels), "D mismatch": (h[:, :7], W, labels),
            "labels float": (h, W, labels.float()), "labels length": (h, W, labels[:3]),
            "labels 2-D": (h, W, labels[:, None]), "chunk 0": (h, W, labels), "empty vocab": (h, W[:0], labels)}
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        fused_linear_cross_entropy(*args[case], chunk_tokens=0 if case == "chunk 0" else None)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Qwen2.5-7B head
# ---------------------------------------------------------------------------------------------------------------

QWEN7B = {"N": 8192, "D": 3584, "V": 152064}


@pytest.mark.gpu
def test_gpu_qwen7b_error_rule(cuda):
    h, W, labels = _inputs(**QWEN7B, dtype=bf16, n_ignored=100, device=cuda)
    scale = 1 / 8092
    _check_rule(h, W, labels, atol=1e-3, scale=scale)
    _check_grad_output_scaling(h, W, labels, 0.37, scale=scale)  # one rounding on the GPU too


@pytest.mark.gpu
def test_gpu_qwen7b_peak_memory(cuda):
    N, D, V = QWEN7B["N"], QWEN7B["D"], QWEN7B["V"]
    h, W, labels = _inputs(N, D, V, dtype=bf16, device=cuda)
    h.requires_grad_()
    W.requires_grad_()
    fused_linear_cross_entropy(h, W, labels).backward()  # compile, cuBLAS workspaces
    h.grad = W.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(h, W, labels).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # what the design must hold: dh (N x D bf16, becomes h.grad), dW in fp32 and its bf16 cast (W.grad)
    grads = N * D * 2 + V * D * 4 + V * D * 2
    logits_chunk = default_chunk_tokens(V) * V * 2
    assert extra - grads <= 1.5 * logits_chunk, f"extra {extra / 2**30:.2f} GiB beyond the gradients"
    assert extra - grads < N * V * 2 / 4  # the full bf16 logits would be N*V*2 = 2.3 GiB on their own
