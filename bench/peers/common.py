"""Shared pieces of the peer baselines: model config, random batches, the timed loop, memory probes, JSONL rows.

Every peer script (`all_on_gpu.py`, `fsdp2_offload.py`, `deepspeed_zero3.py`) trains the same thing as our engine's
benchmark: a transformers `*ForCausalLM` built from a `conf/model/*.yaml` through the engine's HF config mapping
(random init, transformers' default attention: SDPA, eager for gpt-oss; MoE models with their load-balancing loss;
activation checkpointing), seq 4096, random tokens uniform over the vocabulary, fp32 master weights, bf16 compute,
AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on tensors of two or more dimensions, none on biases and
norms: the engine's split), global grad-norm clipping at 1.0, `micro_batch_size * grad_accum * seq_len` tokens per
step. Each run is `--steps` optimizer steps (default 4); the first `--warmup` (default 1) are not timed, and `step_s`
is the median of the rest, each timed between two `torch.cuda.synchronize()` calls (nothing else synchronises).

Rows and failures
-----------------
A run appends one JSON row to `--out`. A CUDA out-of-memory error (or a pinned/host allocation that raises) is caught
and still gives a row, with `error`. A process killed by the kernel's OOM killer cannot write anything itself, so by
default each script re-runs itself as a child process and supervises it (`--no-supervise` to run in-process): when
the child dies without having written its row, the parent writes one with `error` ("killed: SIGKILL ... (host out of
memory?)"), the phase the child last announced, the largest resident set size it saw the child reach
(`host_mem_gib_observed`, a lower bound of the true peak) and the log tail. Without the supervisor a missing row
means the process was killed; the `[peer ...]` progress lines printed before every phase (build, each step) show
where.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from engine.config import ModelConfig
from engine.metrics import count_params, jsonable, model_flops_per_token, run_environment

ROOT = Path(__file__).resolve().parents[2]

GIB = 2**30
CHILD_ENV = "STREAMTRAIN_PEER_CHILD"
ROW_WRITTEN = "[peer] row written"
PEAK_TFLOPS_H200 = 989.0

LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def base_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="qwen7b", help="a conf/model/<name>.yaml (default qwen7b)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None, help="default 4096 (128 with --dry-run)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps in all, warm-up included (default 4; "
                                                            "1 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start (default 1)")
    ap.add_argument("--layers", type=int, default=None, help="truncate the model to this many decoder layers")
    ap.add_argument("--vocab", type=int, default=None, help="override the vocabulary size (tests / dry runs only)")
    ap.add_argument("--experts", type=int, default=None,
                    help="override a MoE model's number of experts, keeping those a token uses (tests / dry runs only)")
    ap.add_argument("--attn-implementation", default=None,
                    help="transformers' attn_implementation (default: transformers' choice, SDPA where the model "
                         "supports it, else eager)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS_H200, help="MFU denominator (H200 dense bf16)")
    ap.add_argument("--out", default="bench/results/peers.jsonl", help="JSONL file the row is appended to")
    ap.add_argument("--tag", default=None, help="free text stored in the row")
    ap.add_argument("--expandable-segments", action="store_true",
                    help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as train.py sets (default: torch's "
                         "allocator settings, or whatever the environment says)")
    ap.add_argument("--no-supervise", action="store_true",
                    help="run in this process; a host-OOM kill then leaves no row")
    ap.add_argument("--debug-kill-phase", default=None, help=argparse.SUPPRESS)  # tests: SIGKILL self at a phase
    return ap


def finish_args(args: argparse.Namespace, dry_run: bool) -> argparse.Namespace:
    if args.seq_len is None:
        args.seq_len = 128 if dry_run else 4096
    if args.steps is None:
        args.steps = 1 if dry_run else 4
    if dry_run and args.layers is None:
        args.layers = 2
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    args.warmup = min(args.warmup, args.steps - 1)  # always time at least one step
    if args.expandable_segments:  # before anything touches CUDA; the supervised child inherits it
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Model config


def load_model_yaml(name: str) -> Dict[str, Any]:
    """The fields of conf/model/<name>.yaml as a plain dict."""
    path = ROOT / "conf" / "model" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
        raise SystemExit(f"--model {name}: no {path.relative_to(ROOT)}; known: {', '.join(known)}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def model_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """The YAML's fields with --layers / --vocab / --experts applied; `truncated` says whether they changed the model.
    Token ids the shrunk vocabulary no longer holds are dropped."""
    fields = load_model_yaml(args.model)
    fields["full_num_hidden_layers"] = fields["num_hidden_layers"]
    if args.layers is not None:
        if not 1 <= args.layers <= fields["num_hidden_layers"]:
            raise SystemExit(f"--layers {args.layers}: {args.model} has {fields['num_hidden_layers']} layers")
        fields["num_hidden_layers"] = args.layers
    if args.vocab is not None:
        fields["vocab_size"] = args.vocab
        for key in ("bos_token_id", "eos_token_id"):
            if isinstance(fields.get(key), int) and fields[key] >= args.vocab:
                fields[key] = None
    if args.experts is not None:
        if not fields.get("num_experts"):
            raise SystemExit(f"--experts {args.experts}: {args.model} is not a mixture of experts")
        if args.experts < fields["num_experts_per_tok"]:
            raise SystemExit(f"--experts {args.experts}: fewer than the {fields['num_experts_per_tok']} a token uses")
        fields["num_experts"] = args.experts
    fields["truncated"] = fields["num_hidden_layers"] != fields["full_num_hidden_layers"] or args.vocab is not None \
        or args.experts is not None
    return fields


def model_config(fields: Dict[str, Any]) -> DictConfig:
    """The engine's ModelConfig (engine/config.py) of these fields: what its parameter and FLOP counts (engine.metrics)
    and its HF config mapping (engine.checkpoint.hf) read, so that a peer's model and its row's figures are the
    engine's for the same YAML."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {k: v for k, v in fields.items() if k in names})


