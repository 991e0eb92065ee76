"""MXFP4 decoding (OCP microscaling FP4), for the expert weights gpt-oss checkpoints ship in.

Format: a block of 32 values is 16 bytes of E2M1 codes, two per byte, the low
nibble first, plus one uint8 E8M0 scale s shared by the block. A code's top bit is the sign and its low three bits
index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; the value is that magnitude times 2^(s - 127). Scale 255 is NaN
in the format and is refused.

Exactness: a magnitude has at most two significant bits and 2^(s - 127) spans exactly fp32's (and bf16's) exponent
range, 2^-127 (a subnormal) to 2^127, so every decoded value is exact in fp32 and in bf16, except that magnitudes of
2 and more at s = 254 exceed every 8-bit-exponent float and decode to +-inf (as in transformers). The power of two
is built from its fp32 bit pattern (exponent field s; s = 0 is the subnormal with only mantissa bit 22 set) rather
than computed, so no libm rounding can enter.

Layout and cost: a checkpoint stores an expert matrix as [E, rows, cols/32, 16] blocks with [E, rows, cols/32]
scales (rows = the output features, nn.Linear's [out, in]); the modules that run them hold the transpose
[E, cols, rows] (`x @ W`). `decode_experts` writes straight into that transposed layout, CHUNK_VALUES values at a
time: peak memory is the output, the packed input (a quarter of a bf16 output) and about 6 bytes per chunk value
of temporaries, independent of the tensor's size. Speed: one table lookup per byte (its two values at once) and one
multiply per value, about 60 M values/s on 2 CPU cores.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16
BLOCK_VALUES = 2 * BLOCK_BYTES
NAN_SCALE = 255
CHUNK_VALUES = 1 << 22  # values decoded per step of decode_experts (about 25 MB of temporaries)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: blocks must "
                         f"be [..., G, {BLOCK_BYTES}] with scales [..., G]")
    bad = scales == NAN_SCALE
    if bad.any():
        raise ValueError(f"MXFP4 scale {NAN_SCALE} (NaN in the format) at block {torch.nonzero(bad)[0].tolist()} "
                         f"({int(bad.sum())} such blocks); valid scales are 0..254")


def power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) in fp32 for uint8 scales s in 0..254, exactly (assembled from the bit pattern)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    return bits.view(torch.float32)


def _decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)  # byte -> (low nibble's, high nibble's)
    values = pairs.index_select(0, blocks.reshape(-1).int()).view(*blocks.shape[:-1], BLOCK_VALUES)
    return values.mul_(power_of_two(scales).unsqueeze(-1)).flatten(-2)


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and scales [..., G] -> values [..., G * 32] in `dtype`, in one piece."""
    _check(blocks, scales)
    return _decode(blocks, scales).to(dtype)


def decode_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   work_device: torch.device | str | None = None) -> torch.Tensor:
    """A checkpoint's expert matrices, blocks [E, rows, G, 16] and scales [E, rows, G], decoded and transposed to
    [E, G * 32, rows] (contiguous, in `dtype`), a bounded number of rows at a time.

    The direction was checked against transformers 5.25 (integrations/mxfp4.py, `convert_moe_packed_tensors`, which
    its GptOss loading uses for `*_blocks`/`*_scales`): it decodes to [E, rows, G * 32] and returns that transposed
    in dims 1 and 2, so gpt-oss's gate_up_proj [E, 2I, D/32, 16] becomes [E, D, 2I] and down_proj [E, D, I/32, 16]
    becomes [E, I, D], the shapes GptOssExperts holds. tests/test_hf_moe.py compares with that function and with
    a checkpoint transformers dequantizes itself.

    `work_device`: where the chunks are decoded (default: the blocks' device). The output stays on the blocks'
    device; a CUDA device decodes the host tensors chunk by chunk (a few tens of MB of GPU memory at a time), about
    as fast as the chunks cross PCIe, where 2 CPU cores manage ~60 M values/s."""
    _check(blocks, scales)
    if blocks.dim() != 4:
        raise ValueError(f"MXFP4 expert blocks must be [E, rows, G, {BLOCK_BYTES}], got {list(blocks.shape)}")
    experts, rows, groups, _ = blocks.shape
    cols = groups * BLOCK_VALUES
    out = torch.empty(experts, cols, rows, dtype=dtype, device=blocks.device)
    step = max(1, CHUNK_VALUES // max(cols, 1))
    work = torch.device(work_device) if work_device is not None else blocks.device
    for e in range(experts):
        for r0 in range(0, rows, step):
            part = _decode(blocks[e, r0:r0 + step].to(work), scales[e, r0:r0 + step].to(work)).T
            out[e, :, r0:r0 + step] = part.to(dtype).to(out.device)
    return out
