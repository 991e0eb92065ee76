"""The peer baselines (bench/peers/) on the CPU: their smoke runs, rows and failure rows, as a user runs them
(`python -m bench.peers.<script>` from the repository root)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.util import user_env

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ["--model", "qwen0_5b", "--layers", "2", "--vocab", "1024", "--seq-len", "64"]
ROW_KEYS = {"bench", "system", "model", "seq_len", "micro_batch_size", "grad_accum", "tokens_per_step", "steps",
            "step_s", "tokens_per_s", "tflops", "tflops_6n", "mfu", "gpu_mem_gib", "host_mem_gib", "build_s",
            "losses", "gpu", "torch", "triton", "transformers", "git_sha", "date", "error"}


def _peer(script, *args, out, timeout=120, launcher=("-m",)):
    """Run peer `script` (a module of bench.peers) with `args`; `launcher` is what python runs the module with."""
    proc = subprocess.run([sys.executable, *launcher, f"bench.peers.{script}", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=user_env())
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, rows


def test_all_on_gpu_dry_run_writes_a_full_row(tmp_path):
    out = tmp_path / "peers.jsonl"
    proc, rows = _peer("all_on_gpu", "--dry-run", *SMOKE, "--grad-accum", "2", "--steps", "2", out=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(rows) == 1
    row = rows[0]
    assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
    assert row["error"] is None and row["bench"] == "peer" and row["system"] == "all_on_gpu"
    assert row["tokens_per_step"] == 2 * 64 and row["num_hidden_layers"] == 2 and row["vocab_size"] == 1024
    assert row["built_params"] == row["num_params"]  # the transformers model is the layout the FLOPs count
    assert row["attn_implementation"] == "sdpa" and row["activation_checkpointing"] is True
    assert len(row["losses"]) == 2 and all(5.0 < v < 9.0 for v in row["losses"])  # ~ln(1024) = 6.9 at init
    assert row["step_s"] == row["step_s_all"][1] and row["tokens_per_s"] > 0 and row["tflops"] > 0
    assert "[peer all_on_gpu" in proc.stdout and "step 2/2 done" in proc.stdout  # the progress lines


def test_fsdp2_dry_run_over_gloo(tmp_path):
    out = tmp_path / "peers.jsonl"
    proc, rows = _peer("fsdp2_offload", "--dry-run", *SMOKE, out=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = rows
    assert row["error"] is None and row["system"] == "fsdp2_cpu_offload" and ROW_KEYS <= row.keys()
    assert row["optimizer"].startswith("torch.optim.AdamW") and row["param_device"] == "cpu"
    assert 5.0 < row["losses"][0] < 9.0


def test_deepspeed_absent_gives_an_error_row(tmp_path):
    out = tmp_path / "peers.jsonl"
    hide = "import runpy, sys; sys.modules['deepspeed'] = None; sys.argv = sys.argv[1:]; " \
           "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
    proc, rows = _peer("deepspeed_zero3", "--model", "qwen7b", "--micro-batch-size", "2", "--grad-accum", "8",
                       out=out, launcher=("-c", hide))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = rows
    assert row["error"] == "deepspeed not installed" and row["system"] == "deepspeed_zero3_offload"
    assert row["tokens_per_step"] == 2 * 8 * 4096 and row["step_s"] is None and ROW_KEYS <= row.keys()


def test_a_killed_run_still_gets_a_row(tmp_path):
    """What a host-OOM kill leaves: the supervisor writes the row the child could not (SIGKILL at the build)."""
    out = tmp_path / "peers.jsonl"
    proc, rows = _peer("all_on_gpu", "--dry-run", *SMOKE, "--debug-kill-phase", "build", out=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = rows
    assert row["error"].startswith("killed: SIGKILL during build") and row["error_phase"] == "build"
    assert row["tokens_per_s"] is None and "log_tail" in row


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(tmp_path):
    proc, rows = _peer("all_on_gpu", "--model", "qwen0_5b", out=tmp_path / "peers.jsonl")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and rows == []


def test_configs_map_to_the_published_parameter_counts():
    import argparse

    from bench.peers import common

    for name in ("qwen0_5b", "qwen7b", "qwen3_8b", "llama8b"):
        fields = common.model_fields(argparse.Namespace(model=name, layers=None, vocab=None))
        cfg = common.hf_config(fields)
        with torch.device("meta"):
            model = common.hf_model_class(fields)(cfg)
        assert sum(p.numel() for p in model.parameters()) == fields["expected_params"], name
        assert cfg.rms_norm_eps == float(fields["rms_norm_eps"]) and cfg._attn_implementation == "sdpa"