def hf_config(fields: Dict[str, Any], attn_implementation: Optional[str] = None):
    """The transformers config of the YAML's architecture, from the engine's HF export mapping (`hf_config_dict`:
    Qwen2, Qwen3, Llama, Qwen3-MoE, gpt-oss with its experts, sinks, sliding window and per-layer attention types,
    the first num_hidden_layers of them under --layers), fp32 (the master weights), no KV cache. MoE models return
    their router logits, so that transformers adds the load-balancing loss (router_aux_loss_coef x its balance term)
    to the loss, as the engine does. `attn_implementation` None leaves the choice to transformers when the model is
    built: SDPA where the class supports it, else eager (gpt-oss: its attention sinks are in the eager, flex and
    flash-attention paths only)."""
    import transformers

    from engine.checkpoint.hf import hf_config_dict

    m = model_config(fields)
    kw = {**hf_config_dict(m, torch.float32), "use_cache": False}
    if m.num_experts:
        kw["output_router_logits"] = True
    cfg = transformers.AutoConfig.for_model(**kw)
    if attn_implementation:
        cfg._attn_implementation = attn_implementation
    return cfg


def hf_model_class(fields: Dict[str, Any]):
    import transformers

    from engine.checkpoint.hf import DEFAULT_ARCHITECTURES

    return getattr(transformers, DEFAULT_ARCHITECTURES[fields["model_type"]])


def implementations(model) -> Dict[str, Optional[str]]:
    """The attention and (MoE models) expert kernels transformers chose for the built model, for the row."""
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    return {"attn_implementation": cfg._attn_implementation,
            "experts_implementation": getattr(cfg, "_experts_implementation", None) if experts else None}


