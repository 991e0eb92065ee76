"""Causal GQA attention for the layer templates.

torch's scaled_dot_product_attention with `enable_gqa` (query head j reads kv head j // (nh/kv), the grouping of
HF's repeat_kv), or the optional flash-attn package where it is installed and applies (bf16/fp16 on CUDA). There
is no knob yet: choosing a backend per run (`train.attention`, with the Triton kernel of engine/kernels/attention.py
among the choices, and never a silent switch away from the one asked for) is the long-context issue's work.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _flash_applicable(q: torch.Tensor, dtype: torch.dtype) -> bool:
    return HAVE_FLASH_ATTN and q.is_cuda and dtype in (torch.bfloat16, torch.float16)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def causal_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> torch.Tensor:
    """Returns [B, T, nh*hd] in the compute dtype. Scale hd**-0.5, causal, no dropout."""
    dtype = _compute_dtype(q_BHTD)
    B, nh, T, hd = q_BHTD.shape
    if _flash_applicable(q_BHTD, dtype):
        from flash_attn import flash_attn_func

        q, k, v = (t.transpose(1, 2).to(dtype) for t in (q_BHTD, k_BHTD, v_BHTD))
        return flash_attn_func(q, k, v, causal=True).reshape(B, T, nh * hd)
    q, k, v = (t.to(dtype) for t in (q_BHTD, k_BHTD, v_BHTD))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != nh)
    return out.transpose(1, 2).reshape(B, T, nh * hd)
