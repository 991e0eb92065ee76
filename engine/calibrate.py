"""Calibration: measure the machine this runs on and write a hardware profile for the planner.

    python -m engine.calibrate --out conf/hardware/h200_calibrated.yaml --jsonl bench/results/calibrate.jsonl
    python -m engine.calibrate --model tiny --micro-batch 1 --seq-len 64 --modes eager --out /tmp/cpu.yaml  # any CPU

The planner (engine/plan.py) predicts a step from a profile's figures. A figure fitted on the very run it then
predicts proves nothing, so every figure here comes from small, separate measurements of the pieces a streamed
step is made of, each the median of `--repeats` timed repetitions after `--warmup` untimed ones:

1. One decoder layer of `--model` at `--micro-batch` x `--seq-len` tokens, built as the streaming engine builds a
   slot: the fp32 master of `spec.units[1]` is initialised with `spec.init_unit`, its cast segment (the matmul
   weights) copied to the device in the compute dtype (bf16 autocast on CUDA, fp32 on CPU) and the tail (norms,
   biases) in fp32, and the templates read it through `layout.bind`. In each mode of `--modes` (a fresh ModelSpec
   per mode; `compiled` calls `compile_templates`, and the first warm-up call, which compiles, is timed on its own
   and printed when slow):
   - forward without autograd, as the engine's forward runs a layer -> `fwd_tflops_<mode>`;
   - backward as the engine runs it (`ModelSpec.layer_grads`): the forward again with autograd from a leaf input,
     then the gradients of the input and every weight under a random upstream gradient, then the weight gradients
     added into an fp32 buffer of the layer's layout (the engine accumulates each micro-batch's gradients so: the
     fused kernel of streamtrain_kernels/grad_accum.py on CUDA, torch adds on the CPU; at qwen7b's 64K tokens per step
     in 8 micro-batches that is ~0.2 s of an H200 step) -> `bwd_tflops_<mode>`, counted as 3 forwards (the
     recompute and the backward's two matmuls per weight) less what the recompute leaves out (a dense layer's down
     projection), as the planner counts it;
   - the head: `spec.loss_sum` with autograd, then the gradient for the input and the head's weights (with tied
     embeddings the embedding matrix is the LM head, as in the engine's `_head`) -> `head_tflops_<mode>`, counted
     as 4 head forwards (the forward, the chunked loss's recompute and a backward of two).
   FLOPs are model FLOPs (`engine.metrics.model_flops_per_token`), the same count the planner divides by these
   rates, so a rate here is exactly what the planner needs, whatever the kernels do underneath.
   The layer figures are of the layer's FLOPs other than attention's, over the layer's time less its attention's
   (the attention alone at the same shape and window, timed as below, subtracted), because attention's rate
   depends on the length and the rest's does not:
   - the attention kernel alone (the backend the layer uses, full causal, one sequence of `--attn-seq-len`
     tokens, the model's heads): forward without autograd -> `attn_fwd_tflops`; forward with autograd and the
     gradients of q, k and v -> `attn_bwd_tflops`, counted as 3 forwards; with `attn_backend` and `attn_seq_len`.
   With `--attn-points BACKEND:TOKENS ...`, the same two attention figures for each more (backend, length) ->
   `attn_points` (at 512K tokens attention is ~88% of a qwen7b layer, and on an H100 the Triton kernel and SDPA's
   default backend differ by ~1.45x: the planner times a run's attention at its own backend's figures, interpolated
   in log(length)). A long point's calls take seconds each (18 s forward + backward at 512K), so they are
   repeated only as often as about 10 s allow (at least once after the warm-up). Without `--attn-points` the base
   profile's points are kept: they are of the kernel alone, measured on the same card.
   With `--moe-models`, each of those mixture-of-experts models' layer at each `--moe-micro-batches` size (default:
   `--micro-batch`) of `--seq-len` tokens, forward and backward as above (its attention alone subtracted) -> one
   entry of `moe_layers` each (model, layer shape, tokens, the forward and backward figures of each mode, and when
   and where they were measured): the planner times MoE layers with the entries of their own shape, or the
   nearest measured one, interpolated in log(tokens) (their grouped expert matmuls, gathers and scatters run far
   below a dense layer's rate, and how far depends on the expert shapes and the tokens each expert gets: at 16K
   tokens on an H200 the dense figures made the MoE backward 2.5-6.4x short, and on an H100 a Qwen3-30B-A3B step
   timed at a gpt-oss-20b layer's figures came out 13% short: bench/results/moe.md). Entries of the base profile
   that are not measured again (another model or token count) are kept, and an entry measured again keeps the
   figures of the modes not measured now. A layer inside a training step runs slower than alone (the profile's
   `moe_step_ratio`, from `python -m bench.plan_backtest` over measured steps, not from here). `--moe-only`
   measures these alone and copies every other field from `--base`: adding a MoE model to a profile then takes a
   minute, not a recalibration.
   The profile records the layer's model and width (`layer_model`, `layer_hidden`). With `--width-models`, each of
   those dense models' layer and head at the same tokens, measured as above -> one entry of `layer_widths` each
   (model, hidden size, the six layer and head figures): a layer's rate depends on its width (on an H100 a
   2048-wide qwen3b layer ran 6-21% below the 3584-wide qwen7b one), and the planner interpolates between
   calibrated widths. Without `--width-models` the base profile's widths are left out, not copied: they were
   measured beside another calibration's main layer.
2. PCIe: `--copy-gib` from page-locked host memory (plain memory registered with cudaHostRegister, as the host
   store pins its arena) to the device -> `h2d_gbps`, back -> `d2h_gbps`, and both at once on two streams ->
   `bidir_gbps` (the bytes of both directions over the time of the pair). GB here is 1e9 bytes.
3. Host AdamW: one fused torch.optim.AdamW step on the CPU over a flat fp32 parameter of `--adam-gparams` billion
   elements, gradient set and moments pre-seeded as engine/optim.py's FlatAdamW seeds them ->
   `cpu_adam_gparams_per_s`; then the same while a thread keeps both PCIe directions busy with pinned copies ->
   `cpu_adam_gparams_per_s_under_pcie` (in a streamed step the host update runs while weights stream in and
   gradients stream out, and page-locked DMA competes with the optimizer for host memory bandwidth), and what that
   thread moved meanwhile -> `bidir_gbps_under_adam` (the link's side of the same contention; the planner times
   the transfers that start while the host AdamW runs at it).
   Without CUDA, 2 and the second half of 3 are skipped and written as 0, and the output says so; engine.config
   refuses TFLOPS figures without transfer figures, so such a profile checks this script rather than plans a run.

GPU work is timed with CUDA events on the current stream (work on other streams is joined back to it before the
end event), host work with a wall clock. Output: `--out` gets the `--base` profile with the measured fields
replaced or added, a `calibration` line (date, git revision, model, tokens, torch / triton, GPU) and a comment
header naming this script; a mode not measured keeps the base profile's figures, and `name` stays the base's (the
card check of engine/hardware.py compares it with the GPU). `--jsonl` gets one row appended with every figure, the
run environment and the arguments. Arguments are checked before anything is allocated.

Costs. Device memory: one layer as a slot holds it, its gradients (in the same dtypes) and the working activations
of one micro-batch; the head (for qwen7b: the LM head in bf16, 1.1 GB, its gradient and a 512 MiB fp32 logits
chunk); two `--copy-gib` buffers. Host memory: two pinned `--copy-gib` buffers, 16 bytes per AdamW element
(parameter, gradient, two moments: 8 GB at the default 0.5 billion) and the fp32 masters of one layer and the head
while they are initialised. Time: under a minute with the defaults on an H200 machine (torch 2.11:
17 s of torch.compile, then mostly the host-side initialisation of the weights and of the AdamW state); the timed
repetitions themselves take a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.config import ATTENTION_BACKENDS, CONF_DIR, ConfigError, ModelConfig, TrainConfig
from engine.device import Device, autocast_ctx, pin_host, resolve_compute_dtype, unpin_host
from engine.fileio import atomic_write
from engine.metrics import child_processes_rss_gib, host_rss_gib, mean_keys, model_flops_per_token, run_environment
from engine.model import ModelSpec, Unit
from engine.model.attention import causal_attention, resolve_attention
from engine.model.dense import LayerCompute
from engine.optim import make_adamw
from engine.streaming.gradients import GradAccumulator

GIB = 2**30
MODES = ("compiled", "eager")
PCIE_FIGURES = ("h2d_gbps", "d2h_gbps", "bidir_gbps")
PCIE_POLL_S = 0.0005  # how often the PCIe load thread looks whether its oldest round has landed
INIT_SEED = 0
CHECKOUT = Path(__file__).resolve().parent.parent


def log(line: str) -> None:
    print(f"[calibrate] {line}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.calibrate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen7b", help="a model of conf/model/ (default: qwen7b)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per layer call (default: 2)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    ap.add_argument("--modes", default="compiled,eager",
                    help=f"comma-separated, from {', '.join(MODES)} (default: compiled,eager)")
    ap.add_argument("--fused-loss", default="auto", choices=("auto", "on", "off"),
                    help="the head as the run computes it (train.fused_loss; auto: fused on CUDA)")
    ap.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                    help="the layer's attention backend (train.attention; default: auto, what a run picks)")
    ap.add_argument("--moe-models", default="",
                    help="comma-separated MoE models of conf/model/ whose layers give the moe_layers figures the "
                         "planner times MoE layers with (default: none; their grouped expert matmuls run well below "
                         "a dense layer)")
    ap.add_argument("--moe-micro-batches", default="",
                    help="comma-separated micro-batch sizes (sequences of --seq-len) each --moe-models layer is "
                         "measured at (default: --micro-batch)")
    ap.add_argument("--moe-only", action="store_true",
                    help="measure the --moe-models layers only; every other field is copied from --base")
    ap.add_argument("--width-models", default="",
                    help="comma-separated dense models of conf/model/ whose layer and head are measured as well, at "
                         "the same tokens, for the planner to time models of other widths (e.g. qwen3b,qwen14b; "
                         "default: none)")
    ap.add_argument("--attn-seq-len", type=int, default=32768,
                    help="tokens of the one sequence the attention figures are measured at (default: 32768)")
    ap.add_argument("--attn-points", nargs="*", default=None, metavar="BACKEND:TOKENS",
                    help="more (backend, sequence length) points of the attention figures, e.g. triton:131072 "
                         "triton:524288 sdpa:524288 (default: the base profile's points)")
    ap.add_argument("--copy-gib", type=float, default=1.0, help="GiB per PCIe copy (default: 1)")
    ap.add_argument("--adam-gparams", type=float, default=0.5,
                    help="billions of fp32 elements of the host AdamW parameter (default: 0.5, 8 GB of state)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repetitions per figure; the median is kept")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed repetitions before the timed ones (>= 1: the first one compiles)")
    ap.add_argument("--base", type=Path, default=CONF_DIR / "hardware" / "h200.yaml",
                    help="the profile to start from (default: conf/hardware/h200.yaml)")
    ap.add_argument("--out", type=Path, required=True, help="the profile to write (replaced if it exists)")
    ap.add_argument("--jsonl", type=Path, default=None, help="append one row of every figure to this file")
    return ap


def _require(parser: argparse.ArgumentParser, ok: bool, message: str) -> None:
    if not ok:
        parser.error(message)


def _model_config(parser: argparse.ArgumentParser, flag: str, name: str, known: list[str],
                  seq_len: int) -> DictConfig:
    """conf/model/<name>.yaml as a checked model config that takes `seq_len` tokens."""
    model_dir = CONF_DIR / "model"
    _require(parser, name in known, f"{flag} {name!r} is not a model of {model_dir}; choose one of {', '.join(known)}")
    try:
        model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(model_dir / f"{name}.yaml"))
        OmegaConf.to_container(model_cfg, throw_on_missing=True)
        ModelSpec(model_cfg).check_expected_params()
    except (OmegaConfBaseException, ConfigError) as err:
        parser.error(f"{flag} {name}: conf/model/{name}.yaml does not make a model config: {err}")
    _require(parser, seq_len <= model_cfg.max_position_embeddings,
             f"--seq-len {seq_len} exceeds max_position_embeddings={model_cfg.max_position_embeddings} of {flag} "
             f"{name}")
    return model_cfg


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DictConfig:
    """Refuse what cannot work, naming the value, before anything is allocated; returns the model config and adds
    the parsed forms to `args` (mode_list, copy_bytes, adam_numel, base_profile). Refusals exit through
    `parser.error` (status 2, the message on stderr)."""
    known = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    _require(parser, bool(args.mode_list), f"--modes {args.modes!r} names no mode; choose from {', '.join(MODES)}")
    for mode in args.mode_list:
        _require(parser, mode in MODES, f"--modes: {mode!r} is not a mode; choose from {', '.join(MODES)}")
    _require(parser, len(set(args.mode_list)) == len(args.mode_list), f"--modes {args.modes!r} repeats a mode")
    for flag, value, minimum in (("--micro-batch", args.micro_batch, 1), ("--seq-len", args.seq_len, 1),
                                 ("--attn-seq-len", args.attn_seq_len, 1),
                                 ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 1)):
        _require(parser, value >= minimum, f"{flag} {value} must be an integer >= {minimum}")
    for flag, value in (("--copy-gib", args.copy_gib), ("--adam-gparams", args.adam_gparams)):
        _require(parser, math.isfinite(value) and value > 0, f"{flag} {value} must be a finite number > 0")
    args.copy_bytes = int(args.copy_gib * GIB)
    args.adam_numel = round(args.adam_gparams * 1e9)
    _require(parser, args.copy_bytes >= 1, f"--copy-gib {args.copy_gib} is less than one byte")
    _require(parser, args.adam_numel >= 1, f"--adam-gparams {args.adam_gparams} is less than one element")

    model_cfg = _model_config(parser, "--model", args.model, known, args.seq_len)
    _moe_args(parser, args, known)
    args.width_cfgs = {}
    widths = {model_cfg.hidden_size: f"--model {args.model}"}
    for name in (m.strip() for m in args.width_models.split(",") if m.strip()):
        cfg = _model_config(parser, "--width-models", name, known, args.seq_len)
        _require(parser, not cfg.num_experts, f"--width-models {name} is a mixture-of-experts model; its layer "
                 "figures come from --moe-models")
        _require(parser, cfg.hidden_size not in widths, f"--width-models {name} has hidden size {cfg.hidden_size}, "
                 f"as {widths.get(cfg.hidden_size)} has: give each width once")
        widths[cfg.hidden_size] = f"--width-models {name}"
        args.width_cfgs[name] = cfg

    args.attn_point_list = _attn_points(parser, args, model_cfg)
    _require(parser, args.base.is_file(), f"--base {str(args.base)!r}: no such file")
    try:
        base = OmegaConf.load(args.base)
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        parser.error(f"--base {str(args.base)!r} is not a YAML profile: {err}")
    _require(parser, isinstance(base, DictConfig), f"--base {str(args.base)!r} is not a mapping of profile fields")
    args.base_profile = OmegaConf.to_container(base, resolve=True)
    for flag, path in (("--out", args.out), ("--jsonl", args.jsonl)):
        if path is not None:
            _require(parser, not path.is_dir(), f"{flag} {str(path)!r} is a directory; give a file name")
            _require(parser, path.resolve().parent.is_dir(),
                     f"{flag} {str(path)!r}: directory {str(path.resolve().parent)!r} does not exist")
    return model_cfg


def _moe_args(parser: argparse.ArgumentParser, args: argparse.Namespace, known: list[str]) -> None:
    """`--moe-models` as args.moe_cfgs {name: model config}, `--moe-micro-batches` as args.moe_micro_batch_list."""
    args.moe_cfgs = {}
    for name in (m.strip() for m in args.moe_models.split(",") if m.strip()):
        _require(parser, name not in args.moe_cfgs, f"--moe-models names {name} twice")
        cfg = _model_config(parser, "--moe-models", name, known, args.seq_len)
        _require(parser, bool(cfg.num_experts), f"--moe-models {name} is a dense model; choose mixture-of-experts "
                 "ones (gptoss20b, gptoss120b, qwen3_30b_a3b)")
        args.moe_cfgs[name] = cfg
    texts = [t.strip() for t in args.moe_micro_batches.split(",") if t.strip()]
    for text in texts:
        _require(parser, text.isdigit() and int(text) >= 1,
                 f"--moe-micro-batches: {text!r} is not an integer >= 1")
    args.moe_micro_batch_list = sorted({int(t) for t in texts}) or [args.micro_batch]
    _require(parser, not args.moe_only or bool(args.moe_cfgs), "--moe-only measures the --moe-models layers; "
             "name at least one")


def _attn_points(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 model_cfg: DictConfig) -> list[tuple[str, int]] | None:
    """`--attn-points` as [(backend, tokens)], each backend one that runs here for the model (None: not given)."""
    if args.attn_points is None:
        return None
    spec = ModelSpec(model_cfg)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    points: list[tuple[str, int]] = []
    for text in args.attn_points:
        backend, _, tokens = text.partition(":")
        _require(parser, backend in ATTENTION_BACKENDS[1:] and tokens.isdigit() and int(tokens) >= 1,
                 f"--attn-points {text!r} is not BACKEND:TOKENS with BACKEND one of "
                 f"{', '.join(ATTENTION_BACKENDS[1:])} and TOKENS an integer >= 1")
        try:
            resolve_attention(backend, device_type, spec.arch.head_dim, spec.sinks_or_window)
        except ConfigError as err:
            parser.error(f"--attn-points {text}: {err}")
        _require(parser, (backend, int(tokens)) not in points, f"--attn-points {text} is given twice")
        points.append((backend, int(tokens)))
    return points


# ---------------------------------------------------------------------------------------------------------------------
# Timing


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_once_s(fn: Callable[[], None], on_device: bool) -> float:
    """Seconds of one call of `fn`: between CUDA events on the current stream for device work (`fn` joins any
    other stream it uses back to the current one), on the wall clock for host work."""
    if on_device:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _first_call_s(fn: Callable[[], None]) -> float:
    """Wall seconds of one call of `fn`, its device work included: the first call, which compiles and tunes and
    which no figure counts."""
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def median_s(fn: Callable[[], None], args: argparse.Namespace, on_device: bool, what: str) -> float:
    """Median seconds of `fn` over `args.repeats` calls after `args.warmup` untimed ones (the first of which is
    reported when it is slow: it is where torch.compile compiles)."""
    first_s = _first_call_s(fn)
    if first_s > 1.0:
        log(f"  {what}: first call {first_s:.1f} s (compilation, allocation)")
    for _ in range(args.warmup - 1):
        fn()
    _sync()
    return statistics.median(_time_once_s(fn, on_device) for _ in range(args.repeats))


def median_s_within(fn: Callable[[], None], args: argparse.Namespace, on_device: bool, what: str,
                    budget_s: float = 10.0) -> float:
    """`median_s` for calls that may take seconds each: one untimed call (compilation, tuning), then as many
    timed ones as `budget_s` allows at the first call's pace, at least one and at most `args.repeats`."""
    repeats = max(1, min(args.repeats, int(budget_s / max(_first_call_s(fn), 1e-6))))
    return statistics.median(_time_once_s(fn, on_device) for _ in range(repeats))


