"""engine=stream against engine=reference on CPU: same seed, same batches, clipping active.

Tolerance: none. On one device both engines run the same ops on tensors of the same shapes in the same order:
the same templates, the fp32 gradient sums over micro-batches in the same order, per-tensor sums of squares by the
one definition (`optim.sq_norms`; the stream engine takes them at each unit's last accumulation, the reference over
the finished `.grad`) combined the same way, and the same fused AdamW kernel per tensor. So every loss, gradient
norm, weight and moment is expected bit-identical.
The one exception is tied embeddings, where the stream engine adds the same terms in a different order (head
gradients of all micro-batches first, then the lookup's); there we allow fp32 rounding, grown over the steps.
"""

import math

import pytest
import torch

from engine import optim
from engine.data import build_data
from engine.device import resolve_compute_dtype
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.trainer import build_engine
from tests.util import SMALL, make_cfg

STEPS = 10
RECIPE = ["train.seq_len=24", "train.micro_batch_size=2", "train.grad_accum=3", "train.max_grad_norm=0.05",
          "train.lr=1e-2", "train.warmup_steps=2", f"train.steps={STEPS}"]
FAMILIES = {
    "qwen2": [],
    "qwen3": ["model.model_type=qwen3", "model.qkv_bias=false", "model.qk_norm=true", "model.head_dim=16"],
    "llama": ["model.model_type=llama", "model.qkv_bias=false",
              "model.rope_scaling={rope_type:llama3,factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,"
              "original_max_position_embeddings:16}"],
    "qwen3_moe": ["model.model_type=qwen3_moe", "model.qkv_bias=false", "model.qk_norm=true", "model.head_dim=16",
                  "model.num_experts=5", "model.num_experts_per_tok=2", "model.moe_intermediate_size=40",
                  "model.router_aux_loss_coef=0.1"],
    "gpt_oss": ["model.model_type=gpt_oss", "model.qkv_bias=false", "model.attention_bias=true", "model.head_dim=16",
                "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
                "model.swiglu_limit=7.0", "model.sliding_window=5", "model.router_aux_loss_coef=0.1",
                "model.layer_types=[sliding_attention,full_attention,sliding_attention]"],
}


def build(engine: str, overrides):
    cfg = make_cfg([f"engine={engine}", *SMALL, *RECIPE, *overrides])
    spec = ModelSpec(cfg.model)
    device = torch.device("cpu")
    plan = build_plan(spec, cfg, 0.0, 64.0, on_gpu=False)
    eng = build_engine(spec, cfg, device, resolve_compute_dtype(cfg.train.compute_dtype, device), plan)
    data = build_data(cfg.data, cfg.train.seq_len, cfg.seed, cfg.model.vocab_size)
    return cfg, eng, data


def train(engine: str, overrides, steps=STEPS, grad_hook_at=None):
    cfg, eng, data = build(engine, overrides)
    t = cfg.train
    records, snapshots = [], []
    try:
        for step in range(steps):
            batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
            hook = grad_hook_at.get(step) if grad_hook_at else None
            records.append(eng.train_step(batches, optim.lr_at(step, t), grad_hook=hook))
            if grad_hook_at:
                snapshots.append((eng.master_weights(), eng.adam_moments()))
        return records, eng.master_weights(), eng.adam_moments(), snapshots
    finally:
        eng.close()


def assert_same(a, b, exact=True, rtol=0.0, atol=0.0):
    assert a.keys() == b.keys()
    for name in a:
        x, y = (a[name], b[name]) if not isinstance(a[name], tuple) else (torch.stack(a[name]), torch.stack(b[name]))
        if exact:
            assert torch.equal(x, y), f"{name}: max |diff| {(x - y).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference_runs():
    return {}


def _reference(cache, key, overrides, steps=STEPS):
    if key not in cache:
        cache[key] = train("reference", overrides, steps)
    return cache[key]


# gpt-oss's Triton attention (sinks, windows) runs in the interpreter at ~0.6 s a call: 2 steps of one micro-batch
# (the other families cover gradient accumulation), ~10 s a step per engine. Qwen3-MoE runs fewer steps than the
# dense families (its placements below compare against the same reference run)
MOE_STEPS = 5
FAMILY_RUN = {"gpt_oss": (2, ["train.grad_accum=1"]), "qwen3_moe": (MOE_STEPS, [])}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stream_matches_reference_bit_for_bit(family, reference_runs):
    steps, extra = FAMILY_RUN.get(family, (STEPS, []))
    overrides = [*FAMILIES[family], *extra]
    ref_rec, ref_w, ref_m, _ = _reference(reference_runs, family, overrides, steps)
    rec, w, m, _ = train("stream", overrides, steps)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert [r["grad_norm"] for r in rec] == [r["grad_norm"] for r in ref_rec]
    assert sum(r["grad_norm"] > 0.05 for r in ref_rec) >= steps - 1, "clipping must be active"
    assert ref_rec[-1]["loss"] < ref_rec[0]["loss"]
    assert_same(w, ref_w)
    assert_same(m, ref_m)


