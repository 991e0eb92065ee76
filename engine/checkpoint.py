"""Checkpoints: HF safetensors import and export, training-state save and exact resume, crash safety.

Three things live here, sharing one small safetensors reader/writer (format: shared/reference/models.md §2.2):

1. HF import (`model.init=hf:<dir>`). `open_hf` reads `<dir>/config.json` (old and new spellings: `torch_dtype` /
   `dtype`, top-level `rope_theta`/`rope_scaling` / v5 `rope_parameters`), compares every architecture field with
   the chosen model config and raises ConfigError naming the first differing field with both values (the others
   that differ are listed after it). Then it reads the header of every shard named by
   `model.safetensors.index.json` (or the single `model.safetensors`) and checks that every tensor of our layout is
   present, in a float dtype (F32/F16/BF16/F64), with its shape, inside the file (a truncated shard is caught from
   its header, before any weight is read), and that there is nothing unexpected (old `rotary_emb.inv_freq`
   buffers and a tied model's redundant `lm_head.weight` are ignored). `max_position_embeddings` is not compared:
   it only bounds train.seq_len, no weight depends on it (llama3 RoPE's `original_max_position_embeddings` is).
   Only then does the Trainer build the engine, and `import_hf` copies the weights in unit by unit through
   `engine.load_unit_state`: each tensor is read with plain `readinto` (no mmap, so no page-cache pages are charged
   to the process) into a buffer of the file's dtype when the engine asks for it, and the engine casts it into its
   fp32 master while copying. Extra host memory is one
   tensor in the file's dtype (the largest is the embedding: 1.1 GB bf16 for Qwen2.5-7B), never a second copy of
   the model. Adam moments start at zero.

2. HF export. `export_hf(source, out_dir)` writes `model-0000k-of-0000n.safetensors` shards (default 5 GiB, keys in
   unit order so each layer's tensors are contiguous, metadata `{"format": "pt"}`, `lm_head.weight` omitted when
   tied), `model.safetensors.index.json` (`total_size` = sum of tensor bytes), `config.json` (architectures,
   model_type, every architecture field, `torch_dtype` and `dtype`, old-style `rope_theta`/`rope_scaling`, which
   every transformers version reads) and `generation_config.json` when bos/eos are known; tokenizer files of the
   `hf:` directory the run started from are copied along. A source is an engine (`EngineSource`, used by
   `train.export_hf=true` at the end of training into `<run dir>/hf`) or a training checkpoint
   (`python -m engine.checkpoint export <run dir | step dir> <out dir> [--dtype bf16|fp32] [--shard-gib 5]`, which
   reads the master weights only). Tensors are converted one at a time while the shard is written: peak extra
   memory is one tensor. Files are written under temporary names in `<out dir>.tmp/` and moved into place at the
   end, the index and config last.

3. Training state. `save_training_state` writes

       <checkpoint root>/step_<N>/              (root: train.checkpoint_dir, default <run dir>/checkpoints)
           unit_0000_embed.safetensors          one file per unit, tensors "master.<hf name>", "exp_avg.<hf name>",
           unit_0001_layer0.safetensors         "exp_avg_sq.<hf name>" (fp32; the moments are absent before the
           ...                                  first update of the reference engine); metadata: unit, adam_step
           unit_<L+1>_head.safetensors
           trainer_state.json                   step, data position, LR-schedule inputs, torch/numpy/python (and
                                                CUDA) RNG states (base64), Adam step per unit, skipped-step
                                                counters, tokens seen, validation losses, run fingerprint, config
           manifest.json                        written last: every file with its size and sha256

   Units are serialised one at a time straight from `engine.unit_state` (views into the host store for the stream
   engine), with the sha256 computed on the bytes as they are written: no copy of the model is made. Atomicity:
   everything goes into `step_<N>.tmp/`, each file is fsynced, then the directory, then it is renamed to
   `step_<N>` and the parent is fsynced. A `step_<N>` directory therefore either has a manifest describing complete
   files or was damaged afterwards; leftovers of a killed save (`*.tmp`, and `*.deleting` from an interrupted
   prune) are removed at the next save. After a save only the newest `train.keep_checkpoints` complete checkpoints
   are kept (0 keeps all); older ones are renamed to `*.deleting` before removal, so a kill mid-removal never leaves
   something that looks complete. Saving a step that already has a complete checkpoint is a no-op.

   `train.resume=auto` takes the newest `step_<N>` with a parseable manifest (a directory without one is skipped
   with a warning and removed at the next save; no checkpoint at all starts from step 0), `train.resume=<dir>`
   a step directory or a run directory. `open_training_state` verifies everything before the engine is touched: the
   manifest, every file's size (truncation) and sha256 (flipped bytes, hashed in parallel threads), trainer_state.json,
   the run fingerprint (model architecture, optimizer recipe, steps, seed, data identity; a difference is a
   ConfigError naming the field and both values) and every unit file's tensor names and shapes. A damaged newest
   checkpoint is refused naming the file, never silently replaced by an older one: pass the older step directory
   explicitly to fall back. Loading then streams one tensor at a time into `engine.load_unit_state`. Cost: a resume
   reads the checkpoint twice (verify, then load); a save writes 12 B/param.

Errors: CheckpointError (a ValueError) names the file; the Trainer turns it, like ConfigError, into exit status 2.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from engine.config import LLAMA3_KEYS, ConfigError

FORMAT = "streamtrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"^step_(\d+)$")
CHUNK = 64 << 20  # bytes per write/hash/read call
MAX_HEADER = 100 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
DEFAULT_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


# ================================================================================================================
# safetensors I/O

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class TensorEntry:
    dtype: str  # safetensors code, e.g. "BF16"
    shape: Tuple[int, ...]
    begin: int  # offsets relative to the data section
    end: int


class SafetensorsFile:
    """A safetensors file opened for reading: the header is parsed and checked against the file size on open
    (a truncated file or corrupt header raises CheckpointError naming the file); `get` reads one tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.f = open(self.path, "rb", buffering=0)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self._parse()
        except BaseException:
            self.f.close()
            raise

    def _parse(self) -> None:
        size = os.fstat(self.f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: truncated ({size} bytes), not a safetensors file")
        (n,) = struct.unpack("<Q", self.f.read(8))
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{self.path}: header length {n} does not fit the file of {size} bytes: "
                                  "truncated or not a safetensors file")
        raw = self._read_exact(8, n)
        try:
            header = json.loads(bytes(raw).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.metadata: Dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: Dict[str, TensorEntry] = {}
        for name, e in header.items():
            try:
                code, shape, (begin, end) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
                begin, end = int(begin), int(end)
            except (TypeError, KeyError, ValueError):
                raise CheckpointError(f"{self.path}: corrupt safetensors header entry for tensor {name}") from None
            if code not in ST_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has dtype {code}, which this reader does not know")
            if end - begin != _numel(shape) * _itemsize(ST_DTYPES[code]) or begin < 0:
                raise CheckpointError(f"{self.path}: tensor {name}: offsets [{begin}, {end}] do not match shape "
                                      f"{list(shape)} {code}: corrupt header")
            if end > data_size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name} ends at byte {self.data_start + end} "
                                      f"but the file has {size} bytes")
            self.entries[name] = TensorEntry(code, shape, begin, end)

    def _read_exact(self, offset: int, n: int, into: Optional[memoryview] = None) -> memoryview:
        buf = into if into is not None else memoryview(bytearray(n))
        self.f.seek(offset)
        done = 0
        while done < n:
            got = self.f.readinto(buf[done:min(n, done + CHUNK)])
            if not got:
                raise CheckpointError(f"{self.path}: truncated: expected {n} bytes at offset {offset}, got {done}")
            done += got
        return buf

    def keys(self) -> List[str]:
        return list(self.entries)

    def get(self, name: str) -> torch.Tensor:
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: no tensor named {name}")
        t = torch.empty(e.shape, dtype=ST_DTYPES[e.dtype])
        if e.end > e.begin:
            self._read_exact(self.data_start + e.begin, e.end - e.begin, _bytes_view(t))
        return t

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# an item to write: (name, dtype, shape, tensor or zero-argument callable producing it)
WriteItem = Tuple[str, torch.dtype, Tuple[int, ...], Any]


