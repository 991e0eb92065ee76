"""Benchmark streamtrain_kernels/adamw_update.py, every state format, at the decoder-layer sizes of qwen7b/32b/72b.

    python -m bench.bench_adamw_update --out bench/results/adamw_update.jsonl
    python -m bench.bench_adamw_update --out bench/results/adamw_update_sweep.jsonl --sweep   # other TILE / warps
    python -m bench.bench_adamw_update --cpu --numel 20000 --out /tmp/adamw.jsonl   # logic check, interpreter
    python -m bench.bench_adamw_update --grad int8 --out bench/results/adamw_update_int8_grad.jsonl

Layer sizes come from the project config (`kernel_bench.layer_layout`: qwen7b 233 M, qwen32b 488 M, qwen72b 878 M
parameters per decoder layer); `--numel N` replaces them with one synthetic unit of N elements. One call = one
AdamW step over a whole layer's flat state with `weights_out` (the bf16 compute weights), fp32 gradient (`--grad
int8`: streamtrain_kernels/grad_quant.py's int8 codes, one scale per BLOCK_SIZE elements), weight decay on the
matrices (`layout_segments`). Bandwidth = bytes read + written per second (`bytes_per_param` of the format times
the layer's elements, plus the int8 scales); `copy_gbps` is a device-to-device `copy_` moving the same
number of bytes (read + write), timed in the same run, and `frac_of_copy` the kernel's share of it (the
target: >= 0.85 in every format). `match` says the kernel's state equals the torch reference's bit for bit on the
first 2**20 elements after one step. Times: medians of triton.testing.do_bench (GPU) or of a few calls (--cpu).
Rows carry the GPU name, torch / triton versions, git sha (STREAMTRAIN_GIT_SHA wins) and date of
`engine.metrics.run_environment`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.kernel_bench import MODELS, ROOT, layer_layout, require_gpu, write_rows

FORMATS = [("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")]
SWEEP = [(256, 1), (256, 2), (512, 2), (1024, 4), (1024, 8), (2048, 8), (4096, 8)]
BLOCK_SIZE = 256  # int8 moments: elements per scale
BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
CHECK_NUMEL = 2**20


def bytes_per_param(master: str, moments: str, grad_bytes: int = 4) -> int:
    """Read master, m, v, grad; write master, m, v and the bf16 weights."""
    return 2 * BYTES[master] + 4 * BYTES[moments] + grad_bytes + 2


def update_bytes(numel: int, master: str, moments: str, grad: str = "fp32") -> int:
    """Bytes one update of `numel` elements reads and writes (`bytes_per_param`, plus int8's per-block scales)."""
    nbytes = numel * bytes_per_param(master, moments, BYTES[grad])
    if moments == "int8":
        nbytes += 2 * 2 * 4 * -(-numel // BLOCK_SIZE)  # m and v scales, read and written
    if grad == "int8":
        nbytes += 4 * -(-numel // BLOCK_SIZE)  # grad scales, read
    return nbytes


def timer(device: str):
    if device == "cuda":
        import triton
        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def cpu_ms(fn, reps=3):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return cpu_ms


def copy_time_ms(torch, nbytes: int, device: str, time_ms) -> float:
    """Time of a device-to-device copy_ moving `nbytes` (nbytes / 2 read, nbytes / 2 written)."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


def make_state(torch, numel: int, master: str, moments: str, device: str, grad: str = "fp32") -> dict:
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    st = {"master": (torch.randn(numel, device=device) * 0.02).to(dt[master]),
          "grad": torch.randn(numel, device=device) * 1e-3,
          "weights_out": torch.empty(numel, device=device, dtype=torch.bfloat16)}
    if moments == "int8":
        n_blocks = -(-numel // BLOCK_SIZE)
        st.update(m=torch.zeros(numel, device=device, dtype=torch.int8),
                  v=torch.zeros(numel, device=device, dtype=torch.uint8),
                  m_scales=torch.zeros(n_blocks, device=device), v_scales=torch.zeros(n_blocks, device=device),
                  block_size=BLOCK_SIZE)
    else:
        st.update(m=torch.zeros(numel, device=device, dtype=dt[moments]),
                  v=torch.zeros(numel, device=device, dtype=dt[moments]))
    if grad == "int8":
        from streamtrain_kernels.grad_quant import quantize_grad_int8
        codes = torch.empty(numel, device=device, dtype=torch.int8)
        scales = torch.empty(-(-numel // BLOCK_SIZE), device=device)
        quantize_grad_int8(st["grad"], codes, scales, seed=2, block_size=BLOCK_SIZE)
        st.update(grad=codes, grad_scales=scales, grad_block_size=BLOCK_SIZE)
    return st


def step_fn(fn, st: dict, segments, lr, clip, step: int = 1):
    def call():
        fn(st["master"], st["m"], st["v"], st["grad"], lr=lr, clip=clip, step=step, beta1=0.9, beta2=0.95,
           eps=1e-8, segments=segments, weights_out=st["weights_out"], m_scales=st.get("m_scales"),
           v_scales=st.get("v_scales"), block_size=st.get("block_size"), seed=1,
           grad_scales=st.get("grad_scales"), grad_block_size=st.get("grad_block_size"))
    return call


def matches_reference(torch, st_kernel: dict, st_before: dict, segments, lr, clip) -> bool:
    """One step of kernel and reference on the first CHECK_NUMEL elements (a prefix of whole int8 blocks)."""
    import streamtrain_kernels.adamw_update as A
    from streamtrain_kernels.reference import adamw_update_reference

    n = min(CHECK_NUMEL, st_before["master"].numel())
    n_blocks = -(-n // BLOCK_SIZE)

    def prefix(st):
        out = {k: (t[:n_blocks] if k.endswith("scales") else t[:n]).clone() if isinstance(t, torch.Tensor) else t
               for k, t in st.items()}
        return out
    segs, start = [], 0
    for s, c, wd in segments:
        c = min(s + c, n) - s
        if c > 0:
            segs.append((s, c, wd))
            start = s + c
    assert start == n
    a = prefix(st_before)
    b = {k: (t.cpu() if isinstance(t, torch.Tensor) else t) for k, t in prefix(st_before).items()}
    step_fn(A.adamw_update, a, segs, lr, clip)()
    step_fn(adamw_update_reference, b, segs, lr.cpu(), clip.cpu())()
    return all(torch.equal(a[k].cpu().view(torch.uint8), b[k].view(torch.uint8))
               for k in a if isinstance(a[k], torch.Tensor))


def bench_unit(torch, name: str, numel: int, segments, device: str, info: dict, configs, grad: str) -> list:
    import streamtrain_kernels.adamw_update as A

    time_ms = timer(device)
    lr = torch.tensor(1e-4, device=device)
    clip = torch.tensor(0.5, device=device)
    rows = []
    for master, moments in FORMATS:
        st = make_state(torch, numel, master, moments, device, grad)
        nbytes = update_bytes(numel, master, moments, grad)
        copy_ms = copy_time_ms(torch, nbytes, device, time_ms)
        copy_rate = nbytes / (copy_ms * 1e-3) / 1e9
        if device == "cpu":
            before = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in st.items()}
        else:  # the check runs on a prefix: keep only that much of the initial state
            before = {k: (t[:CHECK_NUMEL + BLOCK_SIZE].clone() if isinstance(t, torch.Tensor) else t)
                      for k, t in st.items()}
        block = BLOCK_SIZE if moments == "int8" else None
        for tile, num_warps in configs:
            A.SWEEP_OVERRIDE = None if tile is None else (tile, num_warps)
            shipped = tile is None
            launch = A.launch_config(torch.device(device), block)
            if shipped:  # the per-format choice of launch_config: record what it is
                tile, num_warps = launch.rows * launch.groups * 8, launch.num_warps
            match = matches_reference(torch, st, before, segments, lr, clip)
            kernel_ms = time_ms(step_fn(A.adamw_update, st, segments, lr, clip))
            gbps = nbytes / (kernel_ms * 1e-3) / 1e9
            rows.append({"bench": "adamw_update", "model": name, "case": f"master {master}, moments {moments}",
                         "master_dtype": master, "moments_dtype": moments, "grad_dtype": grad,
                         "weights_out": True, "block_size": BLOCK_SIZE if moments == "int8" else None,
                         "numel": numel, "bytes": nbytes,
                         "bytes_per_param": bytes_per_param(master, moments, BYTES[grad]),
                         "kernel_ms": round(kernel_ms, 5), "kernel_gbps": round(gbps, 1),
                         "copy_ms": round(copy_ms, 5), "copy_gbps": round(copy_rate, 1),
                         "frac_of_copy": round(gbps / copy_rate, 3), "tile": tile, "num_warps": num_warps,
                         "maxnreg": launch.maxnreg,
                         "shipped_launch": shipped,
                         "match": match, **info})
            print(json.dumps(rows[-1]), flush=True)
        del st, before
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_table(rows) -> None:
    cols = ["model", "case", "numel", "kernel_ms", "kernel_gbps", "copy_gbps", "frac_of_copy", "tile", "num_warps",
            "match"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/adamw_update.jsonl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--numel", type=int, default=None, help="one synthetic unit of this many elements instead")
    ap.add_argument("--sweep", action="store_true", help="also time other TILE / num_warps configurations")
    ap.add_argument("--configs", help="time these TILE x num_warps configurations instead, e.g. 256x2,512x4")
    ap.add_argument("--grad", choices=("fp32", "int8"), default="fp32", help="the gradient's format")
    ap.add_argument("--cpu", action="store_true", help="run the logic on CPU under the Triton interpreter "
                                                       "(tiny --numel; times mean nothing)")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        import torch
        device = "cpu"
    else:
        torch, _ = require_gpu("bench_adamw_update")
        device = "cuda"
    import streamtrain_kernels.adamw_update as A
    from engine.metrics import run_environment

    configs = [(None, None)] + (SWEEP if args.sweep else [])  # (None, None): the shipped launch configuration
    if args.configs:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    if args.numel is not None:
        units = [(f"numel={args.numel}", args.numel, [(0, args.numel * 3 // 4, 0.1),
                                                      (args.numel * 3 // 4, args.numel - args.numel * 3 // 4, 0.0)])]
    else:
        units = []
        for model in args.models.split(","):
            layout = layer_layout(model)
            units.append((model, layout.numel, A.layout_segments(layout, 0.1)))
    info = run_environment()
    rows = []
    try:
        for name, numel, segments in units:
            rows += bench_unit(torch, name, numel, segments, device, info, configs, args.grad)
    finally:
        A.SWEEP_OVERRIDE = None
        write_rows(args.out, rows)
    if rows:
        print_table(rows)


if __name__ == "__main__":
    main()
