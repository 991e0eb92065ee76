"""Rotary position embeddings: inverse frequencies (default, Llama 3.1 rescaling, YaRN), cos/sin tables, and the
per-micro-batch `Positions` the layer templates take.

Computed in fp32 with autocast off, as transformers does; the tables are [T, head_dim] with the frequencies repeated
for the two halves (the rotate-half convention of HF checkpoints). YaRN (gpt-oss) blends interpolated and original
frequencies by a linear ramp over the rotation count at the original context, and multiplies cos and sin by an
attention factor (0.1 ln(factor) + 1 unless given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Positions:
    """Where a micro-batch's tokens sit: the rotary cos/sin of each token's position, and for packed rows the
    document layout attention masks by (engine/batch.py). Unpacked rows share one [T, head_dim] table (positions
    0..T-1); packed rows gather theirs per token, [B, 1, T, head_dim], from the same table, so a document's tokens
    get exactly the values they would get alone."""
    cos: torch.Tensor  # fp32 [T, head_dim] or [B, 1, T, head_dim]
    sin: torch.Tensor
    doc_start_BT: Optional[torch.Tensor] = None  # int32 [B, T]; None: one document per row

    @property
    def table_len(self) -> int:
        return self.cos.shape[-2]

    def tokens(self, start: int, stop: int) -> "Positions":
        """The rotary tables of tokens start..stop-1 of every row (for per-token work in chunks; the document layout,
        which attention needs over whole rows, is not carried)."""
        return Positions(self.cos[..., start:stop, :], self.sin[..., start:stop, :])

    def of_rows(self, doc_start_BT: Optional[torch.Tensor]) -> "Positions":
        """These (unpacked) tables re-indexed for packed rows: token i of a row gets position i - doc_start[i]."""
        if doc_start_BT is None:
            return self
        T = doc_start_BT.shape[1]
        if self.cos.dim() != 2 or T > self.table_len:
            raise ValueError(f"Positions.of_rows: needs an unpacked table of at least {T} positions, got "
                             f"{tuple(self.cos.shape)}")
        doc_start_BT = doc_start_BT.to(device=self.cos.device, dtype=torch.int32)
        pos_BT = (torch.arange(T, device=self.cos.device, dtype=torch.int32) - doc_start_BT).long()
        return Positions(self.cos[pos_BT].unsqueeze(1), self.sin[pos_BT].unsqueeze(1), doc_start_BT)


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return freq
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(freq, head_dim, theta, scaling)
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"rope_scaling.rope_type={scaling['rope_type']!r} is not supported (llama3, yarn, default)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * freq / factor + smooth * freq
    out = torch.where(wavelen > original / low, freq / factor, freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(medium, blended, out)


def _yarn_inv_freq(freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the frequency index that turns `rotations` times over the original span
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast rotations), 0: the interpolated one
    return (freq / factor) * (1 - keep) + freq * keep


def attention_factor(scaling: dict | None) -> float:
    """The factor YaRN applies to cos and sin (1 for the other rope types)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_tables(head_dim: int, theta: float, scaling: dict | None, seq_len: int,
                device: torch.device | str = "cpu") -> Positions:
    freq = inv_freq(head_dim, theta, scaling).to(device)
    with torch.autocast(device_type=torch.device(device).type, enabled=False):
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(pos, freq)
        emb = torch.cat((angles, angles), dim=-1)
        scale = attention_factor(scaling)
        if scale == 1.0:
            return Positions(emb.cos(), emb.sin())
        return Positions(emb.cos() * scale, emb.sin() * scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHTD: torch.Tensor, pos: Positions) -> torch.Tensor:
    """Rotation in fp32 (the tables are fp32, so type promotion lifts bf16 inputs), as HF does under autocast."""
    return x_BHTD * pos.cos + rotate_half(x_BHTD) * pos.sin
