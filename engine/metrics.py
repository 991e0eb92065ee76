"""Run metrics: FLOP accounting, memory probes, and the per-run logger.

Every run writes two files into its run directory, whatever the logger backend:

* `metrics.jsonl`: one JSON object per line, one line per logged step (`log_step`) or validation (`log_val`),
  flushed as it is written so a crashed or killed run keeps everything up to its last step. A run that starts at
  step 0 starts a new file (an existing one, from an earlier run into the same directory, is renamed to
  `metrics.<time>.jsonl` and the rename is printed); a resumed run keeps the records up to its start step and drops
  later ones, written by the process that died after its last checkpoint. Either way the file reads as one run.
* `train.log`: every line the run prints (progress, checkpoints, the run dir), as printed.
* `summary.json`: written once by `MetricsLogger.close` (atomically, through a temporary file and `os.replace`):
  final and initial losses, medians of the throughput figures, peak memory, the git revision and the config.

W&B is an optional mirror of the same records (`logger.name == "wandb"`); its files go under `run_dir/wandb/`.
Inside a Hydra multirun the W&B group is the sweep directory's name and the run is named after the job, so the jobs
of one sweep sit together. Progress is shown as a tqdm bar on a terminal and as one plain line per logged step
otherwise (log files, batch jobs).

JSON has no NaN or infinity. A non-finite float is written as `null` and the record gets `<key>_finite: false`;
`loss_finite` is written on every step record so a diverged run can be filtered without parsing nulls.

FLOP accounting (`model_flops_per_token`)
-----------------------------------------
These are model FLOPs: what the model needs per trained token, independent of how the engine computes it.
Recomputation under activation checkpointing is not counted, so MFU compares engines on equal terms.

Let h = hidden_size, I = intermediate_size, L = num_hidden_layers, nh = num_attention_heads,
kv = num_key_value_heads, hd = head_dim, V = vocab_size, T = seq_len.

Matmul parameters, those multiplied with an activation once per token:

    N_matmul = L * (h*nh*hd + 2*h*kv*hd + nh*hd*h + 3*h*I) + V*h

i.e. the q, k, v, o projections, the gate/up/down MLP weights and the LM head. The LM head is counted even when it
is tied to the input embedding, because it is still a V x h matmul; the input embedding itself is a table lookup and
costs nothing. Biases and norms are elementwise and are left out.

A matmul weight costs 2 FLOPs (multiply + add) per token in the forward pass and 4 in the backward pass (the
gradient with respect to the input and the gradient with respect to the weight), hence 6 * N_matmul.

Attention scores and the weighted sum of values have no parameters. For a query at position t (1-based), per layer:
QK^T costs 2*nh*hd*t FLOPs and PV another 2*nh*hd*t, so 4*nh*hd*t forward. With a causal mask, t averages
(T+1)/2 ~ T/2 over a sequence of T tokens, giving a forward cost of 2*nh*hd*T per token per layer. The backward pass
is twice the forward, so for training

    attn_flops_per_token = 3 * L * 2*nh*hd*T = 6 * L * nh * hd * T

(6*L*nh*hd per context token; 602,112 for Qwen2.5-7B). The number of key/value heads does not enter: grouped-query
attention shares k and v across query heads but every query head still does its own dot products.

    train_flops_per_token = 6 * N_matmul + 6 * L * nh * hd * T

Mixture-of-experts layers (engine/model/moe.py) count their router (h*E) and the k experts a token uses
(k * 3*h*I_moe) in N_matmul; sliding-window layers count the mean number of keys inside their window instead of T/2
(`mean_keys`).

`6n_flops_per_token` = 6 * (all parameters, embeddings included; active parameters for MoE) is the figure other
codebases (MegaTrain among them) report. It overcounts the embedding lookup and ignores attention; it is kept only
for side-by-side comparison.

Costs
-----
`log_step` does one small JSON write, a flush, a read of /proc/self/status and, on CUDA, two allocator queries; none
synchronise the GPU. `git_sha` runs git twice, once per logger. W&B offline mode spawns its service process once
per Python process and adds a few seconds to the first `wandb.init`.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from engine.fileio import atomic_write, atomic_write_json

GIB = 2**30
DEFAULT_WANDB_PROJECT = "streamtrain"  # logger.project unset and no $WANDB_PROJECT

_THROUGHPUT_KEYS = ("step_s", "tokens_per_s", "tflops", "mfu")
_REQUIRED_STEP_KEYS = ("loss", "lr", "grad_norm", "tokens", "step_s")

# W&B sections: the optimisation itself, validation, throughput, memory, and where a step's time goes. metrics.jsonl
# keeps the flat names; W&B gets `<section>/<name>`, so its dashboard opens with five panels instead of one list.
TRAIN_KEYS = {"loss", "lr", "grad_norm", "skipped", "skipped_steps", "loss_finite", "loss_tokens", "balance_loss",
              "expert_load_min", "expert_load_max", "steps_in_record"}
PERF_KEYS = {"tokens", "tokens_total", "tokens_per_s", "tflops", "tflops_6n", "mfu", "overlap"}


def wandb_key(name: str) -> str:
    """The W&B name of a metrics.jsonl key: train/, eval/, perf/, mem/ or time/."""
    if name.startswith("val_"):
        return f"eval/{name}"
    if name in TRAIN_KEYS or name.startswith(("expert_", "router_")):
        return f"train/{name}"
    if name in PERF_KEYS:
        return f"perf/{name}"
    if name.endswith("_gib"):
        return f"mem/{name}"
    return f"time/{name}"


def _define_metrics(run) -> None:
    """The x axis of every section is the optimizer step; the run's summary keeps the best losses, the last rates."""
    run.define_metric("step")
    for section in ("train", "eval", "perf", "mem", "time"):
        run.define_metric(f"{section}/*", step_metric="step")
    run.define_metric("train/loss", summary="min")
    run.define_metric("eval/val_loss", summary="min")