def checkpointing_on(model) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the first is transformers >= 5.24
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every decoder layer, non-reentrant (transformers 5.24 renamed the method)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def param_groups(model) -> List[Dict[str, Any]]:
    """The engine's decay split: weight decay on tensors of two or more dimensions, none on biases and norms."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = p.ds_shape.__len__() if hasattr(p, "ds_shape") else p.ndim  # ZeRO-3 partitioned params are 1-D
        (decay if ndim >= 2 else no_decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


# ---------------------------------------------------------------------------------------------------------------------
# Data


def say(note, what: str) -> None:
    if note is not None:
        note(what)


def random_batches(step: int, args: argparse.Namespace, vocab_size: int, device) -> List[torch.Tensor]:
    """`grad_accum` micro-batches of token ids, uniform over the vocabulary, seeded by (seed, step)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (args.grad_accum, args.micro_batch_size, args.seq_len), generator=g)
    return [m.to(device, non_blocking=True) for m in ids.unbind(0)]


# ---------------------------------------------------------------------------------------------------------------------
# Progress, memory, versions


class Progress:
    """`[peer <system> +<s> host <GiB> gpu <GiB>] <phase>: <msg>` lines, flushed; remembers the phase."""

    def __init__(self, system: str, debug_kill_phase: Optional[str] = None):
        self.system, self.t0, self.phase = system, time.perf_counter(), "start"
        self.debug_kill_phase = debug_kill_phase

    def __call__(self, phase: str, msg: str = "") -> None:
        self.phase = phase
        gpu = torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0
        host = host_rss_gib()
        print(f"[peer {self.system} +{time.perf_counter() - self.t0:.1f}s host {host:.1f} GiB gpu {gpu:.1f} GiB] "
              f"{phase}{': ' + msg if msg else ''}", flush=True)
        if self.debug_kill_phase and phase == self.debug_kill_phase:
            os.kill(os.getpid(), signal.SIGKILL)


def _status_gib(field: str, pid: str = "self") -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError):
        pass
    return None


def host_rss_gib() -> float:
    return _status_gib("VmRSS") or 0.0


