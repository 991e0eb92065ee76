"""The training loop: build (validate, plan, data, engine, metrics), step, validate, log, close.

Everything that can be refused is refused before the engine allocates: the config is validated, the parameter
count checked against the published one, the data source opened (a missing file fails here) and the memory plan
built (an impossible one raises PlanError with the numbers). `plan=true` stops after printing the plan.

Micro-batch j of step s is batch `s * grad_accum + j` of the training split, so the data position is a pure
function of the step; validation always reads the first `val_batches` batches of the validation split.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from engine import hardware, optim
from engine.config import ConfigError, to_plain, validate
from engine.data import DataError, build_data
from engine.device import resolve_compute_dtype, resolve_device
from engine.metrics import MetricsLogger
from engine.model import ModelSpec
from engine.plan import PlanError, build_plan


def host_mem_total_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("cannot read MemTotal from /proc/meminfo; set hardware.host_mem_gib")


def build_engine(spec: ModelSpec, cfg: DictConfig, device: torch.device, compute_dtype: torch.dtype, plan):
    if cfg.engine.name == "reference":
        from engine.reference import ReferenceEngine

        return ReferenceEngine(spec, cfg, device, compute_dtype)
    from engine.schedule import StreamEngine

    return StreamEngine(spec, cfg, device, compute_dtype, plan)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: str | Path):
        hardware.resolve(cfg)
        validate(cfg)
        self.cfg, self.run_dir = cfg, Path(run_dir)
        t = cfg.train
        self.spec = ModelSpec(cfg.model)
        self.spec.check_expected_params()
        if cfg.plan:  # a plan for the configured hardware, which need not be this machine
            on_gpu = cfg.hardware.device == "cuda" or (cfg.hardware.device == "auto" and torch.cuda.is_available())
            self.plan = build_plan(self.spec, cfg, cfg.hardware.gpu_mem_gib, cfg.hardware.host_mem_gib
                                   or host_mem_total_gib(), on_gpu, check=False)
            return
        self.device = resolve_device(cfg.hardware.device)
        self.compute_dtype = resolve_compute_dtype(t.compute_dtype, self.device)
        gpu_gib = hardware.apply_gpu_cap(cfg.hardware, self.device) if self.device.type == "cuda" else 0.0
        host_gib = cfg.hardware.host_mem_gib or host_mem_total_gib()
        self.plan = build_plan(self.spec, cfg, gpu_gib, host_gib, self.device.type == "cuda")
        self.data = build_data(cfg.data, t.seq_len, cfg.seed, cfg.model.vocab_size)
        torch.manual_seed(cfg.seed)
        self.engine = build_engine(self.spec, cfg, self.device, self.compute_dtype, self.plan)
        plain = to_plain(cfg)
        plain["data_description"] = self.data.description
        plain["num_params"] = self.spec.num_params()
        plain["plan_placement"] = self.plan.placement
        peak, peak_profile = hardware.peak_tflops(cfg.hardware, self.device, self.compute_dtype)
        plain["mfu_peak"] = {"tflops": peak, "profile": peak_profile}
        self.metrics = MetricsLogger(self.run_dir, plain, cfg.model, t.seq_len, peak, cfg.logger, t.steps)

    def _train_batches(self, step: int):
        t = self.cfg.train
        return [self.data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]

    def _validate(self) -> float:
        t = self.cfg.train
        n = min(t.val_batches, max(1, self.data.num_sequences("val") // t.micro_batch_size))
        return self.engine.eval_loss([self.data.batch("val", i, t.micro_batch_size) for i in range(n)])

    def run(self) -> dict:
        if self.cfg.plan:
            print(self.plan.table())
            problem = self.plan.problem()
            if problem:
                raise PlanError(problem)
            print("the plan fits")
            return {"plan": self.plan.rows, "placement": self.plan.placement}
        t = self.cfg.train
        summary_extra = {"num_params": self.spec.num_params(), "engine": self.cfg.engine.name,
                         "memory_plan_gib": {tier: self.plan.total(tier) / 2**30 for tier in ("gpu", "host")},
                         "memory_bytes": self.engine.memory_bytes()}
        try:
            self.metrics.log_val(0, self._validate())
            span_tokens, span_s, span_steps = 0, 0.0, 0  # steps since the last logged one
            for step in range(t.steps):
                lr = optim.lr_at(step, t)
                record = self.engine.train_step(self._train_batches(step), lr)
                span_tokens += record["tokens"]
                span_s += record["step_s"]
                span_steps += 1
                if (step + 1) % t.log_every == 0 or step == t.steps - 1:
                    # with log_every > 1, tokens and step_s cover every step since the previous line
                    record.update(lr=lr, tokens=span_tokens, step_s=span_s, steps_in_record=span_steps)
                    self.metrics.log_step(step + 1, record)
                    span_tokens, span_s, span_steps = 0, 0.0, 0
                last = step == t.steps - 1
                if last or (t.val_every and (step + 1) % t.val_every == 0):
                    self.metrics.log_val(step + 1, self._validate())
            summary_extra["skipped_steps"] = self.engine.skipped_steps
        finally:
            summary = self.metrics.close(summary_extra)
            self.engine.close()
        return summary


def main(cfg: DictConfig) -> dict:
    """Hydra entry. A refused config (bad value, missing file, plan that does not fit) exits with status 2 and a
    one-paragraph message; inside a multirun it is written to the job's run dir instead, and the sweep goes on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    run_dir = Path(hydra_cfg.runtime.output_dir) if hydra_cfg else Path(os.getcwd())
    try:
        return Trainer(cfg, run_dir).run()
    except (ConfigError, DataError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "refused.json").write_text(json.dumps({"error": str(err), "kind": type(err).__name__}))
            return {"refused": str(err)}
        raise SystemExit(2) from None