# ---------------------------------------------------------------------------------------------------------------------
# 1. Layer and head compute


def bind_unit(spec: ModelSpec, unit: Unit, device: torch.device, compute_dtype: torch.dtype,
              leaf: bool) -> dict[str, torch.Tensor]:
    """A unit's weights as a slot holds them: initialised in an fp32 master on the host, the cast segment copied in
    the compute dtype, the tail in fp32, bound by the layout; `leaf`: each view a leaf that autograd differentiates,
    as the engine's backward and head take them."""
    layout = unit.layout
    master = torch.zeros(layout.numel, dtype=torch.float32)
    spec.init_unit(unit, layout.views(master), INIT_SEED)
    cast = master[:layout.cast_numel].to(device=device, dtype=compute_dtype)
    tail = master[layout.cast_numel:].to(device=device)
    views = layout.bind(cast, tail)
    return {k: v.detach().requires_grad_() for k, v in views.items()} if leaf else views


def attention_timer(spec: ModelSpec, backend: str, batch: int, seq_len: int, window: int | None,
                    device: torch.device, compute_dtype: torch.dtype) -> tuple[float, Callable, Callable]:
    """(model FLOPs of one forward, forward, forward + backward) of the attention kernel alone on random q, k, v
    of the model's heads in the compute dtype (sinks of 0 where the model has them)."""
    a = spec.arch
    gen = torch.Generator(device="cpu").manual_seed(INIT_SEED)
    q, k, v = (torch.randn(batch, heads, seq_len, a.head_dim, generator=gen).to(device, compute_dtype)
               for heads in (a.heads, a.kv_heads, a.kv_heads))
    dout = torch.randn(batch, seq_len, a.heads * a.head_dim, generator=gen).to(device, compute_dtype)
    sinks = torch.zeros(a.heads, device=device) if getattr(a, "sinks", False) else None
    flops = 4 * a.heads * a.head_dim * mean_keys(seq_len, window) * batch * seq_len

    def forward() -> None:
        with torch.no_grad():
            causal_attention(q, k, v, backend, window, sinks)

    def backward() -> None:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(causal_attention(*leaves, backend, window, sinks), leaves, grad_outputs=dout)

    return flops, forward, backward


