"""The planner's refusals: every memory tier that overflows is named with its numbers."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from engine.config import AttentionPoint, ConfigError, LayerWidthFigures, validate
from engine.formats import StateFormat, all_formats
from engine.model import ModelSpec
from engine.plan import GIB, PlanError, attention_rates, build_plan, width_rates
from tests.util import FP32, make_cfg


def test_a_refusal_names_every_tier_that_does_not_fit():
    cfg = make_cfg(["model=qwen72b", "engine=stream", "hardware=rtx3090", "train.seq_len=4096",
                    "train.micro_batch_size=1", "plan=true"])
    with pytest.raises(PlanError) as e:
        build_plan(ModelSpec(cfg.model), cfg, gpu_gib=24.0, host_gib=125.0, on_gpu=True)
    message = str(e.value).split("\n\n")[-1]
    assert "of gpu memory where the hardware config allows 24.0 GiB" in message
    assert "of host memory where the hardware config allows 125.0 GiB" in message


def test_a_refusal_of_one_tier_names_only_that_tier():
    cfg = make_cfg(["model=qwen7b", "engine=reference", "train.seq_len=4096", "train.micro_batch_size=1"])
    with pytest.raises(PlanError) as e:
        build_plan(ModelSpec(cfg.model), cfg, gpu_gib=24.0, host_gib=125.0, on_gpu=True)
    message = str(e.value).split("\n\n")[-1]
    assert "of gpu memory" in message and "host memory" not in message and "engine=stream" in message


def test_a_memory_cap_is_not_another_card(monkeypatch):
    """On an H200, hardware=rtx3090 would plan with a 3090's speeds: refused, naming the cap that does what was
    meant; hardware.other_card=true asks for those figures on purpose; the cap keeps the profile's speeds."""
    from engine import hardware
    from engine.config import ConfigError

    monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    with pytest.raises(ConfigError, match=r"hardware=h200 hardware.gpu_mem_cap_gib=24; .*hardware.other_card=true"):
        hardware.resolve(make_cfg(["hardware=rtx3090"], validated=False))
    hardware.resolve(make_cfg(["hardware=rtx3090", "hardware.other_card=true"], validated=False))
    capped = make_cfg(["hardware=h200", "hardware.gpu_mem_cap_gib=24"], validated=False)
    hardware.resolve(capped)
    assert hardware.usable_gpu_gib(capped.hardware, card_gib=140.4) == 24.0
    h200 = OmegaConf.load(hardware.PROFILE_DIR / "h200.yaml")
    assert capped.hardware.fwd_tflops_compiled == h200.fwd_tflops_compiled  # the H200's figures, not another card's
    assert hardware.usable_gpu_gib(make_cfg(["hardware=h200"], validated=False).hardware, card_gib=140.4) == 139.0
    assert hardware.usable_gpu_gib(make_cfg([], validated=False).hardware, card_gib=0.0) == 0.0


def _stream_plan(overrides, gpu_gib=139.0):
    cfg = make_cfg(["model=qwen7b", "engine=stream", "hardware=h200", "train=bench", "train.seq_len=4096",
                    "plan=true", *overrides])
    return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=gpu_gib, host_gib=125.0, on_gpu=True, check=False)


def test_the_split_uses_all_three_places_when_hbm_is_short_of_the_whole_state():
    """qwen7b at 64K tokens/step on an H200: 91 GB of state does not fit beside the activations, so some units
    stream their state and some go to the host; the prediction hides the update under the forward."""
    plan = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=8"])
    p = plan.placement
    n_units = 30
    assert p.gpu_resident_units > 0 and p.gpu_streamed_units > 0
    assert p.gpu_resident_units + p.gpu_streamed_units < n_units
    assert not plan.problem()
    assert plan.times_s["exposed_wait"] <= 0.01 * plan.times_s["step"]
    assert "GPU-streamed" in plan.table() and "calibrat" in plan.table()


def test_transfers_while_the_host_adamw_runs_move_at_the_links_rate_under_it():
    """With host-updated units, the loads that start while their AdamW runs take bidir_gbps / bidir_gbps_under_adam
    times as long (at most twice here: half the rate), so the forward's transfers and the forward grow; without a
    host-updated unit, or without the figure, nothing changes."""
    fixed = ["train.micro_batch_size=2", "train.grad_accum=8", "engine.keep_activation_layers=0"]
    with_host = [*fixed, "engine.gpu_resident_units=2", "engine.gpu_streamed_units=17"]
    alone = _stream_plan([*with_host, "hardware.bidir_gbps_under_adam=0"]).times_s
    loaded = _stream_plan([*with_host, "hardware.bidir_gbps_under_adam=49.355"]).times_s  # half the H200's link
    assert alone["host_adamw"] == loaded["host_adamw"] > 0
    assert alone["forward_h2d"] < loaded["forward_h2d"] < 2 * alone["forward_h2d"]
    assert alone["forward"] < loaded["forward"]
    no_host = [*fixed, "engine.gpu_resident_units=2", "engine.gpu_streamed_units=28"]
    alone = _stream_plan([*no_host, "hardware.bidir_gbps_under_adam=0"]).times_s
    loaded = _stream_plan([*no_host, "hardware.bidir_gbps_under_adam=49.355"]).times_s
    assert alone["host_adamw"] == 0 and alone == loaded