def test_a_one_layer_model_streams_exactly():
    """One decoder layer: a ring of one slot, which looks ahead at nothing (the head's weights were never loaded:
    uniform logits, a loss of ln(vocab) and an infinite gradient norm, every step skipped)."""
    one = ["model.num_hidden_layers=1"]
    ref_rec, ref_w, ref_m, _ = train("reference", one, 3)
    rec, w, m, _ = train("stream", one, 3)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert not any(r["skipped"] for r in rec)
    assert_same(w, ref_w)
    assert_same(m, ref_m)


@pytest.mark.parametrize("placement", [
    ["engine.recompute_group=2", "engine.keep_activation_layers=1"],
    ["engine.gpu_resident_units=2", "engine.gpu_streamed_units=2", "engine.activation_tier=gpu"],
])
def test_moe_placements_are_exact(placement, reference_runs):
    """The balance loss's gradient enters through the layer's backward once per layer and micro-batch, whether the
    layer's graph was kept from the forward, recomputed from a stored input or from a regenerated one."""
    ref_rec, ref_w, ref_m, _ = _reference(reference_runs, "qwen3_moe", FAMILIES["qwen3_moe"], MOE_STEPS)
    rec, w, m, _ = train("stream", [*FAMILIES["qwen3_moe"], *placement, "engine.fused_kernels=false"], MOE_STEPS)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert_same(w, ref_w)
    assert_same(m, ref_m)


@pytest.mark.parametrize("placement", [
    ["engine.grads_tier=gpu", "engine.activation_tier=gpu", "engine.cache_weights=on"],
    ["engine.grads_tier=gpu", "engine.slots=3"],
    ["engine.activation_tier=gpu", "engine.cache_weights=on"],
    ["engine.gpu_resident_units=2"],
    ["engine.gpu_resident_units=5", "engine.grads_tier=gpu"],
    ["engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"],
    ["engine.gpu_streamed_units=5"],
    ["engine.gpu_resident_units=2", "engine.gpu_streamed_units=2", "engine.grads_tier=gpu", "engine.cache_weights=on"],
    ["engine.gpu_streamed_units=3", "engine.activation_tier=gpu", "engine.slots=3"],
    ["engine.keep_activation_layers=2"],
    ["engine.keep_activation_layers=3", "engine.gpu_resident_units=2", "engine.gpu_streamed_units=2",
     "engine.grads_tier=gpu"],
    ["engine.keep_activation_layers=1", "engine.cache_weights=on", "engine.activation_tier=gpu"],
    ["engine.recompute_group=2"],
    ["engine.recompute_group=3", "engine.activation_tier=gpu", "engine.grads_tier=gpu"],
    ["engine.recompute_group=2", "engine.keep_activation_layers=1", "engine.gpu_streamed_units=2", "engine.slots=3"],
])
def test_every_placement_is_exact(placement, reference_runs):
    """Placements are orthogonal to the fused accumulation kernel, which the family tests run (under the Triton
    interpreter, ~5x slower than torch ops on CPU); here the torch path keeps the suite fast."""
    ref_rec, ref_w, ref_m, _ = _reference(reference_runs, "qwen2", FAMILIES["qwen2"])
    rec, w, m, _ = train("stream", [*placement, "engine.fused_kernels=false"])
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert [r["grad_norm"] for r in rec] == [r["grad_norm"] for r in ref_rec]
    assert_same(w, ref_w)
    assert_same(m, ref_m)


@pytest.mark.parametrize("every, over, stored", [
    (2, [], [0, 2]),  # SMALL's 3 layers: groups {0, 1} and {2}
    (3, ["engine.activation_tier=gpu"], [0]),  # one group of all three
    (2, ["model.num_hidden_layers=5", "engine.keep_activation_layers=1"], [0, 2]),  # 4 recomputed: {0, 1} {2, 3}
])
def test_recompute_groups_keep_every_nth_input_and_regenerate_the_rest(monkeypatch, every, over, stored):
    """With engine.recompute_group=g only every g-th layer input is kept; the backward regenerates the others by
    running the group's forward again, and training stays bit-identical to the reference. On the host tier the
    regenerated inputs go to g - 1 spare host entries per micro-batch, none waits on the compute device."""
    from engine.streaming.engine import StreamEngine

    regenerated, on_device = [], []
    original = StreamEngine._regenerate

    def regenerate(self, i, mb):
        regenerated.append(i)
        original(self, i, mb)
        on_device.extend(v for v in self.regenerated.values() if v is not None)

    monkeypatch.setattr(StreamEngine, "_regenerate", regenerate)
    cfg, eng, _ = build("stream", [*over, f"engine.recompute_group={every}", "engine.fused_kernels=false"])
    assert eng.stored_inputs == stored
    host_tier = "engine.activation_tier=gpu" not in over
    assert eng.regenerate_spares == ((every - 1) * cfg.train.grad_accum if host_tier else 0)
    eng.close()
    rec, w, m, _ = train("stream", [*over, f"engine.recompute_group={every}", "engine.fused_kernels=false"],
                         steps=3)
    ref_rec, ref_w, ref_m, _ = train("reference", over, steps=3)
    assert regenerated, "no group was regenerated"
    assert bool(on_device) != host_tier
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert_same(w, ref_w)
    assert_same(m, ref_m)


