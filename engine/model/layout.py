"""Parameter layout of one unit (embedding, one decoder layer, or the LM head) in a flat buffer.

The streaming engine moves a unit's parameters as one contiguous buffer, so each unit has a fixed layout: an ordered
list of tensors (HF names, shapes) at aligned offsets. Both engines and every later kernel index parameters through
this one contract.

Tensors are ordered by how they are streamed to the GPU. `matmul` tensors (consumed only by a linear layer under
autocast) come first and form the *cast segment* `[0, cast_numel)`: the GPU may hold them in the compute dtype,
because autocast would cast them on use anyway, so bf16 copies give bit-identical results. The rest (`embedding`,
consumed by a lookup, and 1-D `vector` tensors: norms and biases, used in fp32 elementwise ops) must stay fp32.
Weight decay applies to every tensor of two or more dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence, Tuple

import torch

ALIGN_ELEMS = 64  # 256 B in fp32, 128 B in bf16: every tensor starts on a cache-line-friendly boundary

KINDS = ("matmul", "embedding", "vector")


@dataclass(frozen=True)
class ParamSpec:
    name: str  # HF name relative to the unit's prefix, e.g. "self_attn.q_proj.weight"
    shape: Tuple[int, ...]
    kind: str  # matmul | embedding | vector

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def decay(self) -> bool:
        return len(self.shape) >= 2


def _align(n: int) -> int:
    return -(-n // ALIGN_ELEMS) * ALIGN_ELEMS


class UnitLayout:
    """Offsets of a unit's tensors in its flat buffer; `views` binds them to a buffer without copying."""

    def __init__(self, prefix: str, specs: Sequence[ParamSpec]):
        for s in specs:
            if s.kind not in KINDS:
                raise ValueError(f"{prefix}{s.name}: kind {s.kind!r} is not one of {KINDS}")
        order = {"matmul": 0, "embedding": 1, "vector": 2}
        self.prefix = prefix
        self.specs: List[ParamSpec] = sorted(specs, key=lambda s: order[s.kind])
        self.offsets: List[int] = []
        offset = 0
        self.cast_numel = 0
        for s in self.specs:
            self.offsets.append(offset)
            offset = _align(offset + s.numel)
            if s.kind == "matmul":
                self.cast_numel = offset
        self.numel = offset  # padded total
        self.param_numel = sum(s.numel for s in self.specs)

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.specs]

    def views(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Tensor views into one flat buffer of this layout (numel >= self.numel)."""
        if flat.numel() < self.numel:
            raise ValueError(f"{self.prefix}: buffer of {flat.numel()} elements < layout {self.numel}")
        return {s.name: flat[off:off + s.numel].view(s.shape) for s, off in zip(self.specs, self.offsets)}

    def bind(self, cast_buf: torch.Tensor, tail_buf: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Views into a split copy: the cast segment in `cast_buf` (any dtype), the rest in `tail_buf` (fp32),
        where `tail_buf[0]` holds flat element `cast_numel`."""
        out = {}
        for s, off in zip(self.specs, self.offsets):
            if s.kind == "matmul":
                out[s.name] = cast_buf[off:off + s.numel].view(s.shape)
            else:
                start = off - self.cast_numel
                out[s.name] = tail_buf[start:start + s.numel].view(s.shape)
        return out
