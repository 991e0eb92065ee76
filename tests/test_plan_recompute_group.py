"""Recompute groups in the planner (`engine.recompute_group`): which layer inputs are kept, the regenerated group's
GPU row, the extra forwards and weight loads in the predicted backward, and the search (g = 1 first, then the
smallest g that fits)."""

import re
from dataclasses import replace

import pytest

from engine.formats import StateFormat
from engine.model import ModelSpec
from engine.plan import GIB, PlanError, Speeds, StepShape, build_plan, predict_stream
from tests.util import FP32, make_cfg

# the Triton attention (SDPA's GQA backward would add 14 GiB of expanded K/V at this length, plan.layer_working_bytes)
# and a fixed process figure (h200.yaml's counts torch.compile's workers: fp32 state at 512K then fits no group)
LONG = ["model=qwen7b", "engine=stream", "hardware=h200", "train=bench", "train.micro_batch_size=1",
        "train.grad_accum=1", "train.seq_len=524288", "model.max_position_embeddings=524288", "train.attention=triton",
        "hardware.host_process_gib=1.83", "plan=true", *FP32]
SMALL_STATE = ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.grad_dtype=bf16"]
ACTIVATIONS = "layer-input activations (all micro-batches)"


def _plan(overrides, base=LONG, on_gpu=True, check=False):
    cfg = make_cfg([*base, *overrides])
    return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=on_gpu, check=check)


def _row(plan, item):
    (nbytes,) = [b for _, name, b in plan.rows if name.startswith(item)]
    return nbytes


def _layer_input_bytes():
    return 4 * 3584 * 524288  # fp32 x qwen7b's hidden x the step's tokens


def test_a_plan_that_fits_keeps_every_input_as_before():
    """qwen7b at 64K tokens/step fits with every input kept: g = 1, no regenerated row, one input per recomputed
    layer, and the same plan as asking for 1."""
    base = ["model=qwen7b", "engine=stream", "hardware=h200", "train=bench", "train.seq_len=4096",
            "train.micro_batch_size=2", "train.grad_accum=8", "plan=true"]
    auto, one = _plan([], base=base), _plan(["engine.recompute_group=1"], base=base)
    assert auto.placement.recompute_group == 1 and not auto.problem()
    assert not any(name.startswith("regenerated") for _, name, _ in auto.rows)
    recomputed = 28 - auto.placement.keep_activation_layers
    assert _row(auto, ACTIVATIONS) == recomputed * 4 * 3584 * 65536
    assert (auto.rows, auto.placement, auto.times_s) == (one.rows, one.placement, one.times_s)
    assert "recompute_group=1," in auto.table()


def test_auto_takes_the_smallest_group_that_fits_only_when_every_input_kept_does_not():
    """qwen7b at 512K tokens in fp32 state (the lean layer): 196 GiB of inputs fit with no g below 3; auto plans 3
    (the same plan as asking for it), and the table shows it."""
    auto = _plan([])
    assert not auto.problem() and auto.placement.recompute_group == 3
    assert auto.total("host") <= 125 * GIB and auto.total("gpu") <= 139 * GIB
    for g in (1, 2):
        assert _plan([f"engine.recompute_group={g}"]).problem(), g
    three = _plan(["engine.recompute_group=3"])
    assert (three.rows, three.placement, three.times_s) == (auto.rows, auto.placement, auto.times_s)
    assert "recompute_group=3," in auto.table()


def test_the_rows_count_the_kept_inputs_and_one_regenerated_group():
    """28 layers, none kept as graphs, g = 4: inputs 0, 4, ..., 24 are kept (7), and one group of 4 is regenerated
    on the GPU; a partial last group (25 recomputed layers, g = 4: 0, 4, ..., 24) keeps 7 as well, g = 5 keeps 6."""
    one_input = _layer_input_bytes()
    plan = _plan(["engine.keep_activation_layers=0", "engine.recompute_group=4"])
    assert _row(plan, ACTIVATIONS) == 7 * one_input
    assert ("gpu", "regenerated layer inputs (one group of 4, all micro-batches)", 4 * one_input) in plan.rows
    assert _row(_plan(["engine.keep_activation_layers=3", "engine.recompute_group=4"], check=False),
                ACTIVATIONS) == 7 * one_input
    assert _row(_plan(["engine.keep_activation_layers=0", "engine.recompute_group=5"]), ACTIVATIONS) == 6 * one_input