def measure_attention(model_cfg: DictConfig, args: argparse.Namespace, device: torch.device,
                      compute_dtype: torch.dtype, label: str = "") -> tuple[dict, dict]:
    """The attention kernel at the calibration's layer shape -> (seconds, forward and backward, that the layer
    figures subtract), and at one sequence of `--attn-seq-len` tokens -> the profile's attention figures
    (only for the main layer: `label` names another one, the `--moe-model` or a `--width-models` layer, which
    only needs the first)."""
    spec = ModelSpec(model_cfg)
    backend = resolve_attention(args.attention, device.type, spec.arch.head_dim, spec.sinks_or_window)
    on_device = device.type == "cuda"
    forward, backward = attention_timer(spec, backend, args.micro_batch, args.seq_len, spec.layer_windows[0], device,
                                        compute_dtype)[1:]
    shape = f"{label} layer shape" if label else "layer shape"
    in_layer = {"fwd": median_s(forward, args, on_device, f"attention fwd ({shape})"),
                "bwd": median_s(backward, args, on_device, f"attention bwd ({shape})")}
    if label:
        return in_layer, {}
    flops, forward, backward = attention_timer(spec, backend, 1, args.attn_seq_len, None, device, compute_dtype)
    figures = {"attn_fwd_tflops": flops / median_s(forward, args, on_device, "attention fwd") / 1e12,
               "attn_bwd_tflops": 3 * flops / median_s(backward, args, on_device, "attention bwd") / 1e12}
    log(f"attention {backend} at 1 x {args.attn_seq_len}: fwd {figures['attn_fwd_tflops']:.2f} TFLOP/s, "
        f"fwd + bwd {figures['attn_bwd_tflops']:.2f} TFLOP/s; at the layer's shape {in_layer['fwd'] * 1e3:.2f} + "
        f"{in_layer['bwd'] * 1e3:.2f} ms")
    if on_device:
        torch.cuda.empty_cache()
    main = {**figures, "attn_backend": backend, "attn_seq_len": args.attn_seq_len}
    if args.attn_point_list is not None:
        main["attn_points"] = [measure_attention_point(spec, point_backend, tokens, args, device, compute_dtype)
                               for point_backend, tokens in args.attn_point_list
                               if (point_backend, tokens) != (backend, args.attn_seq_len)]
    return in_layer, main


