"""Rotary position embeddings: inverse frequencies (default and Llama 3.1 rescaling) and cos/sin tables.

Computed in fp32 with autocast off, as transformers does; the tables are [T, head_dim] with the frequencies repeated
for the two halves (the rotate-half convention of HF checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Rope:
    cos_TD: torch.Tensor  # fp32 [T, head_dim]
    sin_TD: torch.Tensor


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return freq
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"rope_scaling.rope_type={scaling['rope_type']!r} is not supported (llama3, default)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * freq / factor + smooth * freq
    out = torch.where(wavelen > original / low, freq / factor, freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(medium, blended, out)


def rope_tables(head_dim: int, theta: float, scaling: dict | None, seq_len: int,
                device: torch.device | str = "cpu") -> Rope:
    freq = inv_freq(head_dim, theta, scaling).to(device)
    with torch.autocast(device_type=torch.device(device).type, enabled=False):
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(pos, freq)
        emb = torch.cat((angles, angles), dim=-1)
        return Rope(emb.cos(), emb.sin())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotation in fp32 (the tables are fp32, so type promotion lifts bf16 inputs), as HF does under autocast."""
    return x_BHTD * rope.cos_TD + rotate_half(x_BHTD) * rope.sin_TD
