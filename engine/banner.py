"""The start banner: what a run is about to do, in a few lines, before its first step.

Everything a user checks before leaving a long run alone: the model and its size, the tokens per step and the data,
the state formats (chosen by the planner when left `auto`), where the state lives, the predicted step time and the
time to the last step, and where the run writes. The same facts are in summary.json and the W&B config; the banner
is for the terminal and train.log.
"""

from __future__ import annotations

import datetime as dt
from typing import List


def _duration(seconds: float) -> str:
    return str(dt.timedelta(seconds=round(seconds)))


def start_banner(cfg, spec, plan, execution, run_dir, ckpt_root, start_step: int, world: int = 1) -> List[str]:
    t = cfg.train
    step_tokens = t.micro_batch_size * t.seq_len * t.grad_accum
    steps_left = t.steps - start_step
    lines = [f"model: {cfg.model.name} ({spec.num_params() / 1e9:.3g} B parameters, {cfg.model.num_hidden_layers} "
             f"layers), init {cfg.model.init}",
             f"data: {cfg.data.name}" + (f" {cfg.data.path}" if cfg.data.path else "")
             + f", {t.micro_batch_size} x {t.seq_len} tokens x {t.grad_accum} micro-batches = {step_tokens:,} "
             f"tokens per step" + (f" on each of {world} ranks" if world > 1 else ""),
             f"engine: {cfg.engine.name}, " + ("compiled" if execution.compiled else "eager")]
    if plan.grad_accum_choice:
        lines.insert(2, plan.grad_accum_choice)
    if plan.format_choice:
        lines.append(plan.format_choice)
    if plan.placement is not None:
        p = plan.placement
        lines.append(f"placement: {p.gpu_resident_units} units resident on the GPU, {p.gpu_streamed_units} streamed "
                     f"and updated there, {len(p.host_units)} updated on the host"
                     + (f", {p.nvme_units} with moments on NVMe" if p.nvme_units else "")
                     + (f", {p.host_grad_units} streamed with gradients held on the host" if p.host_grad_units else ""))
        if p.norm_pass:
            lines.append(plan.norm_pass_line())
    lines.append(f"memory: GPU {plan.total('gpu') / 2**30:.1f} GiB, host {plan.total('host') / 2**30:.1f} GiB "
                 "planned")
    step_s = plan.times_s.get("step")
    if step_s:
        lines.append(f"predicted: {step_s:.2f} s a step, {steps_left} steps to go, about {_duration(step_s * steps_left)}"
                     f" (bound by {plan.binding})")
        if plan.link_bound_ratio() > 1.0:
            lines.append(plan.link_bound_line())
    lines.append(f"schedule: lr {t.lr:g}, warm-up {t.warmup_steps} steps, cosine to {t.lr * t.min_lr_ratio:g}; "
                 + (f"validation every {t.val_every} steps" if t.val_every > 0 else
                    "validation at the start and the end" if t.val_every == 0 else "no validation"))
    when = [f"every {t.checkpoint_every} steps"] * bool(t.checkpoint_every) \
        + [f"every {t.checkpoint_minutes:g} min"] * bool(t.checkpoint_minutes) + ["at the end"] * t.checkpoint_at_end
    lines.append(f"run dir: {run_dir}; checkpoints: {ckpt_root} "
                 + (", ".join(when) if when else "on a stop only (train.checkpoint_at_end=false)"))
    return lines
