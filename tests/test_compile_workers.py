"""`train.compile_in_process`: Inductor builds the compiled templates' kernels in the training process instead of
in its pool of worker processes, whose host memory (`hardware.host_compile_workers_gib`) the plan then leaves to
the state.

On the CPU the switch and the plan are checked (Inductor's CPU backend starts no pool here, so the pool itself is
not observable); the GPU test runs both ways in fresh processes and reads the workers' memory from the run's
metrics (`host_children_mem_gib`)."""

from pathlib import Path

import pytest
from torch._inductor import config as inductor_config

from engine.model import ModelSpec
from engine.plan import GIB, PlanError, build_plan
from tests.util import make_cfg, train_records


def test_in_process_sets_one_compile_thread_and_the_default_comes_back():
    spec = ModelSpec(make_cfg([]).model)
    try:
        spec.compile_templates(in_process=True)
        assert inductor_config.compile_threads == 1
    finally:
        spec.compile_templates(in_process=False)
    assert inductor_config.compile_threads == inductor_config.decide_compile_threads()


def _process_row(plan) -> int:
    return next(b for tier, item, b in plan.rows if tier == "host" and item.startswith("this process"))


def _qwen7b(overrides, host_gib):
    cfg = make_cfg(["model=qwen7b", "engine=stream", "hardware=h100", "train=bench", "train.seq_len=4096",
                    "train.micro_batch_size=1", "train.grad_accum=16", "train.compile=on", "plan=true",
                    # fp32 state, as these figures are: `auto` would take a smaller format that fits
                    "train.master_dtype=fp32", "train.moments_dtype=fp32", "train.grad_dtype=fp32", *overrides])
    return build_plan(ModelSpec(cfg.model), cfg, gpu_gib=78.5, host_gib=host_gib, on_gpu=True)


def test_an_in_process_compile_plans_the_process_without_the_workers():
    hw = make_cfg(["hardware=h100", "plan=true"]).hardware
    assert hw.host_compile_workers_gib > 0
    pooled = _process_row(_qwen7b([], 125.0))
    alone = _process_row(_qwen7b(["train.compile_in_process=true"], 125.0))
    assert pooled == int(hw.host_process_gib * GIB)
    assert alone == int((hw.host_process_gib - hw.host_compile_workers_gib) * GIB)


def test_a_refusal_says_when_the_plan_fits_without_the_workers():
    """qwen7b at 64K tokens on an H100 with 76 GiB of host, the gradients held: refused with the workers, planned
    without them (74.6 GiB); with 64 GiB neither fits, and the note is not made."""
    held = ["engine.norm_pass=off"]  # with a norm pass, which holds none, it fits either way
    with pytest.raises(PlanError) as e:
        _qwen7b(held, 76.0)
    assert "With train.compile_in_process=true" in str(e.value) and "it fits: host" in str(e.value)
    assert not _qwen7b([*held, "train.compile_in_process=true"], 76.0).problem()
    with pytest.raises(PlanError) as e:
        _qwen7b(held, 64.0)
    assert "compile_in_process" not in str(e.value)


GPU_RUN = ["hardware=auto", "logger=none", "engine=stream", "train.compile=on", "train.steps=2", "train.seq_len=256",
           "train.micro_batch_size=2", "train.val_every=0", "train.val_batches=1", "train.warmup_steps=1"]


def _children_gib(run_dir: Path, *args) -> float:
    records = train_records(run_dir, *GPU_RUN, *args)
    return max(r["host_children_mem_gib"] for r in records if "host_children_mem_gib" in r)


@pytest.mark.gpu
def test_gpu_an_in_process_compile_starts_no_workers(tmp_path):
    pooled = _children_gib(tmp_path / "pool")
    alone = _children_gib(tmp_path / "alone", "train.compile_in_process=true")
    print(f"compile workers' host memory: pool {pooled:.2f} GiB, in process {alone:.2f} GiB")
    assert pooled > 0.2 and alone == 0.0
