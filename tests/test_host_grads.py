"""Held bf16 gradients in host memory (`engine.host_grad_units`, engine/streaming/streamed_update.py).

- The placement and the config refuse counts that place nothing: more units than are GPU-streamed, or held
  gradients where the format holds none (fp32 gradients).
- The planner moves the fewest GPU-streamed units' held gradients to the host that makes the GPU fit: gpt-oss-20b
  at 64K tokens a step on the H100 profile fits only so; its rows count the moved gradients on the host (2 B/param)
  and their wire copies on the GPU, and its time model moves them over both links.
- Both engines train bit-identically with held gradients on the host: tests/test_formats.py (CPU),
  tests/test_stream_gpu.py (GPU, against the fp32 oracle).
"""

from __future__ import annotations

import pytest

from engine.config import ConfigError
from engine.model import ModelSpec
from engine.placement import Placement
from engine.plan import GIB, build_plan, predict_stream
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds
from engine.formats import StateFormat
from tests.util import make_cfg

GPTOSS_64K = ["model=gptoss20b", "engine=stream", "hardware=h100", "train.seq_len=4096",
              "train.micro_batch_size=16", "plan=true"]


def test_more_host_gradient_units_than_streamed_ones_is_not_a_placement():
    with pytest.raises(ValueError, match="not a placement"):
        Placement(n_units=6, gpu_resident_units=2, gpu_streamed_units=3, host_grad_units=4)
    assert list(Placement(n_units=6, gpu_resident_units=2, gpu_streamed_units=3,
                          host_grad_units=2).host_grad_units_range) == [3, 4]


def test_host_gradients_need_a_bf16_gradient_format():
    with pytest.raises(ConfigError, match="engine.host_grad_units=2 places held bf16 gradients, and "
                                          "train.grad_dtype=fp32 holds none"):
        make_cfg(["engine=stream", "train.grad_dtype=fp32", "engine.host_grad_units=2"])
    with pytest.raises(ConfigError, match="engine.host_grad_units=-2 must be >= -1"):
        make_cfg(["engine=stream", "engine.host_grad_units=-2"])


def _plan(*overrides):
    cfg = make_cfg([*GPTOSS_64K, *overrides])
    spec = ModelSpec(cfg.model)
    return build_plan(spec, cfg, gpu_gib=78.5, host_gib=125.0, on_gpu=True, check=False), spec, cfg


def test_gptoss20b_at_64k_tokens_fits_the_h100_with_gradients_on_the_host():
    plan, spec, cfg = _plan()
    p = plan.placement
    assert not plan.problem(), plan.problem()
    assert cfg.train.grad_dtype == "bf16" and 0 < p.host_grad_units <= p.gpu_streamed_units
    moved = [u for u in p.host_grad_units_range]
    assert moved[-1] == len(spec.units) - 1  # the last streamed units: the head and the layers before it
    host_rows = {item: b for tier, item, b in plan.rows if tier == "host"}
    row = next(b for item, b in host_rows.items() if "GPU-streamed units until their update" in item)
    assert row == sum(2 * spec.units[u].layout.numel for u in moved)

    same = [f"engine.{k}={v}" for k, v in p.as_dict().items() if k not in ("host_grad_units", "kept_attention_layers")]
    chosen = [f"train.{k}={cfg.train[k]}" for k in ("master_dtype", "moments_dtype", "grad_dtype")]
    chosen.append(f"train.lean_layer={'on' if plan.execution.lean else 'off'}")  # else the other layer may fit
    fewer, _, _ = _plan(*chosen, *same, f"engine.host_grad_units={p.host_grad_units - 1}")
    assert "GiB of gpu memory" in fewer.problem()  # one unit fewer, all else the same: the GPU overflows
    none, _, _ = _plan(*chosen, "engine.host_grad_units=0")
    assert "GiB of gpu memory" in none.problem() and none.total("gpu") - plan.total("gpu") > 15 * GIB


def test_the_time_model_moves_host_gradients_over_both_links():
    plan, spec, cfg = _plan()
    s = StepShape(spec, cfg, True, StateFormat.of(cfg.train))
    sp = Speeds.of_step(cfg.hardware, spec, s, compiled=True)
    on_host, _ = predict_stream(s, sp, plan.placement)
    on_gpu, _ = predict_stream(s, sp, Placement(**{**vars(plan.placement), "host_grad_units": 0}))
    moved_bytes = sum(2 * spec.units[u].layout.numel for u in plan.placement.host_grad_units_range)
    assert on_host["forward_h2d"] - on_gpu["forward_h2d"] >= moved_bytes / cfg.hardware.h2d_gbps / 1e9
    assert on_host["forward_d2h"] == on_gpu["forward_d2h"]  # the state's D2H only: the gradients left in the backward
    assert on_host["backward"] >= on_gpu["backward"]
