"""HF checkpoints of mixture-of-experts models in and out (engine/checkpoint/hf.py, engine/checkpoint/mxfp4.py).

MXFP4: the decoder against a per-element reading of the format on hand-written bytes (every nibble in both halves
of a byte, scales 0, 127 and 254 among others), and against transformers' own dequantization (which fixes the
transpose to [E, in, out]). Import: tiny random Qwen3-MoE and gpt-oss models written by transformers'
`save_pretrained` (Qwen3-MoE: one matrix per expert on disk; gpt-oss: unquantized, under the in-memory names), one
file and sharded, fp32 and bf16, into both engines: every master weight equals transformers' tensor. gpt-oss in
MXFP4: a checkpoint whose experts this test encodes itself imports as exactly the encoded values (and as
transformers decodes them), through the Trainer and into a depth-truncated run. Export: re-import is bit-exact in
fp32 and transformers loads the files with the same state dict. Refusals: unsupported Qwen3-MoE layouts, a
missing expert tensor, a foreign quantization, a NaN scale.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from engine import checkpoint  # noqa: E402
from engine.checkpoint import CheckpointError, mxfp4  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from engine.device import resolve_compute_dtype  # noqa: E402
from engine.model import ModelSpec  # noqa: E402
from engine.plan import build_plan  # noqa: E402
from engine.trainer import Trainer, build_engine  # noqa: E402
from tests.test_moe_vs_hf import GPT_OSS, QWEN3_MOE, hf_config  # noqa: E402
from tests.util import make_cfg  # noqa: E402

LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# hidden and expert width multiples of 32, as MXFP4 blocks need
BASE = ["model.max_position_embeddings=128", "train.seq_len=16", "train.micro_batch_size=1", "model.hidden_size=64",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16", "model.vocab_size=131",
        "model.intermediate_size=32", "model.moe_intermediate_size=32", "model.num_hidden_layers=2"]
CASES = {"qwen3_moe": [*BASE, *QWEN3_MOE],
         "gpt_oss": [*BASE, *GPT_OSS, "model.layer_types=[sliding_attention,full_attention]"]}


def reference_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The format read literally: byte by byte, low nibble first, LUT value times 2^(scale - 127) in Python floats."""
    flat_blocks, flat_scales = blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()
    values = []
    for row, s in zip(flat_blocks, flat_scales):
        for byte in row:
            values += [LUT[byte & 0xF] * 2.0 ** (s - 127), LUT[byte >> 4] * 2.0 ** (s - 127)]
    return torch.tensor(values, dtype=torch.float32).reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def test_mxfp4_decode_known_values():
    # row 0 pairs low nibble n with high nibble 15 - n for n < 8 and the reverse after; row 1 swaps the halves, so
    # every nibble appears in both halves at every scale
    pairs = [(n, 15 - n) for n in range(8)]
    rows = [[lo | hi << 4 for lo, hi in pairs] + [hi | lo << 4 for lo, hi in pairs],
            [hi | lo << 4 for lo, hi in pairs] + [lo | hi << 4 for lo, hi in pairs]]
    scales = torch.tensor([s for s in (127, 0, 254, 1, 130, 100) for _ in rows], dtype=torch.uint8)
    blocks = torch.tensor(rows * 6, dtype=torch.uint8)
    got = mxfp4.decode(blocks, scales)
    want = reference_decode(blocks, scales)
    assert got.shape == want.shape == (12 * 32,) and got.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    # low nibble first: at scale 127, byte 0xF0 is [0, -6] and 0xE1 is [0.5, -4]; row 1's 0x0F is [-6, 0]
    assert got[0:4].tolist() == [0.0, -6.0, 0.5, -4.0] and got[32:34].tolist() == [-6.0, 0.0]
    # scale 0 multiplies by 2^-127 (an fp32 subnormal); scale 254 by 2^127, past fp32's range for |value| >= 2
    assert got[64:68].tolist() == [0.0, math.ldexp(-6.0, -127), math.ldexp(0.5, -127), math.ldexp(-4.0, -127)]
    assert got[128:132].tolist() == [0.0, -math.inf, math.ldexp(0.5, 127), -math.inf]
    finite = torch.isfinite(got)
    assert torch.equal(mxfp4.decode(blocks, scales, torch.bfloat16).float()[finite], got[finite])  # exact in bf16


