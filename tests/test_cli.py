"""The user-facing commands, run as a user runs them: train.py as a subprocess, outputs read back from disk."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _train(*args, timeout=300):
    out = subprocess.run([sys.executable, "train.py", *args, "hardware=cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _records(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_job_learns(tmp_path):
    """The default recipe, shortened: validation loss leaves ln(256) = 5.5 nats well behind within 40 steps."""
    _train("logger=none", "train.steps=40", "train.warmup_steps=5", "train.micro_batch_size=8", "train.val_every=0",
           f"hydra.run.dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["initial_val_loss"] > 5.4
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 2.0
    steps = [r for r in _records(tmp_path) if "loss" in r]
    required = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s", "tflops", "mfu",
                "gpu_mem_gib", "host_mem_gib"}
    assert len(steps) == 40 and all(required <= r.keys() for r in steps)
    assert summary["config"]["data_description"]["source"] == "stdlib"


def test_multirun_gives_each_job_its_run_dir_and_wandb_run(tmp_path):
    _train("-m", "model=tiny", "train.seq_len=64,128", "logger=wandb", "train.steps=2", "train.val_every=0",
           "train.micro_batch_size=2", f"hydra.sweep.dir={tmp_path}")
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(jobs) == 2
    run_ids = set()
    for job, seq_len in zip(jobs, (64, 128)):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["config"]["train"]["seq_len"] == seq_len
        offline = list((job / "wandb").glob("offline-run-*"))
        assert len(offline) == 1
        run_ids.add(offline[0].name.rsplit("-", 1)[-1])
    assert len(run_ids) == 2


def test_sweep_records_refused_jobs_and_goes_on(tmp_path):
    _train("-m", "model=tiny", "train.seq_len=64,100000", "logger=none", "plan=true", f"hydra.sweep.dir={tmp_path}")
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    refused = [json.loads((j / "refused.json").read_text()) for j in jobs if (j / "refused.json").exists()]
    assert len(jobs) == 2 and len(refused) == 1
    assert "max_position_embeddings" in refused[0]["error"]