def measure_attention_point(spec: ModelSpec, backend: str, tokens: int, args: argparse.Namespace,
                            device: torch.device, compute_dtype: torch.dtype) -> dict:
    """One `--attn-points` entry: the attention figures of `backend` at one sequence of `tokens` tokens."""
    on_device = device.type == "cuda"
    flops, forward, backward = attention_timer(spec, backend, 1, tokens, None, device, compute_dtype)
    point = {"backend": backend, "seq_len": tokens,
             "fwd_tflops": flops / median_s_within(forward, args, on_device, f"attention fwd {backend} {tokens}")
             / 1e12,
             "bwd_tflops": 3 * flops / median_s_within(backward, args, on_device, f"attention bwd {backend} {tokens}")
             / 1e12}
    log(f"attention {backend} at 1 x {tokens}: fwd {point['fwd_tflops']:.2f} TFLOP/s, fwd + bwd "
        f"{point['bwd_tflops']:.2f} TFLOP/s")
    if on_device:
        torch.cuda.empty_cache()
    return point


def measure_mode(model_cfg: DictConfig, mode: str, args: argparse.Namespace, device: torch.device,
                 compute_dtype: torch.dtype, attention: dict, moe: bool = False, label: str = "") -> dict[str, float]:
    """The layer's figures without its attention (`attention`: its seconds at this shape) and the
    head's; `moe`: a `--moe-models` layer's, no head; `label`: names the layer in the log (a `--width-models` or
    `--moe-models` one)."""
    spec = ModelSpec(model_cfg)
    # the attention backend a run picks (train.attention), at the calibration's length: unchunked
    spec.set_layer_compute(LayerCompute(attention=resolve_attention(args.attention, device.type, spec.arch.head_dim,
                                                                    spec.sinks_or_window)))
    if mode == "compiled":
        log("compiled: each measurement's first call compiles what it runs (seconds each on an H200)")
        spec.compile_templates()
    on_device = device.type == "cuda"
    fused = args.fused_loss == "on" or (args.fused_loss == "auto" and on_device)
    if fused:
        spec.use_fused_loss()
    B, T, D = args.micro_batch, args.seq_len, spec.arch.hidden
    tokens = B * T
    flops = model_flops_per_token(model_cfg, T)
    layer_fwd_flops = flops["layer_forward_flops_per_token"] * tokens
    # as the planner counts the head: forward + backward, and the chunked chain's recompute of the logits
    head_flops = (3 if fused else 4) * flops["head_forward_flops_per_token"] * tokens

    gen = torch.Generator(device="cpu").manual_seed(INIT_SEED)
    x = torch.randn(B, T, D, generator=gen).to(device)  # the residual stream is fp32, as the fp32 embedding makes it
    dy = torch.randn(B, T, D, generator=gen).to(device)
    labels = torch.randint(0, spec.arch.vocab, (B, T), generator=gen).to(device)
    rope = spec.positions(T, device)
    layer_p = bind_unit(spec, spec.units[1], device, compute_dtype, leaf=True)
    head_p = {} if moe else bind_unit(spec, spec.units[-1], device, compute_dtype, leaf=True)
    head_names = list(head_p)
    tied_w = bind_unit(spec, spec.units[0], device, compute_dtype, leaf=True)[spec.tied_weight_name] \
        if spec.tied and not moe else None

    def forward() -> None:
        with torch.no_grad(), autocast_ctx(device, compute_dtype):
            spec.layer(layer_p, x, rope, 0)

    # the engine's accumulator: the fused kernel on CUDA, torch copies and adds on the CPU
    grad_acc = GradAccumulator(Device(device), spec.units[1].layout, fused=on_device)

    def backward() -> None:
        x_in = x.detach().requires_grad_()
        with autocast_ctx(device, compute_dtype):
            grad_acc.add(spec.layer_grads(layer_p, x_in, dy, rope, 0)[1])

    def head() -> None:
        x_in = x.detach().requires_grad_()
        with autocast_ctx(device, compute_dtype):
            loss = spec.loss_sum(head_p, x_in, labels, tied_w)
        torch.autograd.grad(loss, [x_in] + [head_p[n] for n in head_names] + ([tied_w] if spec.tied else []))

    out = {}
    # the layer's FLOPs but attention's: its matmuls (the count's attention share is a mean over the model's layers,
    # sliding-window ones included, where this layer's attention, timed alone, is its own)
    other_flops = layer_fwd_flops - flops["layer_attention_forward_flops_per_token"] * tokens
    bwd_flops = 3 * other_flops - spec.recompute_skipped_flops_per_token(chunked_mlp=False) * tokens
    measured = [("fwd", forward, other_flops, attention["fwd"]), ("bwd", backward, bwd_flops, attention["bwd"])]
    if not moe:
        measured.append(("head", head, head_flops, 0.0))
    for name, fn, n_flops, attn_s in measured:
        what = f"{label + ' ' if label else ''}{mode} {name}"
        seconds = median_s(fn, args, on_device, what)
        if seconds <= attn_s:
            raise RuntimeError(f"{what}: the layer took {seconds * 1e3:.3f} ms, its attention alone "
                               f"{attn_s * 1e3:.3f} ms; no time is left for the rest of the layer (a timing this "
                               "noisy cannot calibrate: raise --repeats or the layer's tokens)")
        key = f"{name}_tflops_{mode}"
        out[key] = n_flops / (seconds - attn_s) / 1e12
        log(f"{(label + ' ' if label else '') + mode:12} {name:4} {seconds * 1e3:9.2f} ms  {out[key]:8.2f} TFLOP/s "
            f"({n_flops / 1e12:.3f} TFLOP{', attention excluded' if attn_s else ''})")
    return out