def write_safetensors(path: str | Path, items: Sequence[WriteItem], metadata: Optional[Dict[str, str]] = None
                      ) -> Tuple[int, str]:
    """Write a safetensors file tensor by tensor (each tensor is produced, written and dropped in turn), fsync it,
    return (bytes, sha256 hex). Tensors may live on any device; a non-CPU one is copied to the host one at a time."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, _ in items:
        n = _numel(shape) * _itemsize(dtype)
        header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        def put(b) -> None:  # hash (on a worker thread, in order) while writing: both release the GIL
            nonlocal size
            if len(b) < (1 << 20):
                digest.update(b)
                f.write(b)
            else:
                pending = hasher.submit(digest.update, b)
                f.write(b)
                pending.result()
            size += len(b)

        put(struct.pack("<Q", len(hb)))
        put(hb)
        for name, dtype, shape, src in items:
            t = src() if callable(src) else src
            t = t.detach()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, header says {dtype} "
                                 f"{list(shape)}")
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            mv = _bytes_view(t)
            for i in range(0, len(mv), CHUNK):
                put(mv[i:i + CHUNK])
            del t, mv
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(16 << 20)  # per hashing thread
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(mv[:n])
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> Tuple[int, str]:
    raw = (json.dumps(data, indent=1, allow_nan=False) + "\n").encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return len(raw), hashlib.sha256(raw).hexdigest()


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {what}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt: expected a JSON object")
    return data


class _LazyTensors(Mapping):
    """name -> tensor, read from a file only when asked for (and not kept): lets `engine.load_unit_state` pull one
    tensor at a time. `key(name)` maps a unit-relative name to the name in the file."""

    def __init__(self, names: Sequence[str], fetch: Callable[[str], torch.Tensor]):
        self._names, self._fetch = list(names), fetch

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._fetch(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# ================================================================================================================
# HF config.json <-> model config


def _plain(x):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "items"):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or hasattr(x, "__iter__"):
        return [_plain(v) for v in x]
    return x


def _norm_rope_scaling(s) -> Optional[dict]:
    s = _plain(s)
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
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        return float(theta), _norm_rope_scaling(rp)
    return float(hf.get("rope_theta", 10000.0)), _norm_rope_scaling(hf.get("rope_scaling"))


def head_dim_of(m) -> int:
    return m.head_dim or m.hidden_size // m.num_attention_heads


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def hf_config_differences(hf: dict, m) -> List[Tuple[str, Any, str, Any]]:
    """(HF field, value in config.json, our key, our value) for every architecture field that differs."""
    out = []

    def cmp(field_name: str, theirs, ours_key: str, ours) -> None:
        if not _same(theirs, ours):
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
    cmp("rope_scaling", scaling, "model.rope_scaling", _norm_rope_scaling(m.rope_scaling))
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


def check_hf_config(hf: dict, m, path: Path) -> None:
    diffs = hf_config_differences(hf, m)
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
        "rope_scaling": _norm_rope_scaling(m.rope_scaling),
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
# HF import


@dataclass
class HFCheckpoint:
    """A validated HF checkpoint directory: config matches, every tensor located and its header checked."""
    dir: Path
    config: dict
    dtype: Optional[str]  # torch_dtype / dtype from config.json
    # our hf name -> (file, entry)
    tensors: Dict[str, Tuple[Path, TensorEntry]] = field(default_factory=dict)
    files: List[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(e.end - e.begin for _, e in self.tensors.values())


def hf_dir_of(init: str) -> Optional[Path]:
    return Path(init[3:]).expanduser() if init.startswith("hf:") else None


def open_hf(spec, hf_dir: str | Path) -> HFCheckpoint:
    """Check config.json against spec.cfg and every tensor header; read no weights. Raises ConfigError for a
    config mismatch and CheckpointError (naming the file and tensor) for missing/unexpected/mis-shaped tensors."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    hf = _read_json(config_path, "an HF checkpoint directory needs config.json")
    check_hf_config(hf, spec.cfg, config_path)
    index_path = hf_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = _read_json(index_path, "")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: corrupt: no weight_map")
        weight_map = {str(k): hf_dir / str(v) for k, v in weight_map.items()}
        source = index_path
    elif (hf_dir / "model.safetensors").exists():
        weight_map = None
        source = hf_dir / "model.safetensors"
    else:
        raise CheckpointError(f"{hf_dir}: no model.safetensors.index.json or model.safetensors (only safetensors "
                              "checkpoints are supported)")
    headers: Dict[Path, Dict[str, TensorEntry]] = {}
    files = sorted(set(weight_map.values())) if weight_map is not None else [source]
    for path in files:
        if not path.exists():
            raise CheckpointError(f"{path}: missing (named by {index_path})")
        with SafetensorsFile(path) as st:
            headers[path] = st.entries
    if weight_map is None:
        weight_map = {name: source for name in headers[source]}
    expected = {}
    for unit in spec.units:
        for s in unit.layout.specs:
            expected[unit.layout.prefix + s.name] = s
    ckpt = HFCheckpoint(hf_dir, hf, hf.get("torch_dtype") or hf.get("dtype"), files=files)
    for name, path in weight_map.items():
        entry = headers[path].get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name} is missing although {index_path.name} maps it there")
        if name not in expected:
            if name.endswith(IGNORED_HF_SUFFIXES) or (name == "lm_head.weight" and spec.tied):
                continue
            raise CheckpointError(f"{path}: unexpected tensor {name} (shape {list(entry.shape)}) for model="
                                  f"{spec.cfg.name} ({spec.cfg.model_type}); the checkpoint has parameters this "
                                  "architecture does not")
        want = expected[name].shape
        if tuple(entry.shape) != tuple(want):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(entry.shape)}, model={spec.cfg.name} "
                                  f"expects {list(want)}")
        if entry.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {entry.dtype}; only F32/F16/BF16/F64 weights "
                                  "can be imported (quantized checkpoints are not supported)")
        ckpt.tensors[name] = (path, entry)
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]} is missing" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                              f"; model={spec.cfg.name} needs it")
    return ckpt


