"""`train.grad_accum=-1`: the plan's choice of micro-batches a step (engine/plan/micro_batches.py), its search on
modelled plans against every count, and the real planner's choice on a GPU profile."""

from __future__ import annotations

import json
import random

import pytest

from engine import distributed
from engine.config import ConfigError
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.plan.memory import MemoryPlan
from engine.plan.micro_batches import MAX_MICRO_BATCHES, choose_micro_batches
from engine.trainer import Trainer
from tests.util import SMALL, make_cfg


def modelled(stream_s, compute_s_per_mb: float, fits_up_to: int):
    """plan_with(n) of a model whose forward streams for `stream_s(n)` s and computes `compute_s_per_mb * n` s, and
    whose plan fits up to `fits_up_to` micro-batches; the counts it was asked for are in its `.asked`."""
    def plan_with(n: int) -> MemoryPlan:
        plan_with.asked.append(n)
        plan = MemoryPlan("stream", limits_gib={"gpu": 1.0})
        plan.add("gpu", "grows with the micro-batches", int(n / fits_up_to * 2**30))
        plan.times_s = {"forward_compute": compute_s_per_mb * n, "forward_h2d": stream_s(n), "step": 1.0 + n}
        return plan
    plan_with.asked = []
    return plan_with


def brute_force(plan_with, cap: int = MAX_MICRO_BATCHES) -> int:
    """The rule over every count: the fewest that fit with the stream hidden, else the most that fit, else 1."""
    fitting = [n for n in range(1, cap + 1) if not plan_with(n).problem()]
    hidden = [n for n in fitting if plan_with(n).link_bound_ratio() <= 1.0]
    return hidden[0] if hidden else (fitting[-1] if fitting else 1)


def test_takes_the_fewest_micro_batches_whose_forward_hides_the_stream():
    plan_with = modelled(lambda n: 3.0, 1.0, fits_up_to=40)
    choice = choose_micro_batches(plan_with)
    assert choice.grad_accum == 3 and plan_with.asked == [1, 3]
    assert choice.line == ("train.grad_accum=-1: 3 micro-batches a step (4.00 s planned; the forward computes 1.00x "
                           "as long as it streams the weights)")


def test_a_stream_that_grows_with_the_micro_batches_is_climbed_past():
    plan_with = modelled(lambda n: 3.0 + 0.5 * n, 1.0, fits_up_to=40)  # hidden from n >= 6
    choice = choose_micro_batches(plan_with)
    assert choice.grad_accum == 6 == brute_force(modelled(lambda n: 3.0 + 0.5 * n, 1.0, fits_up_to=40))
    assert choice.plan is not None and choice.plan.link_bound_ratio() <= 1.0


def test_where_the_stream_cannot_hide_the_most_that_fit_are_taken_and_the_line_says_so():
    choice = choose_micro_batches(modelled(lambda n: 10.0, 1.0, fits_up_to=7))
    assert choice.grad_accum == 7
    assert choice.line == ("train.grad_accum=-1: 7 micro-batches a step (8.00 s planned; 8 does not fit, and the "
                           "forward still streams its weights 1.43x as long as it computes: the link sets its pace)")
    capped = choose_micro_batches(modelled(lambda n: 1e3, 1.0, fits_up_to=1000), max_micro_batches=16)
    assert capped.grad_accum == 16 and "16, the most considered" in capped.line


def test_when_one_micro_batch_does_not_fit_its_plan_is_the_refusal():
    choice = choose_micro_batches(modelled(lambda n: 3.0, 1.0, fits_up_to=0.5))
    assert choice.grad_accum == 1 and choice.plan.problem()
    assert choice.line.startswith("train.grad_accum=-1: not even 1 micro-batch a step fits")


def test_the_search_agrees_with_every_count_tried_and_plans_few():
    rng = random.Random(7)
    for _ in range(300):
        base, growth, per_mb = rng.uniform(0.1, 20), rng.uniform(0, 0.3), rng.uniform(0.05, 2)
        fits = rng.choice([rng.randint(1, 80), 1000])
        stream = (lambda b, g: lambda n: b + g * n)(base, growth)
        searched = modelled(stream, per_mb, fits)
        assert choose_micro_batches(searched).grad_accum == brute_force(modelled(stream, per_mb, fits)), \
            (base, growth, per_mb, fits)
        assert len(set(searched.asked)) <= 16


