"""Fused LM head + cross-entropy (streamtrain_kernels/cross_entropy.py) against the unfused torch chains, fwd+bwd,
one GPU.

    python -m bench.bench_cross_entropy --out bench/results/cross_entropy.jsonl
    python -m bench.bench_cross_entropy --tokens 8192 --hidden 3584 --sweep      # + row-kernel launch configs

Cases: Qwen2.5 heads, V = 152064, D = 3584 (7B) and 2048 (3B), N = 4K, 8K, 16K, 32K tokens, bf16. Three ways to
compute loss = sum_i CE(h_i W^T, label_i) / N and its gradients (torch.autograd.grad for h and W):
  fused        fused_linear_cross_entropy (default chunk: 2**27 logits), 3 matmuls, logits never stored
  torch_full   F.cross_entropy(F.linear(h, W).float(), reduction="sum"): the whole N x V logits at once
               (streamtrain_kernels/reference.py linear_cross_entropy_reference); rows that run out of memory say so
  torch_ckpt   the engine's chain before the fused head (engine/model/dense.py loss_sum): the same per chunk of
               2**27 logits under activation checkpointing, 4 matmuls (logits recomputed in backward)
  fused_c<C>   with --fused-chunks C ...: the fused head at other chunk sizes (fewer, larger dW updates)
Timing: CUDA events around whole steps, 1 warmup step (after a first step that compiles), median of --reps.
Peak memory: torch.cuda.max_memory_allocated during one step, minus what was allocated before it (inputs), in
GiB: the step's working memory including the returned gradients. TFLOP/s counts 6*N*D*V (3 matmuls) for every
way, so the checkpointed chain's 4th matmul shows as lower throughput. `loss_diff` is |fused - torch| loss.
With --sweep, `row_kernel` rows time the softmax/CE kernel alone on one default chunk for several (BLOCK,
num_warps): GB/s = 6 bytes per bf16 logit (read twice, written once).

Rows (JSONL): bench case tokens hidden vocab dtype chunk_tokens impl ms tflops peak_gib note loss_diff
(+ block num_warps gbps for row_kernel rows) gpu torch triton python cpus git_sha date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.kernel_bench import event_median_ms

ROOT = Path(__file__).resolve().parent.parent

VOCAB = 152064
HIDDEN = [3584, 2048]
TOKENS = [4096, 8192, 16384, 32768]
SWEEP = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def torch_ckpt_loss(h_ND, weight_VD, labels_N, scale):
    """The pre-fusion engine chain: chunks of 2**27 logits, each checkpointed (logits recomputed in backward)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from streamtrain_kernels.cross_entropy import default_chunk_tokens
    from streamtrain_kernels.reference import linear_cross_entropy_reference

    chunk = default_chunk_tokens(weight_VD.shape[0])
    total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
    for start in range(0, h_ND.shape[0], chunk):
        total = total + checkpoint(linear_cross_entropy_reference, h_ND[start:start + chunk], weight_VD,
                                   labels_N[start:start + chunk], use_reentrant=False, preserve_rng_state=False)
    return total * scale


def impls(fused_chunks) -> dict:
    """name -> (loss function, chunk_tokens for the row)."""
    import functools

    from streamtrain_kernels.cross_entropy import default_chunk_tokens, fused_linear_cross_entropy
    from streamtrain_kernels.reference import linear_cross_entropy_reference

    chunk = default_chunk_tokens(VOCAB)
    ways = {"fused": (fused_linear_cross_entropy, chunk)}
    ways.update({f"fused_c{c}": (functools.partial(fused_linear_cross_entropy, chunk_tokens=c), c)
                 for c in fused_chunks})
    ways.update({"torch_full": (linear_cross_entropy_reference, None), "torch_ckpt": (torch_ckpt_loss, chunk)})
    return ways


def measure(step, reps: int):
    """(median ms, peak GiB above the memory allocated before the step) of a zero-argument step."""
    import torch

    step()  # compile / cuBLAS heuristics
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return event_median_ms(step, reps), peak