def test_an_explicit_group_size_is_kept_and_one_that_does_not_fit_is_refused():
    plan = _plan(["engine.recompute_group=6"])
    assert plan.placement.recompute_group == 6 and not plan.problem()
    with pytest.raises(PlanError) as e:
        _plan(["engine.recompute_group=2"], check=True)
    assert "recompute_group=2," in str(e.value) and "No engine.recompute_group" not in str(e.value)


def test_a_refusal_at_every_group_size_says_so_and_names_the_formats_that_fit_with_theirs():
    """Eager qwen7b with the plain layer at 512K in fp32 state fits at no g; smaller formats do, each with the g it
    needs (and the norm pass where only it fits)."""
    with pytest.raises(PlanError) as e:
        _plan(["train.compile=off", "train.lean_layer=off"], check=True)
    message = str(e.value)
    assert "No engine.recompute_group from 2 to 28 (recompute groups, one layer input kept per group) fits either" \
        in message
    assert "recompute_group=1," in message  # the plan shown is the one that keeps every input
    suggestions = [line for line in message.splitlines() if "fits with train.master_dtype=" in line]
    assert suggestions and all(re.search(r"engine\.recompute_group=\d+( engine\.norm_pass=on)?: host [\d.]+ GiB, "
                                         r"GPU [\d.]+ GiB"
                                         r"( \(int8 gradients train worse .*\))?$", line) for line in suggestions), suggestions


def test_the_low_precision_formats_fit_512k_with_smaller_groups():
    plan = _plan(SMALL_STATE)
    assert not plan.problem() and plan.placement.recompute_group == 2


def test_the_backward_pays_the_regenerating_forwards_and_weight_loads():
    """Same placement, g = 4 against 1: 28 recomputed layers in 7 groups are 21 extra layer forwards at the forward's
    speed (the backward is compute-bound at 512K) and 21 fewer inputs written over D2H in the forward; with compute
    made free, the backward's H2D pays 21 more weight loads (on the host tier the regenerated inputs go out and come
    back, so as many inputs cross as with every input kept)."""
    cfg = make_cfg([*LONG, "engine.keep_activation_layers=0", "engine.recompute_group=4",
                    "engine.activation_tier=host", "engine.grads_tier=gpu", "engine.cache_weights=off",
                    "engine.gpu_resident_units=0", "engine.gpu_streamed_units=0"])
    spec = ModelSpec(cfg.model)
    s = StepShape(spec, cfg, on_gpu=True, fmt=StateFormat.of(cfg.train))
    sp = Speeds(cfg.hardware, compiled=True)
    placement = build_plan(spec, cfg, 139.0, 1000.0, on_gpu=True).placement
    assert placement.recompute_group == 4
    four, one = (predict_stream(s, sp, replace(placement, recompute_group=g))[0] for g in (4, 1))
    assert four["backward"] - one["backward"] == pytest.approx(sp.layer_fwd_s(s, 21), rel=1e-9)
    assert one["forward_d2h"] - four["forward_d2h"] == pytest.approx(21 * _layer_input_bytes() / sp.d2h, rel=1e-9)
    sp.fwd = sp.bwd = sp.attn_fwd = sp.attn_bwd = 1e30
    four, one = (predict_stream(s, sp, replace(placement, recompute_group=g))[0] for g in (4, 1))
    weights = s.fmt.master_bytes(s.layer_numel) / sp.h2d
    assert four["backward"] - one["backward"] == pytest.approx(21 * weights, rel=1e-9)


@pytest.mark.parametrize("value, planned", [(-1, 1), (2, 2)])
def test_a_cpu_plan_takes_the_configured_group_size(value, planned):
    plan = _plan([f"engine.recompute_group={value}"], base=["model=tiny", "engine=stream"], on_gpu=False)
    assert plan.placement.recompute_group == planned