@pytest.mark.parametrize("engine", ["stream", "reference"])
def test_an_eager_run_plans_its_process_without_the_compile_workers(engine):
    """torch.compile's worker processes (hardware.host_compile_workers_gib of host_process_gib) exist only when the
    templates are compiled: an eager run's process row is that much smaller."""
    row = "this process"
    base = ["train.micro_batch_size=2", "train.grad_accum=2", f"engine={engine}"]
    compiled, eager = (next(b for tier, item, b in _stream_plan([*base, f"train.compile={c}"]).rows
                            if tier == "host" and item.startswith(row)) for c in ("on", "off"))
    hw = make_cfg(["hardware=h200", "plan=true"]).hardware
    assert hw.host_compile_workers_gib > 0
    assert compiled == int(hw.host_process_gib * GIB)
    assert eager == int((hw.host_process_gib - hw.host_compile_workers_gib) * GIB)


def test_a_smaller_gpu_moves_units_off_it_and_a_fixed_split_is_kept():
    roomy = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=2"]).placement
    small = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=2"], gpu_gib=60.0).placement
    assert small.gpu_resident_units < roomy.gpu_resident_units
    fixed = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=2", "engine.gpu_resident_units=3",
                          "engine.gpu_streamed_units=7"]).placement
    assert (fixed.gpu_resident_units, fixed.gpu_streamed_units) == (3, 7)


def test_without_calibrated_speeds_every_update_stays_on_the_host():
    zero = [f"hardware.{k}_tflops_{m}=0" for k in ("fwd", "bwd", "head") for m in ("compiled", "eager")]
    plan = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=8", *zero])
    assert (plan.placement.gpu_resident_units, plan.placement.gpu_streamed_units) == (0, 0)
    assert not plan.times_s


def test_the_calibrated_process_memory_is_planned_on_the_host():
    base = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=2", "hardware.host_process_gib=0"])
    with_process = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=2", "hardware.host_process_gib=2.5"])
    assert with_process.total("host") - base.total("host") == int(2.5 * 2**30)


def test_spare_hbm_keeps_graphs_where_that_is_fastest_and_a_fixed_count_is_kept():
    """qwen3b at 32K tokens/step leaves HBM beyond the whole state: the planner keeps the last layers' graphs (no
    recompute), as many as fit, and predicts a shorter backward than with none; an explicit count is honoured."""
    def qwen3b(overrides):
        cfg = make_cfg(["model=qwen3b", "engine=stream", "hardware=h200", "train=bench", "train.seq_len=4096",
                        "train.micro_batch_size=8", "train.grad_accum=1", "plan=true", *overrides])
        return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False)

    auto, none = qwen3b([]), qwen3b(["engine.keep_activation_layers=0"])
    assert auto.placement.keep_activation_layers > 0 and none.placement.keep_activation_layers == 0
    assert auto.times_s["backward"] < none.times_s["backward"] and auto.times_s["step"] < none.times_s["step"]
    assert not auto.problem() and auto.total("gpu") <= 139.0 * 2**30
    assert qwen3b(["engine.keep_activation_layers=3"]).placement.keep_activation_layers == 3


def test_the_margin_is_reserved_not_allocated():
    plan = _stream_plan(["train.micro_batch_size=2", "train.grad_accum=2"])
    assert 0 < plan.allocated("gpu") < plan.total("gpu")
    assert plan.total("gpu") - plan.allocated("gpu") == int((2.0 + 0.05 * 139.0) * 2**30)
    assert plan.allocated("host") == plan.total("host")