# ---------------------------------------------------------------------------------------------------------------------
# Parameter and FLOP counts


def _dims(model_cfg) -> Tuple[int, int, int, int, int, int, int]:
    h = model_cfg.hidden_size
    nh = model_cfg.num_attention_heads
    hd = getattr(model_cfg, "head_dim", None) or h // nh
    return (h, model_cfg.intermediate_size, model_cfg.num_hidden_layers, nh, model_cfg.num_key_value_heads, hd,
            model_cfg.vocab_size)


def _attention_params(model_cfg) -> Tuple[int, int]:
    """(matmul parameters, all parameters) of one layer's attention block."""
    h, _, _, nh, kv, hd, _ = _dims(model_cfg)
    matmul = h * nh * hd + 2 * h * kv * hd + nh * hd * h
    extra = 0
    if getattr(model_cfg, "qkv_bias", False):
        extra += nh * hd + 2 * kv * hd
    if getattr(model_cfg, "attention_bias", False):  # gpt-oss: o_proj too, and a sink logit per head
        extra += nh * hd + 2 * kv * hd + h + nh
    if getattr(model_cfg, "qk_norm", False):
        extra += 2 * hd
    return matmul, matmul + extra


def _mlp_params(model_cfg, active: bool) -> Tuple[int, int]:
    """(matmul parameters, all parameters) of one layer's MLP; a MoE layer counts its router and either all its
    experts or (active=True) the k each token uses."""
    h, inter = model_cfg.hidden_size, model_cfg.intermediate_size
    experts = getattr(model_cfg, "num_experts", 0) or 0
    if experts == 0:
        return 3 * h * inter, 3 * h * inter
    n = model_cfg.num_experts_per_tok if active else experts
    inter = model_cfg.moe_intermediate_size
    matmul = h * experts + n * 3 * h * inter
    if model_cfg.model_type == "gpt_oss":  # router bias; each expert's gate_up and down biases
        return matmul, matmul + experts + n * (2 * inter + h)
    return matmul, matmul


def count_params(model_cfg, active: bool = False) -> int:
    """All parameters: embeddings, the LM head unless tied, every layer's weights, biases and norms, the final norm.
    `active`: a MoE model's parameters one token uses (k experts per layer instead of all)."""
    h, _, n_layers, _, _, _, vocab = _dims(model_cfg)
    layer = _attention_params(model_cfg)[1] + _mlp_params(model_cfg, active)[1] + 2 * h  # + the two RMSNorms
    lm_head = 0 if getattr(model_cfg, "tie_word_embeddings", False) else vocab * h
    return vocab * h + n_layers * layer + h + lm_head


