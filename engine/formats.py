"""Training-state formats: what one parameter costs in each tier, by format.

Three typed fields of `train` choose them, each checked at compose time:
- `train.master_dtype`: fp32 (exact) | bf16 (updated with stochastic rounding);
- `train.moments_dtype`: fp32 | bf16 (stochastic rounding) | int8 (blockwise 8-bit floats with one fp32 scale per
  `train.moments_block_size` elements per moment, streamtrain_kernels/adamw_update.py);
- `train.grad_dtype`: fp32 | bf16 (stochastic rounding) | int8 (blockwise 8-bit floats, the code of the int8 m,
  rounded stochastically, one fp32 scale per `train.moments_block_size` elements; streamtrain_kernels/grad_quant.py):
  the gradients held until the global norm is known. The norm is taken over the held values (int8: dequantized),
  so clipping stays exact for what the update reads.

Bytes per parameter: master 4 / 2, moments 8 / 4 / 2 (+ 8 B of scales per block), gradient 4 / 2 / 1 (+ 4 B of
scale per block). The exact recipe is 12 + 4 = 16 B; bf16 master + int8 moments + bf16 gradients about 6 B, which
is what puts qwen32b (32.8 G parameters, 197 GB) into 128 GiB of host plus the H200's spare HBM; int8 gradients make
it about 5 B, which fits Qwen3-30B-A3B's held gradients into the H100's HBM at 64K tokens a step.

int8 gradients are chosen only when `train.grad_dtype=int8` is set: `auto` takes fp32 or bf16 gradients. On real
text (qwen0_5b, 16M tokens) int8 gradients ended 2.9% above bf16 gradients' validation loss in the same state
formats, outside the 2% bar the int8 moments meet (bench/results/formats-quality.md). Their held copies stay on the
GPU (`engine.host_grad_units` places bf16 ones only).

Every format other than all-fp32 is updated on the GPU by the fused kernel (GPU-resident or GPU-streamed units):
the host AdamW (torch's fused CPU AdamW) updates fp32 state only. `all_formats` lists every combination from the
most precise to the smallest, the order in which a refusal suggests them.

Each field may also be `auto` (the default): the planner then takes, among the formats the set fields allow, the
most precise one with which the run fits this machine (engine/plan/build.py `choose_state_format`), says so in the
start banner and records it in summary.json and the W&B config. A field set to a dtype is never changed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Tuple

AUTO = "auto"
MASTER_DTYPES = ("fp32", "bf16")
MOMENTS_DTYPES = ("fp32", "bf16", "int8")
GRAD_DTYPES = ("fp32", "bf16", "int8")
AUTO_GRAD_DTYPES = ("fp32", "bf16")  # what grad_dtype=auto may take (see the module docstring)
BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
SCALE_BYTES = 4


@dataclass(frozen=True)
class StateFormat:
    master: str = "fp32"
    moments: str = "fp32"
    grad: str = "fp32"
    block_size: int = 256  # int8 moments and int8 gradients: elements per scale

    @classmethod
    def of(cls, train_cfg) -> "StateFormat":
        """The configured format; `auto` fields must have been resolved by the planner (engine/plan/build.py)."""
        if format_is_open(train_cfg):
            raise ValueError("the state format has fields left auto (train.master_dtype/moments_dtype/grad_dtype); "
                             "build_plan resolves them before an engine is built")
        return cls(train_cfg.master_dtype, train_cfg.moments_dtype, train_cfg.grad_dtype,
                   train_cfg.moments_block_size)

    def torch_adamw(self, fp32_update: str) -> bool:
        """Whether engine=reference updates this format with torch's fused AdamW: fp32 state, unless
        `train.fp32_update=kernel` sends it through the fused update kernel as the other formats are."""
        return self.exact and fp32_update == "torch"

    @property
    def exact(self) -> bool:
        """fp32 everywhere: the update equals torch.optim.AdamW on an fp32 model, and the host AdamW can run it."""
        return self.master == self.moments == self.grad == "fp32"

    def n_blocks(self, numel: int) -> int:
        """Blocks of `block_size` elements covering `numel` (the last one partial): int8 codes' fp32 scales, one each."""
        return -(-numel // self.block_size)

    def master_bytes(self, numel: int) -> int:
        return BYTES[self.master] * numel

    def moments_bytes(self, numel: int) -> int:
        """m and v of `numel` parameters, with their per-block scales for int8."""
        if self.moments == "int8":
            return 2 * numel + 2 * SCALE_BYTES * self.n_blocks(numel)
        return 2 * BYTES[self.moments] * numel

    def state_bytes(self, numel: int) -> int:
        """Master + moments: what a unit's optimizer state takes in its home tier (and over the link, each way, when
        it is streamed to the GPU for its update)."""
        return self.master_bytes(numel) + self.moments_bytes(numel)

    def grad_bytes(self, numel: int) -> int:
        """A held gradient of `numel` parameters, with its per-block scales for int8."""
        return BYTES[self.grad] * numel + (SCALE_BYTES * self.n_blocks(numel) if self.grad == "int8" else 0)

    def update_hbm_bytes(self, numel: int) -> int:
        """HBM traffic of one update of `numel` parameters: read and write master and moments, read the gradient;
        the fused kernel of the low-precision formats also writes the bf16 weights (the exact recipe runs torch's
        fused AdamW, which does not)."""
        return 2 * self.state_bytes(numel) + self.grad_bytes(numel) + (0 if self.exact else 2 * numel)

    def overrides(self) -> str:
        text = f"train.master_dtype={self.master} train.moments_dtype={self.moments} train.grad_dtype={self.grad}"
        blocked = "int8" in (self.moments, self.grad)
        return text + (f" train.moments_block_size={self.block_size}" if blocked else "")

    def bytes_per_param(self) -> float:
        """State + gradient bytes per parameter of a large unit (scales included)."""
        n = 1 << 20
        return (self.state_bytes(n) + self.grad_bytes(n)) / n


def all_formats(block_size: int = 256) -> Tuple[StateFormat, ...]:
    """Every combination, the most precise first (fewest bytes per parameter last)."""
    combos = [StateFormat(m, mo, g, block_size)
              for m, mo, g in itertools.product(MASTER_DTYPES, MOMENTS_DTYPES, GRAD_DTYPES)]
    return tuple(sorted(combos, key=lambda f: -f.bytes_per_param()))


GRAD_STREAM = 0x6772616400000000  # xor-ed into an update's seed to key the rounding of its bf16 gradient


def update_seed(run_seed: int, unit: int, step: int) -> int:
    """The key of one unit's stochastic rounding at one Adam step: a function of the run's seed, the unit and the
    step only, so a run is reproducible and a resumed run rounds as the uninterrupted one would."""
    return (int(run_seed) * 1_000_003 + int(unit)) * 1_000_033 + int(step)


FIELDS = ("master_dtype", "moments_dtype", "grad_dtype")


def format_is_open(train_cfg) -> bool:
    """Whether any of the three fields is `auto`, left to the planner."""
    return any(train_cfg[f] == AUTO for f in FIELDS)


def fixed_inexact(train_cfg) -> bool:
    """Whether a field is set to a dtype other than fp32 (so the format cannot be the exact one)."""
    return any(train_cfg[f] not in (AUTO, "fp32") for f in FIELDS)


def candidate_formats(train_cfg, exact_only: bool = False) -> Tuple[StateFormat, ...]:
    """The formats the three fields allow (a dtype fixes its field, `auto` leaves it open, grad_dtype=auto to
    AUTO_GRAD_DTYPES), the most precise first; `exact_only`: all-fp32 alone (the settings that need it: the NVMe tier,
    bf16 gradient transfer)."""
    wanted = {f: train_cfg[f] for f in FIELDS}
    found = [fmt for fmt in all_formats(train_cfg.moments_block_size)
             if all(wanted[f] in (AUTO, getattr(fmt, f.split("_")[0])) for f in FIELDS)
             and (wanted["grad_dtype"] != AUTO or fmt.grad in AUTO_GRAD_DTYPES)]
    return tuple(fmt for fmt in found if fmt.exact or not exact_only)