def test_attention_figures_time_the_layers_attention_apart():
    """At 512K tokens the attention is ~89% of a qwen7b layer's FLOPs. Attention figures equal to the layer figures
    predict what the layer figures alone do; at half those rates every layer's compute grows by its attention FLOPs
    over the layer rate, forward and backward (3 forwards with recompute), and the plan says which rates it used."""
    fixed = ["engine.keep_activation_layers=0", "engine.recompute_group=2", "engine.activation_tier=host",
             "engine.grads_tier=gpu", "engine.cache_weights=on", "engine.gpu_resident_units=30",
             "engine.gpu_streamed_units=0", "engine.kept_attention_layers=0", *SMALL_STATE]
    cfg = make_cfg([*LONG, *fixed, "hardware.attn_fwd_tflops=0", "hardware.attn_bwd_tflops=0"])
    spec = ModelSpec(cfg.model)
    s = StepShape(spec, cfg, on_gpu=True, fmt=StateFormat.of(cfg.train))
    assert 0.85 < s.layer_attn_fwd_flops / s.layer_fwd_flops < 0.95
    placement = build_plan(spec, cfg, 139.0, 125.0, on_gpu=True, check=False).placement
    hw = cfg.hardware
    plain = Speeds(hw, compiled=True, attention="triton")
    times = {}
    for name, scale in (("same", 1.0), ("half", 0.5)):
        rates = [f"hardware.attn_fwd_tflops={hw.fwd_tflops_compiled * scale}",
                 f"hardware.attn_bwd_tflops={hw.bwd_tflops_compiled * scale}",
                 "hardware.attn_seq_len=32768", "hardware.attn_backend=sdpa"]
        times[name] = predict_stream(s, Speeds(make_cfg([*LONG, *fixed, *rates]).hardware, True, "triton"),
                                     placement)[0]
    base = predict_stream(s, plain, placement)[0]
    for phase in ("forward_compute", "backward", "step"):
        assert times["same"][phase] == pytest.approx(base[phase], rel=1e-9), phase
    extra_fwd = s.layer_attn_fwd_flops / plain.fwd
    assert times["half"]["forward_compute"] - base["forward_compute"] == pytest.approx(28 * extra_fwd, rel=1e-9)
    # 28 layers' backward (3 forwards at the backward rate) and 14 regenerating forwards (groups of 2)
    extra_bwd = 28 * 3 * s.layer_attn_fwd_flops / plain.bwd + 14 * extra_fwd
    assert times["half"]["backward"] - base["backward"] == pytest.approx(extra_bwd, rel=1e-9)

    described = {name: _plan([*fixed, *over]).speeds for name, over in (
        ("none", ["hardware.attn_fwd_tflops=0", "hardware.attn_bwd_tflops=0"]),
        ("sdpa", ["hardware.attn_fwd_tflops=300", "hardware.attn_bwd_tflops=300", "hardware.attn_seq_len=32768",
                  "hardware.attn_backend=sdpa"]))}
    assert "attention timed at the layer's rate (no attention figures)" in described["none"]
    assert "attention at the figures of sdpa at 32768 tokens, the nearest measured length (the profile has no " \
        "triton figures: this run's attention is timed as sdpa)" in described["sdpa"]


def test_a_chunked_mlp_pays_one_more_mlp_forward_in_each_backward():
    """The MLP chunks are checkpointed: every layer's backward, kept graph or not, reruns its MLP forward, and the
    recompute of the 26 recomputed layers keeps its down projection (a whole MLP's recompute leaves it out). At 128K
    (auto: 32K-token chunks) the backward is 28 MLP forwards and 26 down projections longer than with the MLP whole;
    the forward phase is the same."""
    fixed = ["engine.keep_activation_layers=2", "engine.recompute_group=1", "engine.activation_tier=host",
             "engine.grads_tier=gpu", "engine.cache_weights=off", "engine.gpu_resident_units=30",
             "engine.gpu_streamed_units=0", *SMALL_STATE]
    base = [*(o for o in LONG if not o.startswith("train.seq_len")), "train.seq_len=131072", *fixed]
    shapes = {}
    for chunk in (-1, 0):
        cfg = make_cfg([*base, f"train.mlp_chunk_tokens={chunk}"])
        shapes[chunk] = (StepShape(ModelSpec(cfg.model), cfg, on_gpu=True, fmt=StateFormat.of(cfg.train)), cfg)
    (chunked, cfg), (whole, _) = shapes[-1], shapes[0]
    assert chunked.mlp_chunk_tokens == 32768 and whole.mlp_recompute_flops == 0
    assert chunked.mlp_recompute_flops == 2 * 3 * 3584 * 18944 * 131072  # gate, up and down over the step's tokens
    assert chunked.recompute_skipped_flops == 0 and whole.recompute_skipped_flops == 2 * 3584 * 18944 * 131072
    sp = Speeds(cfg.hardware, compiled=True)
    placement = build_plan(ModelSpec(cfg.model), cfg, 139.0, 125.0, on_gpu=True, check=False).placement
    t_chunked, t_whole = (predict_stream(s, sp, placement)[0] for s in (chunked, whole))
    assert t_chunked["forward"] == pytest.approx(t_whole["forward"], rel=1e-12)
    assert t_chunked["backward"] - t_whole["backward"] == \
        pytest.approx(28 * chunked.mlp_recompute_flops / sp.fwd + 26 * whole.recompute_skipped_flops / sp.bwd, rel=1e-9)