def mean_keys(seq_len: int, window: Optional[int]) -> float:
    """Keys a causal query sees on average over a sequence: T/2 (the convention below), or for a sliding window
    W < T the exact mean of min(t, W) over t = 1..T."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window * (seq_len - (window - 1) / 2) / seq_len


def model_flops_per_token(model_cfg, seq_len: int) -> Dict[str, int]:
    """Training FLOPs per token; the formulas are in the module docstring. The `*_forward_*` entries split one
    forward pass by unit, for the planner's time model: training = 3 x forward (the backward is twice the forward).
    MoE layers count the router and the k active experts; sliding-window layers the keys their window holds."""
    h, _, n_layers, nh, _, hd, vocab = _dims(model_cfg)
    layer_matmul_params = _attention_params(model_cfg)[0] + _mlp_params(model_cfg, active=True)[0]
    matmul_params = n_layers * layer_matmul_params + vocab * h
    types = getattr(model_cfg, "layer_types", None)
    window = getattr(model_cfg, "sliding_window", None)
    keys = [mean_keys(seq_len, window if types is not None and types[i] == "sliding_attention" else None)
            for i in range(n_layers)]
    attn_forward = round(sum(4 * nh * hd * k for k in keys))  # QK^T and PV over the keys each query sees
    return {
        "matmul_params": matmul_params,
        "train_flops_per_token": 6 * matmul_params + 3 * attn_forward,
        "attn_flops_per_token": 3 * attn_forward,
        "6n_flops_per_token": 6 * count_params(model_cfg, active=True),
        "layer_forward_flops_per_token": 2 * layer_matmul_params + attn_forward // n_layers,
        "layer_attention_forward_flops_per_token": attn_forward // n_layers,
        "layer_mlp_forward_flops_per_token": 2 * _mlp_params(model_cfg, active=True)[0],
        "head_forward_flops_per_token": 2 * vocab * h,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Memory probes and provenance


def _proc_status_gib(field_name: str) -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024 / GIB  # the kernel reports kB
    except OSError:
        pass
    return None


def _getrusage_peak_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes on macOS, kB elsewhere


def host_rss_gib() -> float:
    """Resident set size of this process now. Without /proc only the peak is available, and is returned instead."""
    rss = _proc_status_gib("VmRSS")
    return rss if rss is not None else _getrusage_peak_gib()


def child_processes_rss_gib() -> float:
    """Resident set size of this process's descendants now (0 without /proc): torch.compile's pool of compile
    workers, which lives beside the training process and is not in its own RSS. Pages a child shares with its
    parent count in both."""
    total_kib, pending, seen = 0, [os.getpid()], set()
    while pending:
        pid = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            for child in children:
                if child in seen:
                    continue
                seen.add(child)
                pending.append(child)
                try:
                    with open(f"/proc/{child}/status") as f:
                        total_kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
                except OSError:
                    pass
    return total_kib * 1024 / GIB


def host_peak_rss_gib() -> float:
    """Largest resident set size this process has had."""
    peak = _proc_status_gib("VmHWM")
    return peak if peak is not None else _getrusage_peak_gib()


def gpu_mem_gib() -> float:
    """Memory held by live tensors on the current CUDA device; 0.0 without CUDA."""
    return torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0


def gpu_peak_mem_gib() -> float:
    """Peak of `gpu_mem_gib` since the start or the last `torch.cuda.reset_peak_memory_stats`."""
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0


def gpu_peak_reserved_gib() -> float:
    """Peak of the memory the caching allocator has taken from the device (live tensors plus its cached blocks)."""
    return torch.cuda.max_memory_reserved() / GIB if torch.cuda.is_available() else 0.0


def run_environment() -> dict:
    """Where and when a figure was measured: GPU name, torch / triton / Python versions, CPU count, git revision and
    UTC time. Every benchmark row carries these fields; this is their one source."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "git_sha": git_sha(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def git_sha() -> str:
    """Short revision of the repository holding this file, "+dirty" when tracked files differ from it. A copy of
    the tree sent to a benchmark machine names its revision in STREAMTRAIN_GIT_SHA, which wins when set: such a
    copy may carry a stale .git of its own (seen on the GPU machine: rows of 3495094 read "5ef4a7d+dirty")."""
    if os.environ.get("STREAMTRAIN_GIT_SHA"):
        return os.environ["STREAMTRAIN_GIT_SHA"]
    repo = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git binary, not a repository, or no commit yet
        return "unknown"
    return sha + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------------------------------------------------
# JSON helpers


