"""bench/plan_backtest.py: a measured row re-planned with the placement it ran, on its card's profile."""

import json

import pytest

from bench import plan_backtest
from engine.model import ModelSpec
from engine.plan import build_plan
from tests.util import make_cfg

OVERRIDES = ["model=qwen7b", "engine=stream", "train=bench", "train.seq_len=4096", "train.micro_batch_size=2",
             "train.grad_accum=8"]
PLACEMENT = {"slots": 2, "keep_activation_layers": 4, "recompute_group": 1, "activation_tier": "gpu",
             "grads_tier": "host", "cache_weights": "on", "gpu_resident_units": 4, "gpu_streamed_units": 12,
             "nvme_units": 0}


def test_a_row_is_replanned_with_its_placement_on_its_cards_profile(tmp_path, capsys):
    fixed = [f"engine.{k}={v}" for k, v in PLACEMENT.items()]
    cfg = make_cfg([*OVERRIDES, "hardware=h200", *fixed, "plan=true"])
    expected = build_plan(ModelSpec(cfg.model), cfg, 139.0, cfg.hardware.profile_host_mem_gib, on_gpu=True,
                          check=False)
    row = {"job": "qwen7b-64k", "engine": "stream", "overrides": OVERRIDES, "placement": PLACEMENT, "step_s": 6.5,
           "plan_step_s": 5.9, "gpu": "NVIDIA H200", "git_sha": "abc1234", "median_forward_s": 1.7,
           "median_backward_s": 4.4, "gpu_mem_gib": 120.0, "host_mem_gib": 80.0, "host_children_mem_gib": 7.5,
           "median_optimizer_s": 0.8}
    skipped = {**row, "job": "elsewhere", "gpu": "NVIDIA A100"}
    reference = {**row, "job": "reference", "engine": "reference"}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in (row, skipped, reference)) + "\n")
    out = tmp_path / "backtest.jsonl"
    plan_backtest.main([str(rows), "--jsonl", str(out)])
    table = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["job"] for e in table] == ["qwen7b-64k", "elsewhere"]  # the reference row is not a streamed step
    first, second = table
    assert first["plan_now_s"] == pytest.approx(expected.times_s["step"], rel=1e-12)
    assert first["error_now"] == pytest.approx(expected.times_s["step"] / 6.5 - 1, rel=1e-12)
    assert (first["plan_then_s"], first["forward_s"]) == (5.9, 1.7)
    assert first["host_gib"] == 87.5  # the process and torch.compile's workers, as the plan counts them
    assert first["plan_host_gib"] == pytest.approx(expected.total("host") / 2**30, rel=1e-12)
    assert first["plan_gpu_gib"] == pytest.approx(expected.allocated("gpu") / 2**30, rel=1e-12)
    assert "NVIDIA A100" in second["skipped"]
    spec = ModelSpec(cfg.model)
    host_params = sum(spec.units[u].layout.numel for u in expected.placement.host_units)
    assert host_params > 0 and first["host_adamw_s"] == 0.8
    assert first["plan_host_adamw_s"] == pytest.approx(expected.times_s["host_adamw"], rel=1e-12)
    assert first["host_adamw_gparams_per_s"] == pytest.approx(host_params / 0.8 / 1e9, rel=1e-12)
    printed = capsys.readouterr().out
    assert "qwen7b-64k" in printed and "skipped: no profile" in printed
    assert (f"h200: host AdamW in steps, median {host_params / 0.8 / 1e9:.3f} G parameters/s over 1 rows"
            in printed)


def test_the_host_adamw_rate_leaves_out_rows_without_host_updates_or_with_moments_on_nvme():
    row = {"median_optimizer_s": 2.0, "placement": {"nvme_units": 0}}
    assert plan_backtest.host_adamw_rate(row, 4_000_000_000) == 2.0
    assert plan_backtest.host_adamw_rate(row, 0) is None
    assert plan_backtest.host_adamw_rate({**row, "placement": {"nvme_units": 3}}, 4_000_000_000) is None


@pytest.mark.parametrize("recorded, seq_len, pinned", [(True, 32768, "on"), (False, 262144, "off"),
                                                      (None, 65536, "off"), (None, 262144, "auto")],
                         ids=["recorded-lean", "recorded-plain", "older-row-short", "older-row-long"])
