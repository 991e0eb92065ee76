"""Training-state checkpoints: exact resume through the real CLI, the on-disk format, keep-last-K, and refusal of
damaged or mismatched checkpoints (always naming the file or the field), all on CPU with a tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import checkpoint, optim
from engine.checkpoint import CheckpointError, SafetensorsFile
from engine.checkpoint.state import write_marker
from engine.config import ConfigError
from engine.trainer import Trainer
from tests.util import SMALL, make_cfg, user_env

ROOT = Path(__file__).resolve().parent.parent
# clipping and warmup active, several micro-batches: every part of the optimizer state matters for exactness
RECIPE = [*SMALL, "data=synthetic", "train.seq_len=24", "train.micro_batch_size=2", "train.grad_accum=2",
          "train.lr=1e-2", "train.warmup_steps=2", "train.max_grad_norm=0.05", "train.val_every=0",
          "train.val_batches=2"]


def train_cli(run_dir: Path, *args, check=True, timeout=240, hardware="cpu", env=None):
    out = subprocess.run([sys.executable, "train.py", "logger=none", f"hardware={hardware}", *RECIPE, *args,
                          f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**user_env(), "WANDB_MODE": "disabled", **(env or {})})
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def step_losses(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r], [(r["step"], r["val_loss"]) for r in recs
                                                                    if "val_loss" in r]


def state_tensors(step_dir: Path):
    """Every tensor of a training checkpoint (master weights and moments), by file-qualified name."""
    out = {}
    for f in sorted(step_dir.glob("unit_*.safetensors")):
        with SafetensorsFile(f) as st:
            out.update({k: st.get(k) for k in st.keys()})
    return out


def assert_same_state(a: Path, b: Path):
    ta, tb = state_tensors(a), state_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 0
    assert {k.split(".")[0] for k in ta} == {"master", "exp_avg", "exp_avg_sq"}
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    sa, sb = (json.loads((d / "trainer_state.json").read_text()) for d in (a, b))
    for key in ("step", "units", "rng", "skipped_steps", "tokens_total", "data_position", "lr_schedule"):
        assert sa[key] == sb[key], key


@pytest.mark.parametrize("engine, placement", [
    ("stream", []), ("reference", []),
    # GPU-streamed units: the mid-run checkpoint flushes their pending update, the next load reads the state home
    ("stream", ["engine.gpu_resident_units=1", "engine.gpu_streamed_units=2"])])
def test_ten_steps_equal_five_stop_resume_five(engine, placement, tmp_path):
    """train 10 == train 5, stop, resume=auto, train 5: loss curve, final weights and moments bit-identical."""
    common = [f"engine={engine}", "train.steps=10", "train.checkpoint_every=5", *placement]
    whole, split = tmp_path / "whole", tmp_path / "split"
    Trainer(make_cfg([*RECIPE, *common]), whole).run()  # uninterrupted, in this process; the split run via the CLI
    first = train_cli(split, *common, "train.stop_at=5")
    assert "stopped at step 5" in first.stdout
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step_5"]
    second = train_cli(split, *common, "train.resume=auto")
    assert f"resumed from {split / 'checkpoints' / 'step_5'} at step 5" in second.stdout
    losses_whole, val_whole = step_losses(whole)
    losses_split, val_split = step_losses(split)
    assert [s for s, _ in losses_whole] == list(range(1, 11))
    assert losses_split == losses_whole  # exact floats, one record per step
    assert val_split == val_whole  # initial validation not repeated by the resumed process, final one equal
    assert_same_state(whole / "checkpoints" / "step_10", split / "checkpoints" / "step_10")
    for run in (whole, split):
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_10", "step_5"]
    summary = json.loads((split / "summary.json").read_text())
    assert summary["start_step"] == 5 and summary["tokens_total"] == 10 * 2 * 2 * 24


def _trainer(tmp_path, *overrides):
    return Trainer(make_cfg([*RECIPE, *overrides]), tmp_path)


def test_val_every_minus_one_never_validates(tmp_path):
    summary = _trainer(tmp_path, "train.steps=2", "train.val_every=-1").run()
    losses, val_losses = step_losses(tmp_path)
    assert [s for s, _ in losses] == [1, 2] and val_losses == []
    assert summary["initial_val_loss"] is None and summary["final_val_loss"] is None


def test_format_keep_last_k_and_cleanup(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    for leftover in ("step_2.tmp", "step_0.deleting"):  # a killed save's and a killed prune's (marked: ours)
        (root / leftover).mkdir()
        write_marker(root / leftover)
    Trainer(make_cfg([*RECIPE, "engine=stream", "train.steps=6", "train.checkpoint_every=1",
                      "train.keep_checkpoints=2"]), tmp_path).run()
    assert sorted(p.name for p in root.iterdir()) == ["step_5", "step_6"]
    step = root / "step_6"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["step"] == 6 and set(manifest["files"]) == {p.name for p in step.iterdir()} - {"manifest.json"}
    for name, meta in manifest["files"].items():
        assert (step / name).stat().st_size == meta["bytes"]
        assert checkpoint.sha256_file(step / name) == meta["sha256"]
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["data_position"]["train_batches_consumed"] == 12
    assert state["fingerprint"]["train"]["lr"] == 1e-2 and {"torch", "numpy", "python"} <= state["rng"].keys()
    assert [u["adam_step"] for u in state["units"]] == [6.0] * 5
    # the unit files are standard safetensors: the reference implementation reads them
    from safetensors import safe_open

    with safe_open(str(step / "unit_0001_layer0.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["unit"] == "1"
        q = f.get_tensor("master.model.layers.0.self_attn.q_proj.weight")
    with SafetensorsFile(step / "unit_0001_layer0.safetensors") as st:
        assert torch.equal(q, st.get("master.model.layers.0.self_attn.q_proj.weight"))


def test_resume_auto_starts_fresh_then_skips_incomplete_and_cleans_up(tmp_path):
    run = ["engine=reference", "train.steps=4", "train.checkpoint_every=2", "train.resume=auto"]
    tr = _trainer(tmp_path, *run, "train.stop_at=2")
    assert tr.start_step == 0  # nothing to resume from: a fresh start
    tr.run()
    root = tmp_path / "checkpoints"
    # killed saves' leftovers (marked: ours), a newer one with a partial unit file: ignored, then removed
    for leftover in ("step_7.tmp", "step_3.tmp"):
        (root / leftover).mkdir()
        write_marker(root / leftover)
    (root / "step_7.tmp" / "unit_0000_embed.safetensors").write_bytes(b"partial")
    tr = _trainer(tmp_path, *run)
    assert tr.start_step == 2
    tr.run()
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]


def test_fingerprint_mismatch_names_the_field(tmp_path):
    _trainer(tmp_path, "engine=reference", "train.steps=3", "train.checkpoint_every=3").run()
    with pytest.raises(ConfigError, match=r"train\.lr=0\.01 but this run has train\.lr=0\.02"):
        _trainer(tmp_path, "engine=reference", "train.steps=3", "train.lr=2e-2", "train.resume=auto")
    with pytest.raises(ConfigError, match=r"model\.hidden_size"):
        _trainer(tmp_path, "engine=reference", "train.steps=3", "model.hidden_size=60", "train.resume=auto")
    with pytest.raises(ConfigError, match=r"train\.steps=3 but this run has train\.steps=2"):
        _trainer(tmp_path, "engine=reference", "train.steps=2", "train.resume=auto")
    # another engine may resume it (same state format)
    tr = _trainer(tmp_path, "engine=stream", "train.steps=3", "train.resume=auto")
    assert tr.start_step == 3
    tr.engine.close()


def test_resume_with_more_steps_continues_as_the_longer_run(tmp_path):
    """Training longer: a 3-step run's final checkpoint resumed with train.steps=6 ends exactly where a straight
    6-step run ends. With a schedule constant after warm-up the two runs agree through step 3, so everything after
    must too (data order, step counters, moments, RNG); the learning rate from step 4 on is the 6-step schedule's."""
    flat = ["engine=stream", "train.min_lr_ratio=1.0"]
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    _trainer(straight, *flat, "train.steps=6").run()
    _trainer(extended, *flat, "train.steps=3").run()
    assert sorted(p.name for p in (extended / "checkpoints").iterdir()) == ["step_3"]  # saved at the end by default
    resumed = _trainer(extended, *flat, "train.steps=6", "train.resume=auto")
    assert resumed.start_step == 3
    resumed.run()
    assert "train.steps extended from the checkpoint's 3 to 6" in (extended / "train.log").read_text()
    (losses_e, val_e), (losses_s, val_s) = step_losses(extended), step_losses(straight)
    assert losses_e == losses_s and len(losses_s) == 6
    assert [v for v in val_e if v[0] != 3] == val_s  # the 3-step run's final validation is extra
    assert_same_state(straight / "checkpoints" / "step_6", extended / "checkpoints" / "step_6")


