"""The attention inside the lean layer (engine/model/lean.py): a forward that also returns the log-sum-exp, and a
backward that starts from a kept output (no second attention forward) and writes dq over that output's storage.

Backends, by `train.attention`'s resolved name:
- `triton`: the project's kernel (streamtrain_kernels/attention.py). Document boundaries, sliding windows and sinks;
  each K/V head is read by its group of query heads, never expanded.
- `sdpa`: torch's fused attention ops that return the log-sum-exp and take it back in their backward: cuDNN's on
  CUDA (`aten._scaled_dot_product_cudnn_attention`, what torch's SDPA runs by default on an H100) and the CPU flash
  kernel elsewhere (`aten._scaled_dot_product_flash_attention_for_cpu`, which the CPU tests run). On an H100, cuDNN's
  fwd+bwd is 1.36-1.54x the Triton kernel from 32K to 512K tokens
  (bench/results/attention_sdpa_backends_h100_2026-12-07.jsonl). These are private aten ops: torch's public
  attention calls neither return the log-sum-exp nor take a kept output in their backward. Causal rows only: no
  document boundaries, windows or sinks (`resolve_lean_layer` leaves those to `triton`); bf16 or fp16 on CUDA.

GQA under `sdpa`. Neither op takes fewer K/V heads than query heads; SDPA expands K and V over the whole row, which
at 512K tokens (qwen7b, 28 query and 4 K/V heads) is 14 GiB of expanded K, V and their gradients. Here each K/V head
runs as one call over its group of query heads, with only that head's K and V expanded to the group, and the
gradients of the expanded copies summed back into the head's: the transient is one group's share (heads / kv_heads
of the query width) instead of the whole width, for kv_heads calls whose cost at long rows is their FLOPs.
"""

from __future__ import annotations

from typing import Tuple

import torch

from streamtrain_kernels.attention import attention_backward_over_out, layer_attention_forward


CUDNN_ATTENTION_DTYPES = (torch.bfloat16, torch.float16)  # what cuDNN's fused attention computes


def fused_sdpa_runs(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Whether the `sdpa` lean attention runs on `device` in `compute_dtype`: anywhere on the CPU; on CUDA, cuDNN's
    fused attention needs cuDNN 9 or later, an Ampere or newer card and a 16-bit compute dtype."""
    if device.type != "cuda":
        return device.type == "cpu"
    return (torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
            and torch.cuda.get_device_capability(device) >= (8, 0) and compute_dtype in CUDNN_ATTENTION_DTYPES)


def _kv_groups(heads: int, kv_heads: int):
    """(query heads, the K/V head they read) slices: one call's worth each, all heads at once without GQA."""
    if kv_heads == heads:
        return [(slice(0, heads), slice(0, heads))]
    group = heads // kv_heads
    return [(slice(g * group, (g + 1) * group), slice(g, g + 1)) for g in range(kv_heads)]


def _expanded(t_BKTD: torch.Tensor, kv: slice, heads: int) -> torch.Tensor:
    """K/V heads `kv` as `heads` contiguous heads (a copy when expanded: the fused ops take no zero head stride)."""
    return t_BKTD[:, kv].expand(-1, heads, -1, -1).contiguous()


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, hd], lse [B, H, T] fp32) of causal attention over equal head counts."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[:2]
        return out, lse.squeeze(-1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)


def _fused_backward(d_out, q, k, v, out, lse) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_fused_forward` from its output and log-sum-exp."""
    if q.device.type == "cuda":
        T = q.shape[2]
        no_dropout = torch.zeros((), dtype=torch.int64, device=q.device)  # the dropout RNG's seed and offset, unread
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_out, q, k, v, out, lse.unsqueeze(-1), no_dropout, no_dropout, None, None, None, T, T, 0.0, True)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(d_out, q, k, v, out, lse, 0.0, True)


def _check_sdpa(q: torch.Tensor, window, sinks, doc_start) -> None:
    if window is not None or sinks is not None or doc_start is not None:
        raise ValueError("lean attention sdpa: computes causal rows only (no sliding window, sinks or document "
                         "boundaries); use train.attention=triton")
    if q.device.type == "cuda" and q.dtype not in CUDNN_ATTENTION_DTYPES:
        raise ValueError(f"lean attention sdpa: cuDNN's fused attention computes bf16 or fp16, not {q.dtype}; use "
                         "train.compute_dtype=bf16 or train.attention=triton")


def sdpa_forward(q, k, v, window=None, sinks=None, doc_start_BT=None):
    """`attention_forward` of the `sdpa` backend."""
    _check_sdpa(q, window, sinks, doc_start_BT)
    B, H, T, _ = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((B, H, T), dtype=torch.float32)
    for heads, kv in _kv_groups(H, k.shape[1]):
        n = heads.stop - heads.start
        out_g, lse_g = _fused_forward(q[:, heads].contiguous(), _expanded(k, kv, n), _expanded(v, kv, n))
        out[:, heads] = out_g
        lse[:, heads] = lse_g
    return out, lse


def sdpa_backward_over_out(d_out, q, k, v, out, lse, window=None, sinks=None, doc_start_BT=None):
    """`attention_backward_over_out` of the `sdpa` backend: (dq written over `out`, dk, dv, None)."""
    _check_sdpa(q, window, sinks, doc_start_BT)
    if k.shape[1] == q.shape[1]:
        dq, dk, dv = _fused_backward(d_out, q, k, v, out, lse)
        out.copy_(dq)
        return out, dk, dv, None
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for heads, kv in _kv_groups(q.shape[1], k.shape[1]):
        n = heads.stop - heads.start
        dq_g, dk_g, dv_g = _fused_backward(d_out[:, heads].contiguous(), q[:, heads].contiguous(),
                                           _expanded(k, kv, n), _expanded(v, kv, n), out[:, heads].contiguous(),
                                           lse[:, heads].contiguous())
        out[:, heads] = dq_g  # no later group reads these heads' output
        dk[:, kv] = dk_g.sum(1, keepdim=True)  # the expanded copies' gradients, summed back into their head's
        dv[:, kv] = dv_g.sum(1, keepdim=True)
    return out, dk, dv, None


# backend -> (forward: (q, k, v, window, sinks, doc_start_BT) -> (out [B, H, T, hd] in q's dtype, log-sum-exp
# [B, H, T] fp32, the backend's own: handed back to the same backend only),
# backward: (d_out, q, k, v, out, lse, window, sinks, doc_start_BT) -> (dq written over out, dk, dv, d sinks or None))
_OPS = {"triton": (layer_attention_forward, attention_backward_over_out),
        "sdpa": (sdpa_forward, sdpa_backward_over_out)}
LEAN_BACKENDS = tuple(_OPS)


def attention_ops(backend: str):
    """(forward, backward) of the lean layer's attention on `backend` (see `_OPS`)."""
    if backend not in _OPS:
        raise ValueError(f"lean attention: backend {backend!r} is not one of {', '.join(LEAN_BACKENDS)}")
    return _OPS[backend]
