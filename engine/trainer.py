"""The training loop: build (validate, plan, data, engine, metrics), step, validate, log, close.

Everything that can be refused is refused before the engine allocates: the config is validated, the parameter
count checked against the published one, the data source opened (a missing file fails here) and the memory plan
built (an impossible one raises PlanError with the numbers). `plan=true` stops after printing the plan.

Micro-batch j of step s is batch `s * grad_accum + j` of the training split, so the data position is a pure
function of the step; validation always reads the first `val_batches` batches of the validation split.

Checkpoints (engine/checkpoint/ has the format). A checkpoint to resume from (`train.resume`) is located and
verified completely, and an HF checkpoint to start from (`model.init=hf:<dir>`) checked against the model config,
before the engine allocates; after it is built, the state is copied in (resume wins over init). A resumed run
continues at the saved step with the saved RNG states and counters; its metrics.jsonl keeps the records up to that
step (later ones, written by the process that died, are dropped) and it does not repeat the initial validation, so
the run dir reads as one uninterrupted run. The training state is saved every `train.checkpoint_minutes` (30 by
default) and every `train.checkpoint_every` steps when set, at the end (`train.checkpoint_at_end`, on by default),
at `train.stop_at`, on SIGINT/SIGTERM and after `train.max_consecutive_skips` non-finite steps in a row. A resume
may raise `train.steps` (training longer: the LR schedule is that of the new length from the resumed step on).

Exit status (`main`): 0 done (also after stop_at); 2 refused (config, data, plan, checkpoint); 3 stopped after
max_consecutive_skips skipped steps, with a checkpoint of the last good state; 128+signal (130 SIGINT, 143
SIGTERM) when a signal stopped the run after the current step and a checkpoint of it; 5 the optimizer failed (a
host AdamW pass or the NVMe tier; the message names the unit or the file): the run stops before any later update
reads the stale state, and its last complete checkpoint resumes; 4 a checkpoint could not be written (a full disk,
an I/O error: the message names the step directory and the free space there; its partial files are removed and
the previous complete checkpoint stays the newest). A second signal aborts at once (KeyboardInterrupt / exit
128+signal); the previous complete checkpoint stays loadable, as after SIGKILL.

One run at a time: before anything reads or writes the checkpoint root, the trainer takes the locks of the run dir
and of the checkpoint root (engine/checkpoint/lock.py; a checkpoint root that cannot be written is refused there
too); a second run on either is refused naming the holder's pid and host. They are released at the end of `run`
(or by `close`).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from engine import checkpoint, distributed, formats, hardware, optim
from engine.banner import start_banner
from engine.checkpoint import CheckpointError
from engine.config import ConfigError, to_plain, validate
from engine.data import DataError, build_data
from engine.device import resolve_compute_dtype, resolve_device, set_deterministic
from engine.execution import Execution
from engine.metrics import MetricsLogger, gpu_peak_mem_gib, host_peak_rss_gib, run_environment
from engine.model import ModelSpec
from engine.plan import MemoryPlan, PlanError, build_plan
from engine.progress import LONG_STEP_S, STEP_PROGRESS_EVERY_S, StepProgress
from engine.reference import ReferenceEngine
from engine.streaming import StreamEngine
from engine.streaming.engine import OptimizerPassError
from engine.streaming.nvme import NvmeError


def build_engine(spec: ModelSpec, cfg: DictConfig, device: torch.device, compute_dtype: torch.dtype,
                 plan: MemoryPlan, dp: distributed.DataParallel = distributed.SINGLE,
                 execution: Optional[Execution] = None):
    """The configured engine over `spec`, executing as `execution` says (resolved for `device` when not given; a
    backend that cannot run there is a ConfigError); the stream engine is laid out by the plan's placement."""
    ex = execution or Execution.of(spec, cfg, device.type == "cuda", strict=True)
    spec.set_layer_compute(ex.layer_compute)
    if ex.compiled:
        spec.compile_templates(cfg.train.compile_in_process)
    if ex.fused_loss:
        spec.use_fused_loss()
    if cfg.engine.name == "reference":
        return ReferenceEngine(spec, cfg, device, compute_dtype, dp)
    return StreamEngine(spec, cfg, device, compute_dtype, plan.placement, dp)