class _SdpaLike(torch.autograd.Function):
    """Stands in for a fused SDPA backend (the CPU's math backend would save the score matrix): saves q, k, v, its
    output and an fp32 log-sum-exp, and returns the output in [B, H, T, D] as SDPA does."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_zeros(q.shape)
        ctx.save_for_backward(q, k, v, out, q.new_zeros(q.shape[:3], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *_ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_eager_layer_graph_bytes_are_what_autograd_saves(monkeypatch, qk_norm):
    """The planner's eager count per token equals the bytes the saved-tensor hooks see around `decoder_layer` under
    bf16 autocast (parameters, the layer input and the RoPE tables excluded: they live elsewhere), with and without
    Qwen3's qk-norm."""
    from engine.model import attention, dense
    from engine.plan import layer_activation_bytes_per_token

    monkeypatch.setattr(attention, "HAVE_FLASH_ATTN", False)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, is_causal, enable_gqa: _SdpaLike.apply(q, k, v))
    cfg = make_cfg(["model.hidden_size=72", "model.intermediate_size=100", "model.num_hidden_layers=1",
                    "model.num_attention_heads=6", "model.num_key_value_heads=2", "model.vocab_size=256",
                    *(["model.model_type=qwen3", "model.qkv_bias=false", "model.qk_norm=true"] if qk_norm else [])])
    spec = ModelSpec(cfg.model)
    B, T = 2, 37
    params = {s.name: torch.randn(s.shape, requires_grad=True) for s in spec.units[1].layout.specs}
    x = torch.randn(B, T, spec.arch.hidden, requires_grad=True)
    rope = spec.positions(T, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the engine's slots hold bf16 matrices: no weight casts
        params = {k: (v.to(torch.bfloat16) if v.dim() == 2 else v) for k, v in params.items()}
    elsewhere = {t.untyped_storage().data_ptr() for t in [x, rope.cos, rope.sin, *params.values()]}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in elsewhere:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dense.decoder_layer(params, x, rope, spec.arch)
    measured = sum(saved.values()) / (B * T)
    counted = layer_activation_bytes_per_token(spec, 2, compiled=False)
    assert measured == counted
    assert counted > 1.5 * layer_activation_bytes_per_token(spec, 2, compiled=True)


def test_an_eager_run_plans_fewer_kept_graphs_than_a_compiled_one():
    over = ["model=qwen3b", "engine=stream", "hardware=h200", "train.seq_len=4096", "train.micro_batch_size=4",
            "train.grad_accum=4", "plan=true"]
    spec = ModelSpec(make_cfg(over).model)
    kept = {}
    for mode in ("on", "off"):
        cfg = make_cfg(over + [f"train.compile={mode}"])
        kept[mode] = build_plan(spec, cfg, 139.0, 125.0, on_gpu=True).placement.keep_activation_layers
    assert kept["off"] < kept["on"]


def test_sharded_state_plans_the_fullest_ranks_share_of_the_host_state():
    """qwen32b over 8 ranks of an 8-card host (engine/distributed.py): each rank plans in 1/8 of the host with the
    host-state units of the rank that holds the most, whole units balanced by size: within a layer of 1/8, in bytes
    and in the time of its host AdamW and of its link's loads."""
    from engine.distributed import state_owners

    # the sharding's arithmetic at a fixed per-process figure (h100.yaml's 9.2 GiB, torch.compile's workers on a
    # 16-core machine included, would not leave this rank's share room: 74.6 of 69.6 GiB), with the link as fast
    # under the host AdamW as alone (the contention has a test of its own)
    cfg = make_cfg(["model=qwen32b", "engine=stream", "hardware=h100x8", "train.seq_len=4096",
                    "train.micro_batch_size=1", "train.grad_accum=1", "engine.gpu_resident_units=0",
                    "engine.gpu_streamed_units=0", "hardware.host_process_gib=2", "hardware.bidir_gbps_under_adam=0",
                    "plan=true"])
    spec = ModelSpec(cfg.model)
    # the H100's figures, the 8-card host's RAM
    assert cfg.hardware.profile_host_mem_gib == 557.0 and cfg.hardware.h2d_gbps > 0
    whole, shard = (build_plan(spec, cfg, gpu_gib=78.5, host_gib=557.0 / 8, on_gpu=True, check=False, state_ranks=n)
                    for n in (1, 8))
    state_row = lambda plan: next(b for tier, item, b in plan.rows if tier == "host" and "Adam m + v" in item)  # noqa
    owner = state_owners(spec, shard.placement.gpu_resident_units, 8)
    fullest = max(sum(spec.units[u].layout.numel for u in owner if owner[u] == r) for r in range(8))
    assert state_row(shard) == 12 * fullest  # fp32 master + m + v of the fullest rank's units
    layer = spec.units[1].layout.numel
    assert state_row(whole) / 8 <= state_row(shard) <= state_row(whole) / 8 + 12 * layer
    assert "this rank's" in next(item for tier, item, b in shard.rows if "Adam m + v" in item)
    assert whole.problem() and not shard.problem()  # 391 GB of fp32 state does not fit 70 GiB; its eighth does
    # each rank's CPU updates and each rank's link loads its own units: the busiest rank's share of the work
    for phase, per_param_s in (("host_adamw", 1 / (cfg.hardware.cpu_adam_gparams_per_s_under_pcie * 1e9)),
                               ("forward_h2d", 4 / (cfg.hardware.h2d_gbps * 1e9))):
        assert whole.times_s[phase] / 8 <= shard.times_s[phase] <= whole.times_s[phase] / 8 + layer * per_param_s
    assert shard.times_s["forward_h2d"] == pytest.approx(4 * fullest / (cfg.hardware.h2d_gbps * 1e9))


def test_a_low_precision_master_plans_the_fp32_copies_it_is_drawn_in():
    """HostStore draws a bf16 master in fp32, a few units at once (`init_copies`: at most 4, within 8 GiB of
    copies, at least one); the host plan is the larger of that start-up and the steady state."""
    from engine.streaming.host_store import init_copies

    assert init_copies("fp32", [10**9]) == 0 and init_copies("bf16", []) == 0
    assert init_copies("bf16", [10**6] * 3) == 3 and init_copies("bf16", [10**6] * 9) == 4
    assert init_copies("bf16", [3 * 10**9, 10**6]) == 1  # a gpt-oss-120b layer: 12 GB a copy, one at a time
    over = ["model=qwen7b", "engine=stream", "train.seq_len=1024", "train.micro_batch_size=1", "train.grad_accum=1",
            "engine.gpu_resident_units=27", "engine.gpu_streamed_units=3", "hardware.host_process_gib=1.5"]
    low = make_cfg([*over, "train.master_dtype=bf16", "train.moments_dtype=int8", "train.grad_dtype=bf16"])
    spec = ModelSpec(low.model)
    plan = build_plan(spec, low, gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False)
    held = [u.layout.numel for u in spec.units[27:]]  # two layers and the head
    startup = 2 * sum(held) + 3 * 4 * max(held) + int(1.5 * 2**30)
    assert [r for r in plan.rows if "start-up peak" in r[1]] and plan.total("host") == startup
    exact = build_plan(spec, make_cfg(over), gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False)
    assert not [r for r in exact.rows if "start-up" in r[1]]  # an fp32 master is drawn in place


def _moe_entry(model, tokens, fwd, bwd, shape=(2880, 32, 4, 2880)):
    hidden, experts, top_k, width = shape
    return (f"{{model:{model},hidden:{hidden},experts:{experts},experts_per_token:{top_k},expert_width:{width},"
            f"tokens:{tokens},fwd_tflops_compiled:{fwd},bwd_tflops_compiled:{bwd}}}")


def test_a_moe_plan_times_its_layers_at_the_moe_figures_or_says_it_has_none():
    """Without MoE figures a MoE plan says its layers are timed at a dense layer's; with them (the same placement)
    its backward is that much longer as the MoE rate is lower, and it names the layer they were measured on."""
    def plan(overrides):
        cfg = make_cfg([*overrides, "hardware=h200", "plan=true"])
        return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False)

    note = "MoE layers are timed at a dense layer's figures"
    dense = plan(["experiment=bench_gptoss20b_h200"])
    assert note in dense.speeds and note not in plan(["experiment=bench_qwen14b_h200"]).speeds
    fixed = [f"engine.{k}={v}" for k, v in dense.placement_settings().items()]  # the same placement whatever the speeds
    dense = plan(["experiment=bench_gptoss20b_h200", *fixed])
    h200 = make_cfg(["hardware=h200", "plan=true"]).hardware
    fwd, bwd = h200.fwd_tflops_compiled, h200.bwd_tflops_compiled
    tokens = 4096  # the recipe: one sequence of 4096 a layer call
    same, slow = (plan(["experiment=bench_gptoss20b_h200", *fixed,
                        f"hardware.moe_layers=[{_moe_entry('gptoss20b', tokens, fwd, bwd / k)}]"]) for k in (1, 4))
    assert f"MoE layers at the figures of gptoss20b's layer at {tokens} tokens a layer call" in same.speeds
    assert note not in same.speeds and "nearest" not in same.speeds
    assert same.times_s == dense.times_s
    assert slow.times_s["forward_compute"] == dense.times_s["forward_compute"]
    assert slow.times_s["backward"] > 3 * dense.times_s["backward"] * 0.9


