"""Every model config composes, its layout has the published parameter count, and bad input is refused with a
message that names the problem.

The refusal tests call what the command line calls, in-process: `check_overrides` (what train.py runs before Hydra
composes), then compose and `validate`. BAD holds bad values for every field of the schema, and the parametrization
is drawn from `dataclasses.fields` over the schema, so a field added without a bad value (or without a check that
refuses it) fails here. The user-facing path (exit status, stderr) is tested through the real CLI in test_cli.py.
"""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from engine import config
from engine.config import (ATTENTION_FIGURES, TFLOPS_FIGURES, TRANSFER_FIGURES, Config, ConfigError,
                           check_overrides, validate)
from engine.metrics import count_params
from engine.model import ModelSpec
from tests.util import make_cfg

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = {  # the published config.json, recomputed and checked against checkpoint indexes
    "qwen0_5b": 494_032_768, "qwen1_5b": 1_543_714_304, "qwen3b": 3_085_938_688, "qwen7b": 7_615_616_512,
    "qwen14b": 14_770_033_664, "qwen32b": 32_763_876_352, "qwen72b": 72_706_203_648,
    "qwen3_8b": 8_190_735_360, "qwen3_14b": 14_768_307_200, "qwen3_32b": 32_762_123_264,
    "llama8b": 8_030_261_248, "llama70b": 70_553_706_496,
    "qwen3_30b_a3b": 30_532_122_624, "gptoss20b": 20_914_757_184, "gptoss120b": 116_829_156_672,
}
ACTIVE = {"qwen3_30b_a3b": 3_353_032_704, "gptoss20b": 4_187_440_704, "gptoss120b": 5_711_982_912}  # card: 3.3/3.6/5.1B


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_active_params(name):
    """Active parameters (k experts per layer) as models.md computes them, the embedding included."""
    assert count_params(make_cfg([f"model={name}"]).model, active=True) == ACTIVE[name]