def test_on_the_host_tier_a_group_regenerates_into_host_memory():
    """The group's regenerated inputs wait in host memory (all but its kept input), one input fetched ahead on the
    GPU; on the GPU tier the whole group waits on the GPU."""
    one_input = _layer_input_bytes()
    host = _plan(["engine.keep_activation_layers=0", "engine.recompute_group=4", "engine.activation_tier=host"])
    assert ("host", "regenerated layer inputs (one group of 4 less its kept input, all micro-batches)",
            3 * one_input) in host.rows
    assert ("gpu", "layer input fetched ahead for the backward (one micro-batch)", one_input) in host.rows
    assert not any(tier == "gpu" and name.startswith("regenerated") for tier, name, _ in host.rows)
    gpu = _plan(["engine.keep_activation_layers=0", "engine.recompute_group=4", "engine.activation_tier=gpu"],
                check=False)
    assert ("gpu", "regenerated layer inputs (one group of 4, all micro-batches)", 4 * one_input) in gpu.rows


def test_qwen7b_at_512k_plans_to_fit_the_h100_machine_with_the_defaults():
    """One 512K sequence a step, qwen7b full depth, hardware=h100 (78.5 GiB HBM, 125 GiB host): the lean layer, the
    formats the planner picks and a recompute group regenerated into host memory fit both tiers."""
    cfg = make_cfg(["model=qwen7b", "hardware=h100", "plan=true", "train=bench", "train.micro_batch_size=1",
                    "train.grad_accum=1", "train.seq_len=524288", "model.max_position_embeddings=524288"])
    plan = build_plan(ModelSpec(cfg.model), cfg, cfg.hardware.gpu_mem_gib, cfg.hardware.profile_host_mem_gib,
                      on_gpu=True)
    assert not plan.problem() and plan.placement.recompute_group > 1 and plan.placement.activation_tier == "host"
    assert "working activations" in plan.table()


def test_a_kept_attention_output_saves_its_layers_attention_forward_in_the_backward():
    """qwen7b at 512K on the lean layer: each recomputed layer that keeps its attention output is timed with one
    attention forward less in its backward (compute-bound at this length), and planned as a GPU row."""
    fixed = ["engine.keep_activation_layers=0", "engine.recompute_group=2", "engine.activation_tier=host",
             "engine.grads_tier=gpu", "engine.cache_weights=on", "engine.gpu_resident_units=30",
             "engine.gpu_streamed_units=0", "engine.kept_attention_layers=3", "train.lean_layer=on", *SMALL_STATE]
    cfg = make_cfg([*LONG, *fixed])
    spec = ModelSpec(cfg.model)
    s = StepShape(spec, cfg, on_gpu=True, fmt=StateFormat.of(cfg.train))
    plan = build_plan(spec, cfg, 139.0, 125.0, on_gpu=True, check=False)
    assert plan.placement.kept_attention_layers == 3 and list(plan.placement.kept_attention_units) == [26, 27, 28]
    per_token = 2 * 28 * 128 + 4 * 28
    assert ("gpu", "attention outputs kept for the backward (3 lean layers, all micro-batches)",
            3 * per_token * 524288) in plan.rows
    sp = Speeds(cfg.hardware, compiled=True, attention="triton")
    kept, none = (predict_stream(s, sp, replace(plan.placement, kept_attention_layers=n))[0] for n in (3, 0))
    assert none["backward"] - kept["backward"] == pytest.approx(3 * s.layer_attn_fwd_flops / sp.attn_bwd, rel=1e-9)