def jsonable(value: Any) -> Any:
    """Plain JSON value: tensors and numpy scalars unwrapped (a multi-element tensor as a list), non-finite floats
    as None, containers recursed."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        value = value.tolist()
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (list, dict, str)):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def _sanitize(record: Dict[str, Any]) -> Dict[str, Any]:
    """`jsonable` on each value, plus `<key>_finite: false` for each top-level float that was nan or inf."""
    out: Dict[str, Any] = {}
    for key, value in record.items():
        out[key] = jsonable(value)
        if out[key] is None and value is not None and not isinstance(value, (dict, list, tuple)):
            out[f"{key}_finite"] = False
    return out


def _hydra_job() -> Tuple[Optional[str], Optional[str]]:
    """(sweep dir name, job name) inside a Hydra multirun, else (None, None)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return None, None
    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None, None
    job = hc.job
    name = f"{job.num}-{job.override_dirname}" if job.override_dirname else f"job{job.num}"
    return Path(hc.sweep.dir).name, name


def _start_metrics_file(path: Path, start_step: int, log: Callable[[str], None]) -> None:
    """Make `path` hold exactly the records of steps <= start_step of this run (see the module docstring)."""
    if not path.exists():
        return
    if start_step == 0:
        stamp = dt.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        aside, n = path.with_name(f"metrics.{stamp}.jsonl"), 1
        while aside.exists():
            aside, n = path.with_name(f"metrics.{stamp}-{n}.jsonl"), n + 1
        os.replace(path, aside)
        log(f"{path}: from an earlier run in this directory; moved to {aside.name}, this run starts a new one")
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) > start_step:
                continue
        except ValueError:  # a line cut short by the crash
            continue
        kept.append(line)
    if len(kept) != len(lines):
        atomic_write(path, lambda f: f.write("".join(line + "\n" for line in kept).encode()))
        log(f"{path}: dropped {len(lines) - len(kept)} records after step {start_step}")


# ---------------------------------------------------------------------------------------------------------------------
# The logger