def test_every_model_file_is_covered():
    files = {p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")}
    assert files == set(PUBLISHED) | {"tiny", "tiny_chat"}  # the two tiny ones are ours, not published


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_config_has_published_param_count(name):
    cfg = make_cfg([f"model={name}"])
    spec = ModelSpec(cfg.model)
    spec.check_expected_params()
    assert spec.num_params() == PUBLISHED[name] == cfg.model.expected_params == count_params(cfg.model)


@pytest.mark.parametrize("override", ["model.intermediate_size=18000", "model.num_hidden_layers=29",
                                      "model.vocab_size=160000"])
def test_expected_params_mismatch_is_refused(override):
    cfg = make_cfg(["model=qwen7b", override])
    with pytest.raises(ConfigError, match="expected_params"):
        ModelSpec(cfg.model).check_expected_params()


@pytest.mark.parametrize("layers", [1, 4, 27])
def test_fewer_layers_of_the_published_width_is_a_depth_truncated_copy(layers):
    cfg = make_cfg(["model=qwen7b", f"model.num_hidden_layers={layers}"])
    assert ModelSpec(cfg.model).check_expected_params() == 28
    assert ModelSpec(make_cfg(["model=qwen7b"]).model).check_expected_params() is None


# ---------------------------------------------------------------------------------------------------------------------
# Defaults


def test_default_job_keeps_its_recipe():
    """The dataclass defaults are the default job: the values conf/train/default.yaml used to spell out."""
    t = make_cfg().train
    assert (t.steps, t.lr, t.micro_batch_size, t.val_every, t.seq_len, t.warmup_steps) == (150, 3e-3, 16, 25, 256, 20)


@pytest.mark.parametrize("group", ["train", "engine", "logger", "data"])
def test_group_files_do_not_repeat_schema_defaults(group):
    """One home for defaults: a group option sets only what it changes (model files and hardware profiles are
    records of published or measured figures and keep every field)."""
    section = typing.get_type_hints(Config)[group]
    defaults = OmegaConf.structured(section)
    for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
        for key, value in OmegaConf.load(path).items():
            if key != "defaults" and not OmegaConf.is_missing(defaults, key):
                assert value != defaults[key], f"{path.relative_to(ROOT)} repeats the default {key}={value}"


def test_removed_and_renamed_fields_are_gone_from_the_files():
    text = "\n".join(p.read_text() for p in (ROOT / "conf").rglob("*.yaml"))
    for key in ("hf_repo:", "architectures:", "checkpoint_tier:", "achieved_tflops:", "device_optimizer_units",
                "precision:"):
        assert key not in text


@pytest.mark.parametrize("option", ["experiment=bench_qwen7b_stream_64k", "experiment=bench_qwen7b_reference_64k",
                                    "experiment=bench_qwen7b_512k_h200",
                                    "experiment=tiny_cpu", "+sweep=context", "+sweep=model_size"])
def test_experiment_and_sweep_groups_pass_the_checks(option):
    check_overrides([option])
    make_cfg([option, "plan=true", "hardware=h200"])  # planned for the H200, as the recipes say, on any machine


# ---------------------------------------------------------------------------------------------------------------------
# Refusals, field by field


def schema_keys(section=Config, prefix=""):
    for f in dataclasses.fields(section):
        tp = typing.get_type_hints(section)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _moe_layers(hardware="h200", **fields):
    """Overrides giving the profile one moe_layers entry, `fields` replacing its valid values (with no fields: the
    same model and tokens twice)."""
    entry = {"model": "m", "hidden": 8, "experts": 4, "experts_per_token": 2, "expert_width": 8, "tokens": 8,
             **fields}
    text = "{" + ",".join(f"{k}:{v}" for k, v in entry.items()) + "}"
    return f"hardware={hardware} hardware.moe_layers=[{text}" + ("" if fields else f",{text}") + "]"


def _figures(key):
    return [f"{key}=-1", f"{key}=nan", f"{key}=inf", f"{key}=abc"]


LLAMA3 = "low_freq_factor:1.0,high_freq_factor:4.0,original_max_position_embeddings:64"
A_FILE = str(Path(__file__).resolve())
# key: overrides that must be refused, each a space-separated override list whose first item sets the key
BAD = {
    "model.name": ["model.name=''", "model.name=[a]"],
    "model.model_type": ["model.model_type=gpt2"],
    "model.hidden_size": ["model.hidden_size=0", "model.hidden_size=abc", "model.hidden_size=2.5"],
    "model.intermediate_size": ["model.intermediate_size=0", "model.intermediate_size=-3"],
    "model.num_hidden_layers": ["model.num_hidden_layers=0", "model.num_hidden_layers=true"],
    "model.num_attention_heads": ["model.num_attention_heads=0", "model.num_attention_heads=5"],
    "model.num_key_value_heads": ["model.num_key_value_heads=0", "model.num_key_value_heads=4"],
    "model.head_dim": ["model.head_dim=0", "model.head_dim=7", "model.head_dim=-2", "model.head_dim=x",
                       "model.head_dim=null model.hidden_size=270"],
    "model.vocab_size": ["model.vocab_size=0", "model.vocab_size=x"],
    "model.max_position_embeddings": ["model.max_position_embeddings=0", "model.max_position_embeddings=128"],
    "model.rope_theta": ["model.rope_theta=0", "model.rope_theta=inf", "model.rope_theta=nan", "model.rope_theta=x"],
    "model.rope_scaling": ["model.rope_scaling=5", "model.rope_scaling={rope_type:yarn}",
                           "model.rope_scaling={rope_type:llama3}", "model.rope_scaling={rope_type:default,factor:2}",
                           f"model.rope_scaling={{rope_type:llama3,factor:0.5,{LLAMA3}}}",
                           f"model.rope_scaling={{rope_type:llama3,factor:nan,{LLAMA3}}}",
                           f"model.rope_scaling={{rope_type:llama3,factor:x,{LLAMA3}}}",
                           ("model.rope_scaling={rope_type:llama3,factor:8.0,low_freq_factor:4.0,high_freq_factor:1.0,"
                            "original_max_position_embeddings:64}"),
                           f"model.rope_scaling={{rope_type:llama3,factor:8.0,{LLAMA3},beta:1}}",
                           "model.rope_scaling={rope_type:yarn,factor:4.0,original_max_position_embeddings:x}",
                           "model.rope_scaling={rope_type:yarn,factor:4.0,original_max_position_embeddings:64,"
                           "truncate:3}"],
    "model.rms_norm_eps": ["model.rms_norm_eps=0", "model.rms_norm_eps=nan", "model.rms_norm_eps=-1e-6"],
    "model.tie_word_embeddings": ["model.tie_word_embeddings=maybe"],
    "model.qkv_bias": ["model.qkv_bias=false", "model.qkv_bias=maybe"],
    "model.qk_norm": ["model.qk_norm=true", "model.qk_norm=maybe"],
    "model.hidden_act": ["model.hidden_act=gelu"],
    "model.bos_token_id": ["model.bos_token_id=-1", "model.bos_token_id=256", "model.bos_token_id=x"],
    "model.eos_token_id": ["model.eos_token_id=-1", "model.eos_token_id=256", "model.eos_token_id=x"],
    "model.expected_params": ["model.expected_params=0", "model.expected_params=x"],
    "model.init": ["model.init=foo", "model.init=hf:", "model.init=hf:/nonexistent/checkpoint"],
    "model.init_std": ["model.init_std=0", "model.init_std=nan", "model.init_std=-0.02"],
    "model.attention_bias": ["model.attention_bias=true", "model=gptoss20b model.attention_bias=false"],
    "model.num_experts": ["model.num_experts=4", "model=qwen3_30b_a3b model.num_experts=0"],
    "model.num_experts_per_tok": ["model=qwen3_30b_a3b model.num_experts_per_tok=0",
                                  "model=qwen3_30b_a3b model.num_experts_per_tok=129"],
    "model.moe_intermediate_size": ["model=qwen3_30b_a3b model.moe_intermediate_size=null",
                                    "model=qwen3_30b_a3b model.moe_intermediate_size=0"],
    "model.norm_topk_prob": ["model.norm_topk_prob=maybe"],
    "model.router_aux_loss_coef": ["model=gptoss20b model.router_aux_loss_coef=-1",
                                   "model=gptoss20b model.router_aux_loss_coef=nan"],
    "model.swiglu_limit": ["model=gptoss20b model.swiglu_limit=null", "model=gptoss20b model.swiglu_limit=0",
                           "model=qwen3_30b_a3b model.swiglu_limit=7.0"],
    "model.sliding_window": ["model.sliding_window=128", "model=gptoss20b model.sliding_window=0",
                             "model=gptoss20b model.sliding_window=null"],
    "model.layer_types": ["model.layer_types=[full_attention]", "model=gptoss20b model.layer_types=[full_attention]",
                          "model=gptoss20b model.layer_types=[global,local]"],
    "train.steps": ["train.steps=0", "train.steps=-1", "train.steps=abc"],
    "train.seq_len": ["train.seq_len=0", "train.seq_len=999999"],
    "train.micro_batch_size": ["train.micro_batch_size=0"],
    "train.grad_accum": ["train.grad_accum=0"],
    "train.lr": ["train.lr=0", "train.lr=-1e-3", "train.lr=inf", "train.lr=nan", "train.lr=fast"],
    "train.min_lr_ratio": ["train.min_lr_ratio=-0.1", "train.min_lr_ratio=1.5", "train.min_lr_ratio=nan"],
    "train.warmup_steps": ["train.warmup_steps=-1"],
    "train.weight_decay": ["train.weight_decay=-0.1", "train.weight_decay=nan", "train.weight_decay=inf"],
    "train.beta1": ["train.beta1=1.0", "train.beta1=-0.1", "train.beta1=nan"],
    "train.beta2": ["train.beta2=1", "train.beta2=inf"],
    "train.eps": ["train.eps=0", "train.eps=nan", "train.eps=-1e-8"],
    "train.max_grad_norm": ["train.max_grad_norm=-1", "train.max_grad_norm=nan", "train.max_grad_norm=inf"],
    "train.master_dtype": ["train.master_dtype=fp16"],
    "train.moments_dtype": ["train.moments_dtype=int4"],
    "train.grad_dtype": ["train.grad_dtype=fp8"],
    "train.grad_transfer_dtype": ["train.grad_transfer_dtype=fp16", "train.grad_transfer_dtype=bf16 engine=reference",
                                  "train.grad_transfer_dtype=bf16 engine=stream train.moments_dtype=int8"],
    "train.fp32_update": ["train.fp32_update=triton", "engine=stream train.fp32_update=kernel",
                          "train.master_dtype=bf16 train.moments_dtype=bf16 train.fp32_update=kernel"],
    "train.moments_block_size": ["train.moments_block_size=0", "train.moments_block_size=100",
                                 "train.moments_block_size=32768"],
    "train.compute_dtype": ["train.compute_dtype=fp16"],
    "train.activation_checkpointing": ["train.activation_checkpointing=maybe",
                                       "train.activation_checkpointing=false engine=stream"],
    "train.compile": ["train.compile=yes"],
    "train.deterministic": ["train.deterministic=sometimes"],
    "train.compile_in_process": ["train.compile_in_process=maybe"],
    "train.log_every": ["train.log_every=0"],
    "train.val_every": ["train.val_every=-2"],
    "train.val_batches": ["train.val_batches=0"],
    "train.checkpoint_every": ["train.checkpoint_every=-1"],
    "train.checkpoint_minutes": ["train.checkpoint_minutes=-1", "train.checkpoint_minutes=inf"],
    "train.checkpoint_at_end": ["train.checkpoint_at_end=maybe"],
    "train.keep_checkpoints": ["train.keep_checkpoints=-1"],
    "train.checkpoint_dir": ["train.checkpoint_dir=''", f"train.checkpoint_dir={A_FILE}"],
    "train.resume": ["train.resume=/nonexistent/run", "train.resume=latest"],
    "train.stop_at": ["train.stop_at=-1"],
    "train.max_consecutive_skips": ["train.max_consecutive_skips=-1"],
    "train.export_hf": ["train.export_hf=maybe"],
    "train.fused_loss": ["train.fused_loss=yes"],
    "train.attention": ["train.attention=flash", "train.attention=xformers"],
    "train.mlp_chunk_tokens": ["train.mlp_chunk_tokens=-2", "train.mlp_chunk_tokens=lots"],
    "train.lean_layer": ["train.lean_layer=yes"],
    "train.export_dtype": ["train.export_dtype=fp16"],
    "hardware.name": ["hardware.name=''"],
    "hardware.device": ["hardware.device=tpu"],
    "hardware.gpu_mem_gib": [*_figures("hardware.gpu_mem_gib"),
                             "hardware.gpu_mem_gib=0 hardware=h200 plan=true"],
    "hardware.gpu_mem_cap_gib": _figures("hardware.gpu_mem_cap_gib"),
    "hardware.other_card": ["hardware.other_card=maybe"],
    "hardware.peak_bf16_tflops": _figures("hardware.peak_bf16_tflops"),
    "hardware.peak_fp32_tflops": _figures("hardware.peak_fp32_tflops"),
    "hardware.host_mem_gib": _figures("hardware.host_mem_gib"),
    "hardware.profile_host_mem_gib": _figures("hardware.profile_host_mem_gib"),
    "hardware.host_process_gib": _figures("hardware.host_process_gib"),
    "hardware.bidir_gbps_under_adam": _figures("hardware.bidir_gbps_under_adam"),
    "hardware.lean_step_ratio_sdpa": _figures("hardware.lean_step_ratio_sdpa"),
    "hardware.lean_step_ratio_triton": _figures("hardware.lean_step_ratio_triton"),
    "hardware.moe_step_ratio": _figures("hardware.moe_step_ratio"),
    "hardware.gpus": ["hardware.gpus=0", "hardware.gpus=two"],
    "hardware.cpu_adam_gparams_per_s_in_step": _figures("hardware.cpu_adam_gparams_per_s_in_step"),
    "hardware.host_compile_workers_gib": _figures("hardware.host_compile_workers_gib"),
    **{f"hardware.{key}": [*_figures(f"hardware.{key}"), f"hardware.{key}=0 hardware=h200 plan=true"]
       for key in TRANSFER_FIGURES},
    **{f"hardware.{key}": [*_figures(f"hardware.{key}"), f"hardware.{key}=0 " + " ".join(
        f"hardware.{other}=100" for other in TFLOPS_FIGURES if other != key and other[-5:] == key[-5:])]
       for key in TFLOPS_FIGURES},
    "hardware.attn_backend": ["hardware.attn_backend=auto", "hardware=h200 hardware.attn_fwd_tflops=300 "
                              "hardware.attn_bwd_tflops=300 hardware.attn_seq_len=32768"],
    "hardware.attn_seq_len": ["hardware.attn_seq_len=-1", "hardware=h200 hardware.attn_fwd_tflops=300 "
                              "hardware.attn_bwd_tflops=300 hardware.attn_backend=sdpa"],
    **{f"hardware.{key}": [*_figures(f"hardware.{key}"), f"hardware=h200 hardware.{key}=300 "
                           "hardware.attn_seq_len=32768 hardware.attn_backend=sdpa",
                           "hardware=cpu hardware.attn_fwd_tflops=1 hardware.attn_bwd_tflops=1 "
                           "hardware.attn_seq_len=64 hardware.attn_backend=sdpa"]
       for key in ATTENTION_FIGURES},
    "hardware.moe_layers": ["hardware.moe_layers=x", _moe_layers(hidden=0), _moe_layers(experts_per_token=8),
                            _moe_layers(tokens=-1), _moe_layers(model="''"), _moe_layers(fwd_tflops_eager=-1),
                            _moe_layers(fwd_tflops_eager=100),  # its pair missing
                            # without the dense figures of the mode (the cpu profile has none)
                            _moe_layers(fwd_tflops_eager=1, bwd_tflops_eager=1, hardware="cpu"),
                            _moe_layers()],
    "hardware.layer_model": ["hardware.layer_model=[a]",
                             "hardware=h100 hardware.layer_model='' hardware.layer_widths=[{model:x,hidden:2048}]"],
    "hardware.layer_hidden": ["hardware.layer_hidden=-1", "hardware.layer_hidden=x",
                              "hardware=cpu hardware.layer_widths=[{model:qwen3b,hidden:2048}]"],
    "hardware.attn_points": ["hardware.attn_points=x", "hardware.attn_points=[{backend:sdpa,tokens:2048}]",
                             "hardware=cpu hardware.attn_points=[{backend:sdpa,seq_len:2048,fwd_tflops:1,"
                             "bwd_tflops:1}]",  # no main attention figures
                             "hardware=h100 hardware.attn_points=[{backend:cudnn,seq_len:2048,fwd_tflops:1,"
                             "bwd_tflops:1}]",
                             "hardware=h100 hardware.attn_points=[{backend:sdpa,seq_len:0,fwd_tflops:1,bwd_tflops:1}]",
                             "hardware=h100 hardware.attn_points=[{backend:sdpa,seq_len:32768,fwd_tflops:1,"
                             "bwd_tflops:1}]",  # the main point again
                             "hardware=h100 hardware.attn_points=[{backend:sdpa,seq_len:2048,fwd_tflops:0,"
                             "bwd_tflops:1}]"],
    "hardware.layer_widths": ["hardware.layer_widths=x", "hardware.layer_widths=[{model:qwen3b,width:2048}]",
                              "hardware=h100 hardware.layer_widths=[{model:qwen7b,hidden:3584}]",  # the main width
                              "hardware=h100 hardware.layer_widths=[{model:'',hidden:2048}]",
                              "hardware=h100 hardware.layer_widths=[{model:qwen3b,hidden:0}]",
                              "hardware=h100 hardware.layer_widths=[{model:qwen3b,hidden:2048,fwd_tflops_eager:1}]",
                              "hardware=h100 hardware.layer_widths=[{model:qwen3b,hidden:2048,fwd_tflops_eager:-1}]"],
    "hardware.calibration": ["hardware.calibration=[a]"],
    "hardware.nvme_dir": [f"hardware.nvme_dir={A_FILE} hardware.nvme_gib=10", "hardware.nvme_dir=[a]"],
    "hardware.nvme_gib": [*_figures("hardware.nvme_gib"), "hardware.nvme_gib=10"],
    "hardware.nvme_gbps": _figures("hardware.nvme_gbps"),
    "hardware.nvme_direct_io": ["hardware.nvme_direct_io=maybe"],
    "data.name": ["data.name=web"],
    "data.path": ["data.path=/nonexistent/tokens.bin data=memmap", "data.path=null data=memmap",
                  f"data.path={A_FILE}", "data.name=chat data.tokenizer=tok"],
    "data.val_fraction": ["data.val_fraction=0", "data.val_fraction=1", "data.val_fraction=nan"],
    "data.vocab_size": ["data.vocab_size=0", "data.vocab_size=x"],
    "data.val_path": ["data.val_path=v.jsonl"],  # read by text/chat only
    "data.tokenizer": ["data.tokenizer=tok", "data.name=chat data.path=d.jsonl"],  # chat needs a tokenizer
    "data.loss_on": ["data.loss_on=prompt"],
    "data.cache_dir": ["data.cache_dir=[a]"],
    "data.num_proc": ["data.num_proc=-1"],
    "logger.name": ["logger.name=tensorboard"],
    "logger.project": ["logger.project=''"],
    "logger.entity": ["logger.entity=''"],
    "logger.mode": ["logger.mode=shared"],
    "logger.group": ["logger.group=''"],
    "logger.tags": ["logger.tags=x", "logger.tags=['']", f"logger.tags=[{'t' * 65}]"],
    "logger.progress": ["logger.progress=fancy"],
    "engine.name": ["engine.name=fsdp"],
    "engine.slots": ["engine.slots=1"],
    "engine.grads_tier": ["engine.grads_tier=nvme"],
    "engine.activation_tier": ["engine.activation_tier=disk"],
    "engine.cache_weights": ["engine.cache_weights=maybe"],
    "engine.gpu_resident_units": ["engine.gpu_resident_units=-2"],
    "engine.gpu_streamed_units": ["engine.gpu_streamed_units=-2"],
    "engine.keep_activation_layers": ["engine.keep_activation_layers=-2", "engine.keep_activation_layers=99"],
    "engine.kept_attention_layers": ["engine.kept_attention_layers=-2", "engine.kept_attention_layers=99"],
    "engine.host_grad_units": ["engine.host_grad_units=-2", "engine.host_grad_units=x",
                               "engine=stream engine.host_grad_units=2 train.grad_dtype=fp32",
                               "engine=stream engine.host_grad_units=2 train.grad_dtype=int8"],
    "engine.nvme_units": ["engine.nvme_units=-2", "engine.nvme_units=x",
                          "engine=stream engine.nvme_units=1 train.moments_dtype=int8"],
    "engine.recompute_group": ["engine.recompute_group=0", "engine.recompute_group=-2",
                                "engine.recompute_group=99", "engine.recompute_group=two"],
    "engine.norm_pass": ["engine.norm_pass=maybe", "engine.norm_pass=on train.grad_dtype=int8",
                         "engine.norm_pass=on engine.keep_activation_layers=2"],
    "engine.fused_kernels": ["engine.fused_kernels=maybe"],
    "engine.shard_state": ["engine.shard_state=maybe"],
    "seed": ["seed=-1", "seed=abc", f"seed={2**63}"],
    "plan": ["plan=maybe"],
}
CASES = [(key, bad) for key in schema_keys() for bad in BAD.get(key, [None])]


def refusal(overrides) -> str:
    """The ConfigError message the command line would print for these overrides."""
    try:
        check_overrides(overrides)
        make_cfg(overrides)
    except ConfigError as err:
        return str(err)
    pytest.fail(f"{' '.join(overrides)} was accepted")


@pytest.mark.parametrize("key, bad", CASES, ids=[f"{k}:{b}" for k, b in CASES])
def test_every_field_refuses_bad_values(key, bad):
    assert bad is not None, f"{key} has no bad values in BAD: give it some, and a check in engine/config.py"
    message = refusal(bad.split())
    assert key in message


def test_bad_values_cover_the_schema_exactly():
    assert set(BAD) == set(schema_keys())


@pytest.mark.parametrize("override, pattern", [
    ("train.seq_len=0", "train.seq_len=0 must be >= 1"),
    ("train.grad_accum=0", "train.grad_accum=0 must be >= 1"),
    ("train.seq_len=999999", "exceeds model.max_position_embeddings"),
    ("data=memmap", "data=memmap needs data.path"),
    ("data=memmap data.path=/nonexistent/tokens.bin", "no such file"),
    ("engine.grads_tier=nvme", "engine.grads_tier='nvme' is not valid; choose one of auto, gpu, host"),
    ("train.lr=inf", r"train.lr=inf must be a finite number > 0"),
    ("train.beta2=1.0", r"train.beta2=1.0 must be a finite number within \[0, 1\)"),
    ("data.val_fraction=1", r"data.val_fraction=1.0 must be a finite number within \(0, 1\)"),
    ("train.steps=abc", "train.steps=abc is not valid: train.steps takes an integer"),
    ("train.steps=0", "train.steps=0 must be >= 1"),
    ("hardware.host_mem_gib=-1", r"hardware.host_mem_gib=-1.0 must be a finite number >= 0 \(0: this machine's "
                                 r"memory\)"),
    ("hardware.gpu_mem_cap_gib=-1", r"hardware.gpu_mem_cap_gib=-1.0 must be a finite number >= 0 \(0: no cap\)"),
    ("model.head_dim=x", "model.head_dim=x is not valid: model.head_dim takes an integer or null"),
    ("train.activation_checkpointing=false engine=stream",
     "keeps layer inputs and recomputes.*engine=reference honours false"),
])
def test_messages_say_what_is_valid(override, pattern):
    assert re.search(pattern, refusal(override.split()))


@pytest.mark.parametrize("override", ["train.bogus_key=1", "+train.bogus_key=1", "++train.bogus_key=1"])
def test_unknown_key_is_refused_whatever_the_syntax(override):
    message = refusal([override])
    assert "train.bogus_key is not a config key" in message and "valid keys of train: activation_checkpointing" \
        in message and "weight_decay" in message


@pytest.mark.parametrize("override, pattern", [
    ("+bogus=1", "bogus is not a config key or config group; valid top-level keys: data, engine"),
    ("+model.foo=1", "model.foo is not a config key; valid keys of model: attention_bias, bos_token_id"),
    ("train.lr.x=1", "train.lr.x is not a config key: train.lr holds a number"),
])
def test_unknown_keys_name_the_valid_ones(override, pattern):
    assert pattern in refusal([override])


def test_added_unknown_key_is_refused_after_composing_too():
    """`+` gets past the typed node when composing in-process (no check_overrides); validate refuses it."""
    cfg = make_cfg(["+train.bogus_key=1", "++logger.colour=red"], validated=False)
    with pytest.raises(ConfigError, match="train.bogus_key is not a config key"):
        validate(cfg)


@pytest.mark.parametrize("override", ["engine.checkpoint_tier=gpu", "+engine.checkpoint_tier=gpu",
                                      "++engine.checkpoint_tier=host", "~engine.checkpoint_tier"])
def test_renamed_key_is_refused_with_its_new_name(override):
    assert refusal([override]) == "engine.checkpoint_tier was renamed engine.activation_tier"


def test_removed_fields_are_unknown():
    for key in ("model.hf_repo", "model.architectures"):
        assert f"{key} is not a config key" in refusal([f"{key}=x"])


def test_sweep_values_are_checked_each():
    check_overrides(["train.seq_len=64,128", "train.lr=range(0.001,0.003,0.001)", "model=tiny,qwen7b"])
    assert refusal(["train.seq_len=64,abc"]) == "train.seq_len=abc is not valid: train.seq_len takes an integer"


def test_group_choices_and_hydra_keys_are_left_to_hydra():
    check_overrides(["model=qwen7b", "experiment=tiny_cpu", "hydra.run.dir=/tmp/x", "hydra/launcher=basic",
                     "hydra.job.chdir=true"])


def test_gpu_profile_without_a_gpu_is_refused_unless_planning(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = refusal(["hardware=h200"])
    assert "torch sees no CUDA device" in message and "hardware=cpu" in message and "hardware=auto" in message
    assert "plan=true" in message
    validate(make_cfg(["hardware=h200", "plan=true"], validated=False))


def test_deterministic_refuses_a_cublas_workspace_that_is_not_reproducible(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    message = refusal(["train.deterministic=true"])
    assert "train.deterministic=true" in message and "':4096:2'" in message and ":4096:8, :16:8" in message
    validate(make_cfg(["train.deterministic=false"], validated=False))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    validate(make_cfg(["train.deterministic=true"], validated=False))


def test_hardware_auto_keeps_the_fields_a_user_or_recipe_set(monkeypatch):
    """hardware=auto merges the detected profile in; a field set on the command line (or by an experiment) is not
    overwritten by the profile's value, and the profile fills the rest."""
    from engine import hardware

    monkeypatch.setattr(hardware, "detect_profile", lambda: "h200")
    cfg = make_cfg(["hardware=auto", "hardware.host_mem_gib=105", "plan=true"], validated=False)
    hardware.resolve(cfg)
    assert cfg.hardware.name == "h200" and cfg.hardware.host_mem_gib == 105
    profile = OmegaConf.load(hardware.PROFILE_DIR / "h200.yaml")
    assert cfg.hardware.gpu_mem_gib == profile.gpu_mem_gib
    assert cfg.hardware.profile_host_mem_gib == profile.profile_host_mem_gib == 125.0  # the profile's machine's host
    recipe = make_cfg(["experiment=bench_qwen7b_512k_h200", "hardware=auto", "plan=true"], validated=False)
    hardware.resolve(recipe)
    assert recipe.hardware.name == "h200" and recipe.hardware.host_mem_gib == 105


def test_wrong_type_in_a_group_file_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as err:
        make_cfg(["train.seq_len=long"])
    assert isinstance(err.value.__cause__, ValidationError) and "seq_len" in str(err.value.__cause__)


def test_unknown_key_in_a_group_file_is_refused():
    schema = OmegaConf.structured(Config)
    with pytest.raises(ConfigKeyError, match="hiden_size"):
        OmegaConf.merge(schema, {"model": {"hiden_size": 3}})


def test_conf_dir_is_the_repository_conf_in_a_checkout():
    assert config.CONF_DIR == ROOT / "conf"


@pytest.mark.parametrize("override, new", [("engine.device_optimizer_units=3", "engine.gpu_resident_units"),
                                           ("hardware.achieved_tflops=480", "python -m engine.calibrate"),
                                           ("train.precision=fp32_master", "train.master_dtype")])
def test_keys_renamed_by_performance_ii_point_to_their_successors(override, new):
    message = refusal([override])
    assert message.startswith(f"{override.split('=')[0]} was renamed") and new in message
