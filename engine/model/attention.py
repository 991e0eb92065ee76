"""Causal GQA attention for the layer templates, with the backend chosen per run (`train.attention`).

Backends (query head j reads kv head j // (nh / kv), the grouping of HF's repeat_kv):
- `triton`: the project's flash attention (streamtrain_kernels/attention.py), forward and backward in Triton, memory
  linear in the sequence length. CUDA (or the Triton interpreter, for CPU tests); head_dim a power of two in 16..128.
- `sdpa`: torch's scaled_dot_product_attention with `enable_gqa`; on an H100 torch runs cuDNN's attention for bf16.
- `flash_attn`: the optional flash-attn package (bf16/fp16 on CUDA), when installed.
- `auto`: `sdpa`; on CUDA, `triton` for packed rows and for models with windows or sinks, and where the lean layer runs
  (above 128K tokens a micro-batch) `sdpa`'s cuDNN kernel, or `triton` when that cannot serve (packed rows, fp32
  compute, `train.deterministic`): see `resolve_attention` and engine/model/lean_attention.py.

Measured on an H100: torch's default SDPA (cuDNN) runs 530-567 TFLOPS fwd+bwd from 32K to 512K tokens, 1.36-1.54x the
Triton kernel (bench/results/attention_sdpa_backends_h100_2026-12-07.jsonl); the Triton kernel beats only SDPA's
flash backend (1.20-1.22x, bench/results/attention_h100_2026-12-05.jsonl). flash-attn is not chosen by `auto`: it
does not build offline, so it was never measured here.

Models with attention sinks or sliding-window layers (gpt-oss) run on `triton` only, which `auto` then picks: the
other backends compute neither.

A backend that was asked for and cannot run the shape or the device is an error (`resolve_attention`, called when
the engine is built), never a quiet switch to another one.

The Triton kernel is a torch.library custom op (`layer_attention_forward`, streamtrain_kernels/attention.py): the
compiled layer stays one graph with the kernel as an opaque node.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
import torch.nn.functional as F

from engine.config import ATTENTION_BACKENDS, ConfigError
from engine.device import autocast_dtype
from streamtrain_kernels.attention import HEAD_DIMS, layer_attention_forward

HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _triton_runs_on(device_type: str) -> bool:
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_attention(requested: str, device_type: str, head_dim: int, sinks_or_window: bool = False,
                      packed: bool = False, lean: bool = False, lean_sdpa: bool = False) -> str:
    """The concrete backend for `train.attention=requested` on this device and head size; raises ConfigError
    naming the value and what would be valid when the asked-for backend cannot run. `sinks_or_window`: the model
    has attention sinks or sliding-window layers (gpt-oss), which only the Triton kernel computes. `packed`: the
    rows hold several documents (data=text/chat); `auto` then takes the Triton kernel where it runs (it skips
    other documents' keys; SDPA would need a dense T x T mask), and flash_attn is refused. `lean`: the run would
    take the lean layer (engine/model/lean.py); `auto` then takes a backend it runs on CUDA: `sdpa` (cuDNN's fused
    attention, engine/model/lean_attention.py) where `lean_sdpa` says it runs and the rows are single documents
    without windows or sinks, else the Triton kernel."""
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(f"train.attention={requested!r} is not valid; choose one of {', '.join(ATTENTION_BACKENDS)}")
    triton_fits = head_dim in HEAD_DIMS
    if packed and requested == "flash_attn":
        raise ConfigError("train.attention=flash_attn does not take the document boundaries of packed rows "
                          "(data=text/chat); use train.attention=auto, triton or sdpa")
    if lean and lean_sdpa and requested == "auto" and device_type == "cuda" and not (packed or sinks_or_window):
        return "sdpa"
    if (packed or lean) and requested == "auto" and triton_fits and device_type == "cuda":
        return "triton"
    if sinks_or_window:
        if requested not in ("auto", "triton"):
            raise ConfigError(f"train.attention={requested}: this model has attention sinks or sliding-window layers, "
                              "which only the Triton kernel computes; use train.attention=triton or auto")
        if not _triton_runs_on(device_type):
            raise ConfigError(f"train.attention={requested}: this model has attention sinks or sliding-window layers, "
                              f"which only the Triton kernel computes, and it needs a CUDA device; the run is on "
                              f"{device_type} (TRITON_INTERPRET=1 runs the kernel interpreted on the CPU, slowly)")
        requested = "triton"
    if requested == "auto":
        return "sdpa"
    if requested == "triton":
        if not triton_fits:
            raise ConfigError(f"train.attention=triton: head_dim={head_dim} is not supported by the Triton kernel "
                              f"(head_dim in {HEAD_DIMS}); use train.attention=sdpa")
        if not _triton_runs_on(device_type):
            raise ConfigError(f"train.attention=triton needs a CUDA device (or TRITON_INTERPRET=1 for tests), but "
                              f"the run is on {device_type}; use train.attention=sdpa or auto")
    if requested == "flash_attn":
        if not HAVE_FLASH_ATTN:
            raise ConfigError("train.attention=flash_attn, but the flash-attn package is not installed "
                              "(pip install -e '.[flash]'); use train.attention=auto, triton or sdpa")
        if device_type != "cuda":
            raise ConfigError(f"train.attention=flash_attn needs a CUDA device, but the run is on {device_type}; "
                              "use train.attention=sdpa")
    return requested


def document_mask(doc_start_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T]: query i sees key j iff doc_start[i] <= j <= i (causal, within its own document)."""
    T = doc_start_BT.shape[1]
    j = torch.arange(T, device=doc_start_BT.device, dtype=torch.int32)
    return ((j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= doc_start_BT[:, :, None])).unsqueeze(1)


def causal_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                     backend: str = "sdpa", window: Optional[int] = None,
                     sinks: Optional[torch.Tensor] = None,
                     doc_start_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Returns [B, T, nh*hd] in the compute dtype. Scale hd**-0.5, causal, no dropout. `backend`: a resolved
    name (not `auto`). `window` (keys seen per query, itself included) and `sinks` (fp32 [nh] logits, gpt-oss) are
    computed by the Triton kernel only; `resolve_attention` refuses the other backends for models that use them.
    `doc_start_BT` (packed rows, engine/batch.py): each query sees its own document only; the Triton kernel skips
    the key blocks of other documents, SDPA takes a dense [T, T] mask (T^2 bytes per row: for the CPU and short
    rows), flash_attn refuses it."""
    dtype = autocast_dtype(q_BHTD.device.type, q_BHTD.dtype)
    B, nh, T, hd = q_BHTD.shape
    q, k, v = (t.to(dtype) for t in (q_BHTD, k_BHTD, v_BHTD))
    if backend != "triton" and (window is not None or sinks is not None):
        raise ValueError(f"causal_attention: backend {backend!r} computes neither sliding windows nor sinks; "
                         "use triton")
    if backend == "triton":
        out = layer_attention_forward(q, k, v, window, sinks, doc_start_BT)[0]
    elif backend == "flash_attn":
        if doc_start_BT is not None:
            raise ValueError("causal_attention: flash_attn does not take document boundaries; use triton or sdpa")
        from flash_attn import flash_attn_func

        return flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).reshape(B, T, nh * hd)
    elif backend == "sdpa":
        if doc_start_BT is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != nh)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_start_BT),
                                                 enable_gqa=k.shape[1] != nh)
    else:
        raise ValueError(f"causal_attention: backend {backend!r} is not a resolved backend (triton, sdpa, flash_attn)")
    return out.transpose(1, 2).reshape(B, T, nh * hd)