def measure_width(name: str, model_cfg: DictConfig, args: argparse.Namespace, device: torch.device,
                  compute_dtype: torch.dtype) -> dict:
    """A `--width-models` layer and head in every mode -> one entry of the profile's `layer_widths`."""
    log(f"{name} layer and head (another width: hidden {model_cfg.hidden_size}) at the same tokens")
    attention = measure_attention(model_cfg, args, device, compute_dtype, label=name)[0]
    entry = {"model": name, "hidden": int(model_cfg.hidden_size)}
    for mode in args.mode_list:
        entry.update(measure_mode(model_cfg, mode, args, device, compute_dtype, attention, label=name))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return entry


def measure_moe_layers(args: argparse.Namespace, device: torch.device, compute_dtype: torch.dtype,
                       measured: str) -> list[dict]:
    """Each `--moe-models` layer at each `--moe-micro-batches` size in every mode -> the profile's `moe_layers`: the
    base profile's entries of other models or token counts, then these (`measured`: when and where). An entry
    measured again keeps the base entry's figures of the modes not measured now."""
    base = {(e["model"], e["tokens"]): e for e in args.base_profile.get("moe_layers") or []}
    entries = []
    for name, cfg in args.moe_cfgs.items():
        for micro_batch in args.moe_micro_batch_list:
            at = argparse.Namespace(**{**vars(args), "micro_batch": micro_batch})
            tokens = micro_batch * args.seq_len
            log(f"{name} layer (MoE: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}) at {micro_batch} x "
                f"{args.seq_len} tokens")
            label = f"{name} {tokens}"
            attention = measure_attention(cfg, at, device, compute_dtype, label=label)[0]
            entry = {**base.get((name, tokens), {}),
                     "model": name, "hidden": int(cfg.hidden_size), "experts": int(cfg.num_experts),
                     "experts_per_token": int(cfg.num_experts_per_tok),
                     "expert_width": int(cfg.moe_intermediate_size), "tokens": tokens}
            for mode in args.mode_list:
                entry.update(measure_mode(cfg, mode, at, device, compute_dtype, attention, moe=True, label=label))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            entries.append({**entry, "measured": measured})
    again = {(e["model"], e["tokens"]) for e in entries}
    return [e for key, e in base.items() if key not in again] + entries