class _Readers:
    """Open SafetensorsFile handles by path, for the duration of an import or export."""

    def __init__(self):
        self.open: Dict[Path, SafetensorsFile] = {}

    def __call__(self, path: Path) -> SafetensorsFile:
        if path not in self.open:
            self.open[path] = SafetensorsFile(path)
        return self.open[path]

    def close(self) -> None:
        for r in self.open.values():
            r.close()
        self.open.clear()


def import_hf(engine, ckpt: HFCheckpoint, log: Callable[[str], None] = print) -> dict:
    """Copy the weights of a validated HF checkpoint into the engine, unit by unit, one tensor at a time."""
    t0 = time.perf_counter()
    readers = _Readers()
    try:
        for unit in engine.spec.units:
            prefix = unit.layout.prefix

            def fetch(name: str, prefix=prefix) -> torch.Tensor:
                path, _ = ckpt.tensors[prefix + name]
                return readers(path).get(prefix + name)

            engine.load_unit_state(unit.index, _LazyTensors(unit.layout.names, fetch))
    finally:
        readers.close()
    seconds = time.perf_counter() - t0
    stats = {"bytes": ckpt.total_bytes, "seconds": seconds, "files": len(ckpt.files)}
    log(f"imported {ckpt.dir} ({len(ckpt.tensors)} tensors, {ckpt.total_bytes / 1e9:.2f} GB"
        f"{' ' + ckpt.dtype if ckpt.dtype else ''}) in {seconds:.1f}s")
    return stats


