"""The plan of a step that clips by a norm pass (`engine.norm_pass`): no gradient held, one more head and backward."""

import pytest

from engine.formats import StateFormat
from engine.model import ModelSpec
from engine.plan import PlanError, build_plan
from tests.util import make_cfg

# qwen7b at 2 x 4096 tokens on the H100 profile, every unit updated on the GPU (4 resident, 26 streamed), with
# nothing kept or cached, so that holding the gradients and the norm pass plan the same placement
LOW_PRECISION = ["model=qwen7b", "engine=stream", "hardware=h100", "plan=true", "train.seq_len=4096",
                 "train.micro_batch_size=1", "train.grad_accum=2", "train.lean_layer=off", "train.master_dtype=bf16",
                 "train.moments_dtype=int8", "engine.gpu_resident_units=4", "engine.gpu_streamed_units=26",
                 "engine.keep_activation_layers=0", "engine.kept_attention_layers=0", "engine.activation_tier=host",
                 "engine.cache_weights=off"]
# the same in fp32 state with 14 units left to the host AdamW
EXACT = [*LOW_PRECISION[:8], "train.master_dtype=fp32", "train.moments_dtype=fp32", "train.grad_dtype=fp32",
         "engine.gpu_resident_units=4", "engine.gpu_streamed_units=12", *LOW_PRECISION[12:], "engine.grads_tier=host"]
# gpt-oss-120b at 2 x 4096 tokens on one H100 with 512 GiB of host: its gradients held do not fit in any format
GPTOSS120B = ["model=gptoss120b", "engine=stream", "hardware=h100", "plan=true", "train.seq_len=4096",
              "train.micro_batch_size=1", "train.grad_accum=2", "train.master_dtype=bf16", "train.moments_dtype=int8"]


def _plan(overrides, host_gib=125.0):
    cfg = make_cfg(overrides)
    return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=host_gib, on_gpu=True, check=False)


def _gradient_rows(plan):
    return {(tier, item): nbytes for tier, item, nbytes in plan.rows if "gradients" in item or "accumulators" in item}


def _other_rows(plan):
    return [row for row in plan.rows if (row[0], row[1]) not in _gradient_rows(plan)]


def test_a_norm_pass_holds_no_gradient_and_keeps_every_other_row():
    """Against held bf16 gradients of the same placement: no held copies, only the shared accumulators, and every
    other row (the state, the streamed updates' staging, the working set) the same."""
    hold = _plan([*LOW_PRECISION, "train.grad_dtype=bf16", "engine.norm_pass=off"])
    norm = _plan([*LOW_PRECISION, "train.grad_dtype=fp32", "engine.norm_pass=on"])
    assert norm.placement.norm_pass and not hold.placement.norm_pass
    assert _other_rows(norm) == _other_rows(hold)
    held = {key: b for key, b in _gradient_rows(hold).items() if "held until the norm is known" in key[1]}
    shared = _gradient_rows(hold)[("gpu", "accumulators: embedding, head, 2 layers (fp32)")]
    assert list(held.values())[0] > 10 * 2**30
    assert list(_gradient_rows(norm).values()) == [shared]  # the shared accumulators, on the GPU, and nothing else
    assert norm.total("gpu") == hold.total("gpu") - sum(held.values())
    assert norm.total("host") == hold.total("host")


def test_a_norm_pass_keeps_the_host_updated_units_gradients_only():
    """fp32 state with host-updated units: their gradients wait on the host as before; the GPU-updated layers'
    own accumulators are gone."""
    hold = _plan([*EXACT, "engine.norm_pass=off"])
    norm = _plan([*EXACT, "engine.norm_pass=on"])
    assert _other_rows(norm) == _other_rows(hold)
    hold_grads, norm_grads = _gradient_rows(hold), _gradient_rows(norm)
    host_grads = hold_grads[("host", "fp32 gradients of host-updated units until the global norm is known")]
    assert host_grads > 0
    assert norm_grads[("host", "fp32 gradients of host-updated units until the host AdamW")] == host_grads
    own = hold_grads[("gpu", "accumulators: embedding, head, 2 layers (fp32); GPU-updated layers (fp32)")]
    shared = norm_grads[("gpu", "accumulators: embedding, head, 2 layers (fp32), the norm pass's only gradients")]
    assert 0 < shared < own
    assert norm.total("gpu") == hold.total("gpu") - (own - shared)


