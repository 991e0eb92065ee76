"""HF checkpoints: config.json against our model config, weight import into an engine, export of master weights.

Import is two-phase so that nothing is built on a checkpoint that cannot be used: `open_hf` reads config.json and
every shard's header (no weights) and raises on the first problem; `import_hf` then copies the weights unit by
unit, one tensor at a time, in the file's dtype (the engine casts into its fp32 master while copying). Export
writes shards tensor by tensor under `<out dir>.tmp/` and moves them into place at the end, index and config last.
Peak extra host memory of either is one tensor. The config helpers here (`plain`, `norm_rope_scaling`,
`head_dim_of`, `same_value`) also define what the run fingerprint of a training checkpoint compares.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from engine.checkpoint.common import CheckpointError, read_json
from engine.checkpoint.safetensors_io import (FLOAT_CODES, LazyTensors, Readers, SafetensorsFile, TensorInfo,
                                              itemsize, write_safetensors)
from engine.config import LLAMA3_KEYS, ConfigError
from engine.fileio import fsync_dir, json_bytes, write_durable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
DEFAULT_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# ================================================================================================================
# config.json <-> model config


def plain(x):
    """An OmegaConf node (or anything mapping/sequence-like) as plain dicts, lists and scalars."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "items"):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or hasattr(x, "__iter__"):
        return [plain(v) for v in x]
    return x


def norm_rope_scaling(s) -> Optional[dict]:
    """One spelling of RoPE scaling for comparisons: None for default RoPE, `rope_type` (not `type`), llama3's
    fields as floats (its original_max_position_embeddings as an int)."""
    s = plain(s)
    if not s:
        return None
    s = {k: v for k, v in s.items() if v is not None}
    if "type" in s and "rope_type" not in s:
        s["rope_type"] = s.pop("type")
    s.pop("type", None)
    s.pop("rope_theta", None)
    kind = s.get("rope_type", "default")
    if kind == "default":
        return None
    if kind == "llama3":
        out = {"rope_type": "llama3", **{k: float(s[k]) if k in s else None for k in LLAMA3_KEYS}}
        if out["original_max_position_embeddings"] is not None:
            out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
        return out
    return s


def _hf_rope(hf: dict) -> Tuple[float, Optional[dict]]:
    """(rope_theta, normalised scaling) from either spelling: v5 `rope_parameters` or top-level keys."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        return float(theta), norm_rope_scaling(rp)
    return float(hf.get("rope_theta", 10000.0)), norm_rope_scaling(hf.get("rope_scaling"))


def head_dim_of(m) -> int:
    return m.head_dim or m.hidden_size // m.num_attention_heads


def same_value(a, b) -> bool:
    """Equality for config values: numbers to 1e-9 relative (1e6 == 1000000.0), bools only equal bools,
    containers element by element."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def hf_config_differences(hf: dict, m) -> List[Tuple[str, Any, str, Any]]:
    """(HF field, value in config.json, our key, our value) for every architecture field that differs."""
    out = []

    def cmp(field_name: str, theirs, ours_key: str, ours) -> None:
        if not same_value(theirs, ours):
            out.append((field_name, theirs, ours_key, ours))

    cmp("model_type", hf.get("model_type"), "model.model_type", m.model_type)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        cmp(key, hf.get(key), f"model.{key}", m[key])
    cmp("num_key_value_heads", hf.get("num_key_value_heads", hf.get("num_attention_heads")),
        "model.num_key_value_heads", m.num_key_value_heads)
    heads = hf.get("num_attention_heads") or 1
    hf_hd = hf.get("head_dim") or (hf.get("hidden_size") or 0) // heads
    cmp("head_dim", hf_hd, "model.head_dim (hidden_size // num_attention_heads when null)", head_dim_of(m))
    cmp("vocab_size", hf.get("vocab_size"), "model.vocab_size", m.vocab_size)
    cmp("rms_norm_eps", hf.get("rms_norm_eps"), "model.rms_norm_eps", m.rms_norm_eps)
    theta, scaling = _hf_rope(hf)
    cmp("rope_theta", theta, "model.rope_theta", m.rope_theta)
    cmp("rope_scaling", scaling, "model.rope_scaling", norm_rope_scaling(m.rope_scaling))
    cmp("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False)), "model.tie_word_embeddings",
        bool(m.tie_word_embeddings))
    cmp("hidden_act", hf.get("hidden_act", "silu"), "model.hidden_act", m.hidden_act)
    if m.model_type in ("qwen3", "llama"):  # HF's attention_bias also puts a bias on o_proj; ours never has one
        cmp("attention_bias", bool(hf.get("attention_bias", False)), "(no attention biases in model_type="
            f"{m.model_type})", False)
    if m.model_type == "llama":
        cmp("mlp_bias", bool(hf.get("mlp_bias", False)), "(no MLP biases)", False)
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        cmp("use_sliding_window", True, "(sliding-window attention is not supported)", False)
    if hf.get("architectures"):
        cmp("architectures", list(hf["architectures"]), f"(model_type={m.model_type} means)",
            [DEFAULT_ARCHITECTURES.get(m.model_type)])
    return out


