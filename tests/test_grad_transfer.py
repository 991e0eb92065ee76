"""train.grad_transfer_dtype=bf16: host-updated units' gradients cross the link as stochastically rounded bf16.

The reference is the same engine with fp32 transfer and a grad_hook that replaces each host-updated unit's finished
gradient by `stochastic_round_reference` of it (keyed as the engine keys its transfer rounding) upcast to fp32: if
the rounding is the only difference, the two runs agree bit for bit. The hook also changes the norms (it runs before
them), while bf16 transfer keeps the norms of the fp32 gradients, so those comparisons run with clipping off; the
clipped case is checked on its own against one AdamW step computed here.
"""

import pytest
import torch

from engine import optim
from engine.config import ConfigError
from engine.formats import GRAD_STREAM, update_seed
from streamtrain_kernels.reference import stochastic_round_reference
from engine.model import ModelSpec
from engine.optim import FlatAdamW
from engine.plan import build_plan
from engine.streaming.gradients import GradAccumulator, transfer_seed
from tests.test_engine_equivalence import assert_same, build
from tests.util import FP32, SMALL, make_cfg

STEPS = 3
RECIPE = ["train.seq_len=16", "train.micro_batch_size=2", "train.grad_accum=2", "train.lr=1e-2",
          "train.warmup_steps=1", f"train.steps={STEPS}", "engine.fused_kernels=false", *FP32]
NO_CLIP = ["train.max_grad_norm=0"]
BF16 = ["train.grad_transfer_dtype=bf16"]


def rounding_hook(eng, step: int, changed: list):
    """What bf16 transfer does to a host-updated unit's gradient at `step` (0-based), done to the fp32 gradient in
    place: each tensor rounded at its offset in the unit's flat layout (the kernel rounds the flat buffer)."""
    def hook(unit, views):
        if unit not in eng.host_units:
            return
        layout = eng.store.layouts[unit]
        seed = transfer_seed(eng.seed, unit, step + 1)
        for spec, offset in zip(layout.specs, layout.offsets):
            view = views[spec.name]
            rounded = stochastic_round_reference(view.contiguous(), seed, offset).float()
            changed.append(not torch.equal(rounded, view))
            view.copy_(rounded)
    return hook


def run(overrides, steps=STEPS, hook=False):
    """(records, master weights, moments, engine memory bytes) of a stream run; `hook`: the rounding reference."""
    cfg, eng, data = build("stream", [*RECIPE, *overrides])
    t, records, changed = cfg.train, [], []
    try:
        for step in range(steps):
            batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
            grad_hook = rounding_hook(eng, step, changed) if hook else None
            records.append(eng.train_step(batches, optim.lr_at(step, t), grad_hook=grad_hook))
        if hook:
            assert any(changed), "the reference rounding changed nothing: the comparison would prove nothing"
        return records, eng.master_weights(), eng.adam_moments(), eng.memory_bytes()
    finally:
        eng.close()


@pytest.mark.parametrize("placement", [
    [],  # every unit host-updated, gradients to pinned host memory during the backward
    ["engine.grads_tier=gpu"],  # gradients on the GPU, fetched by the optimizer through the staging pair
    ["engine.gpu_resident_units=2", "engine.gpu_streamed_units=1"],  # GPU-updated units never cross the link
    ["engine.gpu_resident_units=2", "engine.grads_tier=gpu", "engine.slots=3"],
])
def test_bf16_transfer_differs_from_fp32_by_the_rounding_only(placement):
    rec, w, m, mem = run([*placement, *NO_CLIP, *BF16])
    ref_rec, ref_w, ref_m, ref_mem = run([*placement, *NO_CLIP], hook=True)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert_same(w, ref_w)
    assert_same(m, ref_m)
    grads = "host_grad_staging" if "engine.grads_tier=gpu" in placement else "host_grads"
    assert 2 * mem[grads] == ref_mem[grads] > 0
    assert mem["device_grad_transfer"] > 0 and ref_mem["device_grad_transfer"] == 0