def test_moe_layers_are_timed_at_their_own_shapes_figures_interpolated_in_tokens():
    """Of several calibrated MoE layers a run takes its own shape's (not another model's, whatever their order), its
    tokens a layer call between two measured ones at rates interpolated in log(tokens) and outside them at the
    nearest one's; a shape never calibrated takes the nearest shape's and the plan says so."""
    from engine.plan.speeds import MoeShape, moe_rates

    qwen3 = (2048, 128, 8, 768)
    hw = make_cfg(["hardware=h100", "hardware.moe_layers=[" + ",".join(
        [_moe_entry("gptoss20b", 8192, 400, 300), _moe_entry("qwen3_30b_a3b", 8192, 200, 100, qwen3),
         _moe_entry("qwen3_30b_a3b", 32768, 300, 200, qwen3)]) + "]", "plan=true"]).hardware
    shape = MoeShape(*qwen3)
    rates, note = moe_rates(hw, "compiled", shape, 16384)
    assert rates == pytest.approx((250, 150)) and "qwen3_30b_a3b" in note and "between 8192 and 32768" in note
    assert moe_rates(hw, "compiled", shape, 4096)[0] == (200, 100)
    rates, note = moe_rates(hw, "compiled", shape, 65536)
    assert rates == (300, 200) and "at 32768 tokens a layer call (this run: 65536)" in note
    rates, note = moe_rates(hw, "compiled", MoeShape(2880, 32, 4, 2880), 16384)
    assert rates == (400, 300) and "nearest" not in note
    # gpt-oss-120b: gpt-oss-20b's matmul shapes, each expert a quarter of the tokens; nearer than Qwen3's
    rates, note = moe_rates(hw, "compiled", MoeShape(2880, 128, 4, 2880), 16384)
    assert rates == (400, 300) and "the nearest calibrated MoE layer to this model's: hidden 2880, 128 experts" in note
    assert moe_rates(hw, "eager", shape, 16384)[0] is None  # no eager figures: the dense layer's, said so