def test_fused_loss_is_exact_across_engines_and_matches_the_torch_chain(reference_runs):
    """The fused LM head + cross-entropy (Triton, under the interpreter here): both engines run it, bit for bit
    alike; against the chunked torch chain, fp32 rounding (other matmul groupings, dW summed over chunks in fp32)."""
    fused = ["train.fused_loss=on", "engine.fused_kernels=false"]
    ref_rec, ref_w, _, _ = train("reference", fused, steps=4)
    rec, w, _, _ = train("stream", [*fused, "engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"], steps=4)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert_same(w, ref_w)
    torch_rec = _reference(reference_runs, "qwen2", FAMILIES["qwen2"])
    torch.testing.assert_close(torch.tensor([r["loss"] for r in ref_rec]),
                               torch.tensor([r["loss"] for r in torch_rec[0][:4]]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_tied_embeddings_match_to_rounding(fused, reference_runs):
    """The embedding's sums of squares are taken at the lookup's last micro-batch, after the head's adds: taken
    any earlier they would miss part of the gradient, which the norms (clipping is active) would show."""
    tied = ["model.tie_word_embeddings=true"]
    ref_rec, ref_w, ref_m, _ = _reference(reference_runs, "tied", tied)
    rec, w, m, _ = train("stream", [*tied, f"engine.fused_kernels={str(fused).lower()}"])
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rec]), torch.tensor([r["loss"] for r in ref_rec]),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rec]),
                               torch.tensor([r["grad_norm"] for r in ref_rec]), rtol=1e-5, atol=0)
    assert all(r["grad_norm"] > 0.05 for r in ref_rec), "clipping must be active"
    # atol: k_proj's bias has a mathematically zero gradient (softmax ignores a per-query constant), so its
    # gradient is pure rounding noise, which Adam normalises into real updates; 2e-5 is 0.2% of one lr step.
    assert_same(w, ref_w, exact=False, rtol=1e-4, atol=2e-5)
    assert "lm_head.weight" not in w


def _inject_nan(unit, grads):
    if unit == 2:
        next(iter(grads.values())).view(-1)[3] = float("nan")


def test_streamed_units_are_updated_at_their_next_load(monkeypatch):
    """The placement tests above cannot pass by ignoring the split: here the streamed updates are counted. Units 1
    and 2 are updated while the next forward loads them (a slot to cast into), and once more by the flush before
    the final weights are read (no slot)."""
    from engine.streaming.streamed_update import StreamedUpdater

    calls = []
    update = StreamedUpdater.update
    monkeypatch.setattr(StreamedUpdater, "update",
                        lambda self, unit, opt, slot: calls.append((unit, slot is not None)) or update(self, unit, opt,
                                                                                                     slot))
    train("stream", ["engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"], steps=3)
    assert calls == [(1, True), (2, True)] * 2 + [(1, False), (2, False)]


def test_validation_between_steps_sees_the_pending_streamed_updates():
    """A GPU-streamed unit's update runs when the next forward loads it: an evaluation forward in between must apply
    it (and the next training step must not apply it twice)."""
    out = {}
    for engine, overrides in (("reference", []), ("stream", ["engine.gpu_resident_units=1",
                                                              "engine.gpu_streamed_units=3"])):
        cfg, eng, data = build(engine, overrides)
        t, evals, losses = cfg.train, [], []
        try:
            for step in range(4):
                batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size)
                           for j in range(t.grad_accum)]
                losses.append(eng.train_step(batches, optim.lr_at(step, t))["loss"])
                if step in (1, 2):
                    evals.append(eng.eval_loss([data.batch("val", 0, t.micro_batch_size)]))
            out[engine] = losses, evals, eng.master_weights()
        finally:
            eng.close()
    assert out["stream"][:2] == out["reference"][:2]
    assert_same(out["stream"][2], out["reference"][2])


@pytest.mark.parametrize("engine, overrides", [("reference", []), ("stream", []),
                                               ("stream", ["engine.gpu_resident_units=1",
                                                           "engine.gpu_streamed_units=2"])])
