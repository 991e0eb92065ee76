"""The user-facing commands, run as a user runs them: train.py as a subprocess, outputs read back from disk; and the
installed package, built as a wheel and run from outside the checkout."""

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from tests.util import user_env

ROOT = Path(__file__).resolve().parent.parent


def _train(*args, timeout=300):
    out = subprocess.run([sys.executable, "train.py", *args, "hardware=cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env={**user_env(), "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _records(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_job_learns(tmp_path):
    """The default recipe, shortened: validation loss leaves ln(256) = 5.5 nats well behind within 25 steps."""
    out = _train("logger=none", "train.steps=25", "train.warmup_steps=5", "train.micro_batch_size=4",
                 "train.val_every=0", "train.val_batches=4", f"hydra.run.dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the outcome is printed whatever the logger
    assert (f"done: 25 steps, loss {summary['final_loss']:.4f}, val loss {summary['initial_val_loss']:.4f} -> "
            f"{summary['final_val_loss']:.4f}") in out.stdout
    assert summary["initial_val_loss"] > 5.4
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 2.0
    steps = [r for r in _records(tmp_path) if "loss" in r]
    required = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s", "tflops", "mfu",
                "gpu_mem_gib", "host_mem_gib"}
    assert len(steps) == 25 and all(required <= r.keys() for r in steps)
    assert summary["config"]["data_description"]["source"] == "stdlib"


def test_the_summary_line_says_when_a_run_failed():
    from engine.trainer import summary_line

    line = summary_line({"error": "OSError('disk full')", "steps": 3, "final_loss": 2.5, "final_val_loss": None})
    assert line.startswith("failed: OSError('disk full'): 3 steps, loss 2.5000, val loss - -> -")


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


def test_a_sweep_whose_every_job_is_refused_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "-m", "model=tiny", "train.seq_len=100000,200000", "logger=none",
                          "plan=true", f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: every one of the sweep's 2 jobs was refused" in out.stderr
    assert "max_position_embeddings" in out.stderr
    assert len(list(tmp_path.glob("*/refused.json"))) == 2


def test_the_report_without_matplotlib_writes_rows_and_the_table(tmp_path, monkeypatch, capsys):
    """The plot is the only part that needs matplotlib: without it the report says so and still exits 0."""
    from engine import report

    _train("-m", "model=tiny", "train.seq_len=32", "logger=none", "train.steps=2", "train.val_every=0",
           "train.val_batches=1", "train.micro_batch_size=2", f"hydra.sweep.dir={tmp_path}")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report.main([str(tmp_path)]) == 0
    printed = capsys.readouterr()
    err = printed.err
    assert "no plot: it needs matplotlib" in err and (tmp_path / "report.jsonl").exists()
    row = json.loads((tmp_path / "report.jsonl").read_text().splitlines()[0])
    # the table shows each job's overrides and its losses
    assert "model=tiny train.seq_len=32" in printed.out and f"{row['losses'][-1]:.3f}" in printed.out
    assert not (tmp_path / "report.png").exists()


def test_sweep_report_turns_run_dirs_into_rows_a_table_and_a_plot(tmp_path):
    sweep = tmp_path / "sweep"
    _train("-m", "model=tiny", "train.seq_len=32,64,100000", "logger=none", "train.steps=3", "train.val_every=0",
           "train.val_batches=1", "train.micro_batch_size=2", f"hydra.sweep.dir={sweep}")
    out = subprocess.run([sys.executable, "-m", "engine.report", str(sweep), "--png", str(tmp_path / "ctx.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (sweep / "report.jsonl").read_text().splitlines()]
    finished = sorted((r for r in rows if "tflops" in r), key=lambda r: r["seq_len"])
    assert [r["seq_len"] for r in finished] == [32, 64]
    assert all(r["tokens_per_s"] > 0 and r["steps"] == 3 and r["host_mem_gib"] > 0 for r in finished)
    refused = [r for r in rows if "refused" in r]
    assert len(refused) == 1 and "max_position_embeddings" in refused[0]["refused"]
    assert "train.seq_len=100000" in refused[0]["overrides"]
    assert (refused[0]["model"], refused[0]["seq_len"]) == ("tiny", 100000)  # a refused row still says what it was
    for r in finished + refused:  # where and when: every row carries the run's environment
        assert r["gpu"] == "cpu" and r["torch"] == torch.__version__ and r["git_sha"] and r["date"]
    assert "max_position_embeddings" in out.stdout  # the table shows why the job was refused
    assert (tmp_path / "ctx.png").stat().st_size > 10_000


def test_a_depth_truncated_run_is_labelled_and_extrapolated(tmp_path):
    from engine.model import ModelSpec
    from tests.util import make_cfg

    full = ModelSpec(make_cfg(["model=tiny"]).model).num_params()  # tiny: 4 layers
    run_dir = tmp_path / "run"
    out = _train("model=tiny", "model.num_hidden_layers=2", f"model.expected_params={full}", "engine=stream",
                 "logger=none", "train.steps=3", "train.val_every=0", "train.val_batches=1",
                 "train.micro_batch_size=2", f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stderr
    assert "DEPTH-TRUNCATED: 2 of 4 decoder layers" in (run_dir / "train.log").read_text()
    truncated = json.loads((run_dir / "summary.json").read_text())["depth_truncated"]
    assert truncated["layers"] == 2 and truncated["full_depth_layers"] == 4 and truncated["full_depth_fits"]
    from engine.report import run_row, table

    row = run_row(run_dir)
    assert row["depth_truncated"] and row["full_depth_layers"] == 4
    assert row["full_depth_step_s_extrapolated"] > row["step_s"]
    assert row["layer_tflops"] > 0
    # with the compute stream's stalls (measured on CUDA), the layers' own rate leaves those inside the phases out
    metrics = run_dir / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    for step in logged:
        if "loss" in step:
            step.update(forward_s=0.3, backward_s=0.6, exposed_s=0.2, between_steps_stall_s=0.05)
    metrics.write_text("".join(json.dumps(step) + "\n" for step in logged))
    stalled = run_row(run_dir)
    assert stalled["layer_compute_tflops"] == pytest.approx(stalled["layer_tflops"] * 0.9 / 0.75)
    # the plan's phases go beside the measured ones (the CPU profile has no speeds: a GPU plan's phases here)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["plan_times_s"] = {"forward": 1.5, "backward": 2.5, "step": 4.25}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    planned = run_row(run_dir)
    assert (planned["plan_forward_s"], planned["plan_backward_s"], planned["plan_step_s"]) == (1.5, 2.5, 4.25)
    assert "plan_step_s" in row and not any(k.startswith("plan_") and k.endswith("_s") and k != "plan_step_s"
                                            for k in row)
    assert "DEPTH-TRUNCATED 2/4 layers" in table([row])
    assert row["steps_logged"] == 3 and row["host_rss_peak_logged_gib"] > 0 and row["host_children_mem_gib"] >= 0
    # a run killed before its summary (a host OOM kill) still shows the memory its steps logged
    (run_dir / "summary.json").unlink()
    killed = run_row(run_dir)
    assert killed["error"].startswith("incomplete") and killed["steps_logged"] == 3
    assert killed["host_rss_peak_logged_gib"] == row["host_rss_peak_logged_gib"]


def test_sweep_report_refuses_a_missing_dir(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine.report", str(tmp_path / "nope")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a directory" in out.stderr


# ---------------------------------------------------------------------------------------------------------------------
# Refused configs: exit status 2, one `error:` message, no traceback


def _refused(*args, cwd=ROOT, command=("train.py",), env=None):
    out = subprocess.run([sys.executable, *command, *args, "logger=none"], cwd=cwd, capture_output=True, text=True,
                         timeout=120, env=env or user_env())
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.stderr


@pytest.mark.parametrize("override", ["+train.bogus_key=1", "++train.bogus_key=1", "train.bogus_key=1"])
def test_unknown_key_is_refused_whatever_the_syntax(override, tmp_path):
    err = _refused(override, f"hydra.run.dir={tmp_path}")
    assert "train.bogus_key is not a config key; valid keys of train: activation_checkpointing" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, expected", [
    (["+bogus=1"], "bogus is not a config key or config group; valid top-level keys"),
    (["+model.foo=1"], "model.foo is not a config key; valid keys of model"),
    (["engine=stream", "engine.checkpoint_tier=host"], "engine.checkpoint_tier was renamed engine.activation_tier"),
    (["train.steps=abc"], "train.steps=abc is not valid: train.steps takes an integer"),
    (["model=qwen8b"], "Could not find 'model/qwen8b'"),  # Hydra's message, which lists the options
    (["-m", "train.seq_len=64,abc"], "train.seq_len=abc is not valid"),  # before the sweep's first job
])
def test_compose_errors_exit_2(args, expected, tmp_path):
    err = _refused(*args, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}")
    assert expected in err
    if "model=qwen8b" in args:
        assert "qwen7b" in err and "tiny" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, expected", [
    (["train.lr=nan"], "train.lr=nan must be a finite number > 0"),
    (["train.grad_accum=0"], "train.grad_accum=0 must be >= 1"),
    (["data=memmap", "data.path=/nonexistent/tokens.bin"], "data.path='/nonexistent/tokens.bin': no such file"),
])
def test_bad_value_is_a_clean_error(args, expected, tmp_path):
    assert expected in _refused(*args, f"hydra.run.dir={tmp_path}")


def test_corrupt_files_are_refused(tmp_path):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\0" * 7)
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"vocab_size": 256, "n_tokens": 1, "fingerprint": "x"}))
    assert "not a whole number of uint32 tokens" in _refused("data=memmap", f"data.path={tokens}",
                                                            f"hydra.run.dir={tmp_path / 'a'}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    assert "config.json: corrupt JSON" in _refused(f"model.init=hf:{hf}", f"hydra.run.dir={tmp_path / 'b'}")


def test_gpu_profile_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    err = _refused("hardware=h200", f"hydra.run.dir={tmp_path}")
    assert "torch sees no CUDA device" in err and "hardware=cpu" in err and "plan=true" in err


def test_a_crash_in_training_keeps_its_traceback_and_status_1(tmp_path):
    crash = textwrap.dedent("""
        import engine.trainer
        def crash(*args, **kwargs):
            raise RuntimeError("simulated crash")
        engine.trainer.Trainer = crash
        from engine.cli import cli
        cli()
    """)
    out = subprocess.run([sys.executable, "-c", crash, "logger=none", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "RuntimeError: simulated crash" in out.stderr


def test_plan_prints_bytes_per_tier_without_training():
    out = subprocess.run([sys.executable, "train.py", "logger=none", "model=qwen7b", "engine=stream", "plan=true",
                          "hardware=h200"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fp32 master, fp32 Adam m + v" in out.stdout and "host" in out.stdout and "predicted step" in out.stdout
    assert "step 1/" not in out.stdout


# ---------------------------------------------------------------------------------------------------------------------
# Installed layout


def test_wheel_carries_conf_and_finds_it_when_installed(tmp_path):
    """`pip wheel` of a copy of the sources (so the checkout gets no build/ dir); the unpacked wheel, first on
    PYTHONPATH and run from another directory, composes its packaged conf and resolves a hardware profile from it."""
    src = tmp_path / "src"
    for name in ("engine", "streamtrain_kernels", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("streamtrain-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(site)
    modules = {p.relative_to(src).as_posix() for package in ("engine", "streamtrain_kernels")
               for p in (src / package).rglob("*.py")}
    yamls = {"streamtrain_conf/" + p.relative_to(src / "conf").as_posix() for p in (src / "conf").rglob("*.yaml")}
    assert not modules - names, f"not in the wheel (list their package in setup.cfg): {sorted(modules - names)}"
    assert not yamls - names, sorted(yamls - names)
    # no top-level `kernels` package: that import name is Hugging Face's `kernels` (a transformers dependency)
    assert not any(n.startswith("kernels/") for n in names), sorted(n for n in names if n.startswith("kernels/"))
    (entry_points,) = site.glob("*.dist-info/entry_points.txt")
    assert "streamtrain-train = engine.cli:cli" in entry_points.read_text()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**user_env(), "PYTHONPATH": str(site)}
    probe = textwrap.dedent("""
        from hydra import compose, initialize_config_dir
        from engine import hardware
        from engine.config import CONF_DIR, register, validate
        register()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["model=qwen7b", "logger=none"])
        hardware.resolve(cfg)
        validate(cfg)
        print(hardware.__file__, hardware.PROFILE_DIR, cfg.hardware.name, cfg.model.hidden_size)
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    module, profiles, profile, hidden = out.stdout.split()
    assert module.startswith(str(site)) and profiles == str(site / "streamtrain_conf" / "hardware")
    assert profile != "auto" and hidden == "3584"

    cli = ("-c", "from engine.cli import cli; cli()")  # what the streamtrain-train script runs
    assert "valid keys of train" in _refused("+train.bogus_key=1", cwd=elsewhere, command=cli, env=env)
    shown = subprocess.run([sys.executable, *cli, "--cfg", "job", "hardware=h200", "model=qwen7b"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "hidden_size: 3584" in shown.stdout and "gpu_mem_gib: 139.0" in shown.stdout


def test_help_describes_every_field_from_the_schema():
    from engine.schema_help import schema_entries

    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    entries = schema_entries()
    undocumented = [e["key"] for e in entries if not e["doc"]]
    assert not undocumented, f"give these fields a comment in engine/config.py: {undocumented}"
    for e in entries:
        assert f"  {e['key']} (" in out.stdout and e["doc"] in out.stdout
    assert "train.master_dtype (str, default 'auto'; one of auto | fp32 | bf16)" in out.stdout
    section = subprocess.run([sys.executable, "train.py", "--help", "data"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60).stdout
    assert "  data.loss_on (" in section and "  train.lr (" not in section