def depth_truncated(cfg: DictConfig, full_depth_layers: Optional[int], gpu_gib: float, host_gib: float,
                    on_gpu: bool, state_ranks: int = 1) -> Optional[dict]:
    """For a depth-truncated run (fewer decoder layers of the published width): the layer counts and the full-depth
    model's plan on the same hardware and sharding (its memory, whether it fits, its predicted step), else None."""
    if full_depth_layers is None:
        return None
    full_cfg = copy.deepcopy(cfg)
    full_cfg.model.num_hidden_layers = full_depth_layers
    full = build_plan(ModelSpec(full_cfg.model), full_cfg, gpu_gib, host_gib, on_gpu, check=False,
                      state_ranks=state_ranks)
    return {"layers": cfg.model.num_hidden_layers, "full_depth_layers": full_depth_layers,
            "full_depth_plan_gib": {tier: full.total(tier) / 2**30 for tier in ("gpu", "host")},
            "full_depth_fits": not full.problem(), "full_depth_plan_step_s": (full.times_s or {}).get("step"),
            "full_depth_formats_that_fit": full.suggestions}


def extended_schedule_line(t, saved_steps: int, start_step: int) -> str:
    """What training longer than the checkpoint's run did to the learning-rate schedule."""
    saved = SimpleNamespace(lr=t.lr, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, steps=saved_steps)
    before = optim.lr_at(start_step, saved)
    return (f"train.steps extended from the checkpoint's {saved_steps} to {t.steps}: the learning rate follows the "
            f"schedule of {t.steps} steps from here (warm-up {t.warmup_steps}, cosine to {t.lr * t.min_lr_ratio:g} "
            f"at step {t.steps}); step {start_step + 1} runs at {optim.lr_at(start_step, t):.3g} where the "
            f"{saved_steps}-step schedule would have {before:.3g}")


def depth_truncated_line(d: dict) -> str:
    step = d["full_depth_plan_step_s"]
    return (f"DEPTH-TRUNCATED: {d['layers']} of {d['full_depth_layers']} decoder layers at the published width; every "
            f"figure of this run is for {d['layers']} layers. The full-depth model would need host "
            f"{d['full_depth_plan_gib']['host']:.1f} GiB, GPU {d['full_depth_plan_gib']['gpu']:.1f} GiB on this "
            f"hardware ({'fits' if d['full_depth_fits'] else 'does not fit'})"
            + (f", predicted step {step:.2f} s" if step else "") + "."
            + "".join(f"\n  full depth: {line}" for line in d["full_depth_formats_that_fit"]))


def summary_line(summary: dict) -> str:
    """The run's outcome in one line, whatever the logger: steps, losses, throughput, peak memory."""
    def num(key: str, fmt: str) -> str:
        value = summary.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    outcome = f"failed: {summary['error']}" if summary.get("error") else "done"
    return (f"{outcome}: {summary.get('steps', 0)} steps, loss {num('final_loss', '.4f')}, val loss "
            f"{num('initial_val_loss', '.4f')} -> {num('final_val_loss', '.4f')}, {num('median_tokens_per_s', ',.0f')} "
            f"tok/s (median), peak host {num('peak_host_mem_gib', '.1f')} GiB, GPU {num('peak_gpu_mem_gib', '.1f')} GiB")