def test_resume_with_more_steps_follows_the_longer_schedule(tmp_path):
    _trainer(tmp_path, "engine=reference", "train.steps=3").run()
    _trainer(tmp_path, "engine=reference", "train.steps=8", "train.resume=auto").run()
    t = make_cfg([*RECIPE, "train.steps=8"]).train
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r and r["step"] > 3}
    assert lrs == {s + 1: pytest.approx(optim.lr_at(s, t), rel=1e-12) for s in range(3, 8)}


@pytest.fixture()
def saved(tmp_path):
    """A run with checkpoints at steps 2 and 4 (stream engine)."""
    _trainer(tmp_path, "engine=stream", "train.steps=4", "train.checkpoint_every=2").run()
    return tmp_path


def _resume(run_dir, *extra):
    return _trainer(run_dir, "engine=stream", "train.steps=4", "train.checkpoint_every=2", *extra)


def _flip_byte(path: Path, offset_from_end: int = 100):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_is_refused_naming_the_file(saved):
    target = saved / "checkpoints" / "step_4" / "unit_0002_layer1.safetensors"
    _flip_byte(target)
    with pytest.raises(CheckpointError, match=f"{target}: checksum mismatch"):
        _resume(saved, "train.resume=auto")  # the newest is damaged: refused, not silently replaced by step_2
    tr = _resume(saved, f"train.resume={saved / 'checkpoints' / 'step_2'}")  # explicit fallback works
    assert tr.start_step == 2
    tr.engine.close()


