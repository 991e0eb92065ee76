"""HF checkpoints: config.json against our model config, weight import into an engine, export of master weights.

Import is two-phase so that nothing is built on a checkpoint that cannot be used: `open_hf` reads config.json and
every shard's header (no weights) and raises on the first problem; `import_hf` then copies the weights unit by
unit, one tensor at a time, in the file's dtype (the engine casts into its fp32 master while copying). Export
writes shards tensor by tensor under `<out dir>.tmp/` and moves them into place at the end, index and config last.
Peak extra host memory of either is one tensor. The config helpers here (`plain`, `norm_rope_scaling`,
`head_dim_of`, `same_value`) also define what the run fingerprint of a training checkpoint compares.

Most of our tensors are one checkpoint tensor under the same name. MoE expert matrices are not (`layer_recipes`
lists the accepted layouts, `open_hf` picks the one the checkpoint follows and checks all its headers):
- Qwen3-MoE hub checkpoints hold one gate/up/down matrix per expert; the import stacks them into our fused
  `gate_up_proj` [E, 2I, D] (gate rows, then up) and `down_proj` [E, D, I], one tensor at a time, and the export
  writes them back per expert. The fused names (transformers v5's in-memory ones) are accepted too.
- gpt-oss ships its experts in MXFP4 (`*_blocks` uint8 [E, rows, cols/32, 16], `*_scales` [E, rows, cols/32] of
  the [E, out, in] matrix); the import decodes them to bf16, which holds every MXFP4 value exactly, and transposes
  them to our [E, in, out] (engine/checkpoint/mxfp4.py; peak: the bf16 tensor plus its packed quarter). Checkpoints
  transformers wrote unquantized, with our names, import as they are; the export writes that unquantized form.
config.json's MoE keys are compared like the dense ones (`_moe_differences`); a quantization_config is accepted
only as gpt-oss's mxfp4.
"""

from __future__ import annotations

import functools
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

from engine.checkpoint import mxfp4
from engine.checkpoint.common import CheckpointError, read_json
from engine.checkpoint.safetensors_io import (FLOAT_CODES, ST_DTYPES, LazyTensors, Readers, SafetensorsFile,
                                              TensorInfo, itemsize, write_safetensors)