def run_case(N: int, D: int, V: int, reps: int, fused_chunks, info: dict) -> list:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, D, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
    W = (torch.randn(V, D, device="cuda", generator=g) * 2 * D ** -0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    flops = 6.0 * N * D * V
    rows, losses = [], {}
    for name, (fn, chunk) in impls(fused_chunks).items():
        row = {"bench": "cross_entropy", "case": f"D{D}-N{N}", "tokens": N, "hidden": D, "vocab": V,
               "dtype": "bf16", "chunk_tokens": chunk or N,
               "impl": name, "ms": None, "tflops": None, "peak_gib": None, "note": None}

        def step(fn=fn, name=name):
            loss = fn(h, W, labels, scale=1.0 / N)
            torch.autograd.grad(loss, (h, W))
            losses[name] = loss.detach()
        try:
            ms, peak = measure(step, reps)
            row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), peak_gib=round(peak, 3))
        except torch.cuda.OutOfMemoryError as e:
            row["note"] = f"out of memory ({str(e).splitlines()[0][:120]})"
        torch.cuda.empty_cache()
        rows.append({**row, **info})
    for row in rows:
        measured = "fused" in losses and row["impl"] in losses and row["impl"] != "fused"
        row["loss_diff"] = abs(losses["fused"] - losses[row["impl"]]).item() if measured else None
    return rows


def sweep_rows(D: int, V: int, info: dict) -> list:
    """The row kernel alone on one default chunk of logits, for each (BLOCK, num_warps) of SWEEP."""
    import torch
    import triton

    import streamtrain_kernels.cross_entropy as CE

    C = CE.default_chunk_tokens(V)
    z = torch.randn(C, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (C,), device="cuda")
    loss = torch.empty(C, device="cuda")
    default = (CE.BLOCK_GPU, CE.NUM_WARPS_GPU)
    rows = []
    try:
        for block, num_warps in SWEEP:
            CE.BLOCK_GPU, CE.NUM_WARPS_GPU = block, num_warps
            ms = triton.testing.do_bench(lambda: CE.softmax_ce_grad_(z, labels, loss, 1.0), warmup=25, rep=200,
                                         return_mode="median")
            rows.append({"bench": "cross_entropy", "case": "row_kernel", "tokens": C, "hidden": D, "vocab": V,
                         "dtype": "bf16", "chunk_tokens": C, "impl": "fused_row_kernel", "block": block,
                         "num_warps": num_warps, "ms": round(ms, 4), "gbps": round(6 * C * V / ms / 1e6, 1),
                         "default": (block, num_warps) == default, **info})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        CE.BLOCK_GPU, CE.NUM_WARPS_GPU = default
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cross_entropy.jsonl")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--hidden", type=int, nargs="+", default=HIDDEN)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fused-chunks", type=int, nargs="*", default=[],
                    help="also time the fused head at these chunk_tokens (rows impl=fused_c<chunk>)")
    ap.add_argument("--sweep", action="store_true", help="also time the row kernel alone at several launch configs")
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("bench_cross_entropy: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    from engine.metrics import run_environment

    info = run_environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'case':12s} {'impl':12s} {'ms':>9s} {'TFLOP/s':>8s} {'peak GiB':>9s}  note", flush=True)
    with args.out.open("a") as f:
        for D in args.hidden:
            if args.sweep:
                for row in sweep_rows(D, VOCAB, info):
                    f.write(json.dumps(row) + "\n")
            for N in args.tokens:
                for row in run_case(N, D, VOCAB, args.reps, args.fused_chunks, info):
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    def fmt(x, p):
                        return "-" if x is None else format(x, p)
                    print(f"{row['case']:12s} {row['impl']:12s} {fmt(row['ms'], '.2f'):>9s} "
                          f"{fmt(row['tflops'], '.0f'):>8s} {fmt(row['peak_gib'], '.2f'):>9s}  {row['note'] or ''}",
                          flush=True)
    print(f"rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