def test_mxfp4_decode_experts_is_chunked_transposed_and_matches_transformers(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 20, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 20, 4), dtype=torch.uint8, generator=gen)
    monkeypatch.setattr(mxfp4, "CHUNK_VALUES", 3 * 128)  # 3 rows a step: 7 steps per expert, a ragged last one
    got = mxfp4.decode_experts(blocks, scales, torch.float32)
    assert got.shape == (3, 128, 20) and got.is_contiguous()
    assert torch.equal(got, reference_decode(blocks, scales).transpose(1, 2))
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(mxfp4.decode_experts(blocks, scales), theirs)


@pytest.mark.parametrize("work", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mxfp4_decode_on_another_device_gives_the_same_bits(work, monkeypatch):
    """The import decodes on the GPU when there is one (chunks cross PCIe, the output stays in host memory)."""
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 24, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (2, 24, 3), dtype=torch.uint8, generator=gen)
    monkeypatch.setattr(mxfp4, "CHUNK_VALUES", 5 * 96)
    got = mxfp4.decode_experts(blocks, scales, torch.bfloat16, work_device=work)
    assert got.device.type == "cpu"
    assert torch.equal(got, reference_decode(blocks, scales).transpose(1, 2).to(torch.bfloat16))


def test_mxfp4_refuses_a_nan_scale_and_bad_shapes():
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    scales = torch.full((2, 3), 127, dtype=torch.uint8)
    scales[1, 2] = 255
    with pytest.raises(ValueError, match=r"scale 255 \(NaN in the format\) at block \[1, 2\]"):
        mxfp4.decode(blocks, scales)
    with pytest.raises(ValueError, match=r"do not fit"):
        mxfp4.decode(blocks, scales[:, :2])


# ------------------------------------------------------------------------------------------------- checkpoints


def model_cfg(case: str, *extra):
    return make_cfg([*CASES[case], *extra]).model


def random_hf_model(case: str):
    config, cls = hf_config(model_cfg(case))
    torch.manual_seed(0)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def save_hf(model, path: Path, dtype: torch.dtype, shard: str | None) -> Path:
    """save_pretrained in `dtype`; the model is left holding exactly the saved values (in fp32)."""
    model.to(dtype).save_pretrained(str(path), **({"max_shard_size": shard} if shard else {}))
    model.float()
    return path


def new_engine(case: str, engine: str = "reference", *extra):
    cfg = make_cfg([*CASES[case], f"engine={engine}", *extra])
    spec = ModelSpec(cfg.model)
    cpu = torch.device("cpu")
    plan = build_plan(spec, cfg, 0.0, 64.0, on_gpu=False)
    return spec, build_engine(spec, cfg, cpu, resolve_compute_dtype(cfg.train.compute_dtype, cpu), plan)


def imported(case: str, path: Path, engine: str = "reference", *extra):
    spec, eng = new_engine(case, engine, *extra)
    checkpoint.import_hf(eng, checkpoint.open_hf(spec, path), log=lambda s: None)
    return spec, eng


def tensor_names(path: Path) -> set:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    return set(load_file(str(path / "model.safetensors")))


IMPORTS = [("qwen3_moe", torch.float32, None, "reference"), ("qwen3_moe", torch.bfloat16, "20KB", "stream"),
           ("gpt_oss", torch.float32, "20KB", "stream"), ("gpt_oss", torch.bfloat16, None, "reference")]


@pytest.mark.parametrize("case, dtype, shard, engine", IMPORTS,
                         ids=[f"{c}-{str(d)[6:]}-{'sharded' if s else 'single'}-{e}" for c, d, s, e in IMPORTS])
def test_import_of_save_pretrained_gives_transformers_weights(case, dtype, shard, engine, tmp_path):
    model = random_hf_model(case)
    path = save_hf(model, tmp_path / "hf", dtype, shard)
    on_disk = tensor_names(path)
    if case == "qwen3_moe":  # the hub layout: one matrix per expert
        assert "model.layers.1.mlp.experts.5.up_proj.weight" in on_disk
        assert "model.layers.1.mlp.experts.gate_up_proj" not in on_disk
    else:
        assert "model.layers.1.mlp.experts.gate_up_proj" in on_disk
    spec, eng = imported(case, path, engine)
    try:
        sd = model.state_dict()
        weights = eng.master_weights()
        assert weights.keys() == {k for k in sd if not k.endswith("inv_freq")}
        for name, w in weights.items():
            assert w.dtype == torch.float32 and torch.equal(w, sd[name]), name
    finally:
        eng.close()


