"""Shared test helpers: compose the real Hydra config with overrides, build engines and data from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from engine import config, hardware
from engine.config import register, validate

CONF_DIR = str(config.CONF_DIR)
ROOT = Path(__file__).resolve().parent.parent
register()

# A model small enough for many engine steps on 2 cores, with sizes that are not powers of two.
SMALL = ["model.hidden_size=72", "model.intermediate_size=100", "model.num_hidden_layers=3",
         "model.num_attention_heads=6", "model.num_key_value_heads=2", "model.vocab_size=256"]


# The exact state format, for tests about it: the default `auto` lets the planner choose (engine/formats.py)
FP32 = ["train.master_dtype=fp32", "train.moments_dtype=fp32", "train.grad_dtype=fp32"]


def user_env() -> dict:
    """The environment for the train.py (and other command) processes the tests start: a user's CPU run, without the
    suite's TRITON_INTERPRET=1, under which every Triton kernel (gradient accumulation, the fused AdamW) would run
    interpreted instead of taking its torch path, four times slower for the default job. A test of a kernel inside a
    command sets the variable itself."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def make_cfg(overrides=(), validated=True):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "hardware=cpu", *overrides])
    hardware.resolve(cfg)
    if validated:
        validate(cfg)
    return cfg


def train_records(run_dir: Path, *args, timeout: int = 400) -> list:
    """Run `python train.py *args` in a fresh process (run dir `run_dir`, W&B offline), require a clean exit, and
    return its metrics.jsonl records."""
    out = subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout, env={**user_env(), "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