from engine.config import LLAMA3_KEYS, MOE_MODEL_TYPES, ConfigError, is_hub_id
from engine.fileio import fsync_dir, json_bytes, write_durable
from engine.progress import Progress
from engine.model.moe import GPT_OSS_SWIGLU_ALPHA

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
DEFAULT_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                         "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# what transformers assumes for a key config.json leaves out, where it matters to a comparison
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
QWEN3_MOE_DEFAULTS = {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
GPT_OSS_DEFAULTS = {"attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": GPT_OSS_SWIGLU_ALPHA}
EXPERT_MATRICES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
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
    """One spelling of RoPE scaling for comparisons: None for default RoPE, `rope_type` (not `type`), llama3's and
    yarn's fields as floats (original_max_position_embeddings as an int), yarn's omitted fields at their defaults."""
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
    if kind == "yarn":  # transformers' defaults filled in; a field we do not model (mscale, ...) stays and differs
        out = {"rope_type": "yarn", "factor": float(s.pop("factor")) if "factor" in s else None,
               "original_max_position_embeddings": int(s.pop("original_max_position_embeddings"))
               if "original_max_position_embeddings" in s else None,
               "beta_fast": float(s.pop("beta_fast", YARN_DEFAULTS["beta_fast"])),
               "beta_slow": float(s.pop("beta_slow", YARN_DEFAULTS["beta_slow"])),
               "truncate": bool(s.pop("truncate", YARN_DEFAULTS["truncate"]))}
        if "attention_factor" in s:
            out["attention_factor"] = float(s.pop("attention_factor"))
        s.pop("rope_type")
        return {**out, **s}
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
    if m.model_type in ("qwen3", "llama", "qwen3_moe"):  # HF's attention_bias also biases o_proj; ours never
        cmp("attention_bias", bool(hf.get("attention_bias", False)), "(no attention biases in model_type="
            f"{m.model_type})", False)
    if m.model_type == "llama":
        cmp("mlp_bias", bool(hf.get("mlp_bias", False)), "(no MLP biases)", False)
    if m.model_type in MOE_MODEL_TYPES:
        out += _moe_differences(hf, m)
    elif hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        cmp("use_sliding_window", True, "(sliding-window attention is not supported)", False)
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        accepted = "mxfp4" if m.model_type == "gpt_oss" else None
        cmp("quantization_config.quant_method", method, f"(model_type={m.model_type} imports "
            + ("unquantized weights or MXFP4 experts)" if accepted else "unquantized weights only)"), accepted)
    if hf.get("architectures"):
        cmp("architectures", list(hf["architectures"]), f"(model_type={m.model_type} means)",
            [DEFAULT_ARCHITECTURES.get(m.model_type)])
    return out


def _layer_types(types, layers: int) -> List[str]:
    """The first `layers` entries of a layer_types list, full attention where it is shorter or absent."""
    types = list(types or [])[:layers]
    return types + ["full_attention"] * (layers - len(types))


def _moe_differences(hf: dict, m) -> List[Tuple[str, Any, str, Any]]:
    """The MoE fields of `hf_config_differences`. The routing, expert and attention-window fields are compared;
    router_aux_loss_coef is not (a training choice that no weight depends on; the export writes ours). Layer types
    are compared over our first num_hidden_layers, so that a depth-truncated run matches the full checkpoint."""
    out = []

    def cmp(field_name: str, theirs, ours_key: str, ours) -> None:
        if not same_value(theirs, ours):
            out.append((field_name, theirs, ours_key, ours))

    gpt_oss = m.model_type == "gpt_oss"
    experts_key = "num_local_experts" if gpt_oss or "num_experts" not in hf else "num_experts"
    cmp(experts_key, hf.get(experts_key), "model.num_experts", m.num_experts)
    cmp("num_experts_per_tok", hf.get("num_experts_per_tok"), "model.num_experts_per_tok", m.num_experts_per_tok)
    layers = m.num_hidden_layers
    if gpt_oss:  # HF's intermediate_size is the experts' width
        cmp("intermediate_size", hf.get("intermediate_size"), "model.moe_intermediate_size", m.moe_intermediate_size)
        for key in ("attention_bias", "swiglu_limit"):
            cmp(key, hf.get(key, GPT_OSS_DEFAULTS[key]), f"model.{key}", m[key])
        cmp("swiglu_alpha", hf.get("swiglu_alpha", GPT_OSS_DEFAULTS["swiglu_alpha"]),
            "(fixed in engine/model/moe.py: GPT_OSS_SWIGLU_ALPHA)", GPT_OSS_SWIGLU_ALPHA)
        hf_layers = hf.get("num_hidden_layers") or 0
        default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf_layers)]
    else:
        cmp("moe_intermediate_size", hf.get("moe_intermediate_size"), "model.moe_intermediate_size",
            m.moe_intermediate_size)
        cmp("norm_topk_prob", hf.get("norm_topk_prob", QWEN3_MOE_DEFAULTS["norm_topk_prob"]),
            "model.norm_topk_prob", m.norm_topk_prob)
        cmp("decoder_sparse_step", hf.get("decoder_sparse_step", QWEN3_MOE_DEFAULTS["decoder_sparse_step"]),
            "(MoE in every layer; a sparser step is not supported)", 1)
        cmp("mlp_only_layers", hf.get("mlp_only_layers") or QWEN3_MOE_DEFAULTS["mlp_only_layers"],
            "(MoE in every layer; dense MLP layers are not supported)", [])
        if hf.get("use_sliding_window"):
            cmp("use_sliding_window", True, "(sliding-window attention is not supported for model_type=qwen3_moe)",
                False)
        default_types = []
    theirs, ours = _layer_types(hf.get("layer_types") or default_types, layers), _layer_types(m.layer_types, layers)
    cmp("layer_types", theirs, f"model.layer_types (first {layers})", ours)
    if "sliding_attention" in theirs or "sliding_attention" in ours:
        cmp("sliding_window", hf.get("sliding_window"), "model.sliding_window", m.sliding_window)
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
    transformers version reads). MoE models get their published keys (gpt-oss: `num_local_experts`, the experts'
    width as `intermediate_size`) and never a quantization_config: the export's weights are not quantized."""
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
    if m.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_hidden_layers)
    if m.model_type in ("qwen3", "llama", "qwen3_moe"):
        cfg["attention_bias"] = False
    if m.model_type == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1)
    if m.model_type in MOE_MODEL_TYPES:
        cfg.update(num_experts_per_tok=m.num_experts_per_tok, router_aux_loss_coef=float(m.router_aux_loss_coef),
                   output_router_logits=False)
    if m.model_type == "qwen3_moe":
        cfg.update(moe_intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
                   norm_topk_prob=bool(m.norm_topk_prob), decoder_sparse_step=1, mlp_only_layers=[])
    if m.model_type == "gpt_oss":
        cfg.update(intermediate_size=m.moe_intermediate_size, num_local_experts=m.num_experts, attention_bias=True,
                   swiglu_limit=float(m.swiglu_limit), sliding_window=m.sliding_window,
                   layer_types=_layer_types(m.layer_types, m.num_hidden_layers))
    return cfg


