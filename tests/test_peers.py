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


def _without_deepspeed(host_gib):
    """A launcher (python -c) that runs the module named next as if deepspeed were not installed, with psutil
    reporting a host of `host_gib` GiB of RAM (the DeepSpeed peer's pre-flight reads it)."""
    return ("-c", "import psutil, runpy, sys, types; sys.modules['deepspeed'] = None; "
                  f"psutil.virtual_memory = lambda: types.SimpleNamespace(total={host_gib} * 2**30); "
                  "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


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
    proc, rows = _peer("deepspeed_zero3", "--model", "qwen7b", "--micro-batch-size", "2", "--grad-accum", "8",
                       out=out, launcher=_without_deepspeed(host_gib=1024))
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


def _meta_model(name, layers=None):
    """(fields, transformers model on the meta device) of conf/model/<name>.yaml as the peers build it."""
    import argparse

    from bench.peers import common

    fields = common.model_fields(argparse.Namespace(model=name, layers=layers, vocab=None, experts=None))
    with torch.device("meta"):
        return fields, common.hf_model_class(fields)(common.hf_config(fields))


@pytest.mark.parametrize("name", ["qwen0_5b", "qwen7b", "qwen3_8b", "llama8b", "gptoss20b", "qwen3_30b_a3b"])
def test_configs_map_to_the_published_parameter_counts(name):
    fields, model = _meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == fields["expected_params"]
    assert model.config.rms_norm_eps == float(fields["rms_norm_eps"]) and model.config.use_cache is False
    # transformers' default attention: SDPA, except gpt-oss, whose attention sinks SDPA has no place for
    assert model.config._attn_implementation == ("eager" if name == "gptoss20b" else "sdpa")
    if fields.get("num_experts"):  # the load-balancing loss is part of the loss, as in the engine
        assert model.config.output_router_logits is True
        assert model.config.router_aux_loss_coef == fields["router_aux_loss_coef"]


def test_gpt_oss_maps_its_experts_window_and_layer_types_depth_truncated():
    from bench.peers import common
    from engine.metrics import count_params

    fields, model = _meta_model("gptoss20b", layers=3)
    cfg = model.config
    assert type(model).__name__ == "GptOssForCausalLM" and fields["truncated"]
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (32, 4, 2880)
    assert (cfg.sliding_window, cfg.swiglu_limit, cfg.attention_bias) == (128, 7.0, True)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 32.0
    layer = model.model.layers[0]
    assert layer.self_attn.sinks.shape == (64,) and layer.mlp.experts.gate_up_proj.shape == (32, 2880, 2 * 2880)
    # the row's parameter and FLOP counts are the engine's for the same truncated model
    built = sum(p.numel() for p in model.parameters())
    assert built == count_params(common.model_config(fields)) == 3_627_830_688


def test_deepspeed_preflight_refuses_a_model_the_host_cannot_hold(tmp_path):
    """Full-depth gpt-oss-20b needs ~526 GiB of host under ZeRO-3 offload (27 bytes a parameter): a row saying so,
    in seconds, nothing built; 3 of its 24 layers (~91 GiB) pass the check on a 128 GiB host."""
    out = tmp_path / "peers.jsonl"
    shape = ["--micro-batch-size", "4", "--grad-accum", "4"]
    proc, rows = _peer("deepspeed_zero3", "--model", "gptoss20b", *shape, out=out,
                       launcher=_without_deepspeed(host_gib=128))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = rows
    assert row["error"].startswith("host memory: DeepSpeed ZeRO-3 offload needs ~526 GiB of host for 20.91B")
    assert "this host has 128 GiB: not run" in row["error"]
    assert row["host_estimate_gib"] == pytest.approx(20_914_757_184 * 27 / 2**30) and row["host_ram_gib"] == 128
    assert row["num_hidden_layers"] == 24 and row["tokens_per_step"] == 65536 and row["step_s"] is None
    assert ROW_KEYS <= row.keys()

    proc, rows = _peer("deepspeed_zero3", "--model", "gptoss20b", "--layers", "3", *shape, out=out,
                       launcher=_without_deepspeed(host_gib=128))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = rows[-1]  # past the check, stopped by the hidden deepspeed
    assert row["error"] == "deepspeed not installed" and row["num_hidden_layers"] == 3
    assert row["host_estimate_gib"] == pytest.approx(91.2, abs=0.1)
