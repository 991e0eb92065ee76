"""engine/calibrate.py (`python -m engine.calibrate`) on the CPU: a tiny layer in eager mode writes a profile the
schema accepts, keeps the base profile's other fields, writes 0 for the figures that need CUDA, and refuses bad
arguments before measuring."""

import argparse
import json
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from engine.config import HardwareConfig, ModelConfig, _validate_attn_points
from engine.metrics import model_flops_per_token

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "conf" / "hardware" / "h200.yaml"
TINY = ["--model", "tiny", "--micro-batch", "1", "--seq-len", "64", "--attn-seq-len", "96", "--modes", "eager",
        "--adam-gparams", "0.001", "--repeats", "2", "--warmup", "1"]
EAGER = ("fwd_tflops_eager", "bwd_tflops_eager", "head_tflops_eager")
NEEDS_CUDA = ("h2d_gbps", "d2h_gbps", "bidir_gbps", "cpu_adam_gparams_per_s_under_pcie")


def test_runs_as_a_module_of_the_package():
    proc = subprocess.run([sys.executable, "-m", "engine.calibrate", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m engine.calibrate") and "--width-models" in proc.stdout


@pytest.fixture(scope="module")
def calibrate():
    from engine import calibrate as module

    return module


def test_writes_a_profile_from_the_base(calibrate, tmp_path, monkeypatch):
    # the tiny layer's own attention is a large share of it: timed alone on a busy CPU it can outlast the whole
    # layer (the arithmetic is the next test's); here it counts for next to nothing
    measured = calibrate.median_s
    monkeypatch.setattr(calibrate, "median_s", lambda fn, args, on_device, what:
                        1e-9 if what.startswith("attention") and "shape" in what else
                        measured(fn, args, on_device, what))
    base = OmegaConf.to_container(OmegaConf.load(H200))
    base["fwd_tflops_compiled"] = 123.0  # a mode not measured keeps the base's figure
    base["fwd_tflops_eager"] = -1.0  # a measured one is replaced
    base_path = tmp_path / "base.yaml"
    OmegaConf.save(OmegaConf.create(base), base_path)
    out, jsonl = tmp_path / "measured.yaml", tmp_path / "rows.jsonl"

    figures = calibrate.main([*TINY, "--base", str(base_path), "--out", str(out), "--jsonl", str(jsonl)])

    assert out.read_text().startswith("# Written by engine/calibrate.py")
    profile = OmegaConf.to_container(OmegaConf.load(out))
    for key in EAGER + ("cpu_adam_gparams_per_s", "host_process_gib"):
        assert profile[key] > 0, key
    for key in NEEDS_CUDA:
        assert (profile[key] > 0) if torch.cuda.is_available() else profile[key] == 0.0, key
    assert profile["fwd_tflops_compiled"] == 123.0
    for key, value in base.items():
        if key not in figures and key != "calibration":
            assert profile[key] == value, key
    assert "model tiny 1x64" in profile["calibration"] and "modes eager" in profile["calibration"]
    assert profile["attn_backend"] == "sdpa" and profile["attn_seq_len"] == 96
    assert profile["attn_fwd_tflops"] > 0 and profile["attn_bwd_tflops"] > 0
    OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(out))  # the planner's schema reads it

    (row,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert row["bench"] == "calibrate" and row["args"]["model"] == "tiny"
    assert {"gpu", "torch", "triton", "git_sha", "date"} <= set(row)
    for key in EAGER + NEEDS_CUDA + ("cpu_adam_gparams_per_s",):
        assert row[key] == pytest.approx(figures[key]), key


def test_layer_figures_leave_out_the_attention_timed_alone(calibrate, tmp_path, monkeypatch):
    """With fixed timings: the layer's figures are its FLOPs other than attention's over its time less its
    attention's at the same shape, and the attention figures those of the one long sequence."""
    seconds = {"attention fwd (layer shape)": 0.001, "attention bwd (layer shape)": 0.003, "attention fwd": 0.002,
               "attention bwd": 0.005, "eager fwd": 0.004, "eager bwd": 0.011, "eager head": 0.002}
    monkeypatch.setattr(calibrate, "median_s", lambda fn, args, on_device, what: seconds.get(what, 0.01))
    figures = calibrate.main([*TINY, "--out", str(tmp_path / "p.yaml")])

    nh, hd = 6, 48
    attn_64 = 4 * nh * hd * 32 * 64  # one sequence of 64: a query sees 32 keys on average
    attn_96 = 4 * nh * hd * 48 * 96
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml"))
    layer_64 = model_flops_per_token(cfg, 64)["layer_forward_flops_per_token"] * 64
    assert figures["attn_fwd_tflops"] == pytest.approx(attn_96 / 0.002 / 1e12)
    assert figures["attn_bwd_tflops"] == pytest.approx(3 * attn_96 / 0.005 / 1e12)
    assert figures["fwd_tflops_eager"] == pytest.approx((layer_64 - attn_64) / 0.003 / 1e12, rel=1e-4)
    down_64 = 2 * cfg.hidden_size * cfg.intermediate_size * 64  # left out of the recompute (ModelSpec.layer_grads)
    assert figures["bwd_tflops_eager"] == pytest.approx((3 * (layer_64 - attn_64) - down_64) / 0.008 / 1e12, rel=1e-4)

    assert "moe_layers" not in figures

    seconds["eager fwd"] = 0.0009  # faster than its own attention alone: no figure can come of it
    with pytest.raises(RuntimeError, match="eager fwd: the layer took 0.900 ms, its attention alone 1.000 ms"):
        calibrate.main([*TINY, "--out", str(tmp_path / "q.yaml")])


@pytest.mark.parametrize("args, named", [
    (["--model", "gpt5"], ["'gpt5'", "qwen7b", "tiny"]),
    (["--modes", "eager,turbo"], ["'turbo'", "compiled"]),
    (["--modes", ","], ["','"]),
    (["--micro-batch", "0"], ["--micro-batch 0"]),
    (["--seq-len", "-64"], ["--seq-len -64"]),
    (["--seq-len", "8192"], ["--seq-len 8192", "max_position_embeddings=4096"]),
    (["--copy-gib", "0"], ["--copy-gib 0.0"]),
    (["--adam-gparams", "nan"], ["--adam-gparams nan"]),
    (["--attn-seq-len", "0"], ["--attn-seq-len 0"]),
    (["--attn-points", "cudnn:128"], ["--attn-points 'cudnn:128'", "BACKEND:TOKENS", "triton, sdpa"]),
    (["--attn-points", "sdpa:0"], ["--attn-points 'sdpa:0'"]),
    (["--attn-points", "sdpa:128", "sdpa:128"], ["--attn-points sdpa:128 is given twice"]),
    (["--repeats", "0"], ["--repeats 0"]),
    (["--warmup", "0"], ["--warmup 0"]),
    (["--base", "/no/such/profile.yaml"], ["/no/such/profile.yaml"]),
])
def test_refuses_bad_arguments_naming_the_value(calibrate, tmp_path, capsys, args, named):
    out = tmp_path / "never.yaml"
    with pytest.raises(SystemExit) as exc:
        calibrate.main([*TINY, *args, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err
    assert not out.exists()


def test_attention_points_measure_more_backends_and_lengths(calibrate, tmp_path, monkeypatch):
    """--attn-points: each (backend, length) but the main one's gets the two attention figures at that length,
    timed as often as ~10 s allow; the profile lists them and the schema takes it. Without the flag the base
    profile's points are kept."""
    seconds = {"attention fwd sdpa 128": 0.004, "attention bwd sdpa 128": 0.01}
    measured = calibrate.median_s  # the tiny layer's own attention at its shape: as in the first test
    monkeypatch.setattr(calibrate, "median_s", lambda fn, args, on_device, what:
                        1e-9 if what.startswith("attention") and "shape" in what else
                        measured(fn, args, on_device, what))
    monkeypatch.setattr(calibrate, "median_s_within",
                        lambda fn, args, on_device, what, budget_s=10.0: seconds.get(what, 0.02))
    out = tmp_path / "p.yaml"
    figures = calibrate.main([*TINY, "--attn-points", "sdpa:128", "sdpa:96", "sdpa:256", "--out", str(out)])
    nh, hd = 6, 48
    attn_128 = 4 * nh * hd * 64 * 128
    first, second = figures["attn_points"]
    assert first == {"backend": "sdpa", "seq_len": 128, "fwd_tflops": pytest.approx(attn_128 / 0.004 / 1e12),
                     "bwd_tflops": pytest.approx(3 * attn_128 / 0.01 / 1e12)}
    assert second["seq_len"] == 256  # sdpa at 96 tokens is the main point (--attn-seq-len 96): not repeated
    profile = OmegaConf.load(out)
    assert [p["seq_len"] for p in profile.attn_points] == [128, 256]
    # the schema reads it and its points pass the checks (the whole profile of a CPU run does not: no link figures)
    _validate_attn_points(OmegaConf.merge(OmegaConf.structured(HardwareConfig), profile))

    kept = tmp_path / "kept.yaml"
    calibrate.main([*TINY, "--base", str(out), "--out", str(kept)])
    assert OmegaConf.load(kept).attn_points == profile.attn_points


def test_a_long_attention_point_is_timed_within_its_budget(calibrate):
    """median_s_within: one untimed call, then as many timed ones as the budget allows at its pace (>= 1)."""
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.05)

    args = argparse.Namespace(repeats=10)
    assert calibrate.median_s_within(slow, args, False, "slow", budget_s=0.12) >= 0.05
    assert len(calls) == 1 + 2
    calls.clear()
    calibrate.median_s_within(slow, args, False, "slow", budget_s=0.01)
    assert len(calls) == 2


def test_refuses_an_output_in_a_missing_directory(calibrate, tmp_path, capsys):
    with pytest.raises(SystemExit):
        calibrate.main([*TINY, "--out", str(tmp_path / "missing" / "p.yaml")])
    assert "does not exist" in capsys.readouterr().err


def test_a_moe_layer_gives_figures_of_its_own(calibrate, tmp_path, monkeypatch):
    """--moe-models at --moe-micro-batches: each layer at each size, its attention alone at that shape subtracted,
    no head, one moe_layers entry each with the layer's shape; the planner's schema reads the profile (fixed
    timings: the layer is built, never run)."""
    seconds = {"attention fwd (layer shape)": 0.001, "attention bwd (layer shape)": 0.003}
    for tokens, scale in ((64, 1), (128, 2)):
        label = f"qwen3_30b_a3b {tokens}"
        seconds.update({f"attention fwd ({label} layer shape)": 0.002 * scale,
                        f"attention bwd ({label} layer shape)": 0.005 * scale,
                        f"{label} eager fwd": 0.010 * scale, f"{label} eager bwd": 0.035 * scale})
    monkeypatch.setattr(calibrate, "median_s", lambda fn, args, on_device, what: seconds.get(what, 0.01))
    out = tmp_path / "p.yaml"
    figures = calibrate.main([*TINY, "--moe-models", "qwen3_30b_a3b", "--moe-micro-batches", "2,1", "--out", str(out)])

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model/qwen3_30b_a3b.yaml"))
    flops = model_flops_per_token(cfg, 64)
    other = (flops["layer_forward_flops_per_token"] - flops["layer_attention_forward_flops_per_token"]) * 64
    # the backward's recompute leaves out the experts' down projection, as a dense layer's does its own
    skipped = 2 * cfg.num_experts_per_tok * cfg.moe_intermediate_size * cfg.hidden_size * 64
    entries = figures["moe_layers"]
    assert [e["tokens"] for e in entries] == [64, 128]
    for entry, scale in zip(entries, (1, 2)):  # twice the tokens in twice the time: the same rates
        assert entry["fwd_tflops_eager"] == pytest.approx(other / 0.008 / 1e12, rel=1e-4)
        assert entry["bwd_tflops_eager"] == pytest.approx((3 * other - skipped) / 0.030 / 1e12, rel=1e-4)
        assert (entry["model"], entry["hidden"], entry["experts"], entry["experts_per_token"],
                entry["expert_width"]) == ("qwen3_30b_a3b", 2048, 128, 8, 768)
        assert "git" in entry["measured"] and "fwd_tflops_compiled" not in entry
    profile = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(out))
    assert "moe_models qwen3_30b_a3b" in profile.calibration
    assert [e.tokens for e in profile.moe_layers] == [64, 128]
    assert profile.moe_layers[0].fwd_tflops_compiled == 0.0  # a mode not measured is 0


def test_moe_only_measures_the_moe_layers_and_keeps_every_other_field(calibrate, tmp_path, monkeypatch):
    """--moe-only: the base profile's fields and calibration line stay as they are, its moe_layers entries of
    other models or token counts are kept and the one measured again is replaced; nothing else is timed."""
    timed = []

    def median_s(fn, args, on_device, what):
        timed.append(what)
        return (0.002 if "fwd" in what else 0.005) if "attention" in what else 0.01

    monkeypatch.setattr(calibrate, "median_s", median_s)
    monkeypatch.setattr(calibrate, "HostAdam", None)  # the host and link are not measured
    base_text = (ROOT / "conf/hardware/h100.yaml").read_text()
    base = tmp_path / "base.yaml"
    stale = {"model": "qwen3_30b_a3b", "hidden": 2048, "experts": 128, "experts_per_token": 8, "expert_width": 768,
             "tokens": 64, "fwd_tflops_eager": 1.0, "bwd_tflops_eager": 1.0, "measured": "long ago"}
    base.write_text(base_text + "- " + "\n  ".join(f"{k}: {v}" for k, v in stale.items()) + "\n")
    out = tmp_path / "p.yaml"
    calibrate.main([*TINY, "--moe-only", "--moe-models", "qwen3_30b_a3b", "--base", str(base), "--out", str(out)])

    assert all("qwen3_30b_a3b" in what for what in timed)
    written, before = (OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(p)) for p in (out, base))
    assert [(e.model, e.tokens) for e in written.moe_layers] == [(e.model, e.tokens) for e in before.moe_layers]
    assert written.moe_layers[:-1] == before.moe_layers[:-1]
    assert written.moe_layers[-1].measured != "long ago" and written.moe_layers[-1].fwd_tflops_eager != 1.0
    calibrate.main([*TINY, "--moe-only", "--moe-models", "qwen3_30b_a3b", "--modes", "compiled", "--base", str(out),
                    "--out", str(out)])
    again = OmegaConf.load(out).moe_layers[-1]  # a mode not measured again keeps its figures
    assert again.fwd_tflops_eager == written.moe_layers[-1].fwd_tflops_eager and again.fwd_tflops_compiled > 0
    for key in ("calibration", "fwd_tflops_compiled", "h2d_gbps", "layer_widths", "attn_points", "host_process_gib"):
        assert written[key] == before[key], key
    assert "--moe-only" in out.read_text().splitlines()[0]


@pytest.mark.parametrize("argv, named", [
    (["--moe-models", "qwen7b"], "is a dense model"), (["--moe-models", "mixtral"], "'mixtral'"),
    (["--moe-models", "gptoss20b,gptoss20b"], "names gptoss20b twice"),
    (["--moe-models", "gptoss20b", "--moe-micro-batches", "2,0"], "'0' is not an integer >= 1"),
    (["--moe-only"], "name at least one")])
def test_refuses_moe_arguments_that_cannot_work(calibrate, tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit):
        calibrate.main([*TINY, *argv, "--out", str(tmp_path / "p.yaml")])
    assert named in capsys.readouterr().err


def test_other_widths_give_layer_and_head_figures_of_their_own(calibrate, tmp_path, monkeypatch):
    """--width-models: each model's layer and head at the same tokens, its attention alone subtracted, one entry of
    `layer_widths` each beside the main layer's model and width; the planner's schema reads the profile, and a
    later calibration without the flag leaves the widths out rather than mixing leases (fixed timings)."""
    seconds = {"attention fwd (layer shape)": 0.001, "attention bwd (layer shape)": 0.003,
               "attention fwd (qwen0_5b layer shape)": 0.002, "attention bwd (qwen0_5b layer shape)": 0.004,
               "qwen0_5b eager fwd": 0.010, "qwen0_5b eager bwd": 0.028, "qwen0_5b eager head": 0.050}
    monkeypatch.setattr(calibrate, "median_s", lambda fn, args, on_device, what: seconds.get(what, 0.01))
    out = tmp_path / "p.yaml"
    calibrate.main([*TINY, "--width-models", "qwen0_5b", "--out", str(out)])

    profile = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(out))
    assert (profile.layer_model, profile.layer_hidden) == ("tiny", 288)
    (width,) = profile.layer_widths
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model/qwen0_5b.yaml"))
    flops = model_flops_per_token(cfg, 64)
    other = (flops["layer_forward_flops_per_token"] - flops["layer_attention_forward_flops_per_token"]) * 64
    assert (width.model, width.hidden) == ("qwen0_5b", 896)
    assert width.fwd_tflops_eager == pytest.approx(other / 0.008 / 1e12, rel=1e-3)
    down = 2 * cfg.hidden_size * cfg.intermediate_size * 64
    assert width.bwd_tflops_eager == pytest.approx((3 * other - down) / 0.024 / 1e12, rel=1e-3)
    assert width.head_tflops_eager == pytest.approx(4 * flops["head_forward_flops_per_token"] * 64 / 0.050 / 1e12,
                                                    rel=1e-3)  # unfused on a CPU: forward, recompute, backward
    assert width.fwd_tflops_compiled == 0.0  # a mode not measured
    assert "width_models qwen0_5b" in profile.calibration

    again = tmp_path / "q.yaml"
    calibrate.main([*TINY, "--base", str(out), "--out", str(again)])
    assert OmegaConf.load(again).layer_widths == []


@pytest.mark.parametrize("models, named", [("gpt5", "'gpt5'"), ("tiny", "hidden size 288, as --model tiny has"),
                                           ("qwen0_5b,qwen0_5b", "as --width-models qwen0_5b has"),
                                           ("gptoss20b", "mixture-of-experts")])
def test_refuses_width_models_that_cannot_be_one(calibrate, tmp_path, capsys, models, named):
    with pytest.raises(SystemExit):
        calibrate.main([*TINY, "--width-models", models, "--out", str(tmp_path / "p.yaml")])
    assert named in capsys.readouterr().err