def test_a_row_is_replanned_with_the_layer_it_ran(recorded, seq_len, pinned):
    """`train.lean_layer=auto` leaves the layer to the plan: a row is re-planned with the layer it recorded, and an
    older row without the record with the plain layer up to 128K tokens a micro-batch (the rule it ran under)."""
    over = ["model=qwen7b", "engine=stream", "train=bench", f"train.seq_len={seq_len}", "train.micro_batch_size=1",
            "train.grad_accum=1", "model.max_position_embeddings=524288"]
    placement = {"slots": 2, "keep_activation_layers": 0, "recompute_group": 4, "activation_tier": "host",
                 "grads_tier": "host", "cache_weights": "off", "gpu_resident_units": 0, "gpu_streamed_units": 0,
                 "nvme_units": 0}
    row = {"job": "ctx", "engine": "stream", "overrides": over, "placement": placement, "step_s": 1.0,
           "gpu": "NVIDIA H100 80GB HBM3", "seq_len": seq_len, "micro_batch_size": 1}
    if recorded is not None:
        row["lean_layer"] = recorded
    fixed = [f"engine.{k}={v}" for k, v in placement.items()]
    cfg = make_cfg([*over, "hardware=h100", *fixed, f"train.lean_layer={pinned}", "plan=true"])
    expected = build_plan(ModelSpec(cfg.model), cfg, cfg.hardware.gpu_mem_gib, cfg.hardware.profile_host_mem_gib,
                          on_gpu=True, check=False)
    replanned = plan_backtest.replan(row)
    assert replanned.execution.lean == expected.execution.lean
    assert replanned.times_s["step"] == pytest.approx(expected.times_s["step"], rel=1e-12)


def test_a_moe_row_is_replanned_at_the_micro_batches_it_ran_and_gives_its_in_step_ratio(capsys):
    """A row that let `train.grad_accum=-1` choose is re-planned at the count it ran; a MoE row's backward measured
    over planned is printed per model, for `hardware.moe_step_ratio`."""
    over = ["model=gptoss20b", "model.num_hidden_layers=2", "engine=stream", "train=bench", "train.seq_len=4096",
            "train.micro_batch_size=1", "train.grad_accum=-1", "train.master_dtype=bf16", "train.moments_dtype=int8",
            "train.grad_dtype=bf16"]
    placement = {"slots": 2, "keep_activation_layers": 0, "recompute_group": 1, "activation_tier": "gpu",
                 "grads_tier": "gpu", "cache_weights": "on", "gpu_resident_units": 4, "gpu_streamed_units": 0,
                 "nvme_units": 0}
    fixed = [f"engine.{k}={v}" for k, v in placement.items()]
    cfg = make_cfg([*over[:-4], "train.grad_accum=3", *over[-3:], "hardware=h100", *fixed, "plan=true"])
    expected = build_plan(ModelSpec(cfg.model), cfg, 78.5, cfg.hardware.profile_host_mem_gib, on_gpu=True,
                          check=False)
    row = {"job": "moe", "model": "gptoss20b", "engine": "stream", "overrides": over, "placement": placement,
           "step_s": 2.0, "gpu": "NVIDIA H100 80GB HBM3", "grad_accum": 3, "median_backward_s": 1.0}
    (entry,) = plan_backtest.backtest([row])
    assert entry["plan_now_s"] == pytest.approx(expected.times_s["step"], rel=1e-12)
    assert entry["moe_bwd_ratio"] == pytest.approx(1.0 / expected.times_s["backward"], rel=1e-12)
    assert plan_backtest.moe_summary([entry]).startswith(
        f"h100: MoE backward measured over planned, median {entry['moe_bwd_ratio']:.3f} over 1 rows (gptoss20b")
    dense = {"job": "dense", "engine": "stream", "overrides": OVERRIDES, "placement": PLACEMENT, "step_s": 6.5,
             "gpu": "NVIDIA H100 80GB HBM3", "median_backward_s": 4.4}
    assert plan_backtest.backtest([dense])[0]["moe_bwd_ratio"] is None
