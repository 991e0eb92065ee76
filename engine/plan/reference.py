"""The plan of `engine=reference`: everything on the compute device, the correctness oracle's footprint."""

from __future__ import annotations

from engine.execution import Execution
from engine.formats import StateFormat
from engine.plan.memory import MemoryPlan, add_process_row, process_host_bytes
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds
from engine.plan.time_model import HBM_ADAMW_BYTES_PER_S, STEP_OVERHEAD_S


def reference_plan(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution, fmt: StateFormat) -> MemoryPlan:
    """`engine=reference`: master, gradient and moments of every unit, one kept layer input per layer and one
    layer's working activations, all on the compute device."""
    t, hw = cfg.train, cfg.hardware
    on_gpu = ex.on_gpu
    s = StepShape(spec, cfg, on_gpu, fmt, execution=ex)
    n = spec.num_params()
    tier = "gpu" if on_gpu else "host"
    plan = MemoryPlan(engine="reference", limits_gib={"gpu": gpu_gib if on_gpu else 0.0, "host": host_gib})
    plan.add(tier, f"{fmt.master} master weights", fmt.master_bytes(n))
    plan.add(tier, "fp32 gradients", 4 * n)
    plan.add(tier, f"{fmt.moments} Adam m + v", fmt.moments_bytes(n))
    if not fmt.torch_adamw(t.fp32_update):  # the kernel's path (engine/reference.py)
        plan.add(tier, f"fp32 weights the forward reads, the gathered fp32 gradient (+ its {fmt.grad} copy)",
                 8 * n + (fmt.grad_bytes(n) if fmt.grad != "fp32" else 0))
    plan.add(tier, "layer-input activations (one micro-batch)",
             (s.L if t.activation_checkpointing else 0) * 4 * s.h * s.mb_tokens)
    plan.add(tier, "working activations (one layer, or the loss chunk)",
             s.act * (1 if t.activation_checkpointing else s.L))
    add_process_row(plan, process_host_bytes(hw, s.compile_workers), s.compile_workers)
    sp = Speeds.of_step(hw, spec, s, ex.compiled)
    if on_gpu and sp.known:
        recompute = 1 if t.activation_checkpointing else 0
        plan.times_s = {"forward": s.L * sp.layer_fwd_s(s), "head": s.head_flops / sp.head,
                        "backward": s.L * sp.layer_bwd_s(s, 2 + recompute),
                        "optimizer": fmt.update_hbm_bytes(n) / HBM_ADAMW_BYTES_PER_S}
        plan.times_s["step"] = sum(plan.times_s.values()) + STEP_OVERHEAD_S
        plan.binding = "GPU compute"
        plan.speeds = sp.describe(hw)
    return plan

