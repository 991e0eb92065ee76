"""One decoder layer's step as the streaming engine runs it, plain against lean, one GPU.

    python -m bench.bench_lean_layer --out bench/results/lean_layer.jsonl
    python -m bench.bench_lean_layer --seq-lens 32768 --variants sdpa triton     # a subset

A step = the layer's forward without autograd (what the engine's forward runs) + `ModelSpec.layer_grads` (its
backward: recompute and back-propagate), compiled as in training, bf16 autocast, bf16 matmul weights (as a slot
holds them), one sequence of T tokens, qwen7b shapes (`--model`). Variants:
  sdpa     the plain layer on SDPA's flash backend (the MLP chunked at 32K tokens above 64K: train.mlp_chunk_tokens=-1)
  triton   the plain layer on the Triton kernel (same chunking)
  lean     the lean layer (engine/model/lean.py, 8K-token chunks), attention's forward run again in the backward
  kept     the lean layer, the backward from the forward's kept attention output and log-sum-exp
  kept_sdpa  the same on cuDNN's fused attention (engine/model/lean_attention.py `sdpa`)

model_s: the planner's time model for the same work at the figures of `--hardware`'s profile (not counting its
lean_step_ratio_*); step_ratio = step_s / model_s, whose mean over lengths for `kept_sdpa` and `kept` is the
profile's hardware.lean_step_ratio_sdpa and _triton.

Times: CUDA events around whole steps; 1 untimed step first (compiles, autotunes), then the median of 3 timed steps
up to 64K tokens, 1 above. tflops: the layer's model FLOPs (3 x its forward, causal attention counted:
engine/metrics.py) over the step time, no credit for recompute. peak_gib: torch.cuda.max_memory_allocated during the
timed steps less what was allocated before (the layer's weights, x, dy and the copy of dy the backward overwrites),
i.e. the layer's working set as the planner counts it (`planned_gib`: engine/plan/activations.py
`layer_working_bytes`). A variant out of memory gives a row with `error`. Rows carry
engine.metrics.run_environment's fields.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.kernel_bench import event_median_ms, require_gpu, write_rows

VARIANTS = ("sdpa", "triton", "lean", "kept", "kept_sdpa")
LEAN = ("lean", "kept", "kept_sdpa")
KEPT = ("kept", "kept_sdpa")


def _spec_compute(variant: str, T: int):
    """The LayerCompute a variant runs."""
    from engine.model.dense import LayerCompute, resolve_mlp_chunk_tokens

    lean = variant in LEAN
    return LayerCompute(attention="sdpa" if variant in ("sdpa", "kept_sdpa") else "triton",
                        mlp_chunk_tokens=resolve_mlp_chunk_tokens(-1, T, lean), lean=lean)


def _spec(model: str, variant: str, T: int):
    from engine.model import ModelSpec
    from tests.util import make_cfg

    cfg = make_cfg([f"model={model}", f"train.seq_len={T}", f"model.max_position_embeddings={max(T, 4096)}"],
                   validated=False)
    spec = ModelSpec(cfg.model)
    spec.set_layer_compute(_spec_compute(variant, T))
    spec.compile_templates()
    return cfg, spec


def _step_fn(spec, T: int, torch):
    unit = spec.layer_units[0]
    flat = torch.empty(unit.layout.numel, device="cuda")
    views = unit.layout.views(flat)
    spec.init_unit(unit, views, seed=0)
    p = {n: (t.to(torch.bfloat16) if t.dim() == 2 else t).detach().requires_grad_() for n, t in views.items()}
    del flat, views
    D = spec.arch.hidden
    x = torch.randn(1, T, D, device="cuda")
    dy = torch.randn(1, T, D, device="cuda")
    dy_work = torch.empty_like(dy)  # what the backward overwrites: the engine's residual gradient, not the layer's
    pos = spec.positions(T, "cuda")

    def step(kept_output: bool):
        kept = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                if kept_output:
                    kept = spec.forward_keeping(p, x, pos, 0, attention=True)[1]
                else:
                    spec.layer(p, x, pos, 0)
            dy_work.copy_(dy)
            return spec.layer_grads(p, x.detach().requires_grad_(), dy_work, pos, 0, kept=kept)

    return step


def model_seconds(model: str, variant: str, T: int, hardware: str) -> float:
    """The time model's seconds for one step of `variant` (engine/plan/speeds.py, at the figures of
    `hardware`'s profile, without its lean_step_ratio_*): the forward, then the backward as the engine runs it for
    a recomputed layer (from the kept attention output for the kept variants)."""
    from engine.execution import Execution
    from engine.formats import StateFormat
    from engine.plan.shape import StepShape
    from engine.plan.speeds import Speeds
    from engine.model import ModelSpec
    from tests.util import make_cfg

    cfg = make_cfg([f"model={model}", f"hardware={hardware}", f"train.seq_len={T}", "train.micro_batch_size=1",
                    "train.grad_accum=1", f"model.max_position_embeddings={max(T, 4096)}", "plan=true"])
    spec, probe = ModelSpec(cfg.model), _spec_compute(variant, T)
    ex = Execution(on_gpu=True, compiled=True, compile_workers=False, fused_loss=True, attention=probe.attention,
                   mlp_chunk_tokens=probe.mlp_chunk_tokens, lean=probe.lean)
    s = StepShape(spec, cfg, True, StateFormat(), execution=ex)
    sp = Speeds.of_step(cfg.hardware, spec, s, compiled=True)
    return sp.layer_fwd_s(s) + sp.layer_bwd_s(s, 3, s.recompute_skipped_flops, 2 if variant in KEPT else None)


def measure(model: str, variant: str, T: int, torch, hardware: str) -> dict:
    from engine.metrics import model_flops_per_token, run_environment
    from engine.plan.activations import layer_working_bytes

    cfg, spec = _spec(model, variant, T)
    modelled_s = model_seconds(model, variant, T, hardware)
    row = {"bench": "lean_layer", "model": model, "variant": variant, "seq_len": T,
           "mlp_chunk_tokens": spec.compute.mlp_chunk_tokens,
           "planned_gib": round(layer_working_bytes(spec, T, 2, True, spec.compute.mlp_chunk_tokens,
                                                    spec.compute.attention, spec.compute.lean) / 2**30, 2),
           "hardware": hardware, "model_s": round(modelled_s, 4), **run_environment()}
    try:
        step = _step_fn(spec, T, torch)
        kept_output = variant in KEPT
        step(kept_output)  # compile, autotune
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = event_median_ms(lambda: step(kept_output), 3 if T <= 65536 else 1) / 1e3
        flops = 3 * model_flops_per_token(cfg.model, T)["layer_forward_flops_per_token"] * T
        row.update(step_s=round(seconds, 4), tflops=round(flops / seconds / 1e12, 1),
                   step_ratio=round(seconds / modelled_s, 3),
                   peak_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2))
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
    finally:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen7b")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--hardware", default="h100", help="the profile whose figures give model_s (conf/hardware)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch, _ = require_gpu("bench_lean_layer")
    for T in args.seq_lens:
        for variant in args.variants:
            row = measure(args.model, variant, T, torch, args.hardware)
            write_rows(args.out, [row])
            print({k: row.get(k) for k in ("variant", "seq_len", "step_s", "tflops", "step_ratio", "peak_gib",
                                           "planned_gib", "error")}, flush=True)


if __name__ == "__main__":
    main()