def test_truncated_file_is_refused_naming_the_file(saved):
    target = saved / "checkpoints" / "step_4" / "unit_0000_embed.safetensors"
    target.write_bytes(target.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=f"{target}: truncated"):
        _resume(saved, "train.resume=auto")


def test_corrupt_trainer_state_is_refused_naming_the_file(saved):
    target = saved / "checkpoints" / "step_4" / "trainer_state.json"
    _flip_byte(target, 30)
    with pytest.raises(CheckpointError, match=f"{target}"):
        _resume(saved, "train.resume=auto")


def test_missing_manifest_is_refused_naming_it(saved):
    step = saved / "checkpoints" / "step_4"
    (step / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=f"{step / 'manifest.json'}: missing"):
        _resume(saved, f"train.resume={step}")
    previous = saved / "checkpoints" / "step_2"
    with pytest.raises(CheckpointError, match=re.escape(f"{step / 'manifest.json'}: missing") + ".*"
                       + re.escape(f"train.resume={previous}")):
        _resume(saved, "train.resume=auto")  # a step dir gets its name after its manifest: damage, not passed over
    tr = _resume(saved, f"train.resume={previous}")
    assert tr.start_step == 2
    tr.engine.close()


def test_refusal_through_the_cli_is_a_clean_error(tmp_path):
    _trainer(tmp_path, "engine=reference", "train.steps=2", "train.checkpoint_every=2").run()
    target = tmp_path / "checkpoints" / "step_2" / "unit_0004_head.safetensors"
    _flip_byte(target)
    out = train_cli(tmp_path, "engine=reference", "train.steps=2", "train.resume=auto", check=False)
    assert out.returncode == 2 and str(target) in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "engine.checkpoint", "verify", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and str(target) in out.stderr


def test_nothing_is_loaded_before_everything_is_verified(saved, monkeypatch):
    """A damaged last unit file is found before the first unit is copied into the engine."""
    _flip_byte(saved / "checkpoints" / "step_4" / "unit_0004_head.safetensors")
    calls = []
    from engine.streaming import StreamEngine

    monkeypatch.setattr(StreamEngine, "load_unit_state", lambda self, *a, **k: calls.append(a[0]))
    with pytest.raises(CheckpointError):
        _resume(saved, "train.resume=auto")
    assert calls == []


def checkpoint_cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.checkpoint", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_verify_of_a_run_dir_names_what_it_verified_and_the_newer_incomplete_one(saved):
    root = saved / "checkpoints"
    (root / "step_4" / "manifest.json").unlink()
    out = checkpoint_cli("verify", saved)
    assert out.returncode == 0, out.stderr
    assert f"{root / 'step_2'}: complete, step 2" in out.stdout
    assert f"warning: {root / 'step_4'} is newer but incomplete" in out.stderr
    out = checkpoint_cli("verify", root / "step_4")  # named explicitly: refused
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {root / 'step_4' / 'manifest.json'}: missing; " \
        "without a manifest the checkpoint is incomplete (a save was interrupted or files were removed); use an " \
        "older step_<N> directory"


