import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import metrics
from engine.metrics import MetricsLogger, count_params, host_rss_gib, model_flops_per_token


def model(h, inter, n_layers, nh, kv, vocab, head_dim=None, tied=False, qkv_bias=False, qk_norm=False):
    return SimpleNamespace(hidden_size=h, intermediate_size=inter, num_hidden_layers=n_layers, num_attention_heads=nh,
                           num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied,
                           qkv_bias=qkv_bias, qk_norm=qk_norm)


QWEN25_7B = model(3584, 18944, 28, 28, 4, 152064, qkv_bias=True)
QWEN3_8B = model(4096, 12288, 36, 32, 8, 151936, head_dim=128, qk_norm=True)
LLAMA31_8B = model(4096, 14336, 32, 32, 8, 128256)
QWEN25_05B = model(896, 4864, 24, 14, 2, 151936, tied=True, qkv_bias=True)


def logger_cfg(name="none", progress="lines", **kw):
    return SimpleNamespace(name=name, project="streamtrain-test", entity=None, mode="offline", group=None, tags=[],
                           progress=progress, **kw)


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


@pytest.mark.parametrize("cfg, expected", [
    (QWEN25_7B, 7_615_616_512),
    (QWEN3_8B, 8_190_735_360),
    (LLAMA31_8B, 8_030_261_248),
    (QWEN25_05B, 494_032_768),
])
def test_count_params_matches_published(cfg, expected):
    assert count_params(cfg) == expected


def _counted_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_flops_equal_torchs_count_of_a_training_pass(tied):
    """FlopCounterMode counts every matmul of a forward + backward of the tiny model through the real templates.
    Attention's own products are not in that count (torch's CPU SDPA kernel is not one it knows); the loss's
    chunked logits are computed twice (the chunk is recomputed in its backward), which model FLOPs leave out."""
    from engine.model import ModelSpec
    from tests.util import make_cfg

    cfg = make_cfg([f"model.tie_word_embeddings={str(tied).lower()}", "model.num_hidden_layers=2"])
    spec = ModelSpec(cfg.model)
    params = []
    for unit in spec.units:
        p = {s.name: torch.empty(s.shape) for s in unit.layout.specs}
        spec.init_unit(unit, p, 0)
        params.append({k: v.requires_grad_() for k, v in p.items()})
    B, T = 2, 37
    ids, labels = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))

    def train_pass():
        x = spec.embed(params[0], ids)
        for i, p in enumerate(params[1:-1]):
            x = spec.layer(p, x, spec.positions(T, "cpu"), i)
        spec.loss_sum(params[-1], x, labels, params[0][spec.tied_weight_name] if tied else None).backward()

    f = model_flops_per_token(cfg.model, T)
    head_recompute = f["head_forward_flops_per_token"]
    assert _counted_flops(train_pass) == (6 * f["matmul_params"] + head_recompute) * B * T


def test_causal_attention_flops_are_half_of_torchs_count_of_full_attention():
    """Attention as plain batched matmuls (scores, weighted sum), counted by FlopCounterMode over forward and
    backward: the full (unmasked) cost; the causal count of the formula is half of it."""
    cfg = QWEN25_05B
    B, T, nh, hd = 1, 64, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    q, k, v = (torch.randn(B, nh, T, hd, requires_grad=True) for _ in range(3))

    def attention():
        scores = (q @ k.transpose(-1, -2)).softmax(-1)
        (scores @ v).sum().backward()

    per_layer = model_flops_per_token(cfg, T)["attn_flops_per_token"] // cfg.num_hidden_layers
    assert 2 * per_layer * B * T == _counted_flops(attention)


def test_flops_tied_head_still_counted():
    f = model_flops_per_token(QWEN25_05B, 1)
    untied = model_flops_per_token(model(896, 4864, 24, 14, 2, 151936, qkv_bias=True), 1)
    assert f["matmul_params"] == untied["matmul_params"]
    assert f["6n_flops_per_token"] < untied["6n_flops_per_token"]


