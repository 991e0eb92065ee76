"""engine=stream against engine=reference on a CUDA GPU, with the copy streams, pinned host memory and the
optimizer thread really running concurrently (CPU tests cannot see races).

Tolerance: the reference runs AdamW on the GPU and the stream engine on the CPU (different fused kernels), and
cuBLAS/SDPA may pick different algorithms for different memory layouts, so results agree to fp32/bf16 rounding
rather than bit for bit: losses within 1e-3 relative over 6 steps, weights within a small fraction of one lr step.
"""

import pytest
import torch

from engine import optim
from engine.data import build_data
from engine.device import resolve_compute_dtype
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.trainer import build_engine
from tests.util import SMALL, make_cfg

pytestmark = pytest.mark.gpu
STEPS = 6
RECIPE = ["train.seq_len=200", "train.micro_batch_size=2", "train.grad_accum=3", "train.max_grad_norm=0.05",
          "train.lr=1e-3", "train.warmup_steps=1", f"train.steps={STEPS}"]


def run(engine, overrides, compute="bf16"):
    # eager templates: compiling them for each of these small engines would dominate the test's time
    cfg = make_cfg([f"engine={engine}", *SMALL, *RECIPE, f"train.compute_dtype={compute}", "train.compile=off",
                    *overrides])
    spec = ModelSpec(cfg.model)
    device = torch.device("cuda")
    plan = build_plan(spec, cfg, 40.0, 64.0, on_gpu=True)
    eng = build_engine(spec, cfg, device, resolve_compute_dtype(cfg.train.compute_dtype, device), plan)
    data = build_data(cfg.data, cfg.train.seq_len, cfg.seed, cfg.model.vocab_size)
    t = cfg.train
    try:
        losses = []
        for step in range(STEPS):
            batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
            losses.append(eng.train_step(batches, optim.lr_at(step, t))["loss"])
        return losses, eng.master_weights()
    finally:
        eng.close()


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def reference(request):
    return request.param, run("reference", [], request.param)


@pytest.mark.parametrize("placement", [
    [],
    ["engine.grads_tier=host", "engine.checkpoint_tier=host", "engine.cache_weights=off"],
    ["engine.grads_tier=gpu", "engine.checkpoint_tier=gpu", "engine.cache_weights=on"],
    ["engine.grads_tier=host", "engine.checkpoint_tier=gpu", "engine.cache_weights=off", "engine.slots=3"],
    ["engine.device_optimizer_units=3", "engine.grads_tier=host", "engine.cache_weights=off"],
    ["engine.device_optimizer_units=2", "engine.grads_tier=gpu", "engine.cache_weights=on"],
])
def test_stream_matches_reference_on_gpu(reference, placement):
    compute, (ref_losses, ref_w) = reference
    losses, w = run("stream", placement, compute)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    worst = max((w[n] - ref_w[n]).abs().max().item() for n in ref_w if not n.endswith("k_proj.bias"))
    print(f"{compute} {placement}: loss diffs {[a - b for a, b in zip(losses, ref_losses)]}, max |dw| {worst:.2e}")
    # k_proj.bias is excluded: its exact gradient is zero (softmax ignores it), so Adam amplifies rounding noise.
    # The bound is a fraction of the 6 lr steps (6e-3) a weight can move: fp32 runs agree to ~1e-7; in bf16 the
    # GPU (reference) and CPU (stream) AdamW kernels round differently, bf16 weight copies then round to different
    # values and the runs drift apart at bf16 resolution (seen: 9e-4 after 6 steps).
    assert worst < (2e-3 if compute == "bf16" else 1e-6)
