"""Expert compute against dense matmuls of the same FLOPs, forward + backward, at MoE models' shapes, one GPU.

    python -m bench.bench_grouped_mm --out bench/results/grouped_mm.jsonl
    python -m bench.bench_grouped_mm --models gptoss20b --tokens 65536 --routing uniform skewed
    python -m bench.bench_grouped_mm --dry-run        # tiny shapes on the CPU: checks the script and its rows

A MoE layer's experts are two grouped matmuls (gate/up [N*k, D] x [E, D, 2I], down [N*k, I] x [E, I, D]) over the
token rows sorted by expert, plus the sort, gather, SwiGLU and weighted scatter around them (engine/model/moe.py
`experts`). Each row times, at one model's shapes, `--tokens` tokens a step and one routing:
  experts   `moe.experts` as training runs it (sort, gather, grouped matmuls, activation, scatter), forward +
            backward (input and weight gradients) under bf16 autocast with bf16 weights, eager
  experts_compiled  the same through torch.compile (as the compiled layer runs it; the first call compiles)
  grouped   the two grouped matmuls alone on pre-sorted rows, forward + backward
  dense     two plain matmuls of the same FLOPs ([N*k, D] x [D, 2I] and [N*k, I] x [I, D]), forward + backward:
            what the expert compute would cost at dense-matmul efficiency
tflops count the matmuls' model FLOPs (2 x rows x in x out per matmul, x3 for forward + backward) for all three,
so `experts_vs_dense` and `grouped_vs_dense` are efficiencies (the target: experts >= 0.7 of dense).

Routing: `uniform` (each token's k experts drawn at random: every expert near N*k/E rows) or `skewed` (expert 0 takes
exactly 8x its uniform share, capped at every token, the other rows spread at random over the other experts: the
imbalance seen at random init; gpt-oss-20b's 32 experts at top-4 make that every token). A routing
costs its FLOPs: the rows are the same N*k in both, only their split over experts differs.

Times: median of triton.testing.do_bench (L2 flushed) on the GPU. `--dry-run` runs the same code on the CPU at tiny
shapes with one repetition (fp32, grouped_mm's CPU path): the rows carry `dry_run: true` and their times mean
nothing. Rows carry engine.metrics.run_environment's fields.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.kernel_bench import ROOT, time_ms, write_rows

MODELS = ("gptoss20b", "qwen3_30b_a3b")
ROUTINGS = ("uniform", "skewed")
SKEW = 8  # the skewed routing's first expert takes this many times its uniform share


def _arch(model: str, dry_run: bool):
    from engine.model import ModelSpec
    from tests.util import make_cfg

    tiny = ["model.hidden_size=64", "model.moe_intermediate_size=32", "model.num_experts=6",
            "model.num_experts_per_tok=2", "model.num_hidden_layers=1", "model.intermediate_size=32",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16"] if dry_run else []
    return ModelSpec(make_cfg([f"model={model}", *tiny], validated=False).model).arch


def routing_of(N: int, a, kind: str, torch, device):
    """(routing weights [N, k], chosen experts [N, k], load [E] int64) for `kind` (see the module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    scores = torch.rand(N, a.experts, generator=gen)
    if kind == "skewed":
        favoured = min(N, SKEW * N * a.top_k // a.experts)
        scores[:favoured, 0] = 2.0  # above every random score: expert 0 is among these tokens' top k
        scores[favoured:, 0] = -1.0  # and below it for the others
    chosen = scores.topk(a.top_k, dim=1).indices
    weights = torch.softmax(torch.randn(N, a.top_k, generator=gen), dim=1)
    load = torch.bincount(chosen.reshape(-1), minlength=a.experts)
    return weights.to(device), chosen.to(device), load.to(device)


def _median_ms(fn, dry_run: bool) -> float:
    if not dry_run:
        return time_ms(fn)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(model: str, tokens: int, routing: str, dry_run: bool) -> dict:
    import torch

    from engine.model import moe
    from engine.model.moe import grouped_mm

    device = "cpu" if dry_run else "cuda"
    dtype = torch.float32 if dry_run else torch.bfloat16
    a = _arch(model, dry_run)
    D, I, E, k = a.hidden, a.expert_intermediate, a.experts, a.top_k
    gen = torch.Generator(device="cpu").manual_seed(1)
    w_shapes = ((E, D, 2 * I), (E, I, D)) if a.gpt_oss else ((E, 2 * I, D), (E, D, I))
    p = {"mlp.experts.gate_up_proj": torch.randn(*w_shapes[0], generator=gen) * D ** -0.5,
         "mlp.experts.down_proj": torch.randn(*w_shapes[1], generator=gen) * I ** -0.5}
    if a.gpt_oss:
        p["mlp.experts.gate_up_proj_bias"] = torch.zeros(E, 2 * I)
        p["mlp.experts.down_proj_bias"] = torch.zeros(E, D)
    p = {n: t.to(device, dtype if t.dim() == 3 else torch.float32).requires_grad_() for n, t in p.items()}
    y = torch.randn(tokens, D, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(tokens, D, generator=gen).to(device, dtype)
    weights, chosen, load = routing_of(tokens, a, routing, torch, device)
    rows_n = tokens * k
    flops = 3 * 2 * rows_n * (D * 2 * I + I * D)
    offs = load.cumsum(0).to(torch.int32)
    rows_in = torch.randn(rows_n, D, generator=gen).to(device, dtype).requires_grad_()
    act_in = torch.randn(rows_n, I, generator=gen).to(device, dtype).requires_grad_()
    w1 = torch.randn(E, D, 2 * I, generator=gen).to(device, dtype).requires_grad_()
    w2 = torch.randn(E, I, D, generator=gen).to(device, dtype).requires_grad_()
    d1, d2 = (torch.randn(rows_n, n, generator=gen).to(device, dtype) for n in (2 * I, D))
    dense1 = torch.randn(D, 2 * I, generator=gen).to(device, dtype).requires_grad_()
    dense2 = torch.randn(I, D, generator=gen).to(device, dtype).requires_grad_()

    def sorted_experts(p, y, weights, chosen, load):
        return moe.experts(p, y, weights, moe.sort_choices(chosen, load), a, dtype)

    # as a compiled layer runs it: Inductor fuses the sort, gathers, activation and weighting around the grouped
    # matmuls (the dry run only traces it, through AOT autograd under bf16 autocast, which grouped_mm's trace needs)
    compiled_experts = torch.compile(sorted_experts, dynamic=False, backend="aot_eager" if dry_run else "inductor")

    def experts_step(fn=sorted_experts, autocast=not dry_run):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = fn(p, y, weights, chosen, load)
        torch.autograd.grad(out, [y, *p.values()], dy)

    def grouped_step():
        h, o = grouped_mm(rows_in, w1, offs=offs), grouped_mm(act_in, w2, offs=offs)
        torch.autograd.grad((h, o), [rows_in, act_in, w1, w2], (d1, d2))

    def dense_step():
        h, o = rows_in @ dense1, act_in @ dense2
        torch.autograd.grad((h, o), [rows_in, act_in, dense1, dense2], (d1, d2))

    times = {name: _median_ms(fn, dry_run)
             for name, fn in (("experts", experts_step), ("grouped", grouped_step), ("dense", dense_step),
                              ("experts_compiled", lambda: experts_step(compiled_experts, autocast=True)))}
    row = {"bench": "grouped_mm", "model": model, "tokens": tokens, "routing": routing, "experts": E, "top_k": k,
           "hidden": D, "expert_intermediate": I, "rows": rows_n, "max_rows_per_expert": int(load.max()),
           "empty_experts": int((load == 0).sum()), "flops": flops, "dry_run": dry_run}
    for name, ms in times.items():
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
    row["experts_vs_dense"] = times["dense"] / times["experts"]
    row["experts_compiled_vs_dense"] = times["dense"] / times["experts_compiled"]
    row["grouped_vs_dense"] = times["dense"] / times["grouped"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grouped_mm.jsonl"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536], help="tokens a step (default: 65536)")
    ap.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing")
    args = ap.parse_args(argv)
    if min(args.tokens) < 1:
        ap.error(f"--tokens {min(args.tokens)} must be >= 1")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_grouped_mm: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured "
              "(--dry-run checks the script on the CPU)", file=sys.stderr)
        return 2
    from engine.metrics import run_environment

    env = run_environment()
    rows = []
    print(f"{'model':14s} {'tokens':>7s} {'routing':8s} {'experts ms':>11s} {'grouped ms':>11s} {'dense ms':>9s} "
          f"{'experts/dense':>13s} {'compiled/dense':>14s} {'grouped/dense':>13s}", flush=True)
    for model in args.models:
        for tokens in args.tokens:
            for routing in args.routing:
                row = {**run_case(model, min(tokens, 64) if args.dry_run else tokens, routing, args.dry_run), **env}
                rows.append(row)
                print(f"{model:14s} {row['tokens']:7d} {routing:8s} {row['experts_ms']:11.3f} "
                      f"{row['grouped_ms']:11.3f} {row['dense_ms']:9.3f} {row['experts_vs_dense']:13.2f} "
                      f"{row['experts_compiled_vs_dense']:14.2f} "
                      f"{row['grouped_vs_dense']:13.2f}", flush=True)
    write_rows(Path(args.out), rows)
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