def test_the_norm_is_of_the_fp32_gradients_and_clipping_scales_the_upcast_ones():
    """One clipped step: the reported norm is the fp32 run's, and each host-updated unit's update is AdamW on
    upcast(round(g)) x clip coefficient, the coefficient from the fp32 norm."""
    clip = ["train.max_grad_norm=0.05"]
    fp32_rec = run(clip, steps=1)[0]
    cfg, eng, data = build("stream", [*RECIPE, *clip, *BF16])
    t = cfg.train
    grads, initial = {}, {u: eng.master[u].clone() for u in eng.host_units}

    def capture(unit, views):
        flat = torch.zeros(eng.store.layouts[unit].numel)
        for name, view in eng.store.layouts[unit].views(flat).items():
            view.copy_(views[name])
        grads[unit] = flat

    try:
        batches = [data.batch("train", j, t.micro_batch_size) for j in range(t.grad_accum)]
        lr = optim.lr_at(0, t)
        record = eng.train_step(batches, lr, grad_hook=capture)
        eng.wait_for_optimizer()
        assert record["grad_norm"] == fp32_rec[0]["grad_norm"]
        coef = optim.clip_coefficient(optim.global_norm(eng.sq_norms), t.max_grad_norm)
        assert float(coef) < 1.0, "clipping must be active"
        for u in eng.host_units:
            layout = eng.store.layouts[u]
            master, m, v = initial[u], torch.zeros(layout.numel), torch.zeros(layout.numel)
            grad = stochastic_round_reference(grads[u], transfer_seed(cfg.seed, u, 1)).float().mul_(coef)
            FlatAdamW([layout], [master], [m], [v], t).step_unit(0, grad, lr)
            assert torch.equal(eng.master[u], master), f"unit {u}"
            assert torch.equal(eng.m[u], m) and torch.equal(eng.v[u], v), f"unit {u}"
    finally:
        eng.close()


def test_runs_are_reproducible_and_keyed_by_the_seed():
    a, b, c = (run([*NO_CLIP, *BF16, *seed], steps=2)[1] for seed in ([], [], ["seed=7"]))
    assert_same(a, b)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_the_key_depends_on_seed_unit_and_step_and_is_not_the_held_gradients_key():
    x = torch.randn(4096) * 1e-3
    keys = {"base": transfer_seed(1, 2, 3), "seed": transfer_seed(5, 2, 3), "unit": transfer_seed(1, 4, 3),
            "step": transfer_seed(1, 2, 4), "held": update_seed(1, 2, 3) ^ GRAD_STREAM}
    rounded = {k: stochastic_round_reference(x, key) for k, key in keys.items()}
    assert torch.equal(rounded["base"], stochastic_round_reference(x, transfer_seed(1, 2, 3)))
    for k in keys:
        if k != "base":
            assert not torch.equal(rounded[k], rounded["base"]), k


def test_the_transfer_rounding_is_unbiased():
    """The engine's rounding (the accumulator's `to_wire`: the kernel) over many steps: each value sits 0.3 ulp
    above a bf16 value, where rounding to nearest or truncating would be off by -0.3 ulp every time."""
    from engine.device import Device
    from engine.model.layout import ParamSpec, UnitLayout

    n, draws = 2048, 256
    exponent = torch.randint(-20, 4, (n,)).float()
    ulp = torch.exp2(exponent - 7)
    mantissa = torch.randint(0, 128, (n,)).float()
    sign = torch.where(torch.rand(n) < 0.5, -1.0, 1.0)
    x = sign * (torch.exp2(exponent) + (mantissa + 0.3) * ulp)
    acc = GradAccumulator(Device(torch.device("cpu")), UnitLayout("t.", [ParamSpec("g", (n,), "vector")]),
                          fused=False, wire=True)
    acc.flat.copy_(x)
    error = torch.zeros(n, dtype=torch.float64)
    for step in range(1, draws + 1):
        error += (acc.to_wire(transfer_seed(0, 1, step)).double() - x.double()) / ulp.double()
    error /= draws
    assert abs(error.mean().item()) < 0.01
    assert error.abs().max().item() < 0.2  # per element: 4 standard deviations of a 256-draw mean is 0.12