def read_jsonl(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_logger(run_dir, name="none", peak_tflops=100.0, **kw):
    return MetricsLogger(run_dir, {"train": {"lr": 1e-3}, "seed": 0}, QWEN25_05B, 256, peak_tflops,
                         logger_cfg(name, **kw), total_steps=3)


def test_logger_none_jsonl_and_summary(tmp_path, capsys):
    run_dir = tmp_path / "run"
    log = make_logger(run_dir)
    steps = [(1, 3.0, 2.0), (2, float("nan"), 1.0), (3, 2.5, 3.0)]
    for step, loss, step_s in steps:
        rec = log.log_step(step, {"loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": 1000, "step_s": step_s,
                                  "phase_s": {"fwd": 0.1}})
    assert rec["tokens_total"] == 3000
    log.log_val(3, 2.4)
    summary = log.close({"note": "x"})
    assert log.close() is summary

    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert len(lines) == 4
    required = "step loss lr grad_norm tokens tokens_per_s step_s tflops mfu gpu_mem_gib host_mem_gib".split()
    for line in lines[:3]:
        assert set(required) <= set(line)
    assert lines[1]["loss"] is None and lines[1]["loss_finite"] is False
    assert lines[0]["loss_finite"] is True and lines[0]["loss"] == 3.0
    assert lines[3] == {"step": 3, "val_loss": 2.4}

    flops = model_flops_per_token(QWEN25_05B, 256)["train_flops_per_token"]
    assert lines[0]["tokens_per_s"] == pytest.approx(500.0)
    assert lines[0]["tflops"] == pytest.approx(flops * 500 / 1e12)
    assert lines[0]["mfu"] == pytest.approx(lines[0]["tflops"] / 100.0)
    assert lines[0]["host_mem_gib"] > 0

    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == summary
    assert summary["final_loss"] == 2.5 and summary["final_val_loss"] == 2.4 and summary["initial_val_loss"] == 2.4
    # median over steps 2 and 3 (step 1 is warm-up): step_s 1.0 and 3.0
    assert summary["median_step_s"] == pytest.approx(2.0)
    assert summary["median_tokens_per_s"] == pytest.approx((1000 + 1000 / 3) / 2)
    assert summary["median_mfu"] == pytest.approx(summary["median_tflops"] / 100.0)
    assert summary["steps"] == 3 and summary["tokens_total"] == 3000
    assert summary["peak_host_mem_gib"] > 0 and summary["peak_gpu_mem_gib"] >= 0
    assert summary["config"] == {"train": {"lr": 1e-3}, "seed": 0}
    assert summary["note"] == "x" and summary["error"] is None and summary["git_sha"]

    out = capsys.readouterr().out
    assert "step 1/3 loss 3.0000 lr 1.0e-03 gnorm 0.50 tok/s 500 step 2.00s" in out
    assert "val_loss 2.4000" in out


def test_logger_nan_final_loss_and_no_peak(tmp_path):
    log = make_logger(tmp_path / "run", peak_tflops=0.0)
    rec = log.log_step(1, {"loss": float("inf"), "lr": 1e-3, "grad_norm": float("nan"), "tokens": 10, "step_s": 1.0})
    assert rec["mfu"] is None and rec["grad_norm"] is None and rec["grad_norm_finite"] is False
    summary = log.close()
    assert summary["final_loss"] is None and summary["final_loss_finite"] is False
    assert summary["median_step_s"] == 1.0 and summary["median_mfu"] is None
    json.loads((tmp_path / "run" / "summary.json").read_text())


def test_close_in_finally_records_error(tmp_path):
    log = make_logger(tmp_path / "run")
    with pytest.raises(RuntimeError):
        try:
            log.log_step(1, {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.1, "tokens": 10, "step_s": 0.1})
            raise RuntimeError("out of memory")
        finally:
            log.close()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "out of memory" in summary["error"]
    assert log.close()["steps"] == 1


def test_missing_keys_rejected(tmp_path):
    log = make_logger(tmp_path / "run")
    with pytest.raises(KeyError, match="grad_norm"):
        log.log_step(1, {"loss": 1.0, "lr": 1e-3, "tokens": 10, "step_s": 0.1})
    log.close()


def offline_runs(run_dir: Path):
    return sorted(p for p in (run_dir / "wandb").glob("offline-run-*") if p.is_dir())


def test_wandb_offline_two_runs_in_one_process(tmp_path):
    run_ids = []
    for i in range(2):
        run_dir = tmp_path / f"run{i}"
        log = make_logger(run_dir, name="wandb")
        run_ids.append(log._run.id)
        log.log_step(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.3, "tokens": 100, "step_s": 0.5})
        log.log_step(2, {"loss": float("nan"), "lr": 1e-3, "grad_norm": 0.3, "tokens": 100, "step_s": 0.5})
        log.log_val(2, 1.9)
        log.close()
        runs = offline_runs(run_dir)
        assert len(runs) == 1
        assert list(runs[0].glob("*.wandb")), "offline run has no .wandb transaction log"
        assert (run_dir / "summary.json").exists()
    assert run_ids[0] != run_ids[1]