# ---------------------------------------------------------------------------------------------------------------------
# 2. PCIe


@contextlib.contextmanager
def pinned(nbytes: int) -> Iterator[torch.Tensor]:
    """A page-locked host buffer: plain memory, touched, then registered with the driver (no power-of-two rounding,
    unlike pin_memory=True); unregistered on exit, once the device has drained."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    pin_host(buf, hint=", try a smaller --copy-gib")
    try:
        yield buf
    finally:
        torch.cuda.synchronize()
        err = unpin_host(buf)
        if err != 0:
            raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")


class CopyBuffers:
    """One buffer pair per direction: host_in -> dev_in (H2D), dev_out -> host_out (D2H)."""

    def __init__(self, host_in: torch.Tensor, host_out: torch.Tensor, device: torch.device):
        self.host_in, self.host_out = host_in, host_out
        self.dev_in = torch.empty_like(host_in, device=device)
        self.dev_out = torch.zeros_like(host_out, device=device)
        self.nbytes = host_in.numel()

    def h2d(self) -> None:
        self.dev_in.copy_(self.host_in, non_blocking=True)

    def d2h(self) -> None:
        self.host_out.copy_(self.dev_out, non_blocking=True)


def measure_pcie(bufs: CopyBuffers, args: argparse.Namespace) -> dict[str, float]:
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        here = torch.cuda.current_stream()
        for stream, copy in ((h2d_stream, bufs.h2d), (d2h_stream, bufs.d2h)):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                copy()
        here.wait_stream(h2d_stream)
        here.wait_stream(d2h_stream)

    out = {}
    for name, fn, nbytes in (("h2d_gbps", bufs.h2d, bufs.nbytes), ("d2h_gbps", bufs.d2h, bufs.nbytes),
                             ("bidir_gbps", both, 2 * bufs.nbytes)):
        seconds = median_s(fn, args, True, name)
        out[name] = nbytes / seconds / 1e9
        log(f"pcie {name[:-5]:5} {seconds * 1e3:9.2f} ms  {out[name]:8.2f} GB/s ({nbytes / GIB:.2f} GiB)")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# 3. Host AdamW, alone and under PCIe load


class HostAdam:
    """One flat fp32 parameter with its gradient, and a fused AdamW over it whose moments are pre-seeded (as
    FlatAdamW seeds its views), so a step allocates nothing and only the update itself is timed."""

    def __init__(self, numel: int):
        gen = torch.Generator(device="cpu").manual_seed(INIT_SEED)
        self.numel = numel
        self.param = torch.nn.Parameter(torch.empty(numel).normal_(0.0, 0.02, generator=gen), requires_grad=False)
        self.param.grad = torch.empty(numel).normal_(0.0, 1e-3, generator=gen)
        self.opt = make_adamw([self.param], [], TrainConfig())
        self.opt.state[self.param] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}

    def gparams_per_s(self, args: argparse.Namespace, what: str) -> float:
        seconds = median_s(self.opt.step, args, False, what)
        rate = self.numel / seconds / 1e9
        log(f"{what:28} {seconds * 1e3:9.2f} ms  {rate:8.3f} Gparams/s ({self.numel / 1e9:.3f} G elements)")
        return rate


def keep_pcie_busy(bufs: CopyBuffers, stop: threading.Event) -> float:
    """Until `stop` is set, keep both PCIe directions busy: rounds of one H2D and one D2H copy on two streams of
    this thread's own, two rounds queued so the link never waits for the thread, which polls (sleeping, so that it
    takes no core from the optimizer) rather than blocking in the driver. Returns the GB/s it moved, both
    directions together."""
    device = bufs.dev_in.device
    h2d_stream, d2h_stream = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
    queued: deque = deque()
    rounds = 0
    t0 = time.perf_counter()
    while not stop.is_set():
        events = []
        for stream, copy in ((h2d_stream, bufs.h2d), (d2h_stream, bufs.d2h)):
            with torch.cuda.stream(stream):
                copy()
                events.append(torch.cuda.Event())
                events[-1].record(stream)
        queued.append(events)
        if len(queued) > 1:
            oldest = queued.popleft()
            while not all(ev.query() for ev in oldest):
                time.sleep(PCIE_POLL_S)
            rounds += 1
    for events in queued:
        for ev in events:
            ev.synchronize()
        rounds += 1
    return 2 * bufs.nbytes * rounds / (time.perf_counter() - t0) / 1e9


def adam_under_pcie(adam: HostAdam, bufs: CopyBuffers, args: argparse.Namespace) -> tuple[float, float]:
    """The host AdamW rate while a thread keeps the link busy, and the GB/s that thread moved meanwhile."""
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pcie-load") as pool:
        load = pool.submit(keep_pcie_busy, bufs, stop)
        try:
            rate = adam.gparams_per_s(args, "host adamw under pcie")
        finally:
            stop.set()
        return rate, load.result()  # re-raises what failed in the thread


# ---------------------------------------------------------------------------------------------------------------------
# Output


def _shown(path: Path) -> str:
    """A path as the profile's header names it: relative to the checkout when inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(CHECKOUT)) if resolved.is_relative_to(CHECKOUT) else str(path)