class MetricsLogger:
    """Writes step and validation records to metrics.jsonl, mirrors them to W&B, shows progress, writes summary.json.

    Each `log_step` record describes the span since the previous call: `tokens` trained and `step_s` wall seconds
    (one optimizer step when logging every step). The progress bar's position is `step` as given.
    """

    def __init__(self, run_dir: str | Path, config: dict, model_cfg, seq_len: int, peak_tflops: float, logger_cfg,
                 total_steps: int, start_step: int = 0, log: Callable[[str], None] = print):
        if logger_cfg.name not in ("wandb", "none"):
            raise ValueError(f"logger.name={logger_cfg.name!r}: expected 'wandb' or 'none'")
        if logger_cfg.progress not in ("auto", "bar", "lines"):
            raise ValueError(f"logger.progress={logger_cfg.progress!r}: expected 'auto', 'bar' or 'lines'")
        wandb = None
        if logger_cfg.name == "wandb":
            try:
                import wandb
            except ImportError as e:
                raise ImportError("logger=wandb needs the wandb package: `pip install wandb`, or run with "
                                  "logger=none to log to metrics.jsonl only") from e

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.peak_tflops = peak_tflops
        self.total_steps = total_steps
        flops = model_flops_per_token(model_cfg, seq_len)
        self.train_flops_per_token = flops["train_flops_per_token"]
        self.flops_6n_per_token = flops["6n_flops_per_token"]
        self.git_sha = git_sha()

        self.tokens_total = 0
        self.steps: List[Dict[str, Any]] = []
        self.val_losses: List[Any] = []
        self.peak_gpu_mem_gib = 0.0
        self.summary: Optional[Dict[str, Any]] = None

        self._log = log
        _start_metrics_file(self.run_dir / "metrics.jsonl", start_step, log)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._run = None
        self._bar = None
        try:
            if wandb is not None:
                group, name = _hydra_job()
                self._run = wandb.init(
                    project=logger_cfg.project or os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT,
                    entity=logger_cfg.entity or os.environ.get("WANDB_ENTITY"),
                    dir=str(self.run_dir),
                    mode=os.environ.get("WANDB_MODE") or logger_cfg.mode,
                    config=config,
                    group=logger_cfg.group or group,
                    name=name,
                    tags=list(logger_cfg.tags),
                    reinit="create_new",  # each logger owns its run; an earlier one still open is left alone
                )
                _define_metrics(self._run)
            use_bar = logger_cfg.progress == "bar" or (logger_cfg.progress == "auto" and sys.stderr.isatty())
            if use_bar:
                from tqdm import tqdm
                self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        except BaseException:
            self._jsonl.close()
            raise

    def _write(self, record: Dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._run is not None:
            self._run.log({"step": record["step"], **{wandb_key(k): v for k, v in record.items()
                                                       if v is not None and k != "step"}}, step=record["step"])

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            self._log(line)

    def log_step(self, step: int, record: dict) -> dict:
        missing = [k for k in _REQUIRED_STEP_KEYS if k not in record]
        if missing:
            raise KeyError(f"log_step record lacks {missing}; it needs {list(_REQUIRED_STEP_KEYS)}")
        tokens, step_s = record["tokens"], record["step_s"]
        self.tokens_total += tokens
        tokens_per_s = tokens / step_s if step_s > 0 else None
        tflops = self.train_flops_per_token * tokens_per_s / 1e12 if tokens_per_s is not None else None
        tflops_6n = self.flops_6n_per_token * tokens_per_s / 1e12 if tokens_per_s is not None else None
        gpu_mem = gpu_peak_mem_gib()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.peak_gpu_mem_gib = max(self.peak_gpu_mem_gib, gpu_mem)

        raw = {
            "step": step,
            **record,
            "tokens_total": self.tokens_total,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if tflops is not None and self.peak_tflops else None,
            "tflops_6n": tflops_6n,
            "gpu_mem_gib": gpu_mem,
            "host_mem_gib": host_rss_gib(),
            "host_children_mem_gib": child_processes_rss_gib(),
        }
        out = _sanitize(raw)
        out["loss_finite"] = out["loss"] is not None
        self._write(out)
        self.steps.append(out)
        self._show_step(out, raw)
        return out

    def _show_step(self, out: Dict[str, Any], raw: Dict[str, Any]) -> None:
        tok_s = f"{out['tokens_per_s']:,.0f}" if out["tokens_per_s"] is not None else "-"
        if self._bar is not None:
            self._bar.update(max(out["step"] - self._bar.n, 0))
            self._bar.set_postfix_str(f"loss {raw['loss']:.4f} tok/s {tok_s}")
            return
        line = (f"step {out['step']}/{self.total_steps} loss {raw['loss']:.4f} lr {raw['lr']:.1e} "
                f"gnorm {raw['grad_norm']:.2f} tok/s {tok_s} step {raw['step_s']:.2f}s")
        if out["mfu"] is not None:
            line += f" mfu {100 * out['mfu']:.1f}%"
        if "balance_loss" in raw:  # MoE: the balance term and the least / most loaded expert against uniform
            line += (f" balance {raw['balance_loss']:.3f} load {raw['expert_load_min']:.2f}"
                     f"-{raw['expert_load_max']:.2f}")
        self._print(line)

    def log_val(self, step: int, val_loss: float) -> None:
        out = _sanitize({"step": step, "val_loss": val_loss})
        self._write(out)
        self.val_losses.append(val_loss)
        self._print(f"step {step}/{self.total_steps} val_loss {float(val_loss):.4f}")

    def close(self, extra_summary: dict | None = None) -> dict:
        """Write summary.json, finish the W&B run, close files. A second call returns the first call's summary.

        Called while an exception propagates (from `finally:` or `except:`), the summary records the error and the
        W&B run is marked failed.
        """
        if self.summary is not None:
            return self.summary
        exc = sys.exc_info()[1]
        timed = self.steps[1:] if len(self.steps) >= 2 else self.steps  # the first step carries warm-up costs
        medians = {}
        for key in _THROUGHPUT_KEYS:
            values = [s[key] for s in timed if s[key] is not None]
            medians[f"median_{key}"] = statistics.median(values) if values else None
        last = self.steps[-1] if self.steps else {}
        summary = _sanitize({
            "final_loss": last.get("loss"),
            "final_loss_finite": last.get("loss_finite"),
            "final_val_loss": self.val_losses[-1] if self.val_losses else None,
            "initial_val_loss": self.val_losses[0] if self.val_losses else None,
            **medians,
            "peak_gpu_mem_gib": max(self.peak_gpu_mem_gib, gpu_peak_mem_gib()),
            "peak_gpu_reserved_gib": gpu_peak_reserved_gib(),
            "peak_host_mem_gib": host_peak_rss_gib(),
            "steps": last.get("step", 0),
            "logged_steps": len(self.steps),
            "tokens_total": self.tokens_total,
            "error": repr(exc) if exc is not None else None,
            "git_sha": self.git_sha,
            **(extra_summary or {}),
            "config": self.config,
        })
        self.summary = summary
        try:
            atomic_write_json(self.run_dir / "summary.json", summary, indent=2)
            if self._run is not None:
                self._run.summary.update({k: v for k, v in summary.items() if k != "config" and v is not None})
        finally:
            try:
                if self._run is not None:
                    self._run.finish(exit_code=1 if exc is not None else 0)
            finally:
                if self._bar is not None:
                    self._bar.close()
                self._jsonl.close()
        return summary