# ================================================================================================================
# import


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor that goes into one of ours."""
    name: str
    shape: Tuple[int, ...]
    packed: bool = False  # uint8 MXFP4 blocks or scales rather than a float tensor


@dataclass(frozen=True)
class Recipe:
    """How one of our tensors is made from checkpoint tensors. kind `copy`: one tensor as it is; `experts`: per-expert
    matrices stacked (Qwen3-MoE), `per_expert` consecutive parts per expert filling our tensor's dim 1 in order
    (gate rows, then up rows); `mxfp4`: gpt-oss blocks and scales, decoded and transposed (engine/checkpoint/
    mxfp4.py)."""
    kind: str
    parts: Tuple[Part, ...]
    per_expert: int = 1


def layer_recipes(spec, unit, param) -> List[Recipe]:
    """The ways a checkpoint may hold our tensor `param` of `unit`, the published on-disk layout first.

    Qwen3-MoE hub checkpoints keep one gate/up/down matrix per expert; transformers v5 fuses them when loading, so a
    checkpoint with the fused names is accepted too. gpt-oss ships its expert matrices in MXFP4 as [E, rows,
    cols/32, 16] blocks of the transposed matrix; transformers writes the dequantized ones under our names."""
    name = unit.layout.prefix + param.name
    copy = Recipe("copy", (Part(name, param.shape),))
    if unit.kind != "layer" or not spec.moe or param.name not in EXPERT_MATRICES:
        return [copy]
    E = spec.cfg.num_experts
    stem = unit.layout.prefix + "mlp.experts."
    if spec.cfg.model_type == "qwen3_moe":
        _, rows, cols = param.shape
        if param.name == "mlp.experts.gate_up_proj":
            parts = [Part(f"{stem}{j}.{w}_proj.weight", (rows // 2, cols)) for j in range(E) for w in ("gate", "up")]
            return [Recipe("experts", tuple(parts), per_expert=2), copy]
        parts = [Part(f"{stem}{j}.down_proj.weight", (rows, cols)) for j in range(E)]
        return [Recipe("experts", tuple(parts)), copy]
    _, cols, rows = param.shape  # ours is [E, in, out]; the blocks quantize the rows of [E, out, in]
    if cols % mxfp4.BLOCK_VALUES:
        return [copy]
    groups = cols // mxfp4.BLOCK_VALUES
    return [Recipe("mxfp4", (Part(name + "_blocks", (E, rows, groups, mxfp4.BLOCK_BYTES), packed=True),
                             Part(name + "_scales", (E, rows, groups), packed=True))), copy]


@dataclass
class HFCheckpoint:
    """A validated HF checkpoint directory: config matches, every tensor located and its header checked."""
    dir: Path
    config: dict
    dtype: Optional[str]  # torch_dtype / dtype from config.json
    # our hf name -> how it is made; checkpoint tensor name -> (file, its header entry)
    recipes: Dict[str, Recipe] = field(default_factory=dict)
    tensors: Dict[str, Tuple[Path, TensorInfo]] = field(default_factory=dict)
    files: List[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors.values())

    @property
    def mxfp4(self) -> bool:
        return any(r.kind == "mxfp4" for r in self.recipes.values())


HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "merges.txt", "vocab.json"]


def hf_dir_of(init: str) -> Optional[Path]:
    """The local directory of `model.init=hf:<dir or hub id>` (None for random init). A hub id (`org/name` that is
    not a local path) is resolved through huggingface_hub: from its local cache, else downloaded unless
    HF_HUB_OFFLINE=1; CheckpointError when neither works, saying what to do."""
    if not init.startswith("hf:"):
        return None
    target = init[3:]
    return _hub_snapshot(target) if is_hub_id(target) else Path(target).expanduser()


@functools.lru_cache(maxsize=None)
def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception as missing:  # huggingface_hub raises several types here (not cached, incomplete, bad id)
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(
                f"model.init=hf:{repo_id}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE is set ({type(missing).__name__}); download it where there is network "
                f"(`hf download {repo_id}`), or give model.init=hf:<local checkpoint dir>") from None
    print(f"model.init=hf:{repo_id}: downloading into the Hugging Face cache ({constants.HF_HUB_CACHE})", flush=True)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as failed:  # network, authentication (gated models), unknown repository
        raise CheckpointError(f"model.init=hf:{repo_id}: not in the local Hugging Face cache and the download "
                              f"failed: {type(failed).__name__}: {failed}. Log in (`hf auth login`) for gated "
                              "models, or give model.init=hf:<local checkpoint dir>") from None


def _layer_beyond(name: str, num_layers: int) -> bool:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= num_layers


def _choose(recipes: List[Recipe], present) -> Recipe:
    """The recipe the checkpoint follows: the one with the largest share of its tensors present (the first on a
    tie), so that a checkpoint lacking one expert's tensor is told about that tensor."""
    return max(recipes, key=lambda r: sum(p.name in present for p in r.parts) / len(r.parts))


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
    ckpt = HFCheckpoint(hf_dir, hf, hf.get("torch_dtype") or hf.get("dtype"), files=files)
    alternatives: Dict[str, List[Recipe]] = {}
    for unit in spec.units:
        for param in unit.layout.specs:
            name = unit.layout.prefix + param.name
            alternatives[name] = layer_recipes(spec, unit, param)
            ckpt.recipes[name] = _choose(alternatives[name], weight_map)
    expected = {p.name: p for r in ckpt.recipes.values() for p in r.parts}
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
        part = expected[name]
        if tuple(info.shape) != tuple(part.shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(info.shape)}, model={spec.cfg.name} "
                                  f"expects {list(part.shape)}")
        if part.packed and info.dtype != "U8":
            raise CheckpointError(f"{path}: tensor {name} has dtype {info.dtype}; MXFP4 blocks and scales are U8")
        if not part.packed and info.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info.dtype}; only F32/F16/BF16/F64 weights "
                                  "(and gpt-oss's MXFP4 experts) can be imported; other quantized checkpoints are "
                                  "not supported")
        ckpt.tensors[name] = (path, info)
    missing = [(p.name, ours) for ours, r in ckpt.recipes.items() for p in r.parts if p.name not in ckpt.tensors]
    if missing:
        first, ours = missing[0]
        others = [" + ".join(p.name for p in r.parts) if len(r.parts) <= 2 else f"{r.parts[0].name}, ..."
                  for r in alternatives[ours] if r is not ckpt.recipes[ours]]
        raise CheckpointError(f"{source}: tensor {first} is missing" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                              f"; model={spec.cfg.name} needs it" +
                              (f" (accepted instead: {'; '.join(others)})" if others else ""))
    return ckpt


