"""engine.norm_pass=on: clipping without holding gradients, against engine=reference on the CPU.

A norm-pass step runs the backward twice: the first takes every unit's sums of squares and drops the gradient, the
second computes the same gradients again (the same ops on the same weights and kept inputs) and updates each unit as
soon as its gradient is finished. Clipping is the same math, so training must be bit-identical to the reference,
with no gradient held anywhere between a unit's backward and its update.
"""

import pytest

from engine import optim
from engine.config import ConfigError
from tests.test_engine_equivalence import FAMILIES, MOE_STEPS, assert_same, build, continues_identically, train
from tests.util import make_cfg

ON = ["engine.norm_pass=on"]
# the fused accumulation kernel runs under the Triton interpreter on the CPU, ~5x the torch ops' time: one test
# below runs it, the others the torch path
TORCH_ADDS = ["engine.fused_kernels=false"]
INT8_MOMENTS = ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.moments_block_size=64",
                "train.grad_dtype=fp32"]


_REFERENCE_RUNS = {}  # (reference overrides, steps) -> engine=reference's run, shared by the tests of this file


def _same_training(overrides, steps, reference_overrides=None, fused=False):
    """The norm-pass stream run and the reference: the same losses and norms, clipping active, the same weights
    and moments bit for bit. Returns the stream run's records."""
    key = (tuple(reference_overrides or []), steps)
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = train("reference", reference_overrides or [], steps)
    ref_rec, ref_w, ref_m, _ = _REFERENCE_RUNS[key]
    rec, w, m, _ = train("stream", [*ON, *(reference_overrides or []), *overrides,
                                    f"engine.fused_kernels={str(fused).lower()}"], steps)
    assert [r["loss"] for r in rec] == [r["loss"] for r in ref_rec]
    assert [r["grad_norm"] for r in rec] == [r["grad_norm"] for r in ref_rec]
    assert sum(r["grad_norm"] > 0.05 for r in ref_rec) >= steps - 1, "clipping must be active"
    assert_same(w, ref_w)
    assert_same(m, ref_m)
    return rec


@pytest.mark.parametrize("placement", [
    [],  # the CPU default: every unit host-updated, gradients to the host in the second backward
    ["engine.gpu_resident_units=2", "engine.gpu_streamed_units=3"],  # every unit updated in the second backward
    ["engine.gpu_resident_units=1", "engine.gpu_streamed_units=2", "engine.slots=3"],  # all three places
    ["engine.recompute_group=2", "engine.gpu_streamed_units=3"],  # regenerated inputs in spare host entries, twice
    ["engine.recompute_group=3", "engine.activation_tier=gpu", "engine.gpu_streamed_units=5"],
    ["engine.activation_tier=gpu", "engine.gpu_resident_units=2"],  # GPU-tier inputs read by both backwards
])
def test_a_norm_pass_trains_exactly_as_the_reference(placement):
    rec = _same_training(placement, steps=4)
    assert all("norm_backward_s" in r and "backward_s" in r for r in rec)


def test_the_fused_accumulation_takes_the_norms_in_the_first_backward():
    _same_training(["engine.gpu_resident_units=1", "engine.gpu_streamed_units=4"], steps=2, fused=True)


def test_a_format_trains_exactly_with_a_norm_pass():
    """bf16 master and int8 moments, updated by the fused format kernel in the second backward: resident units on
    the compute stream, streamed ones through the staging buffers."""
    _same_training(["engine.gpu_resident_units=2"], steps=4, reference_overrides=INT8_MOMENTS)


def test_moe_routing_kept_by_the_forward_serves_both_backwards():
    """A MoE layer's backward reuses the routing its forward kept: the first backward must leave it for the
    second."""
    moe = FAMILIES["qwen3_moe"]
    _same_training(["engine.gpu_streamed_units=3", "engine.recompute_group=2"], steps=MOE_STEPS,
                   reference_overrides=moe)


