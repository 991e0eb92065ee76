"""Faults: SIGKILL at random moments (also in the middle of a save), SIGINT/SIGTERM, a second signal during the
save, and runs of non-finite steps. Real processes (train.py, or train.py started through a launcher that makes
every unit-file write of a save slower, so that random kills land inside saves often), real files.

Fault injection without a user knob or an environment hook in the product: saves are slowed down by the launcher
below, which monkeypatches `engine.checkpoint.state.write_safetensors` before running train.py; NaN gradients are
injected in-process by wrapping the engine's `train_step` with a `grad_hook` (the engines' test interface), or
produced for real by an absurd learning rate.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import checkpoint
from engine.trainer import Trainer, TrainingDiverged
from tests.test_checkpoint import RECIPE, ROOT, assert_same_state, state_tensors, step_losses, train_cli
from tests.util import make_cfg, user_env

LAUNCHER = """
import os, runpy, sys, time
sys.path.insert(0, {root!r})
import engine.checkpoint.state as c
_write = c.write_safetensors
def slow_write(*args, **kwargs):
    time.sleep(float(os.environ.get("SLOW_SAVE_S", "0")))
    return _write(*args, **kwargs)
c.write_safetensors = slow_write
os.chdir({root!r})
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def launch(tmp_path: Path, run_dir: Path, *args, slow_save_s: float = 0.0) -> subprocess.Popen:
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(root=str(ROOT)))
    return subprocess.Popen([sys.executable, str(launcher), "logger=none", "hardware=cpu", *RECIPE, *args,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**user_env(), "WANDB_MODE": "disabled", "SLOW_SAVE_S": str(slow_save_s)})