@pytest.mark.parametrize("overrides, pattern", [
    (["train.grad_transfer_dtype=fp16"], "train.grad_transfer_dtype='fp16' is not valid; choose one of fp32, bf16"),
    ([*BF16, "engine=reference"], "engine=reference sends no gradients to the host. Valid: "
                                  "train.grad_transfer_dtype=fp32"),
    ([*BF16, "engine=stream", "train.grad_dtype=bf16"], "train.grad_dtype=bf16 updates every unit on the GPU"),
    ([*BF16, "engine=stream", "train.master_dtype=bf16"], "train.master_dtype=bf16 .*updates every unit on the GPU"),
])
def test_bf16_transfer_is_refused_where_no_gradient_goes_to_the_host(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_cfg(overrides)


def test_without_host_updated_units_the_option_says_it_has_no_effect():
    cfg, eng, _ = build("stream", [*RECIPE, *BF16, "engine.gpu_resident_units=5"])
    try:
        assert not eng.host_units and not eng.transfer_bf16
        assert [line for line in eng.notes if "train.grad_transfer_dtype=bf16 has no effect" in line]
        assert eng.memory_bytes()["device_grad_transfer"] == 0
    finally:
        eng.close()
    cfg, eng, _ = build("stream", [*RECIPE, *BF16])
    try:
        assert eng.notes == []
    finally:
        eng.close()


def _rows(plan, text):
    return sum(b for _, item, b in plan.rows if text in item)


@pytest.mark.parametrize("grads_tier", ["host", "gpu"], ids=lambda tier: f"grads_tier={tier}")  # "gpu": a marker
def test_the_planner_counts_host_gradients_and_staging_at_two_bytes(grads_tier):
    """The host gradient row (grads tier host) or the pinned staging row (gpu) halves; the bf16 copies the D2H reads
    and the fp32 upcast scratch are rows of their own; the engine allocates what the rows say. (On a CPU every GPU
    row is a host row too.)"""
    over = [*RECIPE, f"engine.grads_tier={grads_tier}", "engine.gpu_resident_units=1"]
    cfg32, cfg16 = (make_cfg(["engine=stream", *SMALL, *over, *bf16]) for bf16 in ([], BF16))
    spec = ModelSpec(cfg32.model)
    fp32, bf16 = (build_plan(spec, cfg, 0.0, 64.0, on_gpu=False) for cfg in (cfg32, cfg16))
    grads = "gradients of host-updated units until" if grads_tier == "host" else "pinned gradient staging"
    assert 2 * _rows(bf16, grads) == _rows(fp32, grads) > 0
    scratch = 4 * max(u.layout.numel for u in spec.units[1:])
    assert _rows(bf16, "upcasts each bf16 gradient") == scratch
    wired = _rows(bf16, "bf16 copies of host-updated units' gradients")
    assert bf16.total("host") == fp32.total("host") - _rows(fp32, grads) // 2 + scratch + wired
    _, eng, _ = build("stream", [*over, *BF16])
    try:
        mem = eng.memory_bytes()
        assert mem["device_grad_transfer"] == wired > 0
        assert mem["host_grad_upcast"] == scratch
        assert mem["host_grads" if grads_tier == "host" else "host_grad_staging"] == _rows(bf16, grads)
    finally:
        eng.close()


def test_the_time_model_halves_the_gradient_d2h():
    """With the link made the bottleneck of every layer's backward, the backward takes half as long."""
    from engine.formats import StateFormat
    from engine.placement import Placement
    from engine.plan import Speeds, StepShape, predict_stream

    backward = {}
    for dtype in ("fp32", "bf16"):
        cfg = make_cfg(["engine=stream", "hardware=h200", "plan=true", *RECIPE, f"train.grad_transfer_dtype={dtype}"])
        spec = ModelSpec(cfg.model)
        sp = Speeds(cfg.hardware, compiled=True)
        sp.d2h = 1e3  # bytes/s: the gradients' D2H dwarfs compute and weight loads
        shape = StepShape(spec, cfg, True, StateFormat.of(cfg.train))
        placement = Placement(n_units=len(spec.units), activation_tier="gpu")  # every update on the host
        backward[dtype] = predict_stream(shape, sp, placement)[0]["backward"]
    layers = sum(u.layout.numel for u in spec.layer_units)
    assert backward["fp32"] == pytest.approx(4 * layers / 1e3, rel=1e-4)
    assert backward["bf16"] == pytest.approx(backward["fp32"] / 2, rel=1e-4)
