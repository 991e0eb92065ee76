"""Typed configuration schema.

Every knob of a run is a field of one of the dataclasses below. They are registered with Hydra's ConfigStore
as `base_config`, which `conf/config.yaml` puts first in its defaults list, so every group file (`conf/model/*.yaml`,
`conf/train/*.yaml`, ...) is merged into a typed node: a mistyped key or a value of the wrong type fails while Hydra
composes the config, naming the key. Checks that need more than a type (ranges, files that must exist, combinations)
live in `validate`, which the trainer calls before it allocates anything.

Model fields mirror the names of HF `config.json` so a checkpoint's config can be compared and written back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key, the value and what would be valid."""


MODEL_TYPES = ("qwen2", "qwen3", "llama")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    name: str = MISSING
    hf_repo: Optional[str] = None
    architectures: List[str] = field(default_factory=list)
    model_type: str = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    rope_theta: float = 10000.0
    # null or {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.
    # Typed Any because omegaconf cannot merge an override dict into a null Optional[Dict] node.
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/Qwen2.5: q, k, v projections carry a bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    expected_params: Optional[int] = None  # published parameter count, checked against the built layout
    init: str = "random"  # "random" | "hf:<dir>": weights from an HF checkpoint dir (config.json + *.safetensors)
    init_std: float = 0.02


@dataclass
class TrainConfig:
    steps: int = 300
    seq_len: int = 256
    micro_batch_size: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1  # applied to matrices (2-D parameters) only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm clipping; 0 disables it
    precision: str = "fp32_master"  # fp32 master weights and fp32 Adam moments
    compute_dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    activation_checkpointing: bool = True
    compile: str = "auto"  # torch.compile the layer and loss templates: auto (on CUDA) | on | off
    log_every: int = 1
    val_every: int = 100  # 0: validate only at the end
    val_batches: int = 8
    checkpoint_every: int = 0  # save the training state every N steps and at the end; 0: only on a signal/stop
    keep_checkpoints: int = 3  # complete checkpoints kept (oldest removed after a save); 0 keeps all
    checkpoint_dir: Optional[str] = None  # None: <run dir>/checkpoints
    resume: str = "none"  # none | auto (newest complete checkpoint of checkpoint_dir, else step 0) | <step or run dir>
    stop_at: int = 0  # stop after this many steps (saving a checkpoint) without changing the LR schedule; 0: off
    max_consecutive_skips: int = 5  # stop (saving a checkpoint) after N non-finite steps in a row; 0: never
    export_hf: bool = False  # at the end of training, write an HF checkpoint into <run dir>/hf
    export_dtype: str = "bf16"  # bf16 | fp32, for export_hf


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = "auto"  # auto | cpu | cuda
    gpu_mem_gib: float = 0.0  # usable GPU memory; a cap below the card's makes the engine behave like a smaller GPU
    peak_bf16_tflops: float = 0.0  # dense bf16 matmul peak, the MFU denominator on GPUs
    peak_fp32_tflops: float = 0.0  # the MFU denominator when computing in fp32 (CPU runs)
    h2d_gbps: float = 0.0  # measured pinned host->device bandwidth
    d2h_gbps: float = 0.0
    host_mem_gib: float = 0.0  # host RAM the run may use
    cpu_adam_gparams_per_s: float = 0.0  # fused CPU AdamW throughput
    achieved_tflops: float = 0.0  # what the engine's layer matmuls sustain (measured); the planner's time model


@dataclass
class DataConfig:
    name: str = MISSING  # stdlib | memmap | synthetic
    path: Optional[str] = None  # memmap: the .bin file written by `python -m engine.data prepare`
    val_fraction: float = 0.02
    vocab_size: Optional[int] = None  # tokens the data can produce; None: from the source (256 for bytes)


@dataclass
class LoggerConfig:
    name: str = MISSING  # wandb | none
    project: str = "streamtrain"
    entity: Optional[str] = None
    mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins
    group: Optional[str] = None  # None: the multirun sweep dir name, so a sweep's jobs group together
    tags: List[str] = field(default_factory=list)
    progress: str = "auto"  # auto (bar on a terminal) | bar | lines


@dataclass
class EngineConfig:
    name: str = MISSING  # reference | stream
    slots: int = 2  # stream: GPU layer slots in the ring
    grads_tier: str = "auto"  # stream: where full gradients wait for the global norm: auto | gpu | host
    checkpoint_tier: str = "auto"  # stream: where layer-input checkpoints live: auto | gpu | host
    cache_weights: str = "auto"  # stream: keep a layer's compute-dtype weights on the GPU from forward to backward
    # stream: how many leading units (embedding, layer 1, ...) keep optimizer state on the GPU and update there;
    # -1: as many as the planner's time model needs so the host AdamW never stalls the forward
    device_optimizer_units: int = -1
    fused_kernels: bool = True  # stream: Triton gradient accumulation (kernels/grad_accum.py); off: torch ops


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0
    plan: bool = False  # print the memory plan and exit


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: Any, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}")


