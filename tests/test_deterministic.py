"""`train.deterministic`: torch's deterministic-algorithms mode for a run, so that two runs of one seed are the same
bit for bit on a GPU too (without it the backward's atomics make them drift apart at rounding level, which hundreds
of steps amplify: README, the formats' quality runs).

On the CPU every op is reproducible anyway, so the CPU test checks the switch itself; the GPU test checks the result:
two processes, each training a model whose heads take SDPA's flash path, must log the same losses and gradient norms,
for both engines."""

import os
from pathlib import Path

import pytest
import torch

from engine.trainer import Trainer
from tests.util import make_cfg, train_records

QUICK = ["model.num_hidden_layers=1", "train.steps=2", "train.micro_batch_size=2", "train.seq_len=32",
         "train.val_every=0", "train.val_batches=1", "train.warmup_steps=1"]


@pytest.fixture
def restore_mode():
    yield
    torch.use_deterministic_algorithms(False)


def test_the_run_switches_the_mode_and_says_so(tmp_path, restore_mode, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # so that teardown restores the variable as it was
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    Trainer(make_cfg([*QUICK, "train.deterministic=true"]), tmp_path).run()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "deterministic algorithms on (train.deterministic)" in (tmp_path / "train.log").read_text()
    Trainer(make_cfg([*QUICK]), tmp_path / "off").run()
    assert not torch.are_deterministic_algorithms_enabled()


# hidden 512 / 8 heads: head_dim 64, which SDPA's flash backend takes (the model's tiny heads of 12 would not)
GPU_MODEL = ["model.hidden_size=512", "model.intermediate_size=1000", "model.num_hidden_layers=3",
             "model.num_attention_heads=8", "model.num_key_value_heads=2", "model.vocab_size=256"]
GPU_RECIPE = ["train.steps=4", "train.seq_len=1024", "train.micro_batch_size=4", "train.grad_accum=2",
              "train.val_every=0", "train.val_batches=1", "train.warmup_steps=1", "train.lr=1e-3"]


def _losses_and_norms(run_dir: Path, *args) -> list:
    records = train_records(run_dir, "hardware=auto", "logger=none", "train.deterministic=true", *GPU_MODEL,
                            *GPU_RECIPE, *args)
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


@pytest.mark.gpu
@pytest.mark.parametrize("engine, compile_mode", [("stream", "off"), ("reference", "on")])
def test_gpu_deterministic_runs_repeat_bit_for_bit(tmp_path, engine, compile_mode):
    args = (f"engine={engine}", f"train.compile={compile_mode}")
    first = _losses_and_norms(tmp_path / "a", *args)
    second = _losses_and_norms(tmp_path / "b", *args)
    print(f"engine={engine} compile={compile_mode}: {first}")
    assert len(first) == 4 and first == second