def test_every_gpu_updated_unit_is_updated_in_the_second_backward_and_nothing_is_held(monkeypatch):
    """Each GPU-streamed unit's update is queued once a step, in the second backward (no slot to cast into), in
    backward order; no update waits for the next forward, and no gradient buffer exists beyond the shared
    accumulators and the host-updated units' host gradients."""
    from engine.streaming.streamed_update import StreamedUpdater

    calls = []
    update = StreamedUpdater.update
    monkeypatch.setattr(StreamedUpdater, "update", lambda self, unit, step, slot: calls.append(
        (unit, slot is None, self.pending.keys() == {unit})) or update(self, unit, step, slot))
    cfg, eng, data = build("stream", [*ON, *TORCH_ADDS, "engine.gpu_resident_units=1", "engine.gpu_streamed_units=3"])
    t = cfg.train
    try:
        assert eng.held == {} and eng.device_accs == {} and len(eng.layer_accs) == 2
        with_grads = [u for u, g in enumerate(eng.store.grads) if g.numel()]
        assert with_grads == [4], "only the host-updated head has a host gradient buffer"
        for step in range(2):
            batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size) for j in range(t.grad_accum)]
            eng.train_step(batches, optim.lr_at(step, t))
            assert not eng.streamed.pending and not eng.gpu_grads
            assert calls == [(u, True, True) for u in (3, 2, 1)] * (step + 1)
    finally:
        eng.close()


def test_a_skipped_step_runs_no_second_backward(monkeypatch):
    from engine.streaming.engine import StreamEngine

    backwards = []
    original = StreamEngine._backward
    monkeypatch.setattr(StreamEngine, "_backward",
                        lambda self, dx, hook: backwards.append(self.first_pass) or original(self, dx, hook))

    def nan_in_layer_1(unit, grads):
        if unit == 2:
            next(iter(grads.values())).view(-1)[3] = float("nan")

    over = [*ON, *TORCH_ADDS, "engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"]
    rec, _, _, snaps = train("stream", over, steps=3, grad_hook_at={1: nan_in_layer_1})
    assert [r["skipped"] for r in rec] == [False, True, False]
    assert backwards == [True, False, True, True, False]
    assert_same(snaps[1][0], snaps[0][0])
    assert_same(snaps[1][1], snaps[0][1])


def test_validation_and_resume_between_norm_pass_steps():
    """An evaluation between steps sees the updated weights (the second backward updated them already), and the
    state read unit by unit continues the run identically in a fresh engine."""
    out = {}
    for engine, overrides in (("reference", []), ("stream", [*ON, *TORCH_ADDS, "engine.gpu_streamed_units=5"])):
        cfg, eng, data = build(engine, overrides)
        t, evals = cfg.train, []
        try:
            for step in range(3):
                batches = [data.batch("train", step * t.grad_accum + j, t.micro_batch_size)
                           for j in range(t.grad_accum)]
                eng.train_step(batches, optim.lr_at(step, t))
                evals.append(eng.eval_loss([data.batch("val", 0, t.micro_batch_size)]))
            out[engine] = evals
        finally:
            eng.close()
    assert out["stream"] == out["reference"]
    split = [*ON, *TORCH_ADDS, "engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"]
    cfg, a, data = build("stream", split)
    _, b, _ = build("stream", [*split, "seed=7"])
    continues_identically(a, b, data, cfg.train)


@pytest.mark.parametrize("override, named", [
    ("train.grad_dtype=bf16", "train.grad_dtype=bf16"),
    ("engine.keep_activation_layers=1", "engine.keep_activation_layers=1"),
    ("engine.grads_tier=gpu", "engine.grads_tier=gpu"),
    ("engine.cache_weights=on", "engine.cache_weights=on"),
])
def test_settings_a_norm_pass_contradicts_are_refused(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        make_cfg([*ON, override])


def test_a_placement_with_a_norm_pass_that_keeps_graphs_is_not_one():
    from engine.placement import Placement

    with pytest.raises(ValueError, match="norm pass"):
        Placement(n_units=5, keep_activation_layers=1, norm_pass=True)
    assert Placement(n_units=5, norm_pass=True).norm_pass