def _rounded(value: float) -> float:
    return float(f"{value:.4g}")


def write_profile(args: argparse.Namespace, figures: dict, not_measured: list[str], calibration: str | None,
                  what: str = "") -> None:
    """The base profile with `figures` replaced or added (figures of `not_measured` are 0), one field per line;
    `calibration` None keeps the base's line (a `--moe-only` call: `what` names what it measured)."""
    profile = dict(args.base_profile)
    profile.update({k: _rounded(v) if isinstance(v, float) else v for k, v in figures.items()})
    for key in ("layer_widths", "attn_points", "moe_layers"):
        if key in figures:
            profile[key] = [{k: _rounded(v) if isinstance(v, float) else v for k, v in entry.items()}
                            for entry in figures[key]]
    if calibration is not None:
        profile["calibration"] = calibration
        what = f"({calibration}).\n# Measured here: {', '.join(k for k in figures if k not in not_measured)}"
    header = [f"# Written by engine/calibrate.py {what}; every other field is copied from {_shown(args.base)}."]
    if not_measured:
        header.append(f"# No CUDA device: {', '.join(not_measured)} were not measured and are written as 0.")
    body = yaml.safe_dump(profile, sort_keys=False, width=2**16)  # the calibration line stays one line
    atomic_write(args.out, lambda f: f.write(("\n".join(header) + "\n" + body).encode()))