def _gpu_profile_cfg(overrides):
    return make_cfg(["model=qwen7b", "hardware=h100", "plan=true", "train.seq_len=4096", "train.micro_batch_size=1",
                     *overrides])


def _gpu_plan(cfg):
    return build_plan(ModelSpec(cfg.model), cfg, cfg.hardware.gpu_mem_gib, cfg.hardware.profile_host_mem_gib,
                      on_gpu=True, check=False)


def test_on_a_gpu_profile_the_count_taken_is_the_first_whose_forward_hides_the_stream():
    """qwen7b at 4K tokens a micro-batch on the H100 profile: one micro-batch streams longer than it computes; the
    count taken is written into the config with its state formats, and one fewer would leave the stream exposed."""
    cfg = _gpu_profile_cfg(["train.grad_accum=-1"])
    plan = _gpu_plan(cfg)
    n = cfg.train.grad_accum
    assert n > 1 and not plan.problem() and plan.link_bound_ratio() <= 1.0
    assert plan.grad_accum_choice.startswith(f"train.grad_accum=-1: {n} micro-batches a step")
    assert plan.grad_accum_choice in plan.table()
    fewer = _gpu_profile_cfg([f"train.grad_accum={n - 1}"])
    assert _gpu_plan(fewer).link_bound_ratio() > 1.0
    same = _gpu_profile_cfg([f"train.grad_accum={n}"])
    assert _gpu_plan(same).times_s == plan.times_s
    assert [cfg.train[f] for f in ("master_dtype", "moments_dtype", "grad_dtype")] == \
        [same.train[f] for f in ("master_dtype", "moments_dtype", "grad_dtype")] != ["auto"] * 3


@pytest.mark.parametrize("engine", ["stream", "reference"])
def test_a_plan_without_step_times_cannot_choose(engine):
    cfg = make_cfg([f"engine={engine}", "train.grad_accum=-1"])  # the CPU profile: no step times
    with pytest.raises(ConfigError, match=r"train.grad_accum=-1 \(auto\) chooses the micro-batches from the plan's "
                                          r"step times, and this plan has none"):
        build_plan(ModelSpec(cfg.model), cfg, 0.0, 64.0, on_gpu=False)


def test_other_counts_below_one_are_refused_and_data_parallel_needs_a_number(monkeypatch):
    with pytest.raises(ConfigError, match=r"train.grad_accum=-2 must be >= 1, or -1 \(auto: chosen by the plan\)"):
        make_cfg(["train.grad_accum=-2"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="train.grad_accum=-1 \\(auto\\) is planned for one process; with "
                                          "WORLD_SIZE=2 set the micro-batches per step, a multiple of 2"):
        distributed.init("cpu", -1)


# figures that give a CPU plan step times (the CPU profile has none): a link slow enough that one micro-batch's forward
# waits on it
CPU_SPEEDS = ["hardware.fwd_tflops_eager=0.05", "hardware.bwd_tflops_eager=0.05", "hardware.head_tflops_eager=0.05",
              "hardware.h2d_gbps=0.5", "hardware.d2h_gbps=0.5", "hardware.bidir_gbps=0.8",
              "hardware.cpu_adam_gparams_per_s=0.5", "hardware.cpu_adam_gparams_per_s_under_pcie=0.5"]


def test_a_run_trains_with_the_count_its_plan_chose_and_records_it(tmp_path):
    """The trainer plans `-1` before anything reads the count: the data, the banner, the checkpoint fingerprint and
    summary.json see the count taken, and each step consumes that many micro-batches."""
    cfg = make_cfg(["engine=stream", *SMALL, "train.seq_len=32", "train.micro_batch_size=2", "train.grad_accum=-1",
                    "train.steps=1", "train.val_every=-1", *CPU_SPEEDS])
    trainer = Trainer(cfg, tmp_path)
    n = trainer.cfg.train.grad_accum
    assert n > 1 and trainer.plan.grad_accum_choice.startswith(f"train.grad_accum=-1: {n} micro-batches a step")
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records if "loss" in r] == [n * 2 * 32]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["train"]["grad_accum"] == n
    assert trainer.plan.grad_accum_choice in (tmp_path / "train.log").read_text()
