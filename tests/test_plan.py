"""The planner's refusals: every memory tier that overflows is named with its numbers."""

import pytest

from engine.model import ModelSpec
from engine.plan import PlanError, build_plan
from tests.util import make_cfg


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
