"""Data parallel (engine/distributed.py) through the real launcher: `torchrun --nproc_per_node=2 train.py` on CPU
with gloo. Two ranks with half the micro-batches each train as one rank does (losses and final state bit for bit),
with the host state sharded over the ranks (the default) or replicated; each rank holds only its own units' state; a
checkpoint of two ranks resumes on one and the other way round, the HF export of a sharded run is one rank's, and a
step that does not split over the ranks is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import checkpoint
from engine.checkpoint import SafetensorsFile
from tests.test_checkpoint import RECIPE, state_tensors, step_losses, train_cli
from tests.test_engine_equivalence import FAMILIES
from tests.util import user_env

ROOT = Path(__file__).resolve().parent.parent


def torchrun(run_dir: Path, *args, ranks: int = 2, check=True, timeout=300, script: str = "train.py",
             hardware: str = "cpu"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script,
           "logger=none", f"hardware={hardware}", *RECIPE, *args, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**user_env(), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def train_one_rank(run_dir: Path, *args, **kwargs):
    """The one-process run to hold the ranks against, with the one intra-op thread torchrun gives each rank: some
    CPU kernels sum in another order with another thread count (seen: the MoE layers on an AMD EPYC host)."""
    return train_cli(run_dir, *args, env={"OMP_NUM_THREADS": "1"}, **kwargs)


def assert_same_training(a: Path, b: Path, step: int):
    """Losses and the final state bit for bit: with one micro-batch per rank, the sum over two ranks is the one
    addition g0 + g1 that one rank's accumulation makes (more ranks or micro-batches per rank would reorder the terms
    and agree to rounding only)."""
    assert step_losses(a) == step_losses(b) and step_losses(a)[0]
    ta, tb = state_tensors(a / "checkpoints" / f"step_{step}"), state_tensors(b / "checkpoints" / f"step_{step}")
    assert ta.keys() == tb.keys() and len(ta) > 0
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    sa, sb = (json.loads((d / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text()) for d in (a, b))
    for key in ("step", "tokens_total", "data_position", "lr_schedule"):
        assert sa[key] == sb[key], key


@pytest.mark.parametrize("engine, placement", [
    ("stream", []),  # every unit updated by the host AdamW (no GPU): gradients summed, then copied to the host
    ("stream", ["engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"]),  # the three update places
    # low-precision state: the summed gradient is quantized into the held int8 copy, the same bits on every rank
    # (bf16 copies: the test of each rank's own held gradients below), and a slot per layer: the look-ahead holds
    # one unit per rank
    ("stream", ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.grad_dtype=int8",
                "engine.cache_weights=on"]),
    # MoE with its balance loss: each micro-batch's term is scaled by the step's tokens over all ranks
    ("stream", ["model.num_hidden_layers=2", *FAMILIES["qwen3_moe"]]),
    ("stream", ["engine.shard_state=false"]),  # every rank holds and updates every unit
    # the NVMe tier: each rank keeps the moments of its own last layers in a file of its own
    ("stream", ["hardware.nvme_dir=/tmp", "engine.nvme_units=2", "hardware.nvme_direct_io=false"]),
    ("reference", [])],
    ids=["stream-host", "stream-three-places", "stream-formats", "stream-moe", "stream-replicated", "stream-nvme",
         "reference"])
def test_two_ranks_train_as_one(engine, placement, tmp_path):
    common = [f"engine={engine}", "train.steps=4", "train.checkpoint_every=4", *placement]
    one, two = tmp_path / "one", tmp_path / "two"
    train_one_rank(one, *common)
    out = torchrun(two, *common)
    assert "data parallel: rank 0 of 2, micro-batches 0..0 of each step's 2" in out.stdout
    assert_same_training(one, two, 4)
    # rank 1 writes its own records under rank 0's run dir, and its units' files into rank 0's checkpoints
    assert (two / "rank1" / "metrics.jsonl").is_file() and not (two / "rank1" / "checkpoints").exists()
    summary = json.loads((two / "summary.json").read_text())
    assert summary["tokens_total"] == 4 * 2 * 2 * 24  # every rank's tokens
    assert summary["ranks"] == 2 and [p["rank"] for p in summary["per_rank_peak_mem_gib"]] == [0, 1]
    assert summary["peak_host_mem_gib_all_ranks"] > summary["peak_host_mem_gib"] > 0


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_number_of_ranks(first, second, tmp_path):
    common = ["engine=stream", "train.steps=4", "train.checkpoint_every=4"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train_one_rank(whole, *common)
    launch = {1: lambda *a: train_one_rank(split, *a), 2: lambda *a: torchrun(split, *a)}
    out = launch[first](*common, "train.stop_at=2")
    assert "stopped at step 2" in out.stdout
    out = launch[second](*common, "train.resume=auto")
    assert f"resumed from {split / 'checkpoints' / 'step_2'} at step 2" in out.stdout
    assert_same_training(whole, split, 4)


def test_micro_batches_that_do_not_split_over_the_ranks_are_refused(tmp_path):
    out = torchrun(tmp_path / "run", "train.grad_accum=3", check=False)
    assert out.returncode != 0
    assert "train.grad_accum=3 micro-batches per step do not split over WORLD_SIZE=2 ranks" in out.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _held_units(log: str) -> list:
    line = next(ln for ln in log.splitlines() if "this rank holds the host state of units" in ln)
    return json.loads(line.split("units ")[1].split("]")[0] + "]")


def test_sharded_state_is_split_over_the_ranks_and_exports_as_one(tmp_path):
    """Each rank holds the host state of its own units only (together: one rank's bytes, each unit once),
    `train.export_hf` of the sharded run writes what one rank's run writes, and a sharded run imports it as one
    rank does."""
    common = ["engine=stream", "train.steps=2", "train.export_hf=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_one_rank(one, *common)
    out = torchrun(two, *common)
    assert "engine.slots=2 raised to 3: with the state sharded over 2 ranks" in out.stdout
    held = [_held_units(out.stdout), _held_units((two / "rank1" / "train.log").read_text())]
    assert sorted(held[0] + held[1]) == list(range(5)) and held[0] and held[1]  # embedding, 3 layers, head
    summaries = [json.loads(p.read_text()) for p in (one / "summary.json", two / "summary.json",
                                                     two / "rank1" / "summary.json")]
    whole, *ranks = [s["memory_bytes"] for s in summaries]
    for kind in ("host_master", "host_adam_m", "host_adam_v", "host_grads"):
        assert 0 < ranks[0][kind] < whole[kind] and ranks[0][kind] + ranks[1][kind] == whole[kind], kind
    a, b = (SafetensorsFile(d / "hf" / "model-00001-of-00001.safetensors") for d in (one, two))
    with a, b:
        assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) > 0
        for k in a.keys():
            assert torch.equal(a.get(k), b.get(k)), k
    # and a sharded run starts from that HF checkpoint as one rank does (each rank imports its own units)
    init = ["engine=stream", "train.steps=2", "train.checkpoint_every=2", f"model.init=hf:{one / 'hf'}"]
    train_one_rank(tmp_path / "one_hf", *init)
    torchrun(tmp_path / "two_hf", *init)
    assert_same_training(tmp_path / "one_hf", tmp_path / "two_hf", 2)


def test_each_rank_holds_the_bf16_gradients_of_its_own_units(tmp_path):
    """With sharded state and bf16 gradients, a unit's held gradient is read by its owner's update alone: each rank
    holds those of its own units only, on the device or (the last `engine.host_grad_units` streamed units) in host
    memory, so the two ranks together hold what one rank does, each unit's once; and they train as one rank."""
    common = ["engine=stream", "train.steps=4", "train.checkpoint_every=4", "train.master_dtype=bf16",
              "train.moments_dtype=int8", "train.grad_dtype=bf16", "engine.gpu_resident_units=0",
              "engine.host_grad_units=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_one_rank(one, *common)
    torchrun(two, *common)
    assert_same_training(one, two, 4)
    summaries = [json.loads(p.read_text()) for p in (one / "summary.json", two / "summary.json",
                                                     two / "rank1" / "summary.json")]
    whole, *ranks = [s["memory_bytes"] for s in summaries]
    for kind in ("device_held_grads", "host_grads"):
        assert 0 < ranks[0][kind] < whole[kind] and ranks[0][kind] + ranks[1][kind] == whole[kind], kind


@pytest.mark.parametrize("grad_dtype, placement", [
    # the embedding GPU-resident (replicated), layers 1 and 3 on rank 0, layer 2 and the head on rank 1, whose
    # head's held gradient waits on the host
    ("bf16", ["engine.gpu_resident_units=1", "engine.host_grad_units=1"]),
    ("int8", ["engine.gpu_resident_units=1"]),  # 1 B a parameter and an fp32 scale per block of each unit
])
def test_the_plan_counts_the_held_gradients_of_each_rank(grad_dtype, placement, tmp_path):
    """With sharded state each rank holds the held gradients of the units it updates (the GPU-resident ones and its
    own), and the plan each rank makes (state_ranks=2) counts those of the rank holding the most: its GPU gradient
    rows are what that rank's engine allocates, byte for byte, and so are its rows of the held bf16 gradients on
    the host and of their wire copies."""
    from engine.distributed import DataParallel, local_config
    from engine.model import ModelSpec
    from engine.plan import build_plan
    from tests.util import make_cfg

    common = ["engine=stream", "train.steps=1", "train.val_every=-1", "train.checkpoint_at_end=false",
              "train.master_dtype=bf16", "train.moments_dtype=int8", f"train.grad_dtype={grad_dtype}", *placement]
    run = tmp_path / "two"
    torchrun(run, *common)
    ranks = [json.loads(p.read_text())["memory_bytes"] for p in (run / "summary.json", run / "rank1" / "summary.json")]
    assert ranks[0]["device_held_grads"] != ranks[1]["device_held_grads"]  # the ranks hold different units

    cfg = make_cfg([*RECIPE, *common])
    local = local_config(cfg, DataParallel(world=2, local_world=2))  # the trainer's plan of each rank
    plan = build_plan(ModelSpec(cfg.model), local, 0.0, 64.0, on_gpu=False, state_ranks=2)

    def row(text: str) -> int:
        return sum(b for _, item, b in plan.rows if text in item)

    assert row("accumulators") + row(f"{grad_dtype} gradients held") == max(
        r["device_grad_accumulators"] + r["device_held_grads"] for r in ranks)
    assert row(f"{grad_dtype} gradients held") == max(r["device_held_grads"] for r in ranks)
    assert row("GPU-streamed units until their update") == max(r.get("host_grads", 0) for r in ranks)
    assert row("copies of those gradients for the D2H") == max(r["device_grad_transfer"] for r in ranks)
    if grad_dtype == "bf16":
        assert row("GPU-streamed units until their update") > 0


FAILING_SAVE = """
import os, runpy, sys
sys.path.insert(0, {root!r})
import engine.checkpoint.state as c
_write = c.write_safetensors
def failing_write(path, *args, **kwargs):
    if os.environ["RANK"] == "1" and path.parent.name == "step_4.tmp":
        raise OSError(28, "No space left on device (injected)")
    return _write(path, *args, **kwargs)
c.write_safetensors = failing_write
os.chdir({root!r})
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 1 cannot write its unit files of step 4: both ranks stop with the error named (no rank waits forever for
    the other), the partial step_4.tmp is removed and step 2's checkpoint stays complete."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(FAILING_SAVE.format(root=str(ROOT)))
    run = tmp_path / "run"
    out = torchrun(run, "engine=stream", "train.steps=4", "train.checkpoint_every=2", script=str(launcher),
                   check=False)
    assert out.returncode != 0
    assert "saving the checkpoint failed: rank 1: OSError: [Errno 28] No space left on device (injected)" in out.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    assert checkpoint.list_checkpoints(run / "checkpoints")[0] == [(2, run / "checkpoints" / "step_2")]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("shard", ["true", "false"])
def test_two_gpus_train_as_one(shard, tmp_path):
    """NCCL: two GPUs with one micro-batch each against one GPU with both, compiled templates, sharded state (reduce
    to the owner, slot broadcasts) or replicated. To rounding, not bit for bit: one GPU takes the clip norm's sums of
    squares in the accumulation kernel, several GPUs from the summed gradient in a pass of their own."""
    common = ["engine=stream", "train.steps=4", "train.checkpoint_every=4", "engine.gpu_resident_units=1",
              "engine.gpu_streamed_units=1", f"engine.shard_state={shard}"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_cli(one, *common, hardware="auto")
    torchrun(two, *common, hardware="auto")
    (la, _), (lb, _) = step_losses(one), step_losses(two)
    assert [s for s, _ in la] == [s for s, _ in lb] and la
    assert [loss for _, loss in lb] == pytest.approx([loss for _, loss in la], rel=1e-5)
    ta, tb = (state_tensors(d / "checkpoints" / "step_4") for d in (one, two))
    assert ta.keys() == tb.keys() and len(ta) > 0
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-4, atol=1e-6, msg=k)


def test_plan_true_on_a_profile_of_several_cards_plans_one_of_its_ranks(tmp_path, monkeypatch):
    """plan=true with hardware.gpus=N plans rank 0 of a torchrun job of N ranks on the profile's host: its share of
    the micro-batches and of the host, the state sharded, as a run under torchrun plans itself; micro-batches that do
    not split are refused, and hardware.gpus=1 plans one process as before."""
    from engine import distributed, hardware
    from engine.config import ConfigError
    from engine.model import ModelSpec
    from engine.plan import build_plan
    from engine.trainer import Trainer
    from tests.util import make_cfg

    monkeypatch.setattr(hardware, "measure_host_memory_gib", lambda *a, **k: (64.0, "fake measure"), raising=False)
    over = ["model=qwen7b", "engine=stream", "train=bench", "train.seq_len=4096", "train.micro_batch_size=2",
            "train.grad_accum=8", "hardware=h100x4", "plan=true"]
    cfg = make_cfg(over)
    trainer = Trainer(cfg, tmp_path / "x4")
    local = distributed.local_config(cfg, distributed.planned_ranks(4))
    assert local.train.grad_accum == 2 and local.engine.slots >= 5
    expected = build_plan(ModelSpec(cfg.model), local, hardware.usable_gpu_gib(cfg.hardware, 0.0), 509.0 / 4,
                          on_gpu=True, check=False, state_ranks=4)
    assert trainer.plan.rows == expected.rows and trainer.plan.times_s == expected.times_s
    assert trainer.plan.limits_gib["host"] == pytest.approx(509.0 / 4)
    assert "one of 4 data-parallel ranks" in trainer.plan.table() and "its 2 of the 8 micro-batches" in \
        trainer.plan.table()
    one = Trainer(make_cfg([*over, "hardware.gpus=1"]), tmp_path / "one").plan
    assert one.limits_gib["host"] == pytest.approx(509.0) and not one.ranks_line
    with pytest.raises(ConfigError, match="train.grad_accum=6 micro-batches per step do not split over hardware.gpus=4 "
                                        "ranks.*or hardware.gpus=1 to plan one process"):
        Trainer(make_cfg([*over, "train.grad_accum=6"]), tmp_path / "odd")
