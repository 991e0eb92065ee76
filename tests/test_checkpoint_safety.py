"""Checkpoint-directory safety: a save replaces what it finds atomically, cleanup deletes only what streamtrain wrote,
one run at a time holds a run dir and a checkpoint root, write failures are found early or named, a damaged
manifest is refused. Real files, real processes where another run is the point, a tiny model on CPU."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import checkpoint
from engine.checkpoint import CheckpointError
from engine.config import ConfigError
from engine.trainer import Trainer
from tests.test_checkpoint import RECIPE, ROOT, train_cli
from tests.util import make_cfg, user_env

RUN = ["engine=reference", "train.steps=4", "train.checkpoint_every=2"]


def _run(run_dir: Path, *args) -> dict:
    return Trainer(make_cfg([*RECIPE, *args]), run_dir).run()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------------------------
# a save replaces what it finds


def test_a_save_replaces_a_corrupt_checkpoint_of_its_step(tmp_path):
    """step_4 found corrupt, the run resumed from step_2: its save of step 4 replaces the corrupt one."""
    _run(tmp_path, *RUN)
    root = tmp_path / "checkpoints"
    _flip_byte(root / "step_4" / "unit_0002_layer1.safetensors")
    _run(tmp_path, *RUN, f"train.resume={root / 'step_2'}")
    assert checkpoint.open_training_state(root / "step_4").step == 4
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step_2", "step_4"]


def test_runs_of_different_seeds_sharing_a_checkpoint_dir_resume_their_own(tmp_path):
    shared = tmp_path / "shared"
    common = [*RUN, "train.stop_at=2", f"train.checkpoint_dir={shared}"]
    _run(tmp_path / "a", *common, "seed=1")
    _run(tmp_path / "b", *common, "seed=2")  # its step_2 replaces run a's
    summary = _run(tmp_path / "b", *RUN, f"train.checkpoint_dir={shared}", "seed=2", "train.resume=auto")
    assert summary["start_step"] == 2
    assert json.loads((shared / "step_4" / "trainer_state.json").read_text())["fingerprint"]["seed"] == 2


def test_a_crash_at_every_point_of_the_swap_keeps_a_complete_checkpoint(tmp_path, monkeypatch):
    """A save of step 2 over an existing step_2, killed before each rename, fsync and removal in turn (a
    KeyboardInterrupt: no cleanup runs, as after SIGKILL): the next run finds a complete, verified step_2, old or new,
    and its save leaves nothing behind."""
    from engine.checkpoint import state as ckpt_state

    template = tmp_path / "template"
    _run(template, *RUN, "train.stop_at=2")
    tr = Trainer(make_cfg([*RECIPE, *RUN, "train.resume=auto"]), template)
    crash_at, calls = [None], []

    def crashing(fn):
        def wrapped(*args, **kwargs):
            calls.append(fn.__name__)
            if len(calls) == crash_at[0]:
                raise KeyboardInterrupt
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(os, "rename", crashing(os.rename))
    monkeypatch.setattr(ckpt_state, "fsync_dir", crashing(ckpt_state.fsync_dir))
    monkeypatch.setattr(shutil, "rmtree", crashing(shutil.rmtree))
    try:
        for k in range(1, 40):
            root = tmp_path / f"crash{k}"
            shutil.copytree(template / "checkpoints", root, ignore=shutil.ignore_patterns(".streamtrain.lock"))
            crash_at[0], calls[:] = k, []
            try:
                checkpoint.save_training_state(tr.engine, root, 2, {"note": "new"}, log=lambda line: None)
                break  # k is past the last crash point
            except KeyboardInterrupt:
                pass
            crash_at[0] = None
            lines = []
            found = checkpoint.find_resume("auto", root, log=lines.append)
            assert found == root / "step_2", (k, calls, sorted(p.name for p in root.iterdir()))
            assert checkpoint.open_training_state(found, tr.spec).state.get("note") in (None, "new")
            checkpoint.save_training_state(tr.engine, root, 2, {"note": "newer"}, log=lines.append)
            assert sorted(p.name for p in root.iterdir()) == ["step_2"], (k, calls)
            assert checkpoint.open_training_state(root / "step_2", tr.spec).state["note"] == "newer"
        assert k > 3, calls
    finally:
        tr.close()


# ---------------------------------------------------------------------------------------------------------------
# cleanup deletes only what streamtrain wrote


def test_cleanup_deletes_only_what_streamtrain_wrote_and_logs_each_removal(tmp_path):
    root = tmp_path / "checkpoints"
    foreign = [root / "step_1.tmp", root / "notes.deleting", root / "step_0"]
    for p in foreign:
        p.mkdir(parents=True)
        (p / "data.txt").write_text("not streamtrain's")
    _run(tmp_path, *RUN, "train.stop_at=2")
    for p in foreign:
        assert (p / "data.txt").read_text() == "not streamtrain's", p
    from engine.checkpoint.state import write_marker

    ours = [root / "step_3.tmp", root / "step_1.deleting"]  # a killed save's and a killed prune's leftovers
    for p in ours:
        p.mkdir()
        write_marker(p)
    _run(tmp_path, *RUN, "train.resume=auto")
    assert not any(p.exists() for p in ours) and all(p.exists() for p in foreign)
    log = (tmp_path / "train.log").read_text()
    for p in ours:
        assert f"removed {p}" in log, log


# ---------------------------------------------------------------------------------------------------------------
# one run at a time


def _holder(run_dir: Path, *args) -> subprocess.Popen:
    """A real training run that goes on until killed, once it has logged its first step; then stopped (SIGSTOP): it
    stays alive and holds its locks, without taking a core from the runs started beside it."""
    proc = subprocess.Popen([sys.executable, "train.py", "logger=none", "hardware=cpu", *RECIPE, "engine=reference",
                             "train.steps=100000", "train.log_every=1", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**user_env(), "WANDB_MODE": "disabled"})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)
    return proc


def test_a_second_run_is_refused_by_the_lock_and_a_stale_lock_is_taken_over(tmp_path):
    run, shared = tmp_path / "run", tmp_path / "shared"
    holder = _holder(run, f"train.checkpoint_dir={shared}")
    try:
        for other_run, field, where in [(run, "hydra.run.dir", run), (tmp_path / "other", "train.checkpoint_dir",
                                                                      shared)]:
            out = train_cli(other_run, "engine=reference", "train.steps=2", "train.resume=auto",
                            f"train.checkpoint_dir={shared}", check=False)
            errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
            assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
            assert f"{field}={where}" in errors[0] and f"pid {holder.pid} on host {socket.gethostname()}" \
                in errors[0], errors[0]
        assert holder.poll() is None and (run / "train.log").stat().st_size > 0  # the holder is untouched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    out = train_cli(run, "engine=reference", "train.steps=2", f"train.checkpoint_dir={shared}")
    assert f"left by pid {holder.pid} on host {socket.gethostname()}" in out.stdout, out.stdout
    assert not (run / ".streamtrain.lock").exists() and not (shared / ".streamtrain.lock").exists()


def test_nvme_cleanup_keeps_a_file_whose_lock_is_held(tmp_path):
    """Another machine's live run on a shared disk: its pid means nothing here, but it holds its file's lock."""
    from engine.streaming import nvme

    live = nvme.MomentFile(str(tmp_path), {1: 4096}, direct_io=False)
    elsewhere = tmp_path / f"{nvme.FILE_PREFIX}4999999-0badcafe.bin"  # above any pid_max: no such process here
    os.rename(live.path, elsewhere)
    stale = tmp_path / f"{nvme.FILE_PREFIX}4999998-deadbeef.bin"
    stale.write_bytes(b"x" * 4096)
    try:
        assert nvme.remove_stale_files(str(tmp_path)) == [stale]
        assert elsewhere.exists() and not stale.exists()
    finally:
        live.close()
        elsewhere.unlink()


# ---------------------------------------------------------------------------------------------------------------
# write failures


def test_an_uncreatable_checkpoint_dir_is_refused_at_start(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    out = train_cli(tmp_path / "run", *RUN, "train.checkpoint_dir=/proc/streamtrain-checkpoints", check=False)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "train.checkpoint_dir=/proc/streamtrain-checkpoints" in errors[0]
    assert not (tmp_path / "run").exists()  # refused before it started: no run dir
    with pytest.raises(ConfigError, match=f"train.checkpoint_dir={a_file / 'sub'}: cannot be written"):
        Trainer(make_cfg([*RECIPE, *RUN, f"train.checkpoint_dir={a_file / 'sub'}"]), tmp_path / "run2")


def test_a_full_disk_at_a_save_exits_4_naming_the_path_and_the_free_space(tmp_path, monkeypatch, capsys):
    from engine import trainer

    write = checkpoint.state.write_safetensors

    def full_at_step_4(path, *args, **kwargs):
        if "step_4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.state, "write_safetensors", full_at_step_4)
    monkeypatch.chdir(tmp_path)  # main's run dir without Hydra
    with pytest.raises(SystemExit) as exit_:
        trainer.main(make_cfg([*RECIPE, *RUN]))
    assert exit_.value.code == 4
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    root = tmp_path / "checkpoints"
    assert len(errors) == 1 and str(root / "step_4") in errors[0] and "GiB free" in errors[0], errors
    assert "No space left on device" in errors[0] and str(root / "step_2") in errors[0]
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]
    checkpoint.open_training_state(root / "step_2")


# ---------------------------------------------------------------------------------------------------------------
# a damaged manifest


def test_a_damaged_manifest_is_refused_naming_the_previous_checkpoint(tmp_path):
    _run(tmp_path, *RUN)
    root = tmp_path / "checkpoints"
    manifest = root / "step_4" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CheckpointError) as err:
        Trainer(make_cfg([*RECIPE, *RUN, "train.resume=auto"]), tmp_path)
    assert str(manifest) in str(err.value) and f"train.resume={root / 'step_2'}" in str(err.value), err.value
    # a save of another step leaves the damaged checkpoint where it is
    _run(tmp_path, *RUN, "train.checkpoint_every=1", "train.stop_at=3", f"train.resume={root / 'step_2'}")
    assert manifest.read_text() and (root / "step_4" / "unit_0000_embed.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# the last line


def test_the_last_line_names_the_real_checkpoint_root(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    _run(tmp_path / "run", *RUN, f"train.checkpoint_dir={elsewhere}")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert str(elsewhere) in last and "checkpoints/" not in last, last