class RunLog:
    """Prints a line and appends it to `<run dir>/train.log`. Lines printed before `open` (while the run can still
    be refused) are held and written when it opens, so a run refused before it starts writes nothing. With
    `echo=False` (data-parallel ranks other than 0) lines go to the file only."""

    def __init__(self):
        self._held: list[str] = []
        self._file = None
        self.echo = True

    def __call__(self, line: str) -> None:
        if self.echo:
            print(line, flush=True)
        if self._file is None:
            self._held.append(line)
        else:
            self._file.write(line + "\n")

    def open(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "train.log", "a", buffering=1)
        for line in self._held:
            self._file.write(line + "\n")
        self._held = []

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Trainer:
    def _plan_only(self, full_depth_layers: int) -> None:
        """`plan=true`: the plan of one rank of the profile's `hardware.gpus` (one process on a one-card profile),
        made as that rank of a torchrun job on the profile's host would make it."""
        cfg = self.cfg
        on_gpu = cfg.hardware.device == "cuda" or (cfg.hardware.device == "auto" and torch.cuda.is_available())
        ranks = distributed.planned_ranks(cfg.hardware.gpus)
        if ranks.active:
            distributed.check_split(cfg.train.grad_accum, ranks.world, f"hardware.gpus={ranks.world}",
                                    hint="; or hardware.gpus=1 to plan one process")
        local_cfg = distributed.local_config(cfg, ranks)
        # this machine's, or the profile's when planning for another, shared by the host's ranks
        host_gib = hardware.host_budget(cfg).per_rank(ranks.local_world)
        gpu_gib = hardware.usable_gpu_gib(cfg.hardware, 0.0)
        state_ranks = ranks.world if ranks.active and cfg.engine.name == "stream" and cfg.engine.shard_state else 1
        self.plan = build_plan(self.spec, local_cfg, gpu_gib, host_gib, on_gpu, check=False, state_ranks=state_ranks)
        if ranks.active:
            sharded = ", the state sharded" if state_ranks > 1 else ""
            self.plan.ranks_line = (f"planned for one of {ranks.world} data-parallel ranks (hardware.gpus="
                                    f"{ranks.world}, as torchrun --nproc_per_node={ranks.world} runs them): its "
                                    f"{local_cfg.train.grad_accum} of the {cfg.train.grad_accum} micro-batches a "
                                    f"step, its share of the host's memory{sharded}")
        self.depth_truncated = depth_truncated(local_cfg, full_depth_layers, gpu_gib, host_gib, on_gpu, state_ranks)

    def __init__(self, cfg: DictConfig, run_dir: str | Path):
        self.log = RunLog()
        hardware.resolve(cfg)
        validate(cfg)
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.dp = distributed.SINGLE
        t = cfg.train
        self.spec = ModelSpec(cfg.model)
        full_depth_layers = self.spec.check_expected_params()
        if cfg.plan:  # a plan for the configured hardware, which need not be this machine
            self._plan_only(full_depth_layers)
            return
        set_deterministic(t.deterministic)  # before any CUDA work: cuBLAS reads its workspace setting once
        self.dp = distributed.init(cfg.hardware.device, t.grad_accum)
        if self.dp.rank > 0:  # rank 0's run dir holds the run's files (engine/distributed.py)
            self.log.echo = False
        root = Path(self.dp.broadcast(str(self.run_dir)))
        if root != self.run_dir:
            _remove_unused_run_dir(self.run_dir)
        if self.dp.rank > 0:
            self.run_dir = root / f"rank{self.dp.rank}"
        local_cfg = distributed.local_config(cfg, self.dp)  # this rank's share of the micro-batches
        self.device = resolve_device(cfg.hardware.device)
        self.compute_dtype = resolve_compute_dtype(t.compute_dtype, self.device)
        gpu_gib = hardware.apply_gpu_cap(cfg.hardware, self.device) if self.device.type == "cuda" else 0.0
        # this machine's host memory (rank 0's figure on every rank, so that all plan alike), shared by its ranks
        host_gib = hardware.host_budget(cfg, self.dp.broadcast, self.log).per_rank(self.dp.local_world)
        # the host state sharded over the data-parallel ranks (engine/distributed.py): no rank holds every unit
        self.sharded = self.dp.active and cfg.engine.name == "stream" and cfg.engine.shard_state
        state_ranks = self.dp.world if self.sharded else 1
        # what this run executes, read by the planner and the engine alike (a backend that cannot run is refused);
        # where `auto` leaves a choice, the plan takes the faster
        self.plan = build_plan(self.spec, local_cfg, gpu_gib, host_gib, self.device.type == "cuda",
                               state_ranks=state_ranks,
                               executions=Execution.choices(self.spec, cfg, self.device.type == "cuda", strict=True))
        self.execution = self.plan.execution
        for name in formats.FIELDS:  # `auto` state formats, as the planner resolved them in this rank's config
            cfg.train[name] = local_cfg.train[name]
        # the units whose state this rank holds (engine/distributed.py): it verifies and loads their files only
        owner = distributed.state_owners(self.spec, self.plan.placement.gpu_resident_units,
                                         self.dp.world) if self.sharded else {}
        self.depth_truncated = depth_truncated(local_cfg, full_depth_layers, gpu_gib, host_gib,
                                               self.device.type == "cuda", state_ranks)
        with _refusals_named(f"data={cfg.data.name}" + (f" data.path={cfg.data.path}" if cfg.data.path else "")):
            self.data = build_data(cfg.data, t.seq_len, cfg.seed, cfg.model.vocab_size,
                                   tokenizer_dir=checkpoint.hf_dir_of(cfg.model.init))
        self.ckpt_root = Path(t.checkpoint_dir).expanduser() if t.checkpoint_dir else root / "checkpoints"
        self.fingerprint = checkpoint.run_fingerprint(cfg, self.data.fingerprint)
        self._take_locks()
        try:  # everything a checkpoint can be refused for is checked before the engine allocates
            with _refusals_named(f"train.resume={t.resume}"):
                resume_from = checkpoint.find_resume(t.resume, self.ckpt_root, log=self.log)
                restore = checkpoint.open_training_state(
                    resume_from, self.spec, self.fingerprint,
                    verify_unit=lambda u: owner.get(u, self.dp.rank) == self.dp.rank) if resume_from else None
            hf = None
            hf_dir = checkpoint.hf_dir_of(cfg.model.init)
            if restore is None and hf_dir is not None:
                with _refusals_named(f"model.init={cfg.model.init}"):
                    hf = checkpoint.open_hf(self.spec, hf_dir)
        except BaseException:
            self._release_locks()
            raise
        self.log.open(self.run_dir)  # nothing can refuse the run from here on
        if self.dp.active:
            mine = [u for u in sorted(owner) if owner[u] == self.dp.rank]
            held = f"this rank holds the host state of units {mine}" if self.sharded else \
                "every rank holds the whole training state"
            self.log(f"data parallel: rank {self.dp.rank} of {self.dp.world}, micro-batches "
                     f"{self.dp.micro_batches(t.grad_accum).start}..{self.dp.micro_batches(t.grad_accum).stop - 1} "
                     f"of each step's {t.grad_accum}; {held}, in {host_gib:.1f} GiB of host RAM and "
                     f"{torch.get_num_threads()} CPU threads (1/{self.dp.local_world} of the host's)")
        if local_cfg.engine.slots != cfg.engine.slots:
            self.log(f"engine.slots={cfg.engine.slots} raised to {local_cfg.engine.slots}: with the state sharded "
                     f"over {self.dp.world} ranks, each rank's link loads its own units, and the ring holds one "
                     "look-ahead unit per rank so that all links load at once")
        if self.depth_truncated:
            self.log(depth_truncated_line(self.depth_truncated))
        lc = self.execution
        if lc.lean:
            self.log(f"layers: lean (train.lean_layer={t.lean_layer}), every per-token op in chunks of "
                     f"{lc.mlp_chunk_tokens} tokens around the attention, {lc.attention} "
                     f"(train.attention={t.attention})")
        else:
            self.log(f"layers: attention {lc.attention} (train.attention={t.attention}), MLP "
                     + (f"in chunks of {lc.mlp_chunk_tokens} tokens" if lc.mlp_chunk_tokens else "unchunked"))
        if self.plan.execution_choice:
            self.log(self.plan.execution_choice)
        if t.deterministic:
            self.log("deterministic algorithms on (train.deterministic): CUBLAS_WORKSPACE_CONFIG="
                     f"{os.environ['CUBLAS_WORKSPACE_CONFIG']}, fixed attention kernel configs")
        if t.compile_in_process:
            self.log("torch.compile: kernels built in this process, no compile workers (train.compile_in_process)"
                     if self.execution.compiled else
                     "train.compile_in_process=true has nothing to do: the templates run eager")
        torch.manual_seed(cfg.seed)  # and the host RNGs, so that their checkpointed states are reproducible too
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        t_state = time.perf_counter()
        self.log(f"allocating the training state ({self.plan.total('host') / 2**30:.1f} GiB of host, "
                 f"{self.plan.total('gpu') / 2**30:.1f} GiB of GPU planned)"
                 + ("" if restore is not None or hf is not None else " and initialising the weights"))
        self.engine = build_engine(self.spec, local_cfg, self.device, self.compute_dtype, self.plan, self.dp,
                                   self.execution)
        self.log(f"training state ready in {time.perf_counter() - t_state:.1f}s")
        for line in getattr(self.engine, "notes", ()):
            self.log(line)
        self.start_step, self.consecutive_skips, self.resumed = 0, 0, None
        self._saved: Optional[tuple] = None  # (step, path) of this run's last save
        self._last_save_time = time.monotonic()  # train.checkpoint_minutes counts from here
        try:
            if restore is not None:
                state = checkpoint.load_training_state(self.engine, restore)
                self.start_step = state["step"]
                self.consecutive_skips = state.get("consecutive_skips", 0)
                self.engine.skipped_steps = state.get("skipped_steps", 0)
                checkpoint.set_rng_state(state["rng"])
                self.resumed = state
                self.log(f"resumed from {restore.path} at step {self.start_step}")
                if restore.saved_steps is not None:
                    self.log(extended_schedule_line(t, restore.saved_steps, self.start_step))
            elif hf is not None:
                checkpoint.import_hf(self.engine, hf, log=self.log)
        except BaseException:
            self.engine.close()
            self.log.close()
            self._release_locks()
            raise
        for line in start_banner(cfg, self.spec, self.plan, self.execution, self.run_dir, self.ckpt_root,
                                 self.start_step, self.dp.world):
            self.log(line)
        plain = to_plain(cfg)
        plain["state_format_choice"] = self.plan.format_choice
        plain["data_description"] = self.data.description
        plain["num_params"] = self.spec.num_params()
        plain["plan_placement"] = self.plan.placement_settings()
        peak, peak_profile = hardware.peak_tflops(cfg.hardware, self.device, self.compute_dtype)
        peak *= self.dp.world  # tokens/s and TFLOPS are the job's, over all ranks: so is the MFU's denominator
        plain["mfu_peak"] = {"tflops": peak, "profile": peak_profile, "gpus": self.dp.world}
        try:
            logger_cfg = cfg.logger
            if self.dp.rank > 0:  # W&B and the progress display are rank 0's
                logger_cfg = copy.deepcopy(cfg.logger)
                logger_cfg.name, logger_cfg.progress = "none", "lines"
            self.metrics = MetricsLogger(self.run_dir, plain, cfg.model, t.seq_len, peak, logger_cfg, t.steps,
                                         start_step=self.start_step, log=self.log)
        except BaseException:
            self.engine.close()
            self.log.close()
            self._release_locks()
            raise
        if self.resumed is not None:
            self.metrics.tokens_total = self.resumed.get("tokens_total", 0)
            self.metrics.val_losses = list(self.resumed.get("val_losses", []))

    def _take_locks(self) -> None:
        """Take the run dir's lock, refuse a checkpoint root that cannot be written, take its lock (rank 0, which
        owns the root's directory operations); a refusal releases what was taken."""
        self._locks, self._created = [], []
        try:
            if not self.run_dir.is_dir():
                self.run_dir.mkdir(parents=True)
                self._created.append(self.run_dir)
            self._locks.append(checkpoint.DirLock(self.run_dir, "hydra.run.dir", self.log))
            if self.dp.rank == 0:
                if checkpoint.check_writable(self.ckpt_root, "train.checkpoint_dir"):
                    self._created.append(self.ckpt_root)
                self._locks.append(checkpoint.DirLock(self.ckpt_root, "train.checkpoint_dir", self.log))
        except BaseException:
            self._release_locks()
            raise

    def _release_locks(self) -> None:
        """Release the locks; remove the directories `_take_locks` created if they stayed empty (a refused run, a
        run that saved nothing)."""
        for lock in reversed(self._locks):
            lock.release()
        self._locks = []
        for path in reversed(self._created):
            with contextlib.suppress(OSError):
                path.rmdir()
        self._created = []

    def close(self) -> None:
        """Close the engine and release the locks, for a Trainer whose `run` is not called."""
        self.engine.close()
        self._release_locks()

    def _step_progress(self) -> Optional[StepProgress]:
        """Progress lines inside each step when the plan predicts steps of LONG_STEP_S or more (streaming engine)."""
        step_s = (self.plan.times_s or {}).get("step", 0.0)
        if not isinstance(self.engine, StreamEngine) or step_s < LONG_STEP_S:
            return None
        progress = StepProgress(self.spec.num_layers, self.log, STEP_PROGRESS_EVERY_S)
        self.engine.layer_progress = progress
        self.log(f"steps of about {step_s / 60:.0f} minutes predicted: a progress line at most every "
                 f"{progress.every_s:.0f} s inside each step")
        return progress

    def _train_batches(self, step: int):
        t = self.cfg.train
        return [self.data.batch("train", step * t.grad_accum + j, t.micro_batch_size)
                for j in self.dp.micro_batches(t.grad_accum)]

    def _periodic_save_due(self, step: int) -> bool:
        """Whether to save after `step`: every train.checkpoint_every steps, or when train.checkpoint_minutes have
        passed since the start or the last save (rank 0's clock decides for every rank)."""
        t = self.cfg.train
        if t.checkpoint_every and step % t.checkpoint_every == 0:
            return True
        if not t.checkpoint_minutes:
            return False
        return self.dp.any(time.monotonic() - self._last_save_time >= 60 * t.checkpoint_minutes and self.dp.rank == 0)

    def _validate(self) -> float:
        t = self.cfg.train
        n = min(t.val_batches, max(1, self.data.num_sequences("val") // t.micro_batch_size))
        return self.engine.eval_loss([self.data.batch("val", i, t.micro_batch_size) for i in range(n)])

    def _save(self, step: int, pending_tokens: int = 0) -> Path:
        """Save the full training state after `step` optimizer steps (replacing a checkpoint of that step); a save
        that fails raises CheckpointWriteFailed naming the step directory and the free space there. A step this
        run saved already (a stop right after a periodic save) is not written twice."""
        if self._saved is not None and self._saved[0] == step:
            return self._saved[1]
        t = self.cfg.train
        state = {
            "data_position": {"next_step": step, "train_batches_consumed": step * t.grad_accum,
                              "micro_batch_size": t.micro_batch_size, "data_fingerprint": self.data.fingerprint},
            "lr_schedule": {"next_lr": optim.lr_at(step, t) if step < t.steps else None, "lr": t.lr,
                            "warmup_steps": t.warmup_steps, "min_lr_ratio": t.min_lr_ratio, "steps": t.steps},
            "rng": checkpoint.rng_state(),
            "skipped_steps": self.engine.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "tokens_total": self.metrics.tokens_total + pending_tokens,
            "val_losses": [float(v) if math.isfinite(float(v)) else None for v in self.metrics.val_losses],
            "fingerprint": self.fingerprint,
            "engine": self.cfg.engine.name,
            "git_sha": self.metrics.git_sha,
            "saved_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "config": to_plain(self.cfg),
        }
        t0 = time.perf_counter()
        if self.plan.total("host") > 2**30:  # saves of more than a few seconds say that they started
            self.log(f"saving the training state of step {step} into {self.ckpt_root}")
        try:
            path = checkpoint.save_training_state(self.engine, self.ckpt_root, step, state, t.keep_checkpoints,
                                                  self.dp, log=self.log)
        except (OSError, CheckpointError) as err:
            raise CheckpointWriteFailed(checkpoint.save_failure(self.ckpt_root, step, err)) from err
        self._saved = (step, path)
        self._last_save_time = time.monotonic()
        self.log(f"checkpoint of step {step}: {path} ({time.perf_counter() - t0:.1f}s)")
        return path

    def run(self) -> dict:
        if self.cfg.plan:
            print(self.plan.table())
            if self.depth_truncated:
                print(depth_truncated_line(self.depth_truncated))
            problem = self.plan.problem()
            if problem:
                raise PlanError(problem)
            print("the plan fits")
            return {"plan": self.plan.rows, "placement": self.plan.placement_settings()}
        t = self.cfg.train
        summary_extra = {"num_params": self.spec.num_params(), "engine": self.cfg.engine.name,
                         "memory_plan_gib": {tier: self.plan.total(tier) / 2**30 for tier in ("gpu", "host")},
                         "memory_plan_allocated_gib": {tier: self.plan.allocated(tier) / 2**30
                                                       for tier in ("gpu", "host")},
                         "plan_times_s": self.plan.times_s, "attention": self.execution.attention,
                         "mlp_chunk_tokens": self.execution.mlp_chunk_tokens, "lean_layer": self.execution.lean,
                         "memory_bytes": self.engine.memory_bytes(), "start_step": self.start_step,
                         "depth_truncated": self.depth_truncated, "environment": run_environment()}
        stopped = None
        try:
            with _StopSignals() as signals:
                if self.start_step == 0 and t.val_every >= 0:
                    self.metrics.log_val(0, self._validate())
                span_tokens, span_s, span_steps = 0, 0.0, 0  # steps since the last logged one
                step = self.start_step  # optimizer steps done
                if self.execution.compiled and step < t.steps:
                    self.log("the first step compiles the layer and loss templates (torch.compile): expect a minute "
                             "or more before its line")
                progress = self._step_progress()
                while step < t.steps and not self.dp.any(signals.received is not None):
                    lr = optim.lr_at(step, t)
                    if progress is not None:
                        progress.begin(step + 1)
                    record = self.engine.train_step(self._train_batches(step), lr)
                    step += 1
                    span_tokens += record["tokens"]
                    span_s += record["step_s"]
                    span_steps += 1
                    if step % t.log_every == 0 or step == t.steps:
                        # with log_every > 1, tokens and step_s cover every step since the previous line
                        record.update(lr=lr, tokens=span_tokens, step_s=span_s, steps_in_record=span_steps)
                        record.update(self.spec.step_stats())  # MoE routing (one small device read)
                        self.metrics.log_step(step, record)
                        span_tokens, span_s, span_steps = 0, 0.0, 0
                    self.consecutive_skips = self.consecutive_skips + 1 if record["skipped"] else 0
                    if t.max_consecutive_skips and self.consecutive_skips >= t.max_consecutive_skips:
                        n = self.consecutive_skips
                        path = self._save(step, span_tokens)
                        raise TrainingDiverged(
                            f"steps {step - n + 1}..{step}: {n} consecutive steps had a non-finite loss or gradient "
                            f"and were skipped (train.max_consecutive_skips={t.max_consecutive_skips}); stopped. "
                            f"The weights are still those after step {step - n}; they are saved in {path}. Lower "
                            "train.lr or check the data before going on")
                    if t.val_every >= 0 and (step == t.steps or (t.val_every and step % t.val_every == 0)):
                        self.metrics.log_val(step, self._validate())
                    if step == t.stop_at and step < t.steps:
                        stopped = {"reason": f"train.stop_at={t.stop_at}"}
                        break
                    if step < t.steps and self._periodic_save_due(step):
                        self._save(step, span_tokens)
                # the last optimizer pass's errors surface here, before the summary and the final checkpoint
                self.engine.wait_for_optimizer()
                if step < t.steps and stopped is None and signals.received is None:  # another rank's signal
                    stopped = {"reason": "a signal to another data-parallel rank"}
                if signals.received:
                    stopped = {"reason": signal.Signals(signals.received).name, "signal": int(signals.received)}
                export = stopped is None and t.export_hf
                # with sharded state the export reads the final checkpoint, saved for it if not anyway
                if stopped is not None or t.checkpoint_at_end or (export and self.sharded):
                    path = self._save(step, span_tokens)
                    if stopped is not None:
                        stopped.update(step=step, checkpoint=str(path))
                        self.log(f"stopped at step {step} ({stopped['reason']}); resume with train.resume=auto "
                                 f"hydra.run.dir={self.run_dir}")
                if export and self.dp.rank == 0:
                    dtype = torch.bfloat16 if t.export_dtype == "bf16" else torch.float32
                    source = checkpoint.CheckpointSource(path) if self.sharded else \
                        checkpoint.EngineSource(self.engine, checkpoint.tokenizer_dir_of(
                            self.cfg.model.init, self.cfg.data.tokenizer))
                    try:
                        summary_extra["export_hf"] = checkpoint.export_hf(source, self.run_dir / "hf", dtype)
                    finally:
                        source.close()
            summary_extra["skipped_steps"] = self.engine.skipped_steps
            if self.dp.active:  # each rank's peak memory, in rank 0's summary too
                peaks = self.dp.gather({"rank": self.dp.rank, "host_gib": host_peak_rss_gib(),
                                        "gpu_gib": gpu_peak_mem_gib()})
                summary_extra.update(ranks=self.dp.world, per_rank_peak_mem_gib=peaks,
                                     peak_host_mem_gib_all_ranks=sum(p["host_gib"] for p in peaks))
            if stopped is not None:
                summary_extra["stopped"] = stopped
        finally:
            try:
                summary = self.metrics.close(summary_extra)
                self.log(summary_line(summary))
                self.engine.close()
                self.dp.close()
            finally:
                saved = bool(checkpoint.list_checkpoints(self.ckpt_root)[0])
                where = ", checkpoints/)" if self.ckpt_root == self.run_dir / "checkpoints" else \
                    f"); checkpoints: {self.ckpt_root}"
                self.log(f"run dir: {self.run_dir} (metrics.jsonl, summary.json, train.log" + (where if saved else ")"))
                self.log.close()
                self._release_locks()
        return summary


@contextlib.contextmanager
def _refusals_named(field: str):
    """A refusal of a file (data, checkpoint) names the config field that pointed at it, then the file's problem."""
    try:
        yield
    except (DataError, CheckpointError) as err:
        raise type(err)(f"{field}: {err}") from None


class TrainingDiverged(RuntimeError):
    """train.max_consecutive_skips steps in a row were skipped; a checkpoint of the last good state was saved."""


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint could not be written; its partial files are removed, the previous checkpoint is the newest."""


class _StopSignals:
    """SIGINT/SIGTERM: the first asks the loop to stop after the current step and save; a second aborts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.received = signum
        print(f"\n{signal.Signals(signum).name}: stopping after the current step with a checkpoint "
              "(send it again to abort now)", file=sys.stderr, flush=True)


def _remove_unused_run_dir(run_dir: Path) -> None:
    """Hydra creates the run dir (its `.hydra/` config copy and an empty `train.log`) before the trainer runs; a run
    refused before it started, or `plan=true`, leaves nothing behind. A dir holding anything else is left alone."""
    if not run_dir.is_dir():
        return
    entries = {p.name: p for p in run_dir.iterdir()}
    log = entries.get("train.log")
    if set(entries) - {".hydra", "train.log"} or (log is not None and log.stat().st_size):
        return
    if ".hydra" in entries:
        shutil.rmtree(entries[".hydra"])
    if log is not None:
        log.unlink()
    run_dir.rmdir()
    # the default hydra.run.dir is runs/<date>/<time>-...: its dated dir and runs/, if this run made them
    for parent in (run_dir.parent, run_dir.parent.parent):
        if not (re.fullmatch(r"\d{4}-\d{2}-\d{2}", parent.name) or parent.name == "runs") or any(parent.iterdir()):
            break
        parent.rmdir()


def main(cfg: DictConfig) -> dict:
    """Hydra entry. A refused config (bad value, missing file, plan that does not fit) exits with status 2 and a
    one-paragraph message; inside a multirun it is written to the job's run dir instead, and the sweep goes on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    run_dir = Path(hydra_cfg.runtime.output_dir) if hydra_cfg else Path(os.getcwd())
    multirun = hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    try:
        summary = Trainer(cfg, run_dir).run()
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    except CheckpointWriteFailed as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(4) from None
    except (OptimizerPassError, NvmeError) as err:
        print(f"error: {err}. The training state is stale from this step on; resume from the last checkpoint "
              "(train.resume=auto)", file=sys.stderr)
        raise SystemExit(5) from None
    except (ConfigError, DataError, PlanError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        if multirun:
            run_dir.mkdir(parents=True, exist_ok=True)
            shape = {key: OmegaConf.select(cfg, key) for key in ("model.name", "model.num_hidden_layers",
                                                                 "train.seq_len", "engine.name", "hardware.name")}
            (run_dir / "refused.json").write_text(json.dumps({"error": str(err), "kind": type(err).__name__,
                                                              "shape": shape, "environment": run_environment()}))
            return {"refused": str(err)}
        if hydra_cfg is not None:
            _remove_unused_run_dir(run_dir)
        raise SystemExit(2) from None
    if cfg.plan and hydra_cfg is not None and not multirun:
        _remove_unused_run_dir(run_dir)
    stopped = summary.get("stopped") or {}
    if stopped.get("signal"):
        raise SystemExit(128 + stopped["signal"])
    return summary