def test_moe_layers_in_steps_run_at_the_profiles_in_step_ratio_of_their_figures():
    """hardware.moe_step_ratio slows a MoE run's layer rates by that factor, says so in the speeds line, and leaves a
    dense run's alone."""
    from engine.plan.speeds import MoeShape, Speeds

    def speeds(ratio, moe=MoeShape(2880, 32, 4, 2880)):
        hw = make_cfg(["hardware=h100", f"hardware.moe_step_ratio={ratio}", "plan=true"]).hardware
        return Speeds(hw, True, "sdpa", moe, 2880, 4096, mb_tokens=16384), hw

    (alone, hw), (in_step, _) = speeds(0), speeds(1.25)
    assert (in_step.fwd, in_step.bwd) == pytest.approx((alone.fwd / 1.25, alone.bwd / 1.25))
    assert "1.25x their time inside steps" in in_step.describe(hw) and "inside steps" not in alone.describe(hw)
    assert speeds(1.25, moe=None)[0].fwd == speeds(0, moe=None)[0].fwd


def test_layers_of_another_width_are_timed_at_that_widths_calibrated_rates():
    """With a second calibrated width, layers between the two are timed at rates interpolated in log(hidden), at a
    calibrated width at exactly its figures and outside them at the nearest one's; a mode that width has no figures
    for, or a profile without other widths, keeps the main figures. The plan says which it used."""
    cfg = make_cfg(["hardware=h200", "plan=true"])
    hw = cfg.hardware
    keys = ("fwd_tflops_compiled", "bwd_tflops_compiled", "head_tflops_compiled")
    main = tuple(hw[k] for k in keys)
    assert width_rates(hw, "compiled", 2048) == (main, "")  # no other width: the main figures, no note
    hw.layer_widths = [LayerWidthFigures(model="qwen3b", hidden=2048, **{k: hw[k] / 2 for k in keys})]
    validate(cfg)
    half = tuple(r / 2 for r in main)
    assert width_rates(hw, "compiled", 3584) == (main, "layers at the figures of calibrated width 3584 (qwen7b)")
    assert width_rates(hw, "compiled", 2048) == (half, "layers at the figures of calibrated width 2048 (qwen3b)")
    rates, note = width_rates(hw, "compiled", round(math.sqrt(2048 * 3584)))  # halfway in log(hidden)
    assert rates == pytest.approx(tuple(0.75 * r for r in main), rel=1e-3)
    assert note.endswith("between calibrated widths 2048 (qwen3b) and 3584 (qwen7b)")
    assert width_rates(hw, "compiled", 8192)[0] == main and width_rates(hw, "compiled", 896)[0] == half
    assert "nearest calibrated width, 2048 (qwen3b); this model's 896" in width_rates(hw, "compiled", 896)[1]
    eager = tuple(hw[k.replace("compiled", "eager")] for k in keys)
    assert width_rates(hw, "eager", 2048) == (eager, "")  # that width has no eager figures
    assert width_rates(hw, "compiled", 0) == (main, "")  # the run's width unknown