def _check_finite(tensor: torch.Tensor, path, name: str) -> None:
    """A NaN or Inf in a weight would only show later, as skipped steps blamed on the learning rate: refuse it here,
    as the tensor streams in (one reduction over a tensor already in memory)."""
    bad = tensor.numel() - int(torch.isfinite(tensor).sum())
    if bad:
        raise CheckpointError(f"{path}: tensor {name} has {bad} non-finite value{'s' if bad > 1 else ''} (NaN or "
                              "Inf); the checkpoint is damaged or was saved from a diverged run")


def _produce(ckpt: HFCheckpoint, readers: Readers, name: str) -> torch.Tensor:
    """Our tensor `name` from the checkpoint: peak extra memory is that tensor in the file's dtype (bf16 for MXFP4,
    which holds every decoded value exactly) plus one of its parts."""
    recipe = ckpt.recipes[name]

    def read(part: Part) -> torch.Tensor:
        tensor = readers(ckpt.tensors[part.name][0]).get(part.name)
        if tensor.is_floating_point():
            _check_finite(tensor, ckpt.tensors[part.name][0], part.name)
        return tensor

    if recipe.kind == "copy":
        return read(recipe.parts[0])
    if recipe.kind == "mxfp4":
        blocks_part, scales_part = recipe.parts
        try:
            decoded = mxfp4.decode_experts(read(blocks_part), read(scales_part), torch.bfloat16,
                                           "cuda" if torch.cuda.is_available() else None)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.tensors[scales_part.name][0]}: tensor {scales_part.name}: {e}") from None
        _check_finite(decoded, ckpt.tensors[scales_part.name][0], f"{blocks_part.name} (decoded with its scales)")
        return decoded
    k, rows = recipe.per_expert, recipe.parts[0].shape[0]
    dtype = ST_DTYPES[ckpt.tensors[recipe.parts[0].name][1].dtype]
    out = torch.empty((len(recipe.parts) // k, k * rows, *recipe.parts[0].shape[1:]), dtype=dtype)
    slots = out.unflatten(1, (k, rows))
    for i, part in enumerate(recipe.parts):
        slots[i // k, i % k].copy_(read(part))
    return out


def import_hf(engine, ckpt: HFCheckpoint, log: Callable[[str], None] = print) -> dict:
    """Copy the weights of a validated HF checkpoint into the engine, unit by unit, one of our tensors at a time."""
    t0 = time.perf_counter()
    readers = Readers()
    progress = Progress(f"importing {ckpt.dir}", len(engine.spec.units), log, "units")
    try:
        for unit in engine.spec.units:
            prefix = unit.layout.prefix
            engine.load_unit_state(unit.index, LazyTensors(
                unit.layout.names, lambda name, prefix=prefix: _produce(ckpt, readers, prefix + name)))
            progress.update()
    finally:
        readers.close()
    seconds = time.perf_counter() - t0
    stats = {"bytes": ckpt.total_bytes, "seconds": seconds, "files": len(ckpt.files)}
    log(f"imported {ckpt.dir} ({len(ckpt.tensors)} tensors, {ckpt.total_bytes / 1e9:.2f} GB"
        f"{' ' + ckpt.dtype if ckpt.dtype else ''}{', experts MXFP4 decoded to bf16' if ckpt.mxfp4 else ''}) in "
        f"{seconds:.1f}s")
    return stats


# ================================================================================================================
# export


def tokenizer_dir_of(model_init: str, data_tokenizer: Optional[str]) -> Optional[Path]:
    """Where a run's tokenizer files are: `data.tokenizer` when set, else the `model.init=hf:` checkpoint's dir."""
    return Path(data_tokenizer).expanduser() if data_tokenizer else hf_dir_of(model_init or "random")


class EngineSource:
    """Master weights of a live engine, as an export source (`spec`, `tokenizer_dir`, `unit_master(i)`,
    `close()`)."""

    def __init__(self, engine, tokenizer_dir: Optional[Path] = None):
        self.spec, self.engine, self.tokenizer_dir = engine.spec, engine, tokenizer_dir

    def unit_master(self, index: int) -> Mapping:
        return self.engine.unit_state(index)["master"]

    def close(self) -> None:
        pass


# one tensor of the export: (hf name, unit index, our tensor it comes from, shape, and for one expert's matrix of a
# stacked tensor (expert, part within the expert, parts per expert), else None)
ExportItem = Tuple[str, int, str, Tuple[int, ...], Optional[Tuple[int, int, int]]]


def _export_items(spec, unit) -> List[ExportItem]:
    """A unit's tensors as the published checkpoints lay them out (Qwen3-MoE: one matrix per expert), except that
    gpt-oss's experts are written unquantized under transformers' in-memory names."""
    items = []
    for param in unit.layout.specs:
        recipe = next(r for r in layer_recipes(spec, unit, param) if r.kind != "mxfp4")
        k = recipe.per_expert
        for i, part in enumerate(recipe.parts):
            slot = (i // k, i % k, k) if recipe.kind == "experts" else None
            items.append((part.name, unit.index, param.name, part.shape, slot))
    return items


def _plan_shards(spec, itemsize_bytes: int, shard_bytes: int) -> List[List[ExportItem]]:
    """Tensors in unit order, cut into shards of at most `shard_bytes` (a larger tensor gets a shard alone)."""
    shards: List[List[ExportItem]] = [[]]
    size = 0
    for unit in spec.units:
        for item in _export_items(spec, unit):
            n = math.prod(item[3]) * itemsize_bytes
            if shards[-1] and size + n > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(item)
            size += n
    return shards


def export_hf(source, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 5 << 30,
              log: Callable[[str], None] = print) -> dict:
    """Write the source's master weights as an HF checkpoint directory that from_pretrained loads. Qwen3-MoE experts
    are written one matrix per expert (the hub layout); gpt-oss experts are written in `dtype` under transformers'
    in-memory names (`mlp.experts.gate_up_proj` [E, D, 2I], ...), not re-encoded as MXFP4, and config.json has no
    quantization_config. Peak extra memory is one of our tensors (an expert matrix's source is read once)."""
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
    stacked: Dict[Tuple[int, str], torch.Tensor] = {}  # the tensor whose experts are being written, read once

    def producer(unit_index: int, name: str, slot):
        def make():
            if unit_index not in cache:
                cache.clear()
                stacked.clear()
                cache[unit_index] = source.unit_master(unit_index)
            if slot is None:
                t = cache[unit_index][name]
            else:
                if (unit_index, name) not in stacked:
                    stacked.clear()
                    stacked[unit_index, name] = cache[unit_index][name]
                expert, i, k = slot
                t = stacked[unit_index, name].unflatten(1, (k, -1))[expert, i]
            return t.to(dtype) if t.dtype != dtype else t
        return make

    try:
        for fname, shard in zip(names, shards):
            items = [(hf, dtype, shape, producer(u, n, slot)) for hf, u, n, shape, slot in shard]
            write_safetensors(tmp / fname, items, {"format": "pt"})
            for hf, _, _, shape, _ in shard:
                weight_map[hf] = fname
                total += math.prod(shape) * item_bytes
        cache.clear()
        stacked.clear()
        m = spec.cfg
        write_durable(tmp / "config.json", json_bytes(hf_config_dict(m, dtype)))
        if m.bos_token_id is not None or m.eos_token_id is not None:
            write_durable(tmp / "generation_config.json", json_bytes(
                {"_from_model_config": True, "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id}))
        if source.tokenizer_dir is not None:  # the run's tokenizer, so the export loads as a whole model
            for f in TOKENIZER_FILES:
                if (source.tokenizer_dir / f).is_file():
                    shutil.copyfile(source.tokenizer_dir / f, tmp / f)
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