def measure_compute(model_cfg: DictConfig, args: argparse.Namespace, device: torch.device,
                    compute_dtype: torch.dtype) -> dict:
    """Part 1 but the MoE layers: attention, the layer and head in every mode, the other widths, and the host
    memory of the process after them."""
    attention, figures = measure_attention(model_cfg, args, device, compute_dtype)
    for mode in args.mode_list:
        figures.update(measure_mode(model_cfg, mode, args, device, compute_dtype, attention))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    figures["layer_model"], figures["layer_hidden"] = args.model, int(model_cfg.hidden_size)
    figures["layer_widths"] = [measure_width(name, cfg, args, device, compute_dtype)
                               for name, cfg in args.width_cfgs.items()]
    if args.attn_point_list is None and args.base_profile.get("attn_points"):
        log(f"the base profile's {len(args.base_profile['attn_points'])} attention points are kept (--attn-points "
            "measures new ones)")
    dropped = args.base_profile.get("layer_widths") or []
    if dropped and not args.width_cfgs:
        log(f"the base profile's {len(dropped)} other layer widths are left out: they were measured beside another "
            "calibration's main layer (--width-models measures them again)")
    # what a training process holds on the host before any state: torch, the CUDA context, compiled kernels (the
    # layer's host-side master copies are freed by now) and torch.compile's worker processes, which stay alive
    # beside it; the planner adds it to every plan's host memory
    workers_gib = child_processes_rss_gib()
    figures["host_process_gib"] = host_rss_gib() + workers_gib
    figures["host_compile_workers_gib"] = workers_gib
    log(f"process host memory after the compute measurements: {figures['host_process_gib']:.2f} GiB "
        f"({workers_gib:.2f} of it in child processes: torch.compile's workers)")
    return figures


def measure_host_and_link(args: argparse.Namespace, device: torch.device) -> tuple[dict, list[str]]:
    """Parts 2 and 3 -> (figures, the ones not measured: without CUDA, the link's, written as 0)."""
    figures: dict = {}
    not_measured: list[str] = []
    adam = HostAdam(args.adam_numel)
    if device.type == "cuda":
        with pinned(args.copy_bytes) as host_in, pinned(args.copy_bytes) as host_out:
            bufs = CopyBuffers(host_in, host_out, device)
            figures.update(measure_pcie(bufs, args))
            figures["cpu_adam_gparams_per_s"] = adam.gparams_per_s(args, "host adamw")
            figures["cpu_adam_gparams_per_s_under_pcie"], figures["bidir_gbps_under_adam"] = \
                adam_under_pcie(adam, bufs, args)
            del bufs
        log(f"  the PCIe load moved {figures['bidir_gbps_under_adam']:.2f} GB/s (both directions) during that AdamW")
    else:
        figures["cpu_adam_gparams_per_s"] = adam.gparams_per_s(args, "host adamw")
        not_measured = [*PCIE_FIGURES, "cpu_adam_gparams_per_s_under_pcie", "bidir_gbps_under_adam"]
        figures.update({k: 0.0 for k in not_measured})
        log(f"no CUDA device: {', '.join(not_measured)} not measured, written as 0")
    return figures, not_measured


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    model_cfg = check_args(parser, args)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the trainer runs (engine/cli.py)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    compute_dtype = resolve_compute_dtype("auto", device)
    env = run_environment()
    what = (f"{', '.join(args.moe_cfgs)} MoE layers only" if args.moe_only else
            f"{args.model} layer at {args.micro_batch} x {args.seq_len} tokens")
    log(f"{torch.cuda.get_device_name() if cuda else 'cpu'}: {what} in {str(compute_dtype).removeprefix('torch.')}, "
        f"modes {', '.join(args.mode_list)}, attention {args.attention}; median of {args.repeats} after "
        f"{args.warmup} warm-up")
    figures: dict = {} if args.moe_only else measure_compute(model_cfg, args, device, compute_dtype)
    stamp = f"{env['date']} git {env['git_sha']} torch {env['torch']} triton {env['triton']} gpu {env['gpu']}"
    if args.moe_cfgs:
        figures["moe_layers"] = measure_moe_layers(args, device, compute_dtype, stamp)
    not_measured: list[str] = []
    if not args.moe_only:
        link, not_measured = measure_host_and_link(args, device)
        figures.update(link)

    calibration = None if args.moe_only else (
        f"{env['date']} git {env['git_sha']} model {args.model} {args.micro_batch}x{args.seq_len} "
        f"torch {env['torch']} triton {env['triton']} gpu {env['gpu']} modes {','.join(args.mode_list)} "
        f"fused_loss {args.fused_loss} attention {args.attention}"
        + (f" moe_models {','.join(args.moe_cfgs)}" if args.moe_cfgs else "")
        + (f" width_models {','.join(args.width_cfgs)}" if args.width_cfgs else ""))
    if calibration is not None and set(args.mode_list) != set(MODES):
        calibration += f" (other modes' figures from {args.base.name})"
    tokens = ",".join(str(b * args.seq_len) for b in args.moe_micro_batch_list)
    moe_only = (f"--moe-only ({stamp}).\n# Measured here: the moe_layers entries of {', '.join(args.moe_cfgs)} at "
                f"{tokens} tokens, modes {','.join(args.mode_list)}")
    write_profile(args, figures, not_measured, calibration, what=moe_only if calibration is None else "")
    log(f"wrote {args.out}")
    if args.jsonl is not None:
        row = {"bench": "calibrate", **figures, "calibration": calibration or f"moe_only {stamp}", **env,
               "args": arguments}
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        log(f"appended a row to {args.jsonl}")
    return figures


if __name__ == "__main__":
    main()