def test_attention_is_timed_at_the_runs_backends_figures_at_its_length():
    """The main attention figures and `attn_points` are (backend, length) points: a run's attention takes its own
    backend's, interpolated in log(length) between the nearest two, the nearest outside them; a backend without
    figures takes the main backend's and the note says so."""
    cfg = make_cfg(["hardware=h100", "plan=true"])
    hw = cfg.hardware
    assert (hw.attn_backend, hw.attn_seq_len) == ("sdpa", 32768)
    main = (hw.attn_fwd_tflops, hw.attn_bwd_tflops)
    hw.attn_points = []  # the profile's own points aside: a profile without triton figures
    assert attention_rates(hw, "triton", 524288) == (main, "attention at the figures of sdpa at 32768 tokens, the "
                                                     "nearest measured length (the profile has no triton figures: "
                                                     "this run's attention is timed as sdpa)")
    hw.attn_points = [AttentionPoint(backend="triton", seq_len=32768, fwd_tflops=400.0, bwd_tflops=300.0),
                      AttentionPoint(backend="triton", seq_len=524288, fwd_tflops=200.0, bwd_tflops=100.0),
                      AttentionPoint(backend="sdpa", seq_len=131072, fwd_tflops=500.0, bwd_tflops=450.0)]
    validate(cfg)
    assert attention_rates(hw, "triton", 524288) == ((200.0, 100.0), "attention at the figures of triton at 524288 "
                                                     "tokens")
    rates, note = attention_rates(hw, "triton", 131072)  # halfway in log(length) from 32K to 512K
    assert rates == pytest.approx((300.0, 200.0)) and note.endswith("between 32768 and 524288")
    assert attention_rates(hw, "triton", 8192)[0] == (400.0, 300.0)
    assert attention_rates(hw, "sdpa", 1 << 20)[0] == (500.0, 450.0)
    assert attention_rates(hw, "sdpa", 65536)[0] == pytest.approx(((main[0] + 500) / 2, (main[1] + 450) / 2))
    assert attention_rates(hw, "triton", 0)[0] == main  # the run's length unknown: the main figures
    hw.attn_points.append(AttentionPoint(backend="sdpa", seq_len=32768, fwd_tflops=1.0, bwd_tflops=1.0))
    with pytest.raises(ConfigError, match=r"attn_points\[3\] \(sdpa at 32768 tokens\) repeats the point of "
                                          "hardware.attn_backend"):
        validate(cfg)
    hw.attn_points[3] = AttentionPoint(backend="cudnn", seq_len=65536, fwd_tflops=1.0, bwd_tflops=1.0)
    with pytest.raises(ConfigError, match=r"attn_points\[3\].backend='cudnn' is not valid"):
        validate(cfg)


def test_a_run_on_the_triton_kernel_at_512k_is_timed_at_the_kernels_figures():
    """qwen7b at 512K on an H100 profile: with the Triton kernel's own (slower) figures at 512K the step is
    predicted longer than at SDPA's 32K figures, and the speeds line names them."""
    plans = []
    for points in ([], [AttentionPoint(backend="triton", seq_len=524288, fwd_tflops=300.0, bwd_tflops=250.0)]):
        cfg = make_cfg(["experiment=bench_qwen7b_512k_h100", "hardware=h100", "plan=true", "train.attention=triton"])
        cfg.hardware.attn_points = points
        validate(cfg)
        plans.append(build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=125.0, on_gpu=True, check=False))
    as_sdpa, as_triton = plans
    assert "timed as sdpa" in as_sdpa.speeds and "figures of triton at 524288 tokens" in as_triton.speeds
    assert as_triton.times_s["step"] > 1.5 * as_sdpa.times_s["step"]


def test_a_link_bound_forward_says_how_many_more_tokens_would_hide_the_stream():
    """gpt-oss-20b at 16K tokens a step on an H100 streams its weights several times longer than its forward
    computes: the plan says so with the factor; 8x the tokens a step brings the factor to about 1 (the stream's
    time stays, the compute grows) and a dense qwen7b step at 512K says nothing."""
    def plan(over):
        cfg = make_cfg(["experiment=bench_gptoss20b_h200", "hardware=h100", "plan=true", "train.seq_len=4096",
                        "train.micro_batch_size=1", *over])
        return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=125.0, on_gpu=True, check=False)

    # the held gradients stay on the GPU in both plans, so that the stream is the same
    few, many = plan(["train.grad_accum=4", "engine.host_grad_units=0"]), \
        plan(["train.grad_accum=32", "engine.host_grad_units=0"])
    ratio = few.link_bound_ratio()
    assert ratio > 4
    assert f"the forward streams its weights {ratio:.1f}x longer than it computes" in few.table()
    assert f"about {ratio:.1f}x the tokens a step" in few.table()
    assert many.link_bound_ratio() == pytest.approx(ratio / 8, rel=0.05)
    cfg = make_cfg(["experiment=bench_qwen7b_512k_h100", "hardware=h100", "plan=true"])
    dense = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=125.0, on_gpu=True, check=False)
    assert dense.link_bound_ratio() < 1 and "streams its weights" not in dense.table()


