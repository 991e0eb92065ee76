"""Progress inside long steps: the streaming engine reports each layer of the forward and the backward, and the
trainer logs lines from it when the plan predicts long steps."""

import torch

import engine.trainer as trainer_module
from engine.data import build_data
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.progress import StepProgress
from engine.trainer import Trainer, build_engine
from tests.util import SMALL, make_cfg

RECIPE = ["engine=stream", *SMALL, "data=synthetic", "train.seq_len=16", "train.micro_batch_size=2",
          "train.grad_accum=2"]


def test_the_engine_reports_every_layer_of_a_training_steps_forward_and_backward():
    cfg = make_cfg(RECIPE)
    spec = ModelSpec(cfg.model)
    eng = build_engine(spec, cfg, torch.device("cpu"), torch.float32, build_plan(spec, cfg, 0.0, 64.0, False))
    data = build_data(cfg.data, cfg.train.seq_len, cfg.seed, cfg.model.vocab_size)
    calls = []
    eng.layer_progress = lambda phase, done: calls.append((phase, done))
    try:
        eng.train_step([data.batch("train", j, 2) for j in range(2)], 1e-3)
        L = spec.num_layers
        assert calls == [("forward", k) for k in range(1, L + 1)] + [("backward", k) for k in range(1, L + 1)]
    finally:
        eng.close()


def test_step_progress_logs_at_most_every_every_s():
    lines = []
    progress = StepProgress(28, lines.append, every_s=0.0)
    progress.begin(3)
    progress("backward", 12)
    assert len(lines) == 1 and lines[0].startswith("step 3: backward, 12 of 28 layers (")
    quiet = StepProgress(28, lines.append, every_s=3600.0)
    quiet.begin(1)
    quiet("forward", 1)
    assert len(lines) == 1


def test_the_trainer_logs_progress_inside_steps_the_plan_predicts_long(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "LONG_STEP_S", 0.0)  # every step counts as long (a CPU plan has no times)
    monkeypatch.setattr(trainer_module, "STEP_PROGRESS_EVERY_S", 0.0)
    Trainer(make_cfg([*RECIPE, "train.steps=2", "train.val_every=-1"]), tmp_path).run()
    log = (tmp_path / "train.log").read_text()
    assert "a progress line at most every 0 s inside each step" in log
    assert "step 2: backward, 3 of 3 layers (" in log and "step 1: forward, 1 of 3 layers (" in log