def test_the_norm_pass_costs_one_more_head_and_backward():
    """Its first backward is the held plan's (no gradient leaves the GPU there); the streamed updates' traffic moves
    from the forward into the second backward, so the step grows by about that head and backward."""
    hold = _plan([*LOW_PRECISION, "train.grad_dtype=bf16", "engine.norm_pass=off"]).times_s
    norm_plan = _plan([*LOW_PRECISION, "train.grad_dtype=fp32", "engine.norm_pass=on"])
    norm = norm_plan.times_s
    assert "norm_pass" not in hold
    assert norm["norm_pass"] == pytest.approx(hold["head"] + hold["backward"], rel=1e-9)
    # the forward loads weights only, nothing goes back; the second backward carries the streamed state
    assert norm["forward_h2d"] < 0.5 * hold["forward_h2d"] and norm["forward_d2h"] < 0.1 * hold["forward_d2h"]
    assert norm["backward"] > hold["backward"] + 0.5 * (hold["forward"] - norm["forward"])
    assert norm["step"] == pytest.approx(hold["step"] + norm["norm_pass"], rel=0.1)
    assert f"norm_pass {norm['norm_pass']:.3f}s" in norm_plan.table()
    assert "norm pass (engine.norm_pass): clip without holding gradients: one more head and backward" \
        in norm_plan.table()
    # with host-updated units, the first backward sends no gradient: never longer than the held plan's backward
    exact_hold, exact_norm = (_plan([*EXACT, f"engine.norm_pass={mode}"]).times_s for mode in ("off", "on"))
    assert exact_norm["norm_pass"] <= exact_hold["head"] + exact_hold["backward"]


def test_auto_takes_the_norm_pass_only_where_holding_the_gradients_does_not_fit():
    fits = ["model=qwen7b", "engine=stream", "hardware=h100", "plan=true", "train.seq_len=4096",
            "train.micro_batch_size=1", "train.grad_accum=2", "train.lean_layer=off", "train.master_dtype=fp32",
            "train.moments_dtype=fp32", "train.grad_dtype=fp32"]
    auto, off = _plan(fits), _plan([*fits, "engine.norm_pass=off"])
    assert not auto.placement.norm_pass and auto.placement == off.placement and auto.times_s == off.times_s

    # gpt-oss-120b: no format fits holding its gradients; the norm pass does, in fp32 gradients
    cfg = make_cfg(GPTOSS120B)
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=512.0, on_gpu=True, check=False)
    assert not plan.problem() and plan.placement.norm_pass, plan.table()
    assert StateFormat.of(cfg.train).grad == "fp32"
    assert "with a norm pass, none fitting with the gradients held" in plan.format_choice
    assert not any("held" in item for _, item, _ in plan.rows)
    with pytest.raises(PlanError, match=r"With engine.norm_pass=on \(clip without holding gradients.* it fits"):
        cfg = make_cfg([*GPTOSS120B, "engine.norm_pass=off"])
        build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=512.0, on_gpu=True)
    # with more tokens a step neither fits, and the refusal says what the norm pass needed
    with pytest.raises(PlanError, match=r"With a norm pass \(engine.norm_pass=auto.*does not fit either: GPU 78\.6"):
        cfg = make_cfg([*GPTOSS120B, "train.grad_accum=4"])
        build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=512.0, on_gpu=True)


