"""The lean layer's attention backends (engine/model/lean_attention.py), on the CPU.

- `sdpa` (CPU flash kernel here; cuDNN's on CUDA, tests/test_lean_attention.py's gpu case): forward, log-sum-exp and
  the backward from the kept output equal torch's SDPA under autograd, with grouped K/V heads (each group's K/V
  expanded on its own) and without, several rows (head slices that are not contiguous) and odd lengths; dq is written
  over the output's storage.
- What it cannot compute (document boundaries, windows, sinks) is an error, not a quiet result.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.model.lean_attention import attention_ops, sdpa_backward_over_out, sdpa_forward


def _qkv(B, H, KV, T, D, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=gen, device=device).to(dtype) for h in (H, KV, KV))
    return q, k, v, torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)


def _autograd(q, k, v, do):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


@pytest.mark.parametrize("B, H, KV, T", [(2, 6, 2, 37), (1, 4, 4, 29), (3, 8, 1, 16)], ids=["gqa-2rows", "mha", "mqa"])
def test_sdpa_lean_attention_equals_sdpa_under_autograd(B, H, KV, T):
    q, k, v, do = _qkv(B, H, KV, T, 16)
    want_out, want_dq, want_dk, want_dv = _autograd(q, k, v, do)
    out, lse = sdpa_forward(q, k, v)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    scores = (q @ k.repeat_interleave(H // KV, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
    storage = out.data_ptr()
    dq, dk, dv, d_sinks = sdpa_backward_over_out(do, q, k, v, out, lse)
    assert dq.data_ptr() == storage and d_sinks is None
    for got, want in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _assert_bf16_within_twice_sdpas_error(B, H, KV, T, D, device="cpu"):
    """The `sdpa` backend in bf16 against an fp32 SDPA: output and gradients from the kept output at most 2x the
    error of torch's SDPA in bf16 (+ a floor of bf16 rounding for entries SDPA happens to get nearly exact)."""
    q, k, v, do = _qkv(B, H, KV, T, D, device=device)
    exact = _autograd(q, k, v, do)
    q16, k16, v16, do16 = (t.bfloat16() for t in (q, k, v, do))
    ref = _autograd(q16, k16, v16, do16)
    out, lse = sdpa_forward(q16, k16, v16)
    assert lse.shape == (B, H, T) and lse.dtype == torch.float32
    got = (out.clone(), *sdpa_backward_over_out(do16, q16, k16, v16, out, lse)[:3])
    for name, g, r, e in zip(("out", "dq", "dk", "dv"), got, ref, exact):
        err, ref_err = ((t.float() - e).abs().max().item() for t in (g, r))
        assert err <= 2 * ref_err + 2 ** -8 * e.abs().max().item() / 16, f"{name}: {err:.3g} vs sdpa {ref_err:.3g}"


def test_sdpa_lean_attention_in_bf16_is_within_twice_sdpas_own_error():
    _assert_bf16_within_twice_sdpas_error(2, 6, 2, 45, 32)


@pytest.mark.parametrize("what", ["window", "sinks", "documents"])
def test_sdpa_lean_attention_refuses_what_it_cannot_compute(what):
    q, k, v, do = _qkv(1, 4, 2, 8, 16)
    extra = {"window": (4, None, None), "sinks": (None, torch.zeros(4), None),
             "documents": (None, None, torch.zeros(1, 8, dtype=torch.int32))}[what]
    forward, backward = attention_ops("sdpa")
    with pytest.raises(ValueError, match="causal rows only.*train.attention=triton"):
        forward(q, k, v, *extra)
    with pytest.raises(ValueError, match="causal rows only"):
        backward(do, q, k, v, q.clone(), torch.zeros(1, 4, 8), *extra)


def test_an_unknown_lean_backend_is_refused():
    with pytest.raises(ValueError, match="'flash_attn' is not one of triton, sdpa"):
        attention_ops("flash_attn")


@pytest.mark.gpu
@pytest.mark.parametrize("B, H, KV, T", [(1, 28, 4, 4099), (2, 8, 8, 1000)], ids=["qwen7b-heads", "mha-2rows"])
def test_gpu_cudnn_lean_attention_is_within_twice_sdpas_bf16_error(B, H, KV, T):
    """On CUDA the `sdpa` backend runs cuDNN's fused attention per K/V group: its output, log-sum-exp and gradients
    from the kept output against an fp32 SDPA, within 2x torch's SDPA's own bf16 error (+ a floor)."""
    _assert_bf16_within_twice_sdpas_error(B, H, KV, T, 128, device="cuda")