# ================================================================================================================
# HF export


class EngineSource:
    """Master weights of a live engine."""

    def __init__(self, engine, init: str = "random"):
        self.spec, self.engine, self.init = engine.spec, engine, init

    def unit_master(self, index: int) -> Mapping:
        return self.engine.unit_state(index)["master"]

    def close(self) -> None:
        pass


class CheckpointSource:
    """Master weights of a training checkpoint (`run dir` -> its newest complete checkpoint, or a step dir).
    Each unit file is verified against the manifest when first read."""

    def __init__(self, path: str | Path):
        self.ckpt = open_training_state(resolve_checkpoint_path(Path(path)), verify=False)
        _verify_file(self.ckpt.path, TRAINER_STATE, self.ckpt.manifest["files"][TRAINER_STATE])
        self.spec = self.ckpt.spec
        self.init = self.ckpt.state.get("config", {}).get("model", {}).get("init", "random")
        self._verified = set()
        self._readers = _Readers()

    def unit_master(self, index: int) -> Mapping:
        path = self.ckpt.unit_files[index]
        if path not in self._verified:
            _verify_file(self.ckpt.path, path.name, self.ckpt.manifest["files"][path.name])
            self._verified.add(path)
        unit = self.spec.units[index]
        reader = self._readers(path)
        return _LazyTensors(unit.layout.names, lambda n: reader.get(f"master.{unit.layout.prefix}{n}"))

    def close(self) -> None:
        self._readers.close()