def test_nan_gradient_skips_step_and_leaves_state_untouched(engine, overrides):
    rec, _, _, snaps = train(engine, overrides, steps=4, grad_hook_at={2: _inject_nan})
    assert [r["skipped"] for r in rec] == [False, False, True, False]
    assert rec[2]["skipped_steps"] == 1
    (w1, m1), (w2, m2) = snaps[1], snaps[2]
    assert_same(w2, w1)
    assert_same(m2, m1)
    assert not all(torch.equal(snaps[3][0][k], w2[k]) for k in w2), "the step after the skip must update again"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_micro_batch_gradient_skips_the_step(fused, bad, monkeypatch):
    """A non-finite value in one micro-batch's gradient (not the last: the sums of squares are taken at the last
    add, of the accumulated result) makes the norm non-finite and skips the step, with no grad_hook involved."""
    from engine.streaming.gradients import GradAccumulator

    add, adds = GradAccumulator.add, []

    def poisoning_add(self, grads, sq_norms_out=None):
        adds.append(sq_norms_out is not None)
        if poison and len(adds) == 2:  # the head's second micro-batch of three
            grads = {k: g.clone() for k, g in grads.items()}
            next(iter(grads.values())).view(-1)[5] = bad
        add(self, grads, sq_norms_out)

    monkeypatch.setattr(GradAccumulator, "add", poisoning_add)
    cfg, eng, data = build("stream", [f"engine.fused_kernels={str(fused).lower()}"])
    t, records = cfg.train, []
    try:
        for step in range(3):
            poison = step == 1
            adds.clear()
            batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
            records.append(eng.train_step(batches, optim.lr_at(step, t)))
            if step == 0:
                before = eng.master_weights()
            elif step == 1:
                assert_same(eng.master_weights(), before)
    finally:
        eng.close()
    assert adds[:3] == [False, False, True], "the head's sums of squares are taken at its last micro-batch only"
    assert [r["skipped"] for r in records] == [False, True, False]
    assert not math.isfinite(records[1]["grad_norm"])


def test_nan_skip_identical_across_engines():
    ref = train("reference", [], steps=4, grad_hook_at={2: _inject_nan})
    out = train("stream", [], steps=4, grad_hook_at={2: _inject_nan})
    assert [r["loss"] for r in out[0]] == [r["loss"] for r in ref[0]]
    assert_same(out[1], ref[1])


@pytest.mark.parametrize("engine", ["reference", "stream"])
def test_unit_state_round_trip(engine):
    """State taken from one engine and loaded into a fresh one continues the run identically."""
    cfg, a, data = build(engine, [])
    _, b, _ = build(engine, ["seed=7"])
    continues_identically(a, b, data, cfg.train)


def continues_identically(a, b, data, t) -> None:
    """Two steps on engine `a`, its state loaded unit by unit into `b`, then one more step on each: the same loss,
    weights and moments. Closes both."""
    try:
        batches = [[data.batch("train", s * 3 + j, 2) for j in range(3)] for s in range(3)]
        for s in range(2):
            a.train_step(batches[s], optim.lr_at(s, t))
        for unit in range(len(a.spec.units)):
            st = a.unit_state(unit)
            b.load_unit_state(unit, st["master"], st["exp_avg"], st["exp_avg_sq"], st["step"])
        ra, rb = a.train_step(batches[2], optim.lr_at(2, t)), b.train_step(batches[2], optim.lr_at(2, t))
        assert ra["loss"] == rb["loss"]
        assert_same(a.master_weights(), b.master_weights())
        assert_same(a.adam_moments(), b.adam_moments())
    finally:
        a.close()
        b.close()


def test_kept_layers_are_not_recomputed():
    """With the last 2 of 3 layers' graphs kept, one step runs each layer forward once per micro-batch and
    recomputes only the first layer (placement tests above show the result is bit-identical)."""
    cfg, eng, data = build("stream", ["engine.keep_activation_layers=2", "engine.fused_kernels=false"])
    calls, recomputes = [], []
    layer, layer_grads = eng.spec.layer, eng.spec.layer_grads
    eng.spec.layer = lambda p, x, rope, i: calls.append(torch.is_grad_enabled()) or layer(p, x, rope, i)
    eng.spec.layer_grads = lambda p, x, dy, rope, i, **kw: recomputes.append(i) or layer_grads(p, x, dy, rope, i, **kw)
    t = cfg.train
    try:
        eng.train_step([data.batch("train", j, t.micro_batch_size) for j in range(t.grad_accum)], 1e-3)
    finally:
        eng.close()
    L, M = cfg.model.num_hidden_layers, t.grad_accum
    assert len(calls) == L * M and sum(calls) == 2 * M  # the forward: the kept layers' with autograd on
    assert recomputes == [0] * M  # the backward recomputes the first layer only (through the down projection's input)