@pytest.mark.parametrize("env, configured, expected", [("from-env", None, "from-env"), (None, None, "streamtrain"),
                                                       ("from-env", "from-config", "from-config")])
def test_wandb_project_from_the_config_else_the_environment(env, configured, expected, tmp_path, monkeypatch):
    if env:
        monkeypatch.setenv("WANDB_PROJECT", env)
    else:
        monkeypatch.delenv("WANDB_PROJECT", raising=False)
    from tests.util import make_cfg

    composed = make_cfg(["logger=wandb", "logger.progress=lines", *([f"logger.project={configured}"] if configured
                                                                     else [])])  # the schema's default otherwise
    log = MetricsLogger(tmp_path / "run", {"seed": 0}, QWEN25_05B, 256, 100.0, composed.logger, total_steps=3)
    try:
        assert log._run.project == expected
    finally:
        log.close()


def test_wandb_overlapping_loggers_keep_their_runs(tmp_path):
    first = make_logger(tmp_path / "a", name="wandb")
    second = make_logger(tmp_path / "b", name="wandb")
    for log in (first, second):
        log.log_step(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.3, "tokens": 100, "step_s": 0.5})
    assert first._run.id != second._run.id
    assert first.close()["steps"] == 1 and second.close()["steps"] == 1
    assert len(offline_runs(tmp_path / "a")) == len(offline_runs(tmp_path / "b")) == 1


def test_wandb_missing_package_message(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    with pytest.raises(ImportError, match="logger=none"):
        make_logger(tmp_path / "run", name="wandb")
    assert not (tmp_path / "run").exists()


def test_host_rss_tracks_allocation():
    before = host_rss_gib()
    assert before > 0
    x = torch.ones(2**28, dtype=torch.float32)  # 1 GiB, written so every page is resident
    grown = host_rss_gib() - before
    del x
    assert grown == pytest.approx(1.0, rel=0.2)
    assert metrics.host_peak_rss_gib() >= before + 0.8


def test_gpu_mem_zero_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert metrics.gpu_mem_gib() == 0.0 and metrics.gpu_peak_mem_gib() == 0.0


def test_git_sha_is_string():
    sha = metrics.git_sha()
    assert sha == "unknown" or len(sha.split("+")[0]) >= 7


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_child_processes_rss_counts_a_child_holding_memory():
    """torch.compile's worker processes live beside the training process: their resident memory is read from /proc
    (a child that writes 256 MiB is counted, grandchildren included)."""
    from engine.metrics import child_processes_rss_gib

    before = child_processes_rss_gib()
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', " \
           "\"import sys, time; x = b'x' * (256 << 20); print('ready', flush=True); time.sleep(30)\"])"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child_processes_rss_gib() - before >= 0.24
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the grandchild too
        child.wait()


def test_wandb_gets_grouped_keys_against_the_step(tmp_path, monkeypatch):
    """W&B sees train/, eval/, perf/, mem/ and time/ sections with the step as their x axis; metrics.jsonl keeps the
    flat names."""
    log = make_logger(tmp_path, name="wandb")
    logged, defined = [], []
    monkeypatch.setattr(log._run, "log", lambda data, step=None: logged.append((step, data)))
    metrics._define_metrics(SimpleNamespace(define_metric=lambda name, **kw: defined.append((name, kw))))
    log.log_step(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.3, "tokens": 100, "step_s": 0.5, "forward_s": 0.2})
    log.log_val(1, 1.9)
    log.close()
    (step, first), (_, second) = logged
    assert step == 1 and first["step"] == 1
    sections = {k.split("/")[0] for k in first if k != "step"}
    assert sections == {"train", "perf", "mem", "time"}
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "mem/host_mem_gib",
            "time/step_s", "time/forward_s"} <= first.keys()
    assert second == {"step": 1, "eval/val_loss": 1.9}
    assert ("eval/*", {"step_metric": "step"}) in defined and ("eval/val_loss", {"summary": "min"}) in defined
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "loss" in records[0] and "val_loss" in records[1]