def test_export_cli_refuses_bad_paths_with_one_error_line(saved, capsys):
    from engine.checkpoint.cli import main

    a_file = saved / "a_file"
    a_file.write_text("not a directory")
    out = checkpoint_cli("export", saved, a_file)  # the reported case: was a NotADirectoryError traceback
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {a_file}: exists and is not a directory; the export needs a directory there"
    assert a_file.read_text() == "not a directory" and not (saved / "a_file.tmp").exists()

    _flip_byte(saved / "checkpoints" / "step_4" / "unit_0002_layer1.safetensors")
    (saved / "empty").mkdir()
    cases = [  # (src, out, what the one line must say)
        (saved / "missing", saved / "x", f"{saved / 'missing'}: no such directory"),
        (saved / "empty", saved / "x", f"{saved / 'empty'}: no complete checkpoint"),
        (a_file, saved / "x", f"{a_file}: not a directory"),
        (saved, a_file / "sub", f"{a_file / 'sub.tmp'}: Not a directory"),
        (saved, saved / "x", f"{saved / 'checkpoints' / 'step_4' / 'unit_0002_layer1.safetensors'}: checksum mismatch"),
    ]
    for src, dst, message in cases:
        assert main(["export", str(src), str(dst)]) == 2, src
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
        assert not (saved / "x").exists() and not (saved / "x.tmp").exists()
    assert main(["verify", str(saved / "missing")]) == 2
    assert capsys.readouterr().err == f"error: {saved / 'missing'}: no such directory\n"


def test_failed_save_leaves_no_tmp_dir_and_the_previous_checkpoint_newest(saved, monkeypatch):
    root = saved / "checkpoints"
    tr = _resume(saved, "train.resume=auto")
    write, calls = checkpoint.write_safetensors, []

    def fails_third_unit(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpoint.state, "write_safetensors", fails_third_unit)
    try:
        with pytest.raises(OSError, match="No space left"):
            checkpoint.save_training_state(tr.engine, root, 5, {"note": "ok"})
        assert len(calls) == 3
        for bad, message in [(float("nan"), r"state\['lr_schedule'\]\['next_lr'\] is nan"),
                             (float("inf"), r"is inf"), (object(), r"\['next_lr'\] is a object")]:
            with pytest.raises(CheckpointError, match=f"{root / 'step_6' / 'trainer_state.json'}: cannot be written.*"
                                                      f"{message}"):
                checkpoint.save_training_state(tr.engine, root, 6, {"lr_schedule": {"next_lr": bad}})
        assert len(calls) == 3  # refused before any unit file was written
    finally:
        tr.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert checkpoint.list_checkpoints(root)[0][-1] == (4, root / "step_4")
    checkpoint.open_training_state(root / "step_4")


def _safetensors_bytes(tmp_path: Path) -> bytes:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, str(tmp_path / "ok.safetensors"),
              metadata={"format": "pt"})
    return (tmp_path / "ok.safetensors").read_bytes()


def test_safetensors_reader_names_the_file_for_every_kind_of_damage(tmp_path):
    raw = _safetensors_bytes(tmp_path)
    with SafetensorsFile(tmp_path / "ok.safetensors") as st:
        assert st.metadata == {"format": "pt"} and st.entries["w"].shape == (8, 8)
        assert torch.equal(st.get("w"), torch.arange(64, dtype=torch.float32).reshape(8, 8))
        with pytest.raises(CheckpointError, match="ok.safetensors: no tensor named v"):
            st.get("v")
    bad_json = bytearray(raw)
    bad_json[12] = ord("}")
    damaged = {  # file name -> (bytes, what the message must say)
        "short": (raw[:5], "truncated: too short"),
        "header_cut": (raw[:20], "truncated or not a safetensors file: its header length does not fit"),
        "data_cut": (raw[:-4], "truncated"),
        "appended": (raw + b"\0" * 8, r"truncated \(or has bytes appended\)"),
        "bad_json": (bytes(bad_json), "corrupt safetensors header"),
    }
    for name, (data, message) in damaged.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=f"^{path}: {message}"):
            SafetensorsFile(path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'none.safetensors'}: missing"):
        SafetensorsFile(tmp_path / "none.safetensors")


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_ten_steps_equal_five_stop_resume_five_on_gpu(compile_mode, tmp_path):
    """On the GPU, bf16 autocast, copy streams and the optimizer thread running: a stop and a resume still give the
    uninterrupted run's losses, weights and moments bit for bit (the step is deterministic there: no atomics in the
    paths the templates take, checked by tests/test_stream_gpu.py's repeat test)."""
    common = [*RECIPE, "engine=stream", "hardware.device=cuda", f"train.compile={compile_mode}", "train.steps=10",
              "train.checkpoint_every=5"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    Trainer(make_cfg(common), whole).run()
    Trainer(make_cfg([*common, "train.stop_at=5"]), split).run()
    Trainer(make_cfg([*common, "train.resume=auto"]), split).run()
    assert step_losses(split) == step_losses(whole)
    assert_same_state(whole / "checkpoints" / "step_10", split / "checkpoints" / "step_10")