def validate(cfg: DictConfig) -> None:
    """Checks that need more than types. Raises ConfigError naming the key; allocates nothing."""
    m, t, d = cfg.model, cfg.train, cfg.data
    _choice("model.model_type", m.model_type, MODEL_TYPES)
    family = {"qwen2": (True, False), "qwen3": (False, True), "llama": (False, False)}[m.model_type]
    if (m.qkv_bias, m.qk_norm) != family:
        raise ConfigError(f"model.model_type={m.model_type} has qkv_bias={family[0]} and qk_norm={family[1]} in its "
                          f"HF architecture; got qkv_bias={m.qkv_bias}, qk_norm={m.qk_norm}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size"):
        _positive(f"model.{key}", m[key])
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
                          f"model.num_key_value_heads={m.num_key_value_heads}")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                          f"{m.num_attention_heads}; set model.head_dim explicitly")
    if (m.head_dim or m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model.head_dim must be even for rotary embeddings")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        if not hasattr(rs, "get") or rs.get("rope_type") not in ("llama3", "default"):
            raise ConfigError(f"model.rope_scaling={rs!r} is not supported; valid: null, {{rope_type: default}} or "
                              f"{{rope_type: llama3, {', '.join(LLAMA3_KEYS)}}}")
        missing = [k for k in LLAMA3_KEYS if rs.rope_type == "llama3" and k not in rs]
        if missing:
            raise ConfigError(f"model.rope_scaling (llama3) lacks {', '.join(missing)}")
    _choice("model.hidden_act", m.hidden_act, ("silu",))
    if m.init != "random":
        if not m.init.startswith("hf:") or len(m.init) == 3:
            raise ConfigError(f"model.init={m.init!r} is not valid; use 'random' or 'hf:<checkpoint dir>'")
        hf_dir = os.path.expanduser(m.init[3:])
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise ConfigError(f"model.init={m.init!r}: {hf_dir} is not an HF checkpoint directory (no config.json)")

    _positive("train.steps", t.steps, 0)
    _positive("train.seq_len", t.seq_len)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.grad_accum", t.grad_accum)
    _positive("train.log_every", t.log_every)
    _positive("train.val_every", t.val_every, 0)
    _positive("train.val_batches", t.val_batches)
    _positive("train.warmup_steps", t.warmup_steps, 0)
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be within [0, 1]")
    if t.max_grad_norm < 0:
        raise ConfigError(f"train.max_grad_norm={t.max_grad_norm} must be >= 0 (0 disables clipping)")
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings} of model={m.name}; raise model.max_position_embeddings to "
                          "train past the published context")
    _choice("train.precision", t.precision, ("fp32_master",))
    _choice("train.compute_dtype", t.compute_dtype, ("auto", "bf16", "fp32"))
    _choice("train.compile", t.compile, ("auto", "on", "off"))
    if t.resume not in ("none", "auto") and not os.path.isdir(os.path.expanduser(t.resume)):
        raise ConfigError(f"train.resume={t.resume!r} is not valid; use none, auto, or an existing checkpoint "
                          "directory (a run dir or its checkpoints/step_<N>)")
    for key in ("checkpoint_every", "keep_checkpoints", "stop_at", "max_consecutive_skips"):
        _positive(f"train.{key}", t[key], 0)
    _choice("train.export_dtype", t.export_dtype, ("bf16", "fp32"))

    _choice("data.name", d.name, ("stdlib", "memmap", "synthetic"))
    if d.name == "memmap":
        if not d.path:
            raise ConfigError("data=memmap needs data.path=<tokens .bin written by `python -m engine.data prepare`>")
        if not os.path.isfile(d.path):
            raise ConfigError(f"data.path={d.path!r}: no such file; write it with `python -m engine.data prepare`")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be within (0, 1)")

    _choice("logger.name", cfg.logger.name, ("wandb", "none"))
    _choice("logger.mode", cfg.logger.mode, ("offline", "online", "disabled"))
    _choice("logger.progress", cfg.logger.progress, ("auto", "bar", "lines"))
    _choice("engine.name", cfg.engine.name, ("reference", "stream"))
    _choice("hardware.device", cfg.hardware.device, ("auto", "cpu", "cuda"))
    e = cfg.engine
    _positive("engine.slots", e.slots, 2)
    for key in ("grads_tier", "checkpoint_tier"):
        _choice(f"engine.{key}", e[key], ("auto", "gpu", "host"))
    _choice("engine.cache_weights", e.cache_weights, ("auto", "on", "off"))
    _positive("engine.device_optimizer_units", e.device_optimizer_units, -1)


def to_plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