def wait_for(cond, proc: subprocess.Popen, timeout: float = 180.0) -> bool:
    """Poll until cond() holds (True) or the process exits (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.003)
    proc.kill()
    raise TimeoutError("condition not reached")


def newest_complete(root: Path) -> int:
    complete, _ = checkpoint.list_checkpoints(root)
    return complete[-1][0] if complete else 0


def saving(root: Path) -> bool:
    return root.is_dir() and any(p.name.endswith(".tmp") for p in root.iterdir())


def test_sigkill_at_random_moments_then_resume_matches_uninterrupted_run(tmp_path):
    args = ["engine=stream", "train.steps=16", "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    whole = tmp_path / "whole"  # the uninterrupted run, in this process
    Trainer(make_cfg([*RECIPE, *args]), whole).run()
    run = tmp_path / "run"
    root = run / "checkpoints"
    rng = random.Random(20240611)
    killed_mid_save = 0
    for attempt in range(4):
        before = newest_complete(root)
        proc = launch(tmp_path, run, *args, "train.resume=auto", slow_save_s=0.04)
        if attempt % 2 == 0:  # anywhere, once this process has made progress
            alive = wait_for(lambda before=before: newest_complete(root) > before, proc)
            time.sleep(rng.uniform(0.0, 0.4))
        else:  # inside a save: its step_<N>.tmp exists, some unit files are written, the manifest is not
            alive = wait_for(lambda before=before: newest_complete(root) > before and saving(root), proc)
            time.sleep(rng.uniform(0.0, 0.15))
        if not alive or proc.poll() is not None:
            break  # it finished before we got to kill it
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        killed_mid_save += saving(root)
        # the previous complete checkpoint is always intact and loadable
        newest = newest_complete(root)
        assert newest > before
        checkpoint.open_training_state(root / f"step_{newest}")
    assert attempt >= 2 and killed_mid_save >= 1, (attempt, killed_mid_save)
    newest = newest_complete(root)
    out = train_cli(run, *args, "train.resume=auto")
    assert f"resumed from {root / f'step_{newest}'} at step {newest}" in out.stdout
    assert sorted(p.name for p in root.iterdir()) == ["step_15", "step_16"]  # leftovers of killed saves removed
    assert_same_state(whole / "checkpoints" / "step_16", root / "step_16")
    assert step_losses(run) == step_losses(whole)  # one record per step, records of killed processes trimmed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits(sig, tmp_path):
    args = ["engine=stream", "train.steps=5000", "train.log_every=1"]
    proc = launch(tmp_path, tmp_path, *args)
    metrics = tmp_path / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 3, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr and f"{signal.Signals(sig).name}: stopping after the current step" in stderr
    last = step_losses(tmp_path)[0][-1][0]
    assert f"stopped at step {last}" in stdout
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [f"step_{last}"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped"]["reason"] == signal.Signals(sig).name and summary["stopped"]["step"] == last
    ck = checkpoint.open_training_state(tmp_path / "checkpoints" / f"step_{last}")
    assert ck.step == last and ck.state["data_position"]["next_step"] == last
    if sig == signal.SIGTERM:  # and the run goes on from there
        tr = Trainer(make_cfg([*RECIPE, *args, "train.resume=auto", f"train.stop_at={last + 2}"]), tmp_path)
        assert tr.start_step == last
        assert tr.run()["stopped"]["step"] == last + 2


def test_second_signal_during_the_save_aborts_and_keeps_the_previous_checkpoint(tmp_path):
    args = ["engine=reference", "train.steps=5000", "train.checkpoint_every=2"]
    root = tmp_path / "checkpoints"
    proc = launch(tmp_path, tmp_path, *args, slow_save_s=0.5)
    metrics = tmp_path / "metrics.jsonl"
    assert wait_for(lambda: newest_complete(root) >= 2 and metrics.read_text().count('"loss"') >= 3, proc)
    proc.send_signal(signal.SIGTERM)  # during step 4 or later: a save follows (final, or a periodic one)
    assert wait_for(lambda: saving(root), proc)  # the final save has started
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert saving(root)  # the interrupted save never became a checkpoint
    newest = newest_complete(root)
    checkpoint.open_training_state(root / f"step_{newest}")


def _nan_hook(unit, grads):
    if unit == 1:
        next(iter(grads.values())).view(-1)[0] = float("nan")


@pytest.mark.parametrize("engine", ["reference", "stream"])
def test_consecutive_nan_steps_stop_with_a_checkpoint_of_the_last_good_state(engine, tmp_path):
    tr = Trainer(make_cfg([*RECIPE, f"engine={engine}", "train.steps=20", "train.checkpoint_every=1",
                           "train.keep_checkpoints=0", "train.max_consecutive_skips=3"]), tmp_path)
    bad = {1, 4, 5, 6}  # 0-based step indices: one isolated skip (the run goes on), then three in a row
    train_step, calls = tr.engine.train_step, []

    def poisoned(batches, lr, grad_hook=None):
        calls.append(len(calls))
        return train_step(batches, lr, grad_hook=_nan_hook if calls[-1] in bad else grad_hook)

    tr.engine.train_step = poisoned
    with pytest.raises(TrainingDiverged, match=r"steps 5\.\.7: 3 consecutive steps .* still those after step 4"):
        tr.run()
    assert len(calls) == 7
    root = tmp_path / "checkpoints"
    assert sorted(int(p.name[5:]) for p in root.iterdir()) == list(range(1, 8))
    good = state_tensors(root / "step_4")
    for step in (5, 6, 7):  # skipped steps changed nothing: the saved state is the last good one
        assert all(torch.equal(good[k], v) for k, v in state_tensors(root / f"step_{step}").items())
    assert not all(torch.equal(good[k], v) for k, v in state_tensors(root / "step_3").items())
    state = json.loads((root / "step_7" / "trainer_state.json").read_text())
    assert state["skipped_steps"] == 4 and state["consecutive_skips"] == 3
    assert "TrainingDiverged" in json.loads((tmp_path / "summary.json").read_text())["error"]


def test_divergence_through_the_cli_exits_3_with_a_checkpoint(tmp_path):
    """lr=1e30: the first update blows the weights up, every later step is non-finite and skipped."""
    out = train_cli(tmp_path, "engine=reference", "train.steps=20", "train.lr=1e30", "train.warmup_steps=0",
                    "train.max_consecutive_skips=3", check=False)
    assert out.returncode == 3 and "Traceback" not in out.stderr
    assert "3 consecutive steps had a non-finite loss or gradient" in out.stderr
    newest = newest_complete(tmp_path / "checkpoints")
    assert str(tmp_path / "checkpoints" / f"step_{newest}") in out.stderr
    checkpoint.open_training_state(tmp_path / "checkpoints" / f"step_{newest}")
