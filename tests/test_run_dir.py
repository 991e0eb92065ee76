"""What a run leaves in its run dir: the dir is named on the console and its log holds what was printed; a run
refused before it starts, and `plan=true`, leave nothing; a rerun from step 0 never mixes its metrics with an
earlier run's."""

import json
import subprocess
import sys
from pathlib import Path

from engine.trainer import Trainer
from tests.util import make_cfg, user_env

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["model.num_hidden_layers=1", "train.steps=2", "train.micro_batch_size=2", "train.seq_len=32",
         "train.val_every=0", "train.val_batches=1", "train.warmup_steps=1"]


def _train(*args):
    return subprocess.run([sys.executable, "train.py", "hardware=cpu", "logger=none", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**user_env(), "WANDB_MODE": "offline"})


def test_the_run_dir_is_printed_and_train_log_holds_the_output(tmp_path):
    run_dir = tmp_path / "run"
    out = _train(*QUICK, f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count(f"run dir: {run_dir}") == 2, out.stdout
    log = (run_dir / "train.log").read_text()
    assert f"run dir: {run_dir}" in log and "step 2/2 loss" in log


def test_a_refused_run_and_a_plan_leave_no_run_dir(tmp_path):
    for args in (["train.lr=-1"], ["plan=true"], ["train.seq_len=100000"]):
        run_dir = tmp_path / "runs" / "2026-01-01" / "12-00-00-x"
        out = _train(*QUICK, *args, f"hydra.run.dir={run_dir}")
        assert out.returncode == (0 if args == ["plan=true"] else 2), out.stderr[-2000:]
        assert not (tmp_path / "runs").exists(), (args, list(run_dir.rglob("*")))


def test_a_refusal_in_an_existing_run_dir_leaves_it_alone(tmp_path):
    run_dir = tmp_path / "run"
    assert _train(*QUICK, f"hydra.run.dir={run_dir}").returncode == 0
    before = sorted(p.name for p in run_dir.iterdir())
    assert _train(*QUICK, "train.lr=-1", f"hydra.run.dir={run_dir}").returncode == 2
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_a_rerun_from_step_0_starts_a_new_metrics_file(tmp_path):
    cfg = make_cfg([*QUICK])
    Trainer(cfg, tmp_path).run()
    first = (tmp_path / "metrics.jsonl").read_text()
    Trainer(make_cfg([*QUICK]), tmp_path).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    moved = list(tmp_path.glob("metrics.*.jsonl"))
    assert len(moved) == 1 and moved[0].read_text() == first


def test_a_bad_file_is_refused_naming_the_field_that_points_at_it(tmp_path):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\0" * 7)
    out = _train(*QUICK, "data=memmap", f"data.path={tokens}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2 and f"error: data=memmap data.path={tokens}: " in out.stderr, out.stderr
    out = _train(*QUICK, f"train.resume={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2 and f"error: train.resume={tmp_path}: " in out.stderr, out.stderr