def test_a_calibrated_narrower_layer_lengthens_the_plan_of_a_model_of_that_width():
    """qwen3b with a fixed placement: its layers at a calibrated 2048-wide layer's half rates take twice the
    compute of the plan at the qwen7b layer's figures, and the plan's speeds line names the width."""
    over = ["model=qwen3b", "engine=stream", "hardware=h200", "train=bench", "train.seq_len=4096", "plan=true",
            "train.micro_batch_size=2", "train.grad_accum=2", "engine.gpu_resident_units=36",
            "engine.gpu_streamed_units=0", "engine.keep_activation_layers=0"]
    plans = []
    for rate in (1.0, 0.5):
        cfg = make_cfg(over)
        hw = cfg.hardware
        hw.layer_widths = [LayerWidthFigures(model="qwen3b", hidden=2048, **{
            k: hw[k] * rate for k in ("fwd_tflops_compiled", "bwd_tflops_compiled", "head_tflops_compiled")})]
        validate(cfg)
        plans.append(build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False))
    same, slow = plans
    assert "calibrated width 2048 (qwen3b)" in slow.speeds
    for phase in ("forward_compute", "backward"):  # the attention's share keeps its own rates
        assert 1.5 * same.times_s[phase] < slow.times_s[phase] <= 2 * same.times_s[phase], phase


def test_sharded_streamed_units_are_staged_through_each_ranks_own_buffers():
    """With sharded state each rank streams its own units' state through its own two staging buffers: a unit waits
    for the D2H of its rank's previous-but-one streamed unit, not of whichever unit came two before it (another
    rank's), so the forward of N ranks is set by the busiest rank's link, about 1/N of one rank's."""
    from engine.placement import Placement
    from engine.plan import predict_stream
    from engine.plan.shape import StepShape
    from engine.plan.speeds import Speeds

    cfg = make_cfg(["model=qwen14b", "engine=stream", "hardware=h100x4", "train.seq_len=4096",
                    "train.micro_batch_size=1", "train.grad_accum=1", "train.master_dtype=bf16",
                    "train.moments_dtype=int8", "train.grad_dtype=bf16", "plan=true"])
    spec = ModelSpec(cfg.model)
    n = len(spec.units)
    placement = Placement(n_units=n, slots=5, gpu_resident_units=0, gpu_streamed_units=n)
    forward = {}
    for ranks in (1, 4):
        s = StepShape(spec, cfg, True, StateFormat.of(cfg.train), ranks)
        times = predict_stream(s, Speeds.of_step(cfg.hardware, spec, s, compiled=True), placement)[0]
        assert times["forward"] >= times["forward_h2d"] > times["forward_compute"]  # the forward waits on the link
        forward[ranks] = times["forward"]
        if ranks == 4:  # about the busiest rank's link, not the four links' work in a row
            assert times["forward"] <= 1.5 * max(times["forward_h2d"], times["forward_d2h"])
    assert forward[4] < 0.4 * forward[1]


def _fits_with(base, fmt, host_gib, state_ranks):
    cfg = make_cfg([*base, *fmt.overrides().split()])
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=host_gib, on_gpu=True, check=False,
                      state_ranks=state_ranks)
    return not plan.problem()


def test_the_formats_a_sharded_refusal_suggests_are_planned_with_the_shards():
    """qwen14b over 2 ranks of an H200 host: each rank holds half the host state, so formats fit that would not fit
    one rank's share of the host unsharded; the refusal lists the most precise of those, and a depth-truncated run's
    full-depth figures are planned sharded too."""
    from engine.formats import StateFormat, all_formats
    from engine.trainer import depth_truncated

    base = ["model=qwen14b", "engine=stream", "hardware=h200", "train=bench", "plan=true", *FP32]
    cfg = make_cfg(base)
    host_gib = 125.0 / 2
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=host_gib, on_gpu=True, check=False,
                      state_ranks=2)
    assert plan.problem()
    smaller = [f for f in all_formats(256) if f.bytes_per_param() < StateFormat().bytes_per_param()]
    fitting = [f for f in smaller if _fits_with(base, f, host_gib, 2)][:3]
    assert len(fitting) == 3 and [s.split(": fits with ")[1].split(" engine.")[0].split(":")[0]
                                  for s in plan.suggestions] == [f.overrides() for f in fitting]
    truncated = make_cfg([*base, "model.num_hidden_layers=4"])
    full = depth_truncated(truncated, 48, 139.0, host_gib, True, state_ranks=2)
    assert full["full_depth_formats_that_fit"] == plan.suggestions


