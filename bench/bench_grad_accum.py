"""Benchmark streamtrain_kernels/grad_accum.py against the best plain-torch way, at the decoder-layer sizes of
qwen7b/32b/72b.

    python -m bench.bench_grad_accum --out bench/results/grad_accum.jsonl
    python -m bench.bench_grad_accum --out bench/results/grad_accum_sweep.jsonl --sweep

Conventions of bench/kernel_bench.py (medians of do_bench, bandwidth = bytes read + written per second, the copy
rate measured in the same run, `torch_impl` naming the fastest torch way); `--sweep` also times the other BLOCK /
num_warps launch configurations of streamtrain_kernels/tiles.py in `SWEEP`. Cases, per layer:
- bf16 grads, first micro-batch (`first=True`: flat = g): 6 B/element; torch `_foreach_copy_` on the views;
- bf16 grads, later micro-batch (flat += g): 10 B/element; torch `_foreach_add_`;
- bf16 grads, last micro-batch with norms of the result: 10 B/element; torch `_foreach_add_` + `_foreach_norm`;
- fp32 grads, later micro-batch: 12 B/element; torch `_foreach_add_`;
- fp32 -> bf16 stochastic rounding of the whole flat layer: 6 B/element; torch: the same integer trick with
  `torch.randint` bits (fewer guarantees: no NaN handling, a stateful generator).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.kernel_bench import (MODELS, ROOT, best_torch, copy_gbps, layer_layout, print_table, require_gpu,
                          row, time_ms, write_rows)
from engine.metrics import run_environment

SWEEP = [(4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8), (16384, 16)]  # (BLOCK, num_warps)


def bench_model(torch, model: str, copy_rate: float, info: dict, configs) -> list:
    import streamtrain_kernels.grad_accum as G
    import streamtrain_kernels.tiles as T

    layout = layer_layout(model)
    numel = layout.param_numel
    flat = torch.zeros(layout.numel, device="cuda")
    views = [layout.views(flat)[s.name].view(-1) for s in layout.specs]
    rows = []
    cases = [("bf16 first", torch.bfloat16, True, False), ("bf16 add", torch.bfloat16, False, False),
             ("bf16 add+norms", torch.bfloat16, False, True), ("fp32 add", torch.float32, False, False)]
    for case, g_dtype, first, norms in cases:
        grads = [torch.randn(s.numel, device="cuda", dtype=g_dtype) for s in layout.specs]
        sq = torch.zeros(len(grads), device="cuda") if norms else None
        g_size = grads[0].element_size()
        nbytes = numel * (g_size + 4 + (0 if first else 4))
        if first:
            impls = {"foreach_copy_": lambda: torch._foreach_copy_(views, grads),
                     "copy_loop": lambda: [v.copy_(g) for v, g in zip(views, grads)]}
        else:
            def foreach_add():
                torch._foreach_add_(views, grads)
                if norms:
                    torch._foreach_norm(views)

            def add_loop():
                for v, g in zip(views, grads):
                    v.add_(g)
                if norms:
                    torch._foreach_norm(views)
            impls = {"foreach_add_": foreach_add, "add_loop": add_loop}
        torch_name, torch_ms = best_torch(impls)
        for block, num_warps in configs:
            T.BLOCK_GPU, T.NUM_WARPS_GPU = block, num_warps
            base = [torch.randn_like(v) for v in views]
            torch._foreach_copy_(views, base)
            G.accumulate(flat, grads, layout.offsets, first=first, sq_norms_out=sq)
            want = [g.float() if first else b + g.float() for b, g in zip(base, grads)]
            match = all(torch.equal(v, w) for v, w in zip(views, want))
            if norms:
                ref = torch.stack([w.double().square().sum() for w in want])
                match = match and bool(torch.allclose(sq.double(), ref, rtol=1e-5, atol=0))
            del base, want
            kernel_ms = time_ms(lambda: G.accumulate(flat, grads, layout.offsets, first=first, sq_norms_out=sq))
            rows.append(row("grad_accum", model, case, numel, nbytes, kernel_ms, torch_name, torch_ms, copy_rate,
                            info, block=block, num_warps=num_warps, match=match))
            print(json.dumps(rows[-1]), flush=True)
        grads = None  # free before the next case allocates
        torch.cuda.empty_cache()

    # stochastic rounding of the whole flat fp32 layer (the bf16 shadow of a bf16_master recipe)
    src = torch.randn(layout.numel, device="cuda")
    out = torch.empty(layout.numel, device="cuda", dtype=torch.bfloat16)
    bits = src.view(torch.int32)

    def torch_sr():
        r = torch.randint(0, 1 << 16, bits.shape, device="cuda", dtype=torch.int32)
        out.view(torch.int16).copy_((bits + r) >> 16)

    torch_name, torch_ms = best_torch({"randint_bits": torch_sr})
    for rows_per_program, num_warps in [(G.SR_ROWS_GPU, G.SR_NUM_WARPS_GPU)] + (
            [(512, 4), (1024, 4), (2048, 8)] if len(configs) > 1 else []):
        G.SR_ROWS_GPU, G.SR_NUM_WARPS_GPU = rows_per_program, num_warps
        G.to_bf16_stochastic(src, out, seed=1, offset=0)
        near = (out.float() - src).abs() <= (src.abs() * 2**-7)  # within one bf16 ulp
        kernel_ms = time_ms(lambda: G.to_bf16_stochastic(src, out, seed=1, offset=0))
        rows.append(row("grad_accum", model, "fp32->bf16 stochastic", layout.numel, layout.numel * 6, kernel_ms,
                        torch_name, torch_ms, copy_rate, info, block=rows_per_program * 8, num_warps=num_warps,
                        match=bool(near.all())))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/grad_accum.jsonl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sweep", action="store_true", help="also time other BLOCK / num_warps configurations")
    args = ap.parse_args()
    torch, _ = require_gpu("bench_grad_accum")
    import streamtrain_kernels.grad_accum as G
    import streamtrain_kernels.tiles as T

    configs = SWEEP if args.sweep else [(T.BLOCK_GPU, T.NUM_WARPS_GPU)]
    default = (T.BLOCK_GPU, T.NUM_WARPS_GPU, G.SR_ROWS_GPU, G.SR_NUM_WARPS_GPU)
    info = run_environment()
    rate = copy_gbps()
    print(f"device-to-device copy: {rate:.0f} GB/s", flush=True)
    rows = []
    try:
        for model in args.models.split(","):
            rows += bench_model(torch, model, rate, info, configs)
    finally:
        T.BLOCK_GPU, T.NUM_WARPS_GPU, G.SR_ROWS_GPU, G.SR_NUM_WARPS_GPU = default
        write_rows(args.out, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
