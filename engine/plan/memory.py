"""The plan's result: rows of bytes per memory tier, the limits they are held against, the placement and the
predicted step; and the host memory of the training process itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from engine.placement import Placement

if TYPE_CHECKING:
    from engine.execution import Execution
    from engine.formats import StateFormat

GIB = 2**30


class PlanError(RuntimeError):
    pass


@dataclass
class MemoryPlan:
    engine: str
    rows: List[Tuple[str, str, int]] = field(default_factory=list)  # (tier, item, bytes)
    placement: Optional[Placement] = None  # the stream engine's; None for engine=reference
    limits_gib: Dict[str, float] = field(default_factory=dict)
    times_s: Dict[str, float] = field(default_factory=dict)
    binding: str = ""
    speeds: str = ""  # where the time model's figures come from
    suggestions: List[str] = field(default_factory=list)  # smaller state formats that fit, for a refusal
    format_choice: str = ""  # how `auto` state formats were resolved (engine/plan/build.py), for the banner
    state_format: Optional["StateFormat"] = None  # the state format the plan was made in (engine/plan/build.py)
    execution: Optional["Execution"] = None  # what the run executes (engine/execution.py), as the plan chose it
    execution_choice: str = ""  # how the plan chose between executions (engine/plan/build.py), for the banner
    grad_accum_choice: str = ""  # how `train.grad_accum=-1` was resolved (engine/plan/micro_batches.py)
    ranks_line: str = ""  # plan=true for a profile of several cards: the rank this plan is of (engine/trainer.py)
    notes: List[str] = field(default_factory=list)  # for a refusal: what else was tried
    # where the host limit comes from (engine/hardware.py, host_budget: measured, hardware.host_mem_gib or the
    # profile's), for the table and a refusal; "" unknown
    host_source: str = ""
    gpu_cap_gib: float = 0.0  # hardware.gpu_mem_cap_gib when set: a refusal for GPU memory names it

    reserved: Dict[str, int] = field(default_factory=dict)  # bytes per tier held back, not allocated as tensors

    def add(self, tier: str, item: str, nbytes: int) -> None:
        self.rows.append((tier, item, int(nbytes)))

    def reserve(self, tier: str, item: str, nbytes: int) -> None:
        """A row the budget must leave free (allocator fragmentation, the CUDA context) but that no tensor fills:
        it counts in `total`, not in `allocated`."""
        self.add(tier, item, nbytes)
        self.reserved[tier] = self.reserved.get(tier, 0) + int(nbytes)

    def placement_settings(self) -> Dict[str, object]:
        """The placement as `engine.*` settings (empty for engine=reference), for logs and records."""
        return self.placement.as_dict() if self.placement else {}

    def total(self, tier: str) -> int:
        return sum(b for t, _, b in self.rows if t == tier)

    def allocated(self, tier: str) -> int:
        """The predicted peak of tensor memory in `tier` (what `torch.cuda.max_memory_allocated` measures)."""
        return self.total(tier) - self.reserved.get(tier, 0)

    def overflow_bytes(self) -> int:
        """Bytes beyond the limits, summed over the tiers."""
        return sum(max(0, self.total(tier) - int(limit * GIB)) for tier, limit in self.limits_gib.items() if limit)

    def problem(self) -> str:
        """Why the plan does not fit (every tier that overflows), or "" when it does."""
        over = [f"{self.total(tier) / GIB:.1f} GiB of {tier} memory where the hardware config allows {limit:.1f} GiB"
                for tier, limit in self.limits_gib.items() if limit and self.total(tier) > limit * GIB]
        if not over:
            return ""
        alternatives = "a smaller model or other hardware"
        if self.engine == "reference":
            alternatives += ", or engine=stream (state in host RAM)"
        text = (f"The plan needs {' and '.join(over)}. {''.join(note + ' ' for note in self.notes)}"
                f"{''.join(knob + ' ' for knob in self._limit_knobs())}Try fewer "
                f"tokens per step (train.micro_batch_size, train.grad_accum, train.seq_len), {alternatives}.")
        if self.suggestions:
            text += " Smaller training-state formats that fit (engine/formats.py):\n" + "\n".join(self.suggestions)
        return text

    def _limit_knobs(self) -> List[str]:
        """For a refusal: the settings that raise the limit of each overflowing tier, with the limit planned with."""
        knobs = []
        host = self.limits_gib.get("host")
        if host and self.total("host") > host * GIB:
            source = f": {self.host_source}" if self.host_source else ""
            knobs.append(f"hardware.host_mem_gib=<GiB> plans for more host memory (this run planned with {host:.1f} "
                         f"GiB{source}).")
        gpu = self.limits_gib.get("gpu")
        if gpu and self.total("gpu") > gpu * GIB and self.gpu_cap_gib:
            knobs.append(f"hardware.gpu_mem_cap_gib={self.gpu_cap_gib:g} caps the GPU memory planned with (0: no "
                         "cap, the card's own).")
        return knobs

    def table(self) -> str:
        lines = [f"memory plan (engine={self.engine})", f"{'tier':6} {'item':66} {'GiB':>10}"]
        for tier, item, nbytes in self.rows:
            lines.append(f"{tier:6} {item:66} {nbytes / GIB:10.3f}")
        for tier in ("gpu", "host", "nvme"):
            if tier == "nvme" and not self.total(tier):
                continue
            limit = self.limits_gib.get(tier)
            lim = f" of {limit:.1f} GiB" if limit else ""
            lines.append(f"{tier:6} {'TOTAL':66} {self.total(tier) / GIB:10.3f}{lim}")
        if self.host_source:
            lines.append(f"host memory planned with: {self.limits_gib.get('host', 0.0):.1f} GiB ({self.host_source})")
        if self.ranks_line:
            lines.append(self.ranks_line)
        if self.format_choice:
            lines.append(self.format_choice)
        if self.execution_choice:
            lines.append(self.execution_choice)
        if self.grad_accum_choice:
            lines.append(self.grad_accum_choice)
        if self.placement:
            lines.append("placement: " + ", ".join(f"{k}={v}" for k, v in self.placement_settings().items()))
            if self.placement.norm_pass:
                lines.append(self.norm_pass_line())
        if self.times_s:
            lines.append("predicted step: " + ", ".join(f"{k} {v:.3f}s" for k, v in self.times_s.items())
                         + f"; bound by {self.binding}")
            lines.append(self.speeds)
            if self.link_bound_ratio() > 1.0:
                lines.append(self.link_bound_line())
        return "\n".join(lines)

    def norm_pass_line(self) -> str:
        """What a plan with a norm pass does differently, and its predicted cost."""
        cost = self.times_s.get("norm_pass")
        of_step = f" ({cost:.1f} s of the {self.times_s['step']:.1f} s step)" if cost else ""
        streamed = ", each GPU-streamed unit's update in the second backward" \
            if self.placement and self.placement.gpu_streamed_units else ""
        return ("norm pass (engine.norm_pass): clip without holding gradients: one more head and backward a step"
                f"{of_step}{streamed}")

    def link_bound_ratio(self) -> float:
        """How many times longer the forward's weight stream (H2D) takes than its compute (0 without times): above
        1 the forward waits on the link, as a sparse model's does at few tokens a step (all experts stream, few
        compute)."""
        compute_s, h2d_s = (self.times_s or {}).get("forward_compute", 0.0), (self.times_s or {}).get("forward_h2d", 0.0)
        return h2d_s / compute_s if compute_s > 0 else 0.0

    def link_bound_line(self) -> str:
        ratio = self.link_bound_ratio()
        return (f"the forward streams its weights {ratio:.1f}x longer than it computes: the link, not the GPU, sets its "
                f"pace; about {ratio:.1f}x the tokens a step (train.grad_accum, train.micro_batch_size or "
                "train.seq_len) would hide the stream behind compute, where the plan still fits")


def process_host_bytes(hw, compile_workers: bool) -> int:
    """The training process's host memory before any state: the calibrated figure, without torch.compile's worker
    processes when the run starts none (no compiled templates, or `train.compile_in_process`; on an H100 host they
    are 7.3-7.7 of its 9-10 GiB)."""
    return int(max(0.0, hw.host_process_gib - (0.0 if compile_workers else hw.host_compile_workers_gib)) * GIB)


def add_process_row(plan: MemoryPlan, nbytes: int, compile_workers: bool) -> None:
    """The host row of the process itself, `nbytes` (`process_host_bytes`; no row when the profile has no figure)."""
    if nbytes:
        workers = "" if compile_workers else ", no compile workers"
        plan.add("host", f"this process: torch, CUDA context, compiled kernels (calibrated{workers})", nbytes)