@pytest.mark.parametrize("model, hw, expected", [
    ("qwen32b", "h200", "train.master_dtype=bf16 train.moments_dtype=int8 train.grad_dtype=bf16"),
    ("qwen7b", "h100", "train.master_dtype=fp32 train.moments_dtype=fp32 train.grad_dtype=fp32"),
])
def test_auto_state_formats_take_the_most_precise_that_fits(model, hw, expected):
    cfg = make_cfg([f"model={model}", f"hardware={hw}", "plan=true"])
    gpu_gib = cfg.hardware.gpu_mem_gib
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib, cfg.hardware.profile_host_mem_gib, on_gpu=True)
    assert expected in plan.format_choice and expected in StateFormat.of(cfg.train).overrides()
    # the next more precise format does not fit
    chosen = StateFormat.of(cfg.train)
    richer = [f for f in all_formats() if f.bytes_per_param() > chosen.bytes_per_param()]
    for fmt in richer[-1:]:
        fixed = make_cfg([f"model={model}", f"hardware={hw}", "plan=true", *fmt.overrides().split()])
        assert build_plan(ModelSpec(fixed.model), fixed, gpu_gib, cfg.hardware.profile_host_mem_gib, on_gpu=True,
                          check=False).problem()


def test_a_set_format_field_is_kept_and_the_others_chosen_around_it():
    cfg = make_cfg(["model=qwen32b", "hardware=h200", "plan=true", "train.moments_dtype=bf16"])
    plan = build_plan(ModelSpec(cfg.model), cfg, cfg.hardware.gpu_mem_gib, cfg.hardware.profile_host_mem_gib,
                      on_gpu=True, check=False)
    assert cfg.train.moments_dtype == "bf16" and "train.moments_dtype=bf16" in plan.format_choice
    # settings that run fp32 state only leave auto nothing but fp32
    cfg = make_cfg(["model=tiny", "train.grad_transfer_dtype=bf16"])
    build_plan(ModelSpec(cfg.model), cfg, 0.0, 64.0, on_gpu=False)
    assert StateFormat.of(cfg.train).exact


def test_the_host_adamw_in_step_rate_replaces_the_calibrations_where_measured():
    """`hardware.cpu_adam_gparams_per_s_in_step` (the host AdamW's rate measured inside training steps) times the
    host update in place of the calibration's rate under PCIe load; 0 leaves the calibration's."""
    base = ["model=qwen7b", "engine=stream", "hardware=h100", "plan=true", "train.seq_len=4096",
            "train.micro_batch_size=1", "engine.gpu_resident_units=10", "engine.gpu_streamed_units=10"]
    plans = {}
    for rate in (0.0, 1.5):
        cfg = make_cfg([*base, f"hardware.cpu_adam_gparams_per_s_in_step={rate}"])
        plans[rate] = (build_plan(ModelSpec(cfg.model), cfg, cfg.hardware.gpu_mem_gib,
                                  cfg.hardware.profile_host_mem_gib, on_gpu=True, check=False), cfg)
    (calibrated, cfg), (in_step, _) = plans[0.0], plans[1.5]
    ratio = cfg.hardware.cpu_adam_gparams_per_s_under_pcie / 1.5
    assert in_step.times_s["host_adamw"] == pytest.approx(calibrated.times_s["host_adamw"] * ratio, rel=1e-9)
    assert "the host AdamW at its in-step rate, 1.5 G parameters/s" in in_step.speeds
    assert "in-step rate" not in calibrated.speeds
    with pytest.raises(ConfigError, match=r"hardware.cpu_adam_gparams_per_s_in_step=-1.0 .*not measured"):
        make_cfg([*base, "hardware.cpu_adam_gparams_per_s_in_step=-1"])


def test_more_host_memory_never_refuses_a_plan_that_fits_with_less():
    """gpt-oss-20b at 8 x 4 x 4096 tokens on the H100 profile fits in 125 GiB of host by sending 18 units' held bf16
    gradients to the host. With more host, the gradients' tier used to flip back to the GPU after those units had
    been sent to the host (an inconsistent placement whose rows then overflowed HBM), and the run was refused. A
    placement with held gradients on the host keeps the gradients' tier there."""
    cfg = make_cfg(["experiment=bench_gptoss20b_h100", "hardware=h100", "plan=true", "train.grad_accum=8"])
    plans = {host: build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=host, on_gpu=True, check=False)
             for host in (125.0, 190.0, 253.0)}
    for host, plan in plans.items():
        assert not plan.problem(), (host, plan.table())
        placement = plan.placement
        assert placement.host_grad_units > 0 and placement.grads_tier == "host", (host, placement)
    assert plans[253.0].times_s["step"] <= plans[125.0].times_s["step"] * 1.001