def host_peak_gib() -> Optional[float]:
    """VmHWM: the largest resident set size this process has had (pinned pages included once touched)."""
    return _status_gib("VmHWM")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def versions() -> Dict[str, Any]:
    """The project's provenance fields (engine.metrics.run_environment) plus the transformers version peers run."""
    try:
        transformers_version = __import__("transformers").__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as None
        transformers_version = None
    return {**run_environment(), "transformers": transformers_version}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    """What torchrun would set for one process, so no launcher is needed."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


# ---------------------------------------------------------------------------------------------------------------------
# Rows


def write_row(path: str | Path, row: Dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(jsonable(row), allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"{ROW_WRITTEN} -> {path}", flush=True)


def base_row(system: str, args: argparse.Namespace, fields: Dict[str, Any]) -> Dict[str, Any]:
    tokens = args.micro_batch_size * args.grad_accum * args.seq_len
    return {
        "bench": "peer", "system": system, "model": args.model,
        "num_hidden_layers": fields["num_hidden_layers"], "vocab_size": fields["vocab_size"],
        "truncated": fields["truncated"], "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
        "grad_accum": args.grad_accum, "tokens_per_step": tokens, "steps": args.steps, "warmup": args.warmup,
        "num_params": count_params(model_config(fields)), "tag": args.tag,
        "command": " ".join(["python -m", script_module(), *sys.argv[1:]]),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def write_unrun_row(system: str, args: argparse.Namespace, fields: Dict[str, Any], error: str,
                    extra: Optional[Dict[str, Any]] = None) -> None:
    """The row of a run refused before anything was built (a missing package, a host too small): the run's shape,
    the environment and `error`, no results."""
    row = {**base_row(system, args, fields), **versions(), **(extra or {}), "error": error}
    write_row(args.out, null_results(row))


def error_text(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError):
        return f"CUDA out of memory: {msg[:300]}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return f"out of memory ({type(exc).__name__}): {msg[:300]}"
    return f"{type(exc).__name__}: {msg[:300]}"


RESULT_KEYS = ("build_s", "steps_done", "step_s", "step_s_all", "tokens_per_s", "tflops", "tflops_6n", "mfu",
               "peak_tflops", "gpu_mem_gib", "gpu_reserved_gib", "host_mem_gib", "losses", "grad_norms")


def null_results(row: Dict[str, Any]) -> Dict[str, Any]:
    """The result keys, unmeasured, for rows written without a run (a refused import, a killed child)."""
    for key in RESULT_KEYS:
        row.setdefault(key, None)
    return row


def fill_results(row: Dict[str, Any], fields: Dict[str, Any], args: argparse.Namespace, step_times: List[float],
                 losses: List[float], grad_norms: List[float]) -> None:
    """Throughput and memory of a run (partial runs too: what was measured so far)."""
    timed = step_times[args.warmup:] if len(step_times) > args.warmup else step_times
    step_s = statistics.median(timed) if timed else None
    tokens_per_s = row["tokens_per_step"] / step_s if step_s else None
    flops = model_flops_per_token(model_config(fields), args.seq_len)
    tflops = flops["train_flops_per_token"] * tokens_per_s / 1e12 if tokens_per_s else None
    row.update({
        "steps_done": len(step_times), "step_s": step_s, "step_s_all": step_times, "tokens_per_s": tokens_per_s,
        "tflops": tflops, "tflops_6n": flops["6n_flops_per_token"] * tokens_per_s / 1e12 if tokens_per_s else None,
        "mfu": tflops / args.peak_tflops if tflops is not None and args.peak_tflops else None,
        "peak_tflops": args.peak_tflops,
        "gpu_mem_gib": torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB if torch.cuda.is_available() else None,
        "host_mem_gib": host_peak_gib(), "losses": losses, "grad_norms": grad_norms,
    })


# ---------------------------------------------------------------------------------------------------------------------
# The run


# (micro-batches, note) -> (mean loss, grad norm); note(what) is None or prints a progress line (warm-up steps)
StepFn = Callable[[Sequence[torch.Tensor], Optional[Callable[[str], None]]], tuple]


def run(system: str, args: argparse.Namespace, fields: Dict[str, Any], build: Callable[[Callable], Dict[str, Any]],
        device, extra: Optional[Dict[str, Any]] = None) -> int:
    """Build, then `args.steps` timed steps; always one row. `build(progress)` returns a dict with `step` (StepFn)
    and optional row fields. Returns the exit code: 0 on success or a caught out-of-memory error, 1 otherwise."""
    progress = Progress(system, args.debug_kill_phase)
    row = {**base_row(system, args, fields), **versions(), **(extra or {})}
    step_times: List[float] = []
    losses: List[float] = []
    grad_norms: List[float] = []
    rc = 0
    try:
        progress("build", f"{args.model} ({fields['num_hidden_layers']} layers, vocab {fields['vocab_size']}, "
                          f"{row['num_params'] / 1e9:.2f}B params)")
        t0 = time.perf_counter()
        torch.manual_seed(args.seed)  # the random init
        built = build(progress)
        sync()
        row["build_s"] = time.perf_counter() - t0
        step = built.pop("step")
        row.update(built)
        progress("built", f"{row['build_s']:.1f}s")
        for i in range(args.steps):
            batches = random_batches(i, args, fields["vocab_size"], device)
            kind = "warm-up" if i < args.warmup else "timed"
            progress(f"step {i + 1}/{args.steps}", f"{kind}, {row['tokens_per_step']:,} tokens")
            # warm-up steps (untimed) announce each micro-batch's phases, so a log that ends shows where it died
            note = (lambda what, _i=i: progress(f"step {_i + 1}/{args.steps} {what}")) if i < args.warmup else None
            sync()
            t = time.perf_counter()
            loss, gnorm = step(batches, note)
            sync()
            step_times.append(time.perf_counter() - t)
            losses.append(float(loss))
            grad_norms.append(float(gnorm))
            progress(f"step {i + 1}/{args.steps} done", f"{step_times[-1]:.3f}s loss {losses[-1]:.4f} "
                                                         f"grad_norm {grad_norms[-1]:.3f}")
    except (torch.OutOfMemoryError, MemoryError) as e:
        row["error"] = error_text(e)
        row["error_phase"] = progress.phase
        progress("error", row["error"])
    except Exception as e:  # noqa: BLE001 - every failure still gives a row
        row["error"] = error_text(e)
        row["error_phase"] = progress.phase
        row["traceback"] = traceback.format_exc()[-3000:]
        traceback.print_exc()
        rc = 0 if "out of memory" in row["error"].lower() else 1
    row.setdefault("build_s", None)
    fill_results(row, fields, args, step_times, losses, grad_norms)
    row.setdefault("error", None)
    write_row(args.out, row)
    if row["error"] is None:
        print(f"[peer {system}] {args.model}: {row['tokens_per_s']:,.0f} tokens/s, step {row['step_s']:.3f}s, "
              f"{row['tflops']:.1f} TFLOPS ({row['tflops_6n']:.1f} 6N), GPU peak {row['gpu_mem_gib'] or 0:.1f} GiB, "
              f"host peak {row['host_mem_gib'] or 0:.1f} GiB", flush=True)
    return rc


# ---------------------------------------------------------------------------------------------------------------------
# The supervisor: the same script as a child process, so a host-OOM kill still leaves a row


def script_module() -> str:
    """The peer script this process runs, as a module of the repository root (`bench.peers.all_on_gpu`)."""
    return sys.modules["__main__"].__spec__.name


def is_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def supervise(system: str, args: argparse.Namespace, fields: Dict[str, Any]) -> int:
    cmd = [sys.executable, "-u", "-m", script_module(), *sys.argv[1:]]
    proc = subprocess.Popen(cmd, env={**os.environ, CHILD_ENV: "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: List[str] = []
    state: Dict[str, Any] = {"phase": "start", "row": False, "build_s": None, "steps": []}

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line)
            del tail[:-80]
            if line.startswith(ROW_WRITTEN):
                state["row"] = True
            elif line.startswith("[peer ") and "] " in line:
                phase, _, msg = line.split("] ", 1)[1].partition(":")
                state["phase"] = phase.strip()
                try:  # what the child measured before it died
                    if state["phase"] == "built":
                        state["build_s"] = float(msg.split()[0].rstrip("s"))
                    elif state["phase"].endswith(" done"):
                        state["steps"].append(float(msg.split()[0].rstrip("s")))
                except (ValueError, IndexError):
                    pass

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    observed = 0.0
    while proc.poll() is None:
        observed = max(observed, _status_gib("VmRSS", str(proc.pid)) or 0.0)
        time.sleep(0.5)
    reader.join(timeout=10)
    rc = proc.returncode
    if state["row"]:
        return rc
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        hint = " (host out of memory?)" if -rc == signal.SIGKILL else ""
        error = f"killed: {name} during {state['phase']}{hint}"
    else:
        error = f"exit {rc} during {state['phase']} without a row"
    row = {**base_row(system, args, fields), **versions(), "error": error, "error_phase": state["phase"],
           "host_mem_gib_observed": observed, "build_s": state["build_s"], "steps_done": len(state["steps"]),
           "step_s_all": state["steps"], "log_tail": "".join(tail)[-3000:]}
    write_row(args.out, null_results(row))
    print(f"[peer {system}] {error}; largest child RSS seen {observed:.1f} GiB", flush=True)
    return 0 if rc == -signal.SIGKILL else (rc if rc > 0 else 1)


def main(system: str, args: argparse.Namespace, fields: Dict[str, Any], child: Callable[[], int]) -> None:
    """Supervise (default) or run `child()` in this process; exit with its code."""
    if args.no_supervise or is_child():
        sys.exit(child())
    sys.exit(supervise(system, args, fields))


def refuse_without_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU (torch {torch.__version__} sees none); this peer baseline measures GPU "
              f"training. On a CPU-only machine, only the smoke runs work: all_on_gpu.py --dry-run, "
              f"fsdp2_offload.py --dry-run.", file=sys.stderr, flush=True)
        sys.exit(2)
