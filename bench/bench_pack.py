"""Benchmark engine/kernels/pack.py against the best plain-torch way, at the decoder-layer sizes of qwen7b/32b/72b.

    python bench/bench_pack.py --out bench/results/pack.jsonl
    python bench/bench_pack.py --out bench/results/pack_sweep.jsonl --sweep     # also try other BLOCK / num_warps

Needs a CUDA GPU with TRITON_INTERPRET unset (or 0); on any other machine it exits with a message. Times are
medians of triton.testing.do_bench. Bandwidth = (bytes read + bytes written) / time; `copy_gbps` is a large
fp32 device-to-device `copy_` timed in the same run (read + write), `frac_of_copy` the kernel's share of it.
The torch baseline is the fastest of a few plain-torch ways (`torch_impl` names it): `_foreach_copy_` into the
layout's views, a per-tensor `copy_` loop, or one `torch.cat` of flattened casts, each followed by
`_foreach_norm` when the case wants norms. Shapes come from the project config (`make_cfg(["model=..."])`), so
this needs hydra-core and omegaconf (see bench/README.md for bringing them to a machine without a registry).

Cases: bf16 -> bf16 with norms (gradients in the compute dtype), fp32 -> bf16 (stream_dtype=fp32: the fp32
master streamed in, the compute copy written out), fp32 -> fp32 with norms (fp32 gradients).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.metrics import run_environment  # noqa: E402

MODELS = ("qwen7b", "qwen32b", "qwen72b")
SWEEP = [(4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8), (16384, 16)]


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


def bench_model(torch, model: str, copy_rate: float, info: dict, configs) -> list:
    import engine.kernels.pack as P

    layout = layer_layout(model)
    rows = []
    cases = [("bf16->bf16+norms", torch.bfloat16, torch.bfloat16, True),  # (case, source, out, with norms)
             ("fp32->bf16", torch.float32, torch.bfloat16, False),
             ("fp32->fp32+norms", torch.float32, torch.float32, True)]
    for case, src_dtype, out_dtype, norms in cases:
        tensors = [torch.randn(s.shape, device="cuda", dtype=src_dtype) for s in layout.specs]
        out = torch.zeros(layout.numel, device="cuda", dtype=out_dtype)
        views = [layout.views(out)[s.name].view(-1) for s in layout.specs]
        flat_src = [t.view(-1) for t in tensors]
        numel = layout.param_numel
        nbytes = numel * (torch.tensor([], dtype=src_dtype).element_size() + out.element_size())

        def foreach():
            torch._foreach_copy_(views, flat_src)
            if norms:
                torch._foreach_norm(flat_src)

        def loop():
            for v, t in zip(views, flat_src):
                v.copy_(t)
            if norms:
                torch._foreach_norm(flat_src)

        def cat():
            torch.cat([t.to(out_dtype) for t in flat_src])
            if norms:
                torch._foreach_norm(flat_src)

        torch_name, torch_ms = best_torch({"foreach_copy_": foreach, "copy_loop": loop, "cat": cat})
        for block, num_warps in configs:
            P.BLOCK_GPU, P.NUM_WARPS_GPU = block, num_warps
            out.zero_()
            got = P.pack(tensors, layout.offsets, out, compute_sq_norms=norms)
            match = all(torch.equal(v, t.to(out_dtype)) for v, t in zip(views, flat_src))
            if norms:
                want = torch.stack([t.double().square().sum() for t in flat_src])
                match = match and bool(torch.allclose(got.double(), want, rtol=1e-5, atol=0))
            kernel_ms = time_ms(lambda: P.pack(tensors, layout.offsets, out, compute_sq_norms=norms))
            rows.append(row("pack", model, case, numel, nbytes, kernel_ms, torch_name, torch_ms, copy_rate, info,
                            block=block, num_warps=num_warps, match=match))
            print(json.dumps(rows[-1]), flush=True)
        tensors = out = views = flat_src = None  # free before the next case allocates
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/pack.jsonl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sweep", action="store_true", help="also time other BLOCK / num_warps configurations")
    args = ap.parse_args()
    torch, _ = require_gpu("bench_pack")
    import engine.kernels.pack as P

    configs = SWEEP if args.sweep else [(P.BLOCK_GPU, P.NUM_WARPS_GPU)]
    default = (P.BLOCK_GPU, P.NUM_WARPS_GPU)
    info = run_environment()
    rate = copy_gbps()
    print(f"device-to-device copy: {rate:.0f} GB/s", flush=True)
    rows = []
    try:
        for model in args.models.split(","):
            rows += bench_model(torch, model, rate, info, configs)
    finally:
        P.BLOCK_GPU, P.NUM_WARPS_GPU = default
        write_rows(args.out, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