def check_hf_config(hf: dict, m, path: Path, full_depth_layers: Optional[int] = None) -> None:
    """ConfigError naming the first differing architecture field with both values, and the others after it.
    `full_depth_layers`: the run is a depth-truncated copy of a model with that many layers (ModelSpec.
    check_expected_params), and a checkpoint of the full depth is accepted."""
    diffs = [d for d in hf_config_differences(hf, m)
             if not (d[0] == "num_hidden_layers" and full_depth_layers is not None and d[1] == full_depth_layers)]
    if not diffs:
        return
    field_name, theirs, ours_key, ours = diffs[0]
    msg = (f"{path}: does not match model={m.name}: {field_name} is {theirs!r} in config.json but "
           f"{ours_key}={ours!r}")
    if len(diffs) > 1:
        msg += "; also differ: " + ", ".join(f"{d[0]} ({d[1]!r} vs {d[3]!r})" for d in diffs[1:])
    raise ConfigError(msg + ". Choose the matching conf/model file or override the field")


def hf_config_dict(m, dtype: torch.dtype) -> dict:
    """config.json for our model config, in the format transformers writes (old-style rope keys, which every
    transformers version reads)."""
    dtype_name = str(dtype).replace("torch.", "")
    cfg = {
        "architectures": [DEFAULT_ARCHITECTURES[m.model_type]],  # the one class that runs these weights
        "model_type": m.model_type,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": head_dim_of(m),
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": float(m.rope_theta),
        "rope_scaling": norm_rope_scaling(m.rope_scaling),
        "tie_word_embeddings": bool(m.tie_word_embeddings),
        "hidden_act": m.hidden_act,
        "attention_dropout": 0.0,
        "initializer_range": m.init_std,
        "bos_token_id": m.bos_token_id,
        "eos_token_id": m.eos_token_id,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if m.model_type in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_hidden_layers)
    if m.model_type in ("qwen3", "llama"):
        cfg["attention_bias"] = False
    if m.model_type == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1)
    return cfg


# ================================================================================================================
# import


@dataclass
class HFCheckpoint:
    """A validated HF checkpoint directory: config matches, every tensor located and its header checked."""
    dir: Path
    config: dict
    dtype: Optional[str]  # torch_dtype / dtype from config.json
    # our hf name -> (file, its header entry)
    tensors: Dict[str, Tuple[Path, TensorInfo]] = field(default_factory=dict)
    files: List[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors.values())


def hf_dir_of(init: str) -> Optional[Path]:
    return Path(init[3:]).expanduser() if init.startswith("hf:") else None


def _layer_beyond(name: str, num_layers: int) -> bool:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= num_layers