def test_import_of_fused_qwen3_moe_names(tmp_path):
    """A Qwen3-MoE checkpoint holding transformers v5's fused expert tensors is accepted as it is."""
    model = random_hf_model("qwen3_moe")
    path = tmp_path / "fused"
    path.mkdir()
    save_hf(model, tmp_path / "hf", torch.float32, None)
    shutil.copy(tmp_path / "hf" / "config.json", path / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    spec, eng = imported("qwen3_moe", path)
    try:
        sd = model.state_dict()
        assert all(torch.equal(w, sd[name]) for name, w in eng.master_weights().items())
    finally:
        eng.close()


def encode_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., G, 32] 4-bit codes -> [..., G, 16] bytes, low nibble first."""
    return (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)


def write_mxfp4_checkpoint(model, path: Path) -> dict:
    """The model's checkpoint with its expert matrices replaced by random MXFP4 ones, laid out as gpt-oss ships them
    (blocks [E, out, in/32, 16], scales [E, out, in/32], quantization_config mxfp4). Returns our name -> the values
    encoded, in our [E, in, out] layout."""
    save_hf(model, path, torch.bfloat16, None)
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    expected = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape
        codes = torch.randint(0, 16, (experts, rows, cols // 32, 32), generator=gen)
        scales = torch.randint(119, 128, (experts, rows, cols // 32), generator=gen)
        tensors[name + "_blocks"] = encode_mxfp4(codes)
        tensors[name + "_scales"] = scales.to(torch.uint8)
        values = torch.tensor(LUT)[codes] * torch.exp2(scales.double() - 127).unsqueeze(-1)
        expected[name] = values.reshape(experts, rows, cols).transpose(1, 2).float()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return expected


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    model = random_hf_model("gpt_oss")
    path = tmp_path_factory.mktemp("mxfp4") / "hf"
    return model, path, write_mxfp4_checkpoint(model, path)


def test_mxfp4_import_gives_the_encoded_values(gpt_oss_mxfp4, tmp_path):
    """Through the Trainer (model.init=hf:<dir>), as a run imports it."""
    model, path, expected = gpt_oss_mxfp4
    tr = Trainer(make_cfg([*CASES["gpt_oss"], "engine=stream", "data=synthetic", "train.val_every=0",
                           f"model.init=hf:{path}"]), tmp_path / "run")
    try:
        weights = tr.engine.master_weights()
        sd = model.state_dict()
        for name, w in weights.items():
            assert torch.equal(w, expected[name] if name in expected else sd[name]), name
    finally:
        tr.engine.close()
        tr.log.close()
    assert "experts MXFP4 decoded to bf16" in (tmp_path / "run" / "train.log").read_text()
    # transformers, dequantizing the same files, holds the same values
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16).state_dict()
    for name, values in expected.items():
        assert torch.equal(theirs[name].float(), values), name


def test_mxfp4_import_into_a_depth_truncated_run(gpt_oss_mxfp4):
    """One layer of the two-layer checkpoint (layer_types still lists both)."""
    _, path, expected = gpt_oss_mxfp4
    full = ModelSpec(model_cfg("gpt_oss")).num_params()
    spec, eng = imported("gpt_oss", path, "reference", "model.num_hidden_layers=1", f"model.expected_params={full}")
    try:
        weights = eng.master_weights()
        assert not any(k.startswith("model.layers.1.") for k in weights)
        name = "model.layers.0.mlp.experts.down_proj"
        assert torch.equal(weights[name], expected[name])
    finally:
        eng.close()


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_export_round_trips_and_loads_in_transformers(case, gpt_oss_mxfp4, tmp_path):
    """Qwen3-MoE from save_pretrained files, gpt-oss from MXFP4 ones: export fp32 (sharded), re-import bit-exactly;
    transformers loads the export with the same state dict."""
    src = gpt_oss_mxfp4[1] if case == "gpt_oss" else save_hf(random_hf_model(case), tmp_path / "src",
                                                              torch.float32, None)
    spec, eng = imported(case, src)
    out = tmp_path / "export"
    try:
        weights = eng.master_weights()
        checkpoint.export_hf(checkpoint.EngineSource(eng), out, torch.float32, 30_000, log=lambda s: None)
    finally:
        eng.close()
    names = tensor_names(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    if case == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and len(names) == 2 * (9 + 3 * 6) + 3
    else:
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith("_blocks") for n in names)
    _, again = imported(case, out, "stream")
    try:
        back = again.master_weights()
        assert all(torch.equal(back[name], w) for name, w in weights.items())
    finally:
        again.close()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert {k for k in theirs if not k.endswith("inv_freq")} == weights.keys()
    for name, w in weights.items():
        assert torch.equal(theirs[name], w), name


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "gptoss20b", "gptoss120b"])
def test_moe_model_configs_round_trip_through_transformers_config(name, tmp_path):
    """Our config.json is read by transformers as the same architecture, and what it writes back is accepted."""
    m = make_cfg([f"model={name}"]).model
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(checkpoint.hf_config_dict(m, torch.bfloat16)))
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path / "ours"))
    assert (hf.model_type, hf.num_local_experts, hf.num_experts_per_tok, hf.hidden_size, hf.num_hidden_layers) == \
        (m.model_type, m.num_experts, m.num_experts_per_tok, m.hidden_size, m.num_hidden_layers)
    if m.layer_types is not None:
        assert hf.layer_types == list(m.layer_types)
    hf.save_pretrained(str(tmp_path / "theirs"))
    written = json.loads((tmp_path / "theirs" / "config.json").read_text())
    checkpoint.check_hf_config(written, m, tmp_path / "theirs" / "config.json")


PUBLISHED_GPT_OSS_20B = {  # openai/gpt-oss-20b config.json
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}
PUBLISHED_QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_published_configs_are_accepted_and_mismatches_named(tmp_path):
    path = tmp_path / "config.json"
    gpt_oss = make_cfg(["model=gptoss20b"]).model
    checkpoint.check_hf_config(PUBLISHED_GPT_OSS_20B, gpt_oss, path)
    checkpoint.check_hf_config(PUBLISHED_QWEN3_30B_A3B, make_cfg(["model=qwen3_30b_a3b"]).model, path)
    # a depth-truncated run of the 20b: layer_types of the full depth is fine
    checkpoint.check_hf_config({**PUBLISHED_GPT_OSS_20B, "num_hidden_layers": 24},
                               make_cfg(["model=gptoss20b", "model.num_hidden_layers=3"]).model, path, 24)
    cases = [
        ({"num_local_experts": 16}, r"num_local_experts is 16 in config.json but model.num_experts=32"),
        ({"sliding_window": 256}, r"sliding_window is 256 in config.json but model.sliding_window=128"),
        ({"swiglu_limit": 5.0}, r"swiglu_limit is 5.0 in config.json but model.swiglu_limit=7.0"),
        ({"layer_types": ["full_attention"] * 24}, r"layer_types is \['full_attention', .*model.layer_types"),
        ({"rope_scaling": {**PUBLISHED_GPT_OSS_20B["rope_scaling"], "truncate": True}},
         r"rope_scaling is \{.*'truncate': True.*model.rope_scaling=\{.*'truncate': False"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config.quant_method is 'fp8'"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message):
            checkpoint.check_hf_config({**PUBLISHED_GPT_OSS_20B, **change}, gpt_oss, path)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return save_hf(random_hf_model("qwen3_moe"), tmp_path_factory.mktemp("q") / "hf", torch.bfloat16, "20KB")


def _copy_with(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


def test_unsupported_qwen3_moe_layouts_are_refused(qwen3_moe_dir, tmp_path):
    spec = ModelSpec(model_cfg("qwen3_moe"))
    with pytest.raises(ConfigError, match=r"decoder_sparse_step is 2 in config.json but .*not supported"):
        checkpoint.open_hf(spec, _copy_with(qwen3_moe_dir, tmp_path / "a", decoder_sparse_step=2))
    with pytest.raises(ConfigError, match=r"mlp_only_layers is \[1\] in config.json but .*not supported"):
        checkpoint.open_hf(spec, _copy_with(qwen3_moe_dir, tmp_path / "b", mlp_only_layers=[1]))
    with pytest.raises(ConfigError, match=r"quantization_config.quant_method is 'mxfp4' .*unquantized weights only"):
        checkpoint.open_hf(spec, _copy_with(qwen3_moe_dir, tmp_path / "c", quantization_config={
            "quant_method": "mxfp4"}))


def test_a_missing_expert_tensor_is_named(qwen3_moe_dir, tmp_path):
    bad = _copy_with(qwen3_moe_dir, tmp_path / "bad")
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].pop("model.layers.1.mlp.experts.3.up_proj.weight")
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.mlp.experts.3.up_proj.weight is missing; "
                                              r"model=\S+ needs it"):
        checkpoint.open_hf(ModelSpec(model_cfg("qwen3_moe")), bad)


def test_a_nan_mxfp4_scale_is_refused_naming_the_tensor(gpt_oss_mxfp4, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(gpt_oss_mxfp4[1], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 0] = 255
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    spec, eng = new_engine("gpt_oss")
    try:
        ckpt = checkpoint.open_hf(spec, bad)  # headers are fine; the value is found when decoding
        with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.down_proj_scales: MXFP4 scale 255 "
                                                  r"\(NaN in the format\) at block \[2, 5, 0\]"):
            checkpoint.import_hf(eng, ckpt, log=lambda s: None)
    finally:
        eng.close()
