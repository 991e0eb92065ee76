"""HF checkpoints in and out, against transformers (a test-only dependency; engine/checkpoint/ never imports it).

Import: tiny random Qwen2 (q/k/v bias), Qwen3 (head_dim != hidden / heads) and Llama (llama3 rope scaling) models are
saved by transformers' `save_pretrained` (safetensors; fp32 and bf16; one file, and sharded with a small
max_shard_size so that one layer's tensors span several shards), loaded with `model.init=hf:<dir>` into both
engines through the Trainer: every master weight must equal HF's tensor (upcast exactly from bf16), and our
templates on the imported weights must give HF's logits. Export: our files must load in
`AutoModelForCausalLM.from_pretrained` with the same weights and logits. On CPU in fp32 both implementations run
the same ops, so the logits agree to ~1e-6 or exactly; the tolerance is the one test_model_vs_hf uses.
Refusals: a config.json field that differs, a truncated shard, a corrupt header, a missing or unexpected tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import checkpoint  # noqa: E402
from engine.checkpoint import CheckpointError  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from engine.model import ModelSpec  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from tests.test_model_vs_hf import _randomize, hf_config, our_logits  # noqa: E402
from tests.util import SMALL, make_cfg, user_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE = [*SMALL, "data=synthetic", "train.seq_len=16", "train.micro_batch_size=2", "train.val_batches=1",
        "train.val_every=0", "model.max_position_embeddings=64"]
FAMILIES = {
    "qwen2": [],
    "qwen3": ["model.model_type=qwen3", "model.qkv_bias=false", "model.qk_norm=true", "model.head_dim=16"],
    "llama": ["model.model_type=llama", "model.qkv_bias=false", "model.rms_norm_eps=1e-5", "model.rope_theta=500000.0",
              "model.rope_scaling={rope_type:llama3,factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,"
              "original_max_position_embeddings:8}"],
    "qwen2_tied": ["model.tie_word_embeddings=true"],
}


def hf_model(family: str):
    m = make_cfg([*BASE, *FAMILIES[family]]).model
    config, cls = hf_config(m, "eager")
    torch.manual_seed(0)
    model = cls(config).float().eval()
    _randomize(model, torch.Generator().manual_seed(11))
    return model


def save_hf(model, path: Path, dtype: torch.dtype, shard: str | None) -> Path:
    kw = {"max_shard_size": shard} if shard else {}
    model.to(dtype).save_pretrained(str(path), safe_serialization=True, **kw)
    model.float()
    return path


def fp32_reference(path: Path):
    """transformers' own model from the saved files, in fp32 (its rope buffers fresh, not round-tripped via bf16)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def unit_params(spec: ModelSpec, weights: dict) -> list:
    return [{s.name: weights[u.layout.prefix + s.name] for s in u.layout.specs} for u in spec.units]


def ids_for(m, seq_len=16):
    return torch.randint(0, m.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(3))


def assert_logits_match(spec, weights, hf, atol=1e-5):
    ids = ids_for(spec.cfg)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
        ours = our_logits(spec, unit_params(spec, weights), ids)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(ours, ref, atol=atol, rtol=1e-5)


CASES = [  # family, file dtype, max_shard_size (None: one model.safetensors), engine
    ("qwen2", torch.float32, None, "reference"),
    ("qwen2", torch.bfloat16, "40KB", "stream"),
    ("qwen3", torch.float32, "60KB", "stream"),
    ("qwen3", torch.bfloat16, None, "reference"),
    ("llama", torch.bfloat16, "40KB", "reference"),
    ("llama", torch.float32, None, "stream"),
    ("qwen2_tied", torch.bfloat16, "40KB", "stream"),
]


