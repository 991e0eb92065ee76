"""Shared helpers of the kernel benchmarks (bench_grad_accum.py, bench_adamw_update.py).

Conventions: a kernel is timed at the decoder-layer sizes of `MODELS`, whose shapes come from the project config
(`layer_layout`, so this needs hydra-core and omegaconf; see bench/README.md for bringing them to a machine without
a registry). Times are medians of triton.testing.do_bench (`time_ms`). Bandwidth = (bytes read + bytes written) /
time; `copy_gbps` is a large fp32 device-to-device `copy_` timed in the same run (read + write), `frac_of_copy` the
kernel's share of it. The torch baseline is the fastest of a few plain-torch ways (`best_torch`; `torch_impl` names
it). Each result is one JSON row (`row`) with the environment of `engine.metrics.run_environment`, appended to the
`--out` JSONL file (`write_rows`) and printed as a table (`print_table`). On a machine without a CUDA GPU, or under
TRITON_INTERPRET=1, `require_gpu` exits with a message instead of timing the interpreter.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODELS = ("qwen7b", "qwen32b", "qwen72b")


def require_gpu(name: str):
    """Exit with a clear message unless kernels can be timed here; returns (torch, triton)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit(f"{name}: TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}: the interpreter cannot be timed; "
                 "run on a CUDA GPU with TRITON_INTERPRET unset")
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"{name}: needs a CUDA GPU (torch {torch.__version__} sees none); nothing measured")
    import triton
    return torch, triton


def layer_layout(model: str):
    try:
        from engine.model import ModelSpec
        from tests.util import make_cfg
    except ImportError as e:
        sys.exit(f"layer shapes come from the project config, which needs hydra-core + omegaconf ({e}); "
                 "see bench/README.md")
    return ModelSpec(make_cfg([f"model={model}"]).model).layer_units[0].layout


def time_ms(fn) -> float:
    import triton
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def event_median_ms(step, reps: int) -> float:
    """Median of `reps` timings of a zero-argument step between CUDA events, for steps too long for do_bench."""
    import torch
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps() -> float:
    """Device-to-device copy rate (read + write) of a 1 GiB fp32 tensor."""
    import torch
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def best_torch(impls: dict) -> tuple:
    """(name, ms) of the fastest of several zero-argument torch implementations."""
    timed = {name: time_ms(fn) for name, fn in impls.items()}
    name = min(timed, key=timed.get)
    return name, timed[name]


def row(bench: str, model: str, case: str, numel: int, nbytes: int, kernel_ms: float, torch_name: str,
        torch_ms: float, copy_rate: float, info: dict, **extra) -> dict:
    kernel_gbps = nbytes / (kernel_ms * 1e-3) / 1e9
    torch_gbps = nbytes / (torch_ms * 1e-3) / 1e9
    return {"bench": bench, "model": model, "case": case, "numel": numel, "bytes": nbytes,
            "kernel_ms": round(kernel_ms, 5), "torch_ms": round(torch_ms, 5), "torch_impl": torch_name,
            "kernel_gbps": round(kernel_gbps, 1), "torch_gbps": round(torch_gbps, 1), "copy_gbps": round(copy_rate, 1),
            "frac_of_copy": round(kernel_gbps / copy_rate, 3), "speedup": round(torch_ms / kernel_ms, 3),
            **extra, **info}


def print_table(rows) -> None:
    cols = ["model", "case", "numel", "kernel_ms", "torch_ms", "torch_impl", "kernel_gbps", "frac_of_copy", "speedup"]
    extra = [c for c in ("block", "num_warps") if any(c in r for r in rows)]
    cols += extra
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def write_rows(out: Path, rows) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