def open_hf(spec, hf_dir: str | Path) -> HFCheckpoint:
    """Check config.json against spec.cfg and every tensor header; read no weights. Raises ConfigError for a
    config mismatch and CheckpointError (naming the file and tensor) for missing/unexpected/mis-shaped tensors."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    hf = read_json(config_path, "an HF checkpoint directory needs config.json")
    full_depth = spec.check_expected_params()
    check_hf_config(hf, spec.cfg, config_path, full_depth)
    index_path = hf_dir / INDEX
    if index_path.exists():
        weight_map = read_json(index_path, "").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: corrupt: no weight_map")
        weight_map = {str(k): hf_dir / str(v) for k, v in weight_map.items()}
        source = index_path
    elif (hf_dir / SINGLE_FILE).exists():
        weight_map = None
        source = hf_dir / SINGLE_FILE
    else:
        raise CheckpointError(f"{hf_dir}: no {INDEX} or {SINGLE_FILE} (only safetensors checkpoints are supported)")
    headers: Dict[Path, Dict[str, TensorInfo]] = {}
    files = sorted(set(weight_map.values())) if weight_map is not None else [source]
    for path in files:
        if not path.exists():
            raise CheckpointError(f"{path}: missing (named by {index_path})")
        with SafetensorsFile(path) as st:
            headers[path] = st.entries
    if weight_map is None:
        weight_map = {name: source for name in headers[source]}
    expected = {unit.layout.prefix + s.name: s for unit in spec.units for s in unit.layout.specs}
    ckpt = HFCheckpoint(hf_dir, hf, hf.get("torch_dtype") or hf.get("dtype"), files=files)
    for name, path in weight_map.items():
        info = headers[path].get(name)
        if info is None:
            raise CheckpointError(f"{path}: tensor {name} is missing although {index_path.name} maps it there")
        if name not in expected:
            if name.endswith(IGNORED_HF_SUFFIXES) or (name == "lm_head.weight" and spec.tied) \
                    or (full_depth is not None and _layer_beyond(name, spec.num_layers)):  # the first layers only
                continue
            raise CheckpointError(f"{path}: unexpected tensor {name} (shape {list(info.shape)}) for model="
                                  f"{spec.cfg.name} ({spec.cfg.model_type}); the checkpoint has parameters this "
                                  "architecture does not")
        want = expected[name].shape
        if tuple(info.shape) != tuple(want):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(info.shape)}, model={spec.cfg.name} "
                                  f"expects {list(want)}")
        if info.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info.dtype}; only F32/F16/BF16/F64 weights "
                                  "can be imported (quantized checkpoints are not supported)")
        ckpt.tensors[name] = (path, info)
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]} is missing" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                              f"; model={spec.cfg.name} needs it")
    return ckpt


def import_hf(engine, ckpt: HFCheckpoint, log: Callable[[str], None] = print) -> dict:
    """Copy the weights of a validated HF checkpoint into the engine, unit by unit, one tensor at a time."""
    t0 = time.perf_counter()
    readers = Readers()
    try:
        for unit in engine.spec.units:
            prefix = unit.layout.prefix

            def fetch(name: str, prefix=prefix) -> torch.Tensor:
                path, _ = ckpt.tensors[prefix + name]
                return readers(path).get(prefix + name)

            engine.load_unit_state(unit.index, LazyTensors(unit.layout.names, fetch))
    finally:
        readers.close()
    seconds = time.perf_counter() - t0
    stats = {"bytes": ckpt.total_bytes, "seconds": seconds, "files": len(ckpt.files)}
    log(f"imported {ckpt.dir} ({len(ckpt.tensors)} tensors, {ckpt.total_bytes / 1e9:.2f} GB"
        f"{' ' + ckpt.dtype if ckpt.dtype else ''}) in {seconds:.1f}s")
    return stats


# ================================================================================================================
# export


class EngineSource:
    """Master weights of a live engine, as an export source (`spec`, `init`, `unit_master(i)`, `close()`)."""

    def __init__(self, engine, init: str = "random"):
        self.spec, self.engine, self.init = engine.spec, engine, init

    def unit_master(self, index: int) -> Mapping:
        return self.engine.unit_state(index)["master"]

    def close(self) -> None:
        pass


# one tensor of the export: (hf name, unit index, name inside the unit, shape)
ExportItem = Tuple[str, int, str, Tuple[int, ...]]


def _plan_shards(spec, itemsize_bytes: int, shard_bytes: int) -> List[List[ExportItem]]:
    """Tensors in unit order, cut into shards of at most `shard_bytes` (a larger tensor gets a shard alone)."""
    shards: List[List[ExportItem]] = [[]]
    size = 0
    for unit in spec.units:
        for s in unit.layout.specs:
            n = math.prod(s.shape) * itemsize_bytes
            if shards[-1] and size + n > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((unit.layout.prefix + s.name, unit.index, s.name, s.shape))
            size += n
    return shards


def export_hf(source, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 5 << 30,
              log: Callable[[str], None] = print) -> dict:
    """Write the source's master weights as an HF checkpoint directory that from_pretrained loads."""
    t0 = time.perf_counter()
    spec, out_dir = source.spec, Path(out_dir).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: exists and is not a directory; the export needs a directory there")
    item_bytes = itemsize(dtype)
    shards = _plan_shards(spec, item_bytes, shard_bytes)
    k = len(shards)
    names = [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    cache: Dict[int, Mapping] = {}  # the unit being written: its master tensors, produced lazily

    def producer(unit_index: int, name: str):
        def make():
            if unit_index not in cache:
                cache.clear()
                cache[unit_index] = source.unit_master(unit_index)
            t = cache[unit_index][name]
            return t.to(dtype) if t.dtype != dtype else t
        return make

    try:
        for fname, shard in zip(names, shards):
            items = [(hf, dtype, shape, producer(u, n)) for hf, u, n, shape in shard]
            write_safetensors(tmp / fname, items, {"format": "pt"})
            for hf, _, _, shape in shard:
                weight_map[hf] = fname
                total += math.prod(shape) * item_bytes
        cache.clear()
        m = spec.cfg
        write_durable(tmp / "config.json", json_bytes(hf_config_dict(m, dtype)))
        if m.bos_token_id is not None or m.eos_token_id is not None:
            write_durable(tmp / "generation_config.json", json_bytes(
                {"_from_model_config": True, "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id}))
        hf_src = hf_dir_of(getattr(source, "init", "random") or "random")
        if hf_src is not None:
            for f in TOKENIZER_FILES:
                if (hf_src / f).is_file():
                    shutil.copyfile(hf_src / f, tmp / f)
        write_durable(tmp / INDEX, json_bytes({"metadata": {"total_size": total,
                                                            "total_parameters": spec.num_params()},
                                               "weight_map": weight_map}))
        fsync_dir(tmp)
        if not out_dir.exists():
            os.rename(tmp, out_dir)
        else:  # an existing dir: move files in (index last), drop shards of an earlier export
            for f in sorted(os.listdir(tmp), key=lambda f: f == INDEX):
                os.replace(tmp / f, out_dir / f)
            for f in os.listdir(out_dir):
                if (f.startswith("model-") and f.endswith(".safetensors") and f not in names) or f == SINGLE_FILE:
                    os.remove(out_dir / f)
            shutil.rmtree(tmp)
        fsync_dir(out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    log(f"exported {spec.num_params():,} parameters ({total / 1e9:.2f} GB {str(dtype).replace('torch.', '')}, "
        f"{k} shard{'s' if k > 1 else ''}) to {out_dir} in {seconds:.1f}s")
    return {"bytes": total, "seconds": seconds, "shards": k, "dir": str(out_dir)}