@pytest.mark.parametrize("family, dtype, shard, engine", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-{'sharded' if c[2] else 'single'}-{c[3]}" for c in CASES])
def test_import_gives_hf_weights_and_logits(family, dtype, shard, engine, tmp_path):
    model = hf_model(family)
    path = save_hf(model, tmp_path / "hf", dtype, shard)
    if shard:  # one layer's tensors really are spread over several files
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len({f for k, f in weight_map.items() if k.startswith("model.layers.1.")}) >= 2
    else:
        assert (path / "model.safetensors").exists()
    cfg = make_cfg([*BASE, *FAMILIES[family], f"engine={engine}", f"model.init=hf:{path}"])
    tr = Trainer(cfg, tmp_path / "run")
    try:
        weights = tr.engine.master_weights()
        ref = fp32_reference(path)
        sd = ref.state_dict()
        if tr.spec.tied:
            assert "lm_head.weight" not in weights
        for name, w in weights.items():
            assert w.dtype == torch.float32
            assert torch.equal(w, sd[name]), name  # exactly HF's values (bf16 upcasts exactly)
        assert_logits_match(tr.spec, weights, ref)
        moments = tr.engine.adam_moments()
        assert all(not m.any() and not v.any() for m, v in moments.values())  # fresh optimizer state
    finally:
        tr.engine.close()


def test_a_depth_truncated_run_imports_the_first_layers_of_the_full_checkpoint(tmp_path):
    """SMALL has 3 layers; a 2-layer run of the same width (expected_params = the 3-layer count) takes layers 0 and 1
    of the 3-layer checkpoint and ignores layer 2; a run that is not depth-truncated still refuses the mismatch."""
    model = hf_model("qwen2")
    path = save_hf(model, tmp_path / "hf", torch.float32, "40KB")
    full = ModelSpec(make_cfg([*BASE]).model).num_params()
    cfg = make_cfg([*BASE, "engine=stream", "model.num_hidden_layers=2", f"model.expected_params={full}",
                    f"model.init=hf:{path}"])
    tr = Trainer(cfg, tmp_path / "run")
    try:
        weights = tr.engine.master_weights()
        sd = fp32_reference(path).state_dict()
        assert not any(name.startswith("model.layers.2.") for name in weights)
        for name, w in weights.items():
            assert torch.equal(w, sd[name]), name
    finally:
        tr.engine.close()
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        checkpoint.open_hf(_spec("model.num_hidden_layers=2"), path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen2_tied"])
def test_export_loads_in_transformers_with_same_logits(family, tmp_path):
    """Start from an HF checkpoint (O(1) random weights, so logits are far from zero), train a few steps, export
    fp32 at the end of training (train.export_hf), load with from_pretrained: same tensors, same logits."""
    src = save_hf(hf_model(family), tmp_path / "src", torch.float32, None)
    (src / "tokenizer.json").write_text('{"dummy": true}')
    cfg = make_cfg([*BASE, *FAMILIES[family], "engine=stream", "train.steps=3", "train.checkpoint_every=3",
                    "train.export_hf=true", "train.export_dtype=fp32", "train.lr=1e-2", f"model.init=hf:{src}"])
    tr = Trainer(cfg, tmp_path)
    tr.run()
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").read_text() == '{"dummy": true}'  # tokenizer files travel along
    index = json.loads((out / "model.safetensors.index.json").read_text())
    masters = _checkpoint_masters(tmp_path / "checkpoints" / "step_3")
    weights = {k.removeprefix("master."): v for k, v in masters.items()}
    assert index["metadata"]["total_size"] == 4 * sum(w.numel() for w in weights.values())
    assert set(index["weight_map"]) == set(weights)
    hf = fp32_reference(out)
    sd = hf.state_dict()
    start = fp32_reference(src).state_dict()
    assert all(not torch.equal(start[k], w) for k, w in weights.items() if w.ndim == 2), "training moved them"
    for name, w in weights.items():
        assert torch.equal(sd[name], w), name
    if tr.spec.tied:
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert_logits_match(tr.spec, weights, hf)
    # the config round-trips: importing our export into the same model config is accepted
    checkpoint.open_hf(tr.spec, out)


def _checkpoint_masters(step_dir: Path) -> dict:
    out = {}
    for f in sorted(step_dir.glob("unit_*.safetensors")):
        with checkpoint.SafetensorsFile(f) as st:
            out.update({k: st.get(k) for k in st.keys() if k.startswith("master.")})
    return out


def test_export_cli_bf16_sharded(tmp_path):
    run = tmp_path / "run"
    src = save_hf(hf_model("llama"), tmp_path / "src", torch.bfloat16, None)
    Trainer(make_cfg([*BASE, *FAMILIES["llama"], "engine=reference", "train.steps=2", f"model.init=hf:{src}",
                      "train.checkpoint_every=2", "model.bos_token_id=1", "model.eos_token_id=2"]), run).run()
    out = tmp_path / "export"
    res = subprocess.run([sys.executable, "-m", "engine.checkpoint", "export", str(run), str(out), "--dtype", "bf16",
                          "--shard-gib", str(60e3 / 2**30)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    masters = {k.removeprefix("master."): v for k, v in _checkpoint_masters(run / "checkpoints" / "step_2").items()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert hf.dtype == torch.bfloat16
    for name, w in hf.state_dict().items():
        assert torch.equal(w, masters[name].to(torch.bfloat16)), name
    rounded = {k: v.to(torch.bfloat16).float() for k, v in masters.items()}
    spec = ModelSpec(make_cfg([*BASE, *FAMILIES["llama"]]).model)
    assert_logits_match(spec, rounded, fp32_reference(out))


PUBLISHED = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_model_config_round_trips_through_transformers_config(name, tmp_path):
    """For every conf/model file: our config.json (old spellings) is read by transformers as the same architecture,
    and what transformers writes back (v5 spellings: dtype, rope_parameters) is accepted by our check."""
    m = make_cfg([f"model={name}"]).model
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(checkpoint.hf_config_dict(m, torch.bfloat16)))
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path / "ours"))
    assert hf.model_type == m.model_type
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.vocab_size) == \
        (m.hidden_size, m.num_hidden_layers, m.num_key_value_heads, m.vocab_size)
    hf.save_pretrained(str(tmp_path / "theirs"))
    written = json.loads((tmp_path / "theirs" / "config.json").read_text())
    checkpoint.check_hf_config(written, m, tmp_path / "theirs" / "config.json")
    if m.rope_scaling is not None:
        assert written.get("rope_parameters", written.get("rope_scaling"))["rope_type"] == m.rope_scaling.rope_type


# ------------------------------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return save_hf(hf_model("qwen2"), tmp_path_factory.mktemp("hf") / "qwen2", torch.bfloat16, "40KB")


def _spec(*overrides):
    return ModelSpec(make_cfg([*BASE, *overrides]).model)


def test_config_mismatch_names_the_field(qwen2_dir):
    with pytest.raises(ConfigError, match=r"hidden_size is 72 in config.json but model.hidden_size=60"):
        checkpoint.open_hf(_spec("model.hidden_size=60"), qwen2_dir)
    with pytest.raises(ConfigError, match=r"rope_theta is 10000.0 in config.json but model.rope_theta=1000000.0"):
        checkpoint.open_hf(_spec("model.rope_theta=1000000.0"), qwen2_dir)
    with pytest.raises(ConfigError, match=r"model_type is 'qwen2' in config.json but model.model_type='llama'"):
        checkpoint.open_hf(_spec(*FAMILIES["llama"]), qwen2_dir)
    with pytest.raises(ConfigError, match=r"tie_word_embeddings is False"):
        checkpoint.open_hf(_spec("model.tie_word_embeddings=true"), qwen2_dir)


def test_config_mismatch_through_the_cli(qwen2_dir, tmp_path):
    out = subprocess.run([sys.executable, "train.py", "logger=none", "hardware=cpu", *BASE, "model.vocab_size=300",
                          f"model.init=hf:{qwen2_dir}", f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=user_env())
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "vocab_size is 256 in config.json but model.vocab_size=300" in out.stderr


def test_old_config_spellings_are_read(qwen2_dir, tmp_path):
    """Hub originals: torch_dtype, top-level rope_theta / rope_scaling instead of v5's dtype / rope_parameters."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(qwen2_dir, old)
    cfg = json.loads((old / "config.json").read_text())
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", "bfloat16")
    (old / "config.json").write_text(json.dumps(cfg))
    ck = checkpoint.open_hf(_spec(), old)
    assert ck.dtype == "bfloat16"
    cfg["rope_theta"] = 1e6
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_theta"):
        checkpoint.open_hf(_spec(), old)


def test_truncated_shard_is_refused_naming_the_file(qwen2_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(qwen2_dir, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=f"{shard}: truncated"):
        checkpoint.open_hf(_spec(), bad)


def test_corrupt_header_is_refused_naming_the_file(qwen2_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(qwen2_dir, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[12] = ord("}")  # inside the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard}: corrupt safetensors header"):
        checkpoint.open_hf(_spec(), bad)


def test_missing_and_unexpected_tensors_are_named(qwen2_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(qwen2_dir, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].pop("model.layers.2.mlp.up_proj.weight")
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.2.mlp.up_proj.weight is missing"):
        checkpoint.open_hf(_spec(), bad)
    shutil.rmtree(bad)
    shutil.copytree(qwen2_dir, bad)
    save_file({"model.layers.0.self_attn.o_proj.bias": torch.zeros(72)}, str(bad / "extra.safetensors"),
              metadata={"format": "pt"})
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.self_attn.o_proj.bias"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"extra.safetensors: unexpected tensor model.layers.0.self_attn.o_proj"):
        checkpoint.open_hf(_spec(), bad)


def test_init_dir_without_config_is_refused_by_validate(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        make_cfg([*BASE, f"model.init=hf:{tmp_path}"])


@pytest.mark.parametrize("engine", ["reference", "stream"])
def test_import_into_a_low_precision_format_rounds_to_nearest(engine, tmp_path):
    """HF fp32 weights into a bf16 master: each weight is the nearest bf16 of HF's value, and the optimizer state
    starts fresh (step 0, zero moments and scales)."""
    path = save_hf(hf_model("qwen2"), tmp_path / "hf", torch.float32, None)
    over = ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.moments_block_size=64"]
    over += ["engine.gpu_resident_units=5"] if engine == "stream" else []
    tr = Trainer(make_cfg([*BASE, f"engine={engine}", f"model.init=hf:{path}", *over]), tmp_path / "run")
    try:
        sd = fp32_reference(path).state_dict()
        weights = tr.engine.master_weights()
        assert weights.keys() <= sd.keys()
        for name, w in weights.items():
            assert torch.equal(w, sd[name].bfloat16().float()), name
        opt = tr.engine.opt if engine == "reference" else tr.engine.format_opt
        assert opt.steps == [0] * len(tr.spec.units)
        assert not any(t.any() for t in opt.m + opt.v) and not any(s.any() for s in opt.m_scales + opt.v_scales)
    finally:
        tr.engine.close()


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(bad_value, tmp_path):
    """A NaN or Inf in an imported tensor is found as the tensor is read, not later as skipped steps."""
    model = hf_model("qwen2")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = bad_value
    path = save_hf(model, tmp_path / "bad", torch.float32, None)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.1.mlp.down_proj.weight has 1 "
                                              r"non-finite value"):
        Trainer(make_cfg([*BASE, f"model.init=hf:{path}"]), tmp_path / "run")


def test_a_hub_id_resolves_through_the_local_cache_and_offline_misses_say_so(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from engine.checkpoint import hf

    snapshot = tmp_path / "models--acme--tiny-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--acme--tiny-model" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-model" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hf._hub_snapshot.cache_clear()
    assert checkpoint.hf_dir_of("hf:acme/tiny-model") == snapshot
    with pytest.raises(CheckpointError, match=r"hf:acme/other: not in the local Hugging Face cache .*HF_HUB_OFFLINE"):
        checkpoint.hf_dir_of("hf:acme/other")
    hf._hub_snapshot.cache_clear()
    # a local directory of that shape is a directory, not a hub id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "other").mkdir(parents=True)
    assert checkpoint.hf_dir_of("hf:acme/other") == Path("acme/other")