def export_hf(source, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 5 << 30,
              log: Callable[[str], None] = print) -> dict:
    """Write the source's master weights as an HF checkpoint directory that from_pretrained loads."""
    t0 = time.perf_counter()
    spec, out_dir = source.spec, Path(out_dir).resolve()
    itemsize = _itemsize(dtype)
    plan: List[Tuple[str, int, str, Tuple[int, ...]]] = []  # hf name, unit index, name in unit, shape
    for unit in spec.units:
        for s in unit.layout.specs:
            plan.append((unit.layout.prefix + s.name, unit.index, s.name, s.shape))
    shards: List[List[Tuple[str, int, str, Tuple[int, ...]]]] = [[]]
    size = 0
    for item in plan:
        n = _numel(item[3]) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    k = len(shards)
    names = [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    cache: Dict[int, Mapping] = {}

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
                total += _numel(shape) * itemsize
        cache.clear()
        m = spec.cfg
        _write_json(tmp / "config.json", hf_config_dict(m, dtype))
        if m.bos_token_id is not None or m.eos_token_id is not None:
            _write_json(tmp / "generation_config.json", {"_from_model_config": True, "bos_token_id": m.bos_token_id,
                                                         "eos_token_id": m.eos_token_id})
        hf_src = hf_dir_of(getattr(source, "init", "random") or "random")
        if hf_src is not None:
            for f in TOKENIZER_FILES:
                if (hf_src / f).is_file():
                    shutil.copyfile(hf_src / f, tmp / f)
        _write_json(tmp / "model.safetensors.index.json",
                    {"metadata": {"total_size": total, "total_parameters": spec.num_params()},
                     "weight_map": weight_map})
        _fsync_dir(tmp)
        if not out_dir.exists():
            os.rename(tmp, out_dir)
        else:  # an existing dir: move files in (index last), drop shards of an earlier export
            order = sorted(os.listdir(tmp), key=lambda f: f == "model.safetensors.index.json")
            for f in order:
                os.replace(tmp / f, out_dir / f)
            for f in os.listdir(out_dir):
                if (f.startswith("model-") and f.endswith(".safetensors") and f not in names) \
                        or f == "model.safetensors":
                    os.remove(out_dir / f)
            shutil.rmtree(tmp)
        _fsync_dir(out_dir)
        _fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    log(f"exported {spec.num_params():,} parameters ({total / 1e9:.2f} GB {str(dtype).replace('torch.', '')}, "
        f"{k} shard{'s' if k > 1 else ''}) to {out_dir} in {seconds:.1f}s")
    return {"bytes": total, "seconds": seconds, "shards": k, "dir": str(out_dir)}


# ================================================================================================================
# Training state


def rng_state() -> dict:
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    np_state = np.random.get_state()
    py = random.getstate()
    out = {"torch": b64(torch.get_rng_state()),
           "numpy": {"kind": np_state[0], "keys": base64.b64encode(np_state[1].astype("<u4").tobytes()).decode(),
                     "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
           "python": [py[0], list(py[1]), py[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(s: dict) -> None:
    def unb64(x: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(x)), dtype=torch.uint8)

    torch.set_rng_state(unb64(s["torch"]))
    n = s["numpy"]
    np.random.set_state((n["kind"], np.frombuffer(base64.b64decode(n["keys"]), dtype="<u4").astype(np.uint32),
                         n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = s["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([unb64(x) for x in s["cuda"]])


MODEL_FINGERPRINT = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                     "qkv_bias", "qk_norm", "hidden_act")
TRAIN_FINGERPRINT = ("steps", "seq_len", "micro_batch_size", "grad_accum", "lr", "min_lr_ratio", "warmup_steps",
                     "weight_decay", "beta1", "beta2", "eps", "max_grad_norm", "precision")


def run_fingerprint(cfg, data_fingerprint: str) -> dict:
    """What a resumed run must share with the checkpoint: the model architecture, the optimizer recipe and LR
    schedule (train.steps included, it shapes the cosine), the seed and the data. Not part of it: the engine and
    its placement, logging/validation/checkpoint cadence, hardware, compute dtype."""
    m, t = cfg.model, cfg.train
    model = {k: _plain(m[k]) for k in MODEL_FINGERPRINT}
    model["head_dim"] = head_dim_of(m)
    model["rope_scaling"] = _norm_rope_scaling(m.rope_scaling)
    return {"model": model, "train": {k: _plain(t[k]) for k in TRAIN_FINGERPRINT}, "seed": cfg.seed,
            "data": {"name": cfg.data.name, "fingerprint": data_fingerprint, "val_fraction": cfg.data.val_fraction}}


def fingerprint_differences(saved: dict, current: dict, prefix: str = "") -> List[Tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(saved) | set(current), key=lambda k: (list(current).index(k) if k in current else 99)):
        a, b = saved.get(key), current.get(key)
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict) and key != "rope_scaling":
            out += fingerprint_differences(a, b, path + ".")
        elif not _same(a, b):
            out.append((path, a, b))
    return out


def unit_file_name(unit) -> str:
    return f"unit_{unit.index:04d}_{unit.name}.safetensors"


def _is_complete(step_dir: Path) -> bool:
    try:
        m = json.loads((step_dir / MANIFEST).read_text())
        return m.get("format") == FORMAT and isinstance(m.get("files"), dict)
    except (OSError, ValueError):
        return False


def list_checkpoints(root: Path) -> Tuple[List[Tuple[int, Path]], List[Path]]:
    """(complete checkpoints as (step, dir) oldest first, step dirs without a valid manifest)."""
    complete, incomplete = [], []
    if not root.is_dir():
        return complete, incomplete
    for p in root.iterdir():
        mt = STEP_DIR.match(p.name)
        if mt and p.is_dir():
            (complete.append((int(mt.group(1)), p)) if _is_complete(p) else incomplete.append(p))
    return sorted(complete), sorted(incomplete)


def resolve_checkpoint_path(path: Path) -> Path:
    """A step dir as is; a run dir or checkpoint root -> its newest complete checkpoint."""
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        return path
    for root in (path / "checkpoints", path):
        complete, _ = list_checkpoints(root)
        if complete:
            return complete[-1][1]
    raise CheckpointError(f"{path}: no complete checkpoint (step_<N>/ with {MANIFEST}) in it or in its "
                          "checkpoints/ directory")


def find_resume(resume: str, root: Path, log: Callable[[str], None] = print) -> Optional[Path]:
    """The checkpoint a run with train.resume=<resume> continues from, or None to start from step 0."""
    if resume == "none":
        return None
    if resume != "auto":
        return resolve_checkpoint_path(Path(resume).expanduser())
    complete, incomplete = list_checkpoints(root)
    newest = complete[-1][0] if complete else -1
    for p in incomplete:
        if int(STEP_DIR.match(p.name).group(1)) > newest:
            log(f"warning: {p} has no valid {MANIFEST}: an incomplete checkpoint, ignored")
    if not complete:
        log(f"train.resume=auto: no checkpoint in {root}, starting from step 0")
        return None
    return complete[-1][1]


def _cleanup(root: Path) -> None:
    """Remove leftovers of interrupted saves and prunes, and step dirs without a valid manifest."""
    _, incomplete = list_checkpoints(root)
    for p in list(root.iterdir()) + incomplete:
        if p.is_dir() and (p.name.endswith(".tmp") or p.name.endswith(".deleting") or p in incomplete):
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    complete, _ = list_checkpoints(root)
    for _, p in complete[:-keep]:
        doomed = p.with_name(p.name + ".deleting")
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    _fsync_dir(root)


def save_training_state(engine, root: Path, step: int, state: dict, keep: int = 3) -> Path:
    """Atomically write the engine's full training state plus `state` (trainer_state.json) as root/step_<step>."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    if _is_complete(final):
        return final
    _cleanup(root)
    if final.exists():
        shutil.rmtree(final)
    tmp = root / f"step_{step}.tmp"
    tmp.mkdir()
    files: Dict[str, dict] = {}
    units = []
    for unit in engine.spec.units:
        st = engine.unit_state(unit.index)
        items: List[WriteItem] = []
        for kind in STATE_KINDS:
            tensors = st[kind]
            if not tensors:  # the reference engine's moments before its first update
                continue
            for s in unit.layout.specs:
                t = tensors[s.name]
                items.append((f"{kind}.{unit.layout.prefix}{s.name}", t.dtype, tuple(s.shape), t))
        fname = unit_file_name(unit)
        nbytes, sha = write_safetensors(tmp / fname, items, {"format": "pt", "unit": str(unit.index),
                                                              "adam_step": repr(float(st["step"]))})
        files[fname] = {"bytes": nbytes, "sha256": sha}
        units.append({"index": unit.index, "name": unit.name, "file": fname, "adam_step": float(st["step"]),
                      "moments": bool(st["exp_avg"])})
    state = {"format": FORMAT, "version": VERSION, **state, "step": step, "units": units}
    nbytes, sha = _write_json(tmp / TRAINER_STATE, state)
    files[TRAINER_STATE] = {"bytes": nbytes, "sha256": sha}
    _write_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, "step": step, "files": files,
                                 "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)
    return final


@dataclass
class TrainingCheckpoint:
    path: Path
    manifest: dict
    state: dict
    spec: Any
    unit_files: List[Path]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _verify_file(ckpt_dir: Path, name: str, meta: dict) -> None:
    path = ckpt_dir / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (listed in {ckpt_dir / MANIFEST})")
    size = path.stat().st_size
    if size != meta.get("bytes"):
        raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, {MANIFEST} says {meta.get('bytes')}")
    if sha256_file(path) != meta.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from {MANIFEST}): the file is corrupt")


def open_training_state(path: Path, spec=None, fingerprint: Optional[dict] = None, verify: bool = True,
                        threads: int = 8) -> TrainingCheckpoint:
    """Check a checkpoint completely without touching any engine: manifest, sizes, checksums (`verify`), the run
    fingerprint against `fingerprint` (ConfigError naming the field), every unit file's tensor names and shapes."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest = _read_json(path / MANIFEST, "without a manifest the checkpoint is incomplete (a save was interrupted "
                                           "or files were removed); use an older step_<N> directory")
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path / MANIFEST}: not a {FORMAT} manifest")
    files = manifest["files"]
    if TRAINER_STATE not in files:
        raise CheckpointError(f"{path / MANIFEST}: does not list {TRAINER_STATE}")
    for name, meta in files.items():  # cheap checks first: missing and truncated files
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in {path / MANIFEST})")
        if p.stat().st_size != meta.get("bytes"):
            raise CheckpointError(f"{p}: truncated or overwritten: {p.stat().st_size} bytes, {MANIFEST} says "
                                  f"{meta.get('bytes')}")
    state = _read_json(path / TRAINER_STATE, "")
    if fingerprint is not None:
        diffs = fingerprint_differences(state.get("fingerprint", {}), fingerprint)
        if diffs:
            key, saved, now = diffs[0]
            more = "; also differ: " + ", ".join(d[0] for d in diffs[1:]) if len(diffs) > 1 else ""
            raise ConfigError(f"train.resume: checkpoint {path} was made with {key}={saved!r} but this run has "
                              f"{key}={now!r}{more}. Resume with the checkpoint's settings, or start a new run "
                              "(train.resume=none, or another run dir)")
    if verify:
        names = sorted(files, key=lambda n: -files[n]["bytes"])
        with ThreadPoolExecutor(max_workers=max(1, min(threads, os.cpu_count() or 1, len(names)))) as pool:
            for f in [pool.submit(_verify_file, path, n, files[n]) for n in names]:
                f.result()
    if spec is None:
        from omegaconf import OmegaConf

        from engine.model import ModelSpec

        try:
            spec = ModelSpec(OmegaConf.create(state["config"]["model"]))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path / TRAINER_STATE}: lacks the model config ({e})") from None
    units = state.get("units") or []
    if len(units) != len(spec.units):
        raise CheckpointError(f"{path / TRAINER_STATE}: has {len(units)} units, model={spec.cfg.name} has "
                              f"{len(spec.units)}")
    unit_files = []
    for unit, u in zip(spec.units, units):
        p = path / u["file"]
        if u["file"] not in files:
            raise CheckpointError(f"{p}: not listed in {path / MANIFEST}")
        with SafetensorsFile(p) as st:
            kinds = STATE_KINDS if u.get("moments", True) else STATE_KINDS[:1]
            for kind in kinds:
                for s in unit.layout.specs:
                    name = f"{kind}.{unit.layout.prefix}{s.name}"
                    e = st.entries.get(name)
                    if e is None:
                        raise CheckpointError(f"{p}: tensor {name} is missing")
                    if tuple(e.shape) != tuple(s.shape):
                        raise CheckpointError(f"{p}: tensor {name} has shape {list(e.shape)}, the model expects "
                                              f"{list(s.shape)}")
        unit_files.append(p)
    return TrainingCheckpoint(path, manifest, state, spec, unit_files)


def load_training_state(engine, ckpt: TrainingCheckpoint) -> dict:
    """Copy a checkpoint opened (and verified) by `open_training_state` into the engine; returns trainer_state."""
    for unit, u, p in zip(engine.spec.units, ckpt.state["units"], ckpt.unit_files):
        with SafetensorsFile(p) as st:
            prefix = unit.layout.prefix

            def lazy(kind: str, st=st, prefix=prefix, unit=unit) -> _LazyTensors:
                return _LazyTensors(unit.layout.names, lambda n: st.get(f"{kind}.{prefix}{n}"))

            if u.get("moments", True):
                engine.load_unit_state(unit.index, lazy("master"), lazy("exp_avg"), lazy("exp_avg_sq"),
                                       float(u["adam_step"]))
            else:
                engine.load_unit_state(unit.index, lazy("master"))
    return ckpt.state


# ================================================================================================================
# CLI


def _cli(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.checkpoint", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="training checkpoint -> HF safetensors directory")
    ex.add_argument("src", help="a run dir (its newest complete checkpoint) or a checkpoints/step_<N> dir")
    ex.add_argument("out", help="output directory (created; an existing one gets its model files replaced)")
    ex.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ex.add_argument("--shard-gib", type=float, default=5.0)
    ve = sub.add_parser("verify", help="check a training checkpoint's files against its manifest")
    ve.add_argument("src", help="a run dir or a step dir")
    args = p.parse_args(argv)
    try:
        if args.cmd == "export":
            src = CheckpointSource(args.src)
            try:
                print(f"exporting {src.ckpt.path} (step {src.ckpt.step})")
                export_hf(src, args.out, torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                          int(args.shard_gib * 2**30))
            finally:
                src.close()
        else:
            ck = open_training_state(resolve_checkpoint_path(Path(args.src)))
            print(f"{ck.path}: complete, step {ck.step}, {len(ck.manifest['files'])} files verified")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