def test_a_data_parallel_plan_takes_no_norm_pass():
    """plan=true for a profile of several cards plans one of their ranks: auto does not take the norm pass there,
    and on is refused naming both settings."""
    cfg = make_cfg([*GPTOSS120B, "hardware.gpus=2"])
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=512.0, on_gpu=True, check=False)
    assert not plan.placement.norm_pass and plan.problem()
    cfg = make_cfg([*GPTOSS120B, "hardware.gpus=2", "engine.norm_pass=on"])
    with pytest.raises(PlanError, match=r"engine.norm_pass=on: .*hardware.gpus=2"):
        build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=512.0, on_gpu=True, check=False)


def test_a_cpu_run_with_a_norm_pass_plans_fp32_gradients():
    cfg = make_cfg(["model=tiny", "engine=stream", "engine.norm_pass=on"])
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=0.0, host_gib=64.0, on_gpu=False)
    assert plan.placement.norm_pass and StateFormat.of(cfg.train).grad == "fp32"
    assert not any("held" in item or "GPU-updated layers" in item for _, item, _ in plan.rows)


def test_a_data_parallel_rank_runs_no_norm_pass():
    """Under torchrun each rank's config (`distributed.local_config`) turns auto off and refuses on, sharded state
    or not: the engine's norm pass runs in one process."""
    from engine.config import ConfigError
    from engine.distributed import DataParallel, local_config

    ranks = DataParallel(world=2, local_world=2)
    for shard in ("true", "false"):
        cfg = make_cfg(["model=tiny", "engine=stream", "train.grad_accum=2", f"engine.shard_state={shard}"])
        assert local_config(cfg, ranks).engine.norm_pass == "off"
    with pytest.raises(ConfigError, match=r"engine.norm_pass=on runs in one process.* 2 data-parallel ranks"):
        local_config(make_cfg(["model=tiny", "engine=stream", "train.grad_accum=2", "engine.norm_pass=on"]), ranks)



@pytest.mark.parametrize("hold_fits_up_to, count, norm_pass", [(4, 4, "off"), (0.5, 8, "auto")])
def test_micro_batches_chosen_by_the_plan_hold_the_gradients_where_any_count_fits_so(
        monkeypatch, hold_fits_up_to, count, norm_pass):
    """train.grad_accum=-1 compares counts by their forward's stream against its compute, which does not see a norm
    pass's extra backward: the counts are planned holding the gradients (engine.norm_pass=off), and with the norm
    pass allowed (auto) only where not even one micro-batch fits so. Modelled plans: the forward streams 8 s and
    computes 1 s a micro-batch; holding the gradients fits up to `hold_fits_up_to` micro-batches, allowing the norm
    pass up to 40. Without that order the climb from 1 would jump to 8, which fits with a norm pass only."""
    from engine.plan import build as build_module
    from tests.test_plan_micro_batches import modelled

    hold, allowed = modelled(lambda n: 8.0, 1.0, hold_fits_up_to), modelled(lambda n: 8.0, 1.0, 40)
    modes = []

    def plan_executions(spec, cfg, *args, **kwargs):
        modes.append(cfg.engine.norm_pass)
        plan = (hold if cfg.engine.norm_pass == "off" else allowed)(cfg.train.grad_accum)
        plan.state_format = StateFormat.of(cfg.train)
        return plan

    monkeypatch.setattr(build_module, "_plan_executions", plan_executions)
    cfg = make_cfg(["model=tiny", "engine=stream", "train.grad_accum=-1", "train.master_dtype=fp32",
                    "train.moments_dtype=fp32", "train.grad_dtype=fp32"])
    plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=125.0, on_gpu=True, check=False)
    assert cfg.train.grad_accum == count and cfg.engine.norm_pass == "auto"
    assert plan.grad_accum_choice.startswith(f"train.grad_accum=-1: {count} micro-batches a step")
    assert modes[-1] == norm_pass and set(modes) == ({"off"} if norm_pass == "off" else {"off", "auto"})
