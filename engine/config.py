"""Typed configuration schema and its checks (the command line that composes it: engine/cli.py).

Every knob of a run is a field of one of the dataclasses below. They are registered with Hydra's ConfigStore as
`base_config`, which `conf/config.yaml` puts first in its defaults list, so every group file (`conf/model/*.yaml`,
`conf/train/*.yaml`, ...) is merged into a typed node: a mistyped key or a value of the wrong type in a group file
fails while Hydra composes the config. Model fields mirror the names of HF `config.json` so a checkpoint's config can
be compared and written back.

Defaults live here and only here: the dataclass defaults are the values of the default job (`python train.py`, the
tiny model on CPU), and a group file holds only what its option changes (a model's published sizes, a hardware
profile's figures, `conf/train/bench.yaml`'s benchmark recipe).

Two functions refuse what the schema's types cannot:
- `check_overrides` reads the command line before Hydra composes anything. It refuses a key the schema does not know
  whatever its syntax (`+key=` and `++key=` add keys past a typed node's struct flag, so composing alone would let
  them through), a renamed key, and a value (each value of a sweep) that does not convert to the field's type.
- `validate` checks the composed config before the trainer allocates anything: keys again (for configs composed
  in-process), then the range of every numeric field, the choice fields, files that must exist and combinations.
Both raise ConfigError, whose message names the key, the value and what would be valid.

`conf/` is found next to the `engine` package: in a source checkout it is the repository's `conf/`, and a wheel
installs the same files as the data package `streamtrain_conf` (setup.cfg), so an installed `streamtrain-train`
composes the same config as `python train.py` at the repository root.
"""

from __future__ import annotations

import math
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from engine import formats
from engine.device import CUBLAS_DETERMINISTIC_WORKSPACES
from streamtrain_kernels.adamw_update import BLOCK_SIZE_RANGE  # int8 moments: whole blocks in the fused kernel's tile


def _conf_dir() -> Path:
    root = Path(__file__).resolve().parent.parent
    installed = root / "streamtrain_conf"
    return installed if installed.is_dir() else root / "conf"


CONF_DIR = _conf_dir()


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key, the value and what would be valid."""


MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "gpt_oss")
MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss")  # engine/model/moe.py
LAYER_TYPES = ("full_attention", "sliding_attention")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
RENAMED = {"engine.checkpoint_tier": "engine.activation_tier",
           "engine.device_optimizer_units": "engine.gpu_resident_units",
           "hardware.achieved_tflops": "hardware.fwd_tflops_compiled / bwd_tflops_compiled / head_tflops_compiled "
                                       "(and the _eager ones), measured by python -m engine.calibrate",
           "train.precision": "train.master_dtype / train.moments_dtype / train.grad_dtype (engine/formats.py)"}


ATTENTION_BACKENDS = ("auto", "triton", "sdpa", "flash_attn")  # train.attention (engine/model/attention.py)
AUTO_ON_OFF = ("auto", "on", "off")
GRAD_ACCUM_AUTO = -1  # train.grad_accum: the plan chooses (engine/plan/micro_batches.py)
TIER_CHOICES = ("auto", "gpu", "host")


def one_of(default: Any, allowed: tuple) -> Any:
    """A field whose value must be one of `allowed` (`validate` checks every such field, naming the choices)."""
    return field(default=default, metadata={"choices": allowed})


@dataclass
class ModelConfig:
    name: str = MISSING  # the name runs and logs use (conf/model/<name>.yaml sets it)
    model_type: str = one_of(MISSING, MODEL_TYPES)  # the HF architecture family, which fixes the layer template
    hidden_size: int = MISSING  # width of the residual stream
    intermediate_size: int = MISSING  # width of the dense MLP (gpt-oss: of each expert)
    num_hidden_layers: int = MISSING  # decoder layers; lower it for a depth-truncated copy of a published model
    num_attention_heads: int = MISSING  # query heads
    num_key_value_heads: int = MISSING  # key/value heads (grouped-query attention: a divisor of the query heads)
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    vocab_size: int = MISSING  # rows of the embedding and the LM head
    max_position_embeddings: int = MISSING  # the longest train.seq_len the model accepts
    rope_theta: float = 10000.0  # rotary embedding base
    # null or {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.
    # Typed Any because omegaconf cannot merge an override dict into a null Optional[Dict] node.
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # the LM head reuses the embedding matrix
    qkv_bias: bool = False  # Qwen2/Qwen2.5: q, k, v projections carry a bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False  # gpt-oss: q, k, v and o projections carry a bias
    # Mixture of experts (model_type qwen3_moe or gpt_oss; engine/model/moe.py). 0 experts: a dense model.
    num_experts: int = 0  # HF: num_experts (Qwen3-MoE), num_local_experts (gpt-oss)
    num_experts_per_tok: int = 0  # MoE: experts each token is routed to (top-k)
    moe_intermediate_size: Optional[int] = None  # per-expert MLP width (gpt-oss: intermediate_size)
    norm_topk_prob: bool = True  # Qwen3-MoE: renormalise the top-k softmax probabilities to sum to 1
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added to the training loss
    swiglu_limit: Optional[float] = None  # gpt-oss: clamp of the expert SwiGLU's gate (above) and up (both sides)
    sliding_window: Optional[int] = None  # keys seen per query on "sliding_attention" layers
    layer_types: Optional[List[str]] = None  # per layer: full_attention | sliding_attention; None: all full
    hidden_act: str = one_of("silu", ("silu",))  # the MLP activation (SwiGLU's)
    bos_token_id: Optional[int] = None  # written to an export's generation_config.json
    eos_token_id: Optional[int] = None  # written to an export's generation_config.json
    expected_params: Optional[int] = None  # published parameter count, checked against the built layout
    # "random" | "hf:<dir>": weights from an HF checkpoint dir (config.json + *.safetensors) | "hf:<org>/<name>": a
    # Hugging Face Hub id, from the local cache (downloaded when online and not cached)
    init: str = "random"
    init_std: float = 0.02  # standard deviation of random matrix initialisation


@dataclass
class TrainConfig:
    """The full-precision recipe: fp32 master weights and moments, bf16 autocast on GPU (fp32 on CPU), AdamW,
    global-norm clipping, linear warmup then cosine decay. Sized so the default tiny job trains in minutes on 2
    cores."""

    steps: int = 150  # optimizer steps of the run (the LR schedule's length; train.resume may extend it)
    seq_len: int = 256  # tokens per sequence (packed data: per row)
    micro_batch_size: int = 16  # sequences per micro-batch (one forward and backward)
    # micro-batches per optimizer step; -1 (engine=stream, planned on a GPU or for a GPU profile): the fewest, up to
    # 64, whose forward computes at least as long as it streams the weights, else the most that fit (a larger batch:
    # opt-in; engine/plan/micro_batches.py)
    grad_accum: int = 1
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warm-up from lr / warmup_steps to lr
    weight_decay: float = 0.1  # applied to matrices (2-D parameters) only
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # global-norm clipping; 0 disables it
    # training-state formats (engine/formats.py): fp32 everywhere is exact; the others are updated on the GPU. auto:
    # the most precise format (among those the set fields allow) with which the run fits this machine
    master_dtype: str = one_of("auto", (formats.AUTO, *formats.MASTER_DTYPES))  # bf16: stochastic rounding
    # bf16: stochastic rounding; int8: blockwise 8-bit floats + fp32 scales
    moments_dtype: str = one_of("auto", (formats.AUTO, *formats.MOMENTS_DTYPES))
    # bf16 (stochastic rounding) | int8 (blockwise 8-bit floats, stochastic rounding; never chosen by auto): the
    # gradients held until the global norm is known
    grad_dtype: str = one_of("auto", (formats.AUTO, *formats.GRAD_DTYPES))
    # fp32 | bf16: the dtype the host-updated units' gradients cross PCIe in (engine=stream, exact fp32 state only);
    # bf16 rounds them stochastically on the GPU (seeded per run, unit and step) and halves their host buffers
    grad_transfer_dtype: str = one_of("fp32", ("fp32", "bf16"))
    # engine=reference with fp32 state: torch (torch's fused AdamW, the exact recipe) | kernel (the fused update
    # kernel of the low-precision formats, over the same fp32 state: equal to torch's to 1 ulp per element and step,
    # to compare the two update paths, e.g. in bench/bench_formats_quality.py)
    fp32_update: str = one_of("torch", ("torch", "kernel"))
    moments_block_size: int = 256  # int8 moments and int8 gradients: elements per scale, a power of two
    compute_dtype: str = one_of("auto", ("auto", "bf16", "fp32"))  # auto: bf16 autocast on CUDA, fp32 on CPU
    activation_checkpointing: bool = True  # engine=reference only: the stream engine always recomputes
    compile: str = one_of("auto", AUTO_ON_OFF)  # torch.compile the layer and loss templates; auto: on CUDA
    # compiled templates: Inductor builds their kernels in this process, one after another, instead of in its pool of
    # worker processes (min(32, cores) of them, ~0.48 GiB of host each: 7.4-7.7 GiB on the 16-core benchmark machine,
    # `hardware.host_compile_workers_gib`, which the plan then leaves to the state); costs a slower first step
    compile_in_process: bool = False
    # bitwise-reproducible GPU runs (engine/device.py `set_deterministic`): torch's deterministic algorithms (an op
    # that has none stops the run with torch's error naming it) and fixed Triton kernel configs; off: the backward
    # may accumulate in a different order each run (atomics), so two runs of one seed drift apart at rounding level
    deterministic: bool = False
    # the LM head + cross-entropy fused in a Triton kernel, no logits recomputed (streamtrain_kernels/cross_entropy.py):
    # auto (on CUDA) | on | off (the chunked torch chain, logits recomputed in the backward)
    fused_loss: str = one_of("auto", AUTO_ON_OFF)
    # attention backend (engine/model/attention.py): auto (the one measured faster in the layer: sdpa; triton on CUDA
    # for packed rows; for the lean layer sdpa's cuDNN kernel, triton on packed rows, in fp32 or deterministic runs) |
    # triton | sdpa | flash_attn; a backend asked for that cannot run is an error, never a quiet switch
    attention: str = one_of("auto", ATTENTION_BACKENDS)
    # the MLP block in token chunks, each recomputed in the backward (engine/model/dense.py): -1 auto (32K-token chunks
    # when a micro-batch holds more than 64K tokens), 0 off, N tokens per chunk
    mlp_chunk_tokens: int = -1
    # the lean long-context layer (engine/model/lean.py): a layer's per-token work (dense or MoE) in chunks of
    # train.mlp_chunk_tokens around an attention whose output the backward reuses where the plan keeps it (triton, or
    # sdpa on rows of one document: engine/model/lean_attention.py). auto (on a GPU: whichever layer the plan finds
    # faster in the most precise state format that fits; planned without a GPU or refused by both: on where a
    # micro-batch holds more than 128K tokens and the attention is one of those) | on (needs one of those) | off
    lean_layer: str = one_of("auto", AUTO_ON_OFF)
    log_every: int = 1  # write a metrics record every N steps
    val_every: int = 25  # validate at step 0, every N steps and at the end; 0: at step 0 and the end; -1: never
    val_batches: int = 8  # micro-batches of the validation split per validation
    checkpoint_every: int = 0  # save the training state every N steps; 0: not by steps
    # save the training state when this many minutes have passed since the run's start or its last save; 0: not by
    # time. A stop (a signal, train.stop_at, diverging) always saves
    checkpoint_minutes: float = 30.0
    checkpoint_at_end: bool = True  # save the final training state (what train.resume extends)
    keep_checkpoints: int = 3  # complete checkpoints kept (oldest removed after a save); 0 keeps all
    checkpoint_dir: Optional[str] = None  # None: <run dir>/checkpoints
    resume: str = "none"  # none | auto (newest complete checkpoint of checkpoint_dir, else step 0) | <step or run dir>
    stop_at: int = 0  # stop after this many steps (saving a checkpoint) without changing the LR schedule; 0: off
    max_consecutive_skips: int = 5  # stop (saving a checkpoint) after N non-finite steps in a row; 0: never
    export_hf: bool = False  # at the end of training, write an HF checkpoint into <run dir>/hf
    export_dtype: str = one_of("bf16", ("bf16", "fp32"))  # for export_hf


@dataclass
class LayerFigures:
    """Measured by `python -m engine.calibrate` on the machine (the planner's time model; 0: unknown). TFLOPS count
    model FLOPs (engine/metrics.py) of one decoder layer's forward, its backward (recompute included: 3x the forward's
    FLOPs, less the down projection a dense layer's recompute leaves out, `ModelSpec.layer_grads`) and the head's
    forward + backward, with compiled or eager templates. With attention figures (HardwareConfig) the layer figures
    cover the layer's FLOPs other than attention's (the layer's time less its attention's); without, all."""
    fwd_tflops_compiled: float = 0.0  # decoder layer forward, compiled
    bwd_tflops_compiled: float = 0.0  # decoder layer backward (recompute included), compiled
    head_tflops_compiled: float = 0.0  # final norm + LM head + loss, forward and backward, compiled
    fwd_tflops_eager: float = 0.0  # decoder layer forward, eager
    bwd_tflops_eager: float = 0.0  # decoder layer backward (recompute included), eager
    head_tflops_eager: float = 0.0  # final norm + LM head + loss, forward and backward, eager


@dataclass
class LayerWidthFigures(LayerFigures):
    """The figures of one more model's decoder layer and head (0: that mode not measured), so the planner can time
    models of other widths: a 2048-wide qwen3b layer runs 6-21% below a 3584-wide qwen7b one on an H100.
    python -m engine.calibrate --width-models measures them."""
    model: str = ""  # the model of conf/model/ whose layer was measured
    hidden: int = 0  # its hidden size, the axis the planner interpolates along


@dataclass
class MoeLayerFigures:
    """One mixture-of-experts model's decoder layer at one micro-batch size: its forward and backward TFLOPS (the
    layer's FLOPs other than attention's, active experts counted; 0: that mode not measured), as LayerFigures counts
    a dense layer's. Grouped expert matmuls, gathers and scatters run far below a dense layer's rate, and their rate
    depends on the expert shapes and on the tokens each expert gets: a run is timed at the entries of its own layer
    shape (or the nearest measured one), interpolated in log(tokens per micro-batch) (engine/plan/speeds.py).
    python -m engine.calibrate --moe-models measures them."""
    model: str = MISSING  # the model of conf/model/ whose layer was measured
    hidden: int = 0  # its hidden size
    experts: int = 0  # experts per layer
    experts_per_token: int = 0  # experts each token is routed to (top-k)
    expert_width: int = 0  # one expert's MLP width (model.moe_intermediate_size)
    tokens: int = 0  # tokens per layer call (micro-batch size x sequence length)
    fwd_tflops_compiled: float = 0.0  # MoE layer forward, compiled
    bwd_tflops_compiled: float = 0.0  # MoE layer backward (recompute included), compiled
    fwd_tflops_eager: float = 0.0  # MoE layer forward, eager
    bwd_tflops_eager: float = 0.0  # MoE layer backward (recompute included), eager
    measured: str = ""  # when and where: date, git revision, torch / triton, GPU


@dataclass
class AttentionPoint:
    """The attention kernel alone at one more (backend, sequence length), measured as the main attn_* figures
    (python -m engine.calibrate --attn-points). Attention's rate grows with length and differs by backend, and at
    512K tokens it is ~88% of a qwen7b layer's FLOPs: a run's attention is timed at its own backend's figures,
    interpolated in log(length) between the two nearest measured lengths (engine/plan/speeds.py)."""
    backend: str = MISSING  # triton | sdpa | flash_attn
    seq_len: int = 0  # tokens of the one sequence measured
    fwd_tflops: float = 0.0  # attention forward
    bwd_tflops: float = 0.0  # attention forward + backward, as 3 forwards' FLOPs


@dataclass
class HardwareConfig(LayerFigures):
    """Figures of 0 are unknown: no GPU memory cap, no MFU, no step-time prediction. The layer and head figures
    (LayerFigures) are those of `layer_model`'s layer."""

    name: str = MISSING  # the profile's name (conf/hardware/<name>.yaml; auto: detected)
    # where the run computes; auto: CUDA when present, else the CPU
    device: str = one_of("auto", ("auto", "cpu", "cuda"))
    gpu_mem_gib: float = 0.0  # the card's usable GPU memory (a little below its capacity: the CUDA context)
    # cap this process's GPU memory at this many GiB (0: none), to see how a run fits a smaller card; the speeds and
    # the MFU peak stay those of the card the run is on
    gpu_mem_cap_gib: float = 0.0
    # a profile describes one card: on another card it is refused, unless this is true (use its figures anyway, e.g.
    # to plan a run for that card; its gpu_mem_gib then caps the process like gpu_mem_cap_gib)
    other_card: bool = False
    peak_bf16_tflops: float = 0.0  # dense bf16 matmul peak, the MFU denominator on GPUs
    peak_fp32_tflops: float = 0.0  # the MFU denominator when computing in fp32 (CPU runs)
    # host RAM the run may plan with, overriding what is measured; 0: this machine's memory as the run starts (the
    # cgroup limit or the total, less what other processes use: engine/hardware.py, host_budget)
    host_mem_gib: float = 0.0
    # the host RAM of the machine the profile was measured on, used only when planning for that machine from
    # another one (plan=true with another card's profile); a run plans with the memory of the machine it is on
    profile_host_mem_gib: float = 0.0
    # the cards of one host the profile describes (h100x8: 8); plan=true plans one of that many data-parallel ranks,
    # as `torchrun --nproc_per_node=<gpus>` runs them (each its share of the micro-batches and of the host's RAM, the
    # state sharded); a run takes its ranks from torchrun
    gpus: int = 1
    # the model and hidden size of the layer the LayerFigures were measured on ("", 0: unknown; they then time
    # every model), and the figures of other widths: a model between two calibrated widths is timed at rates
    # interpolated in log(hidden), one outside them at the nearest width's
    layer_model: str = ""
    layer_hidden: int = 0  # the hidden size of layer_model
    layer_widths: List[LayerWidthFigures] = field(default_factory=list)  # figures of other widths (see above)
    # The attention kernel alone (causal, full, one sequence of attn_seq_len tokens, backend attn_backend): its
    # model FLOPs (QK^T and PV) per second forward, and forward + backward counted as 3 forwards. Attention's rate
    # grows with length while the rest of the layer's does not: the planner times the two parts apart.
    attn_backend: str = one_of("", ("", *ATTENTION_BACKENDS[1:]))  # "" (with the figures 0): not calibrated
    attn_seq_len: int = 0  # the sequence length the attention figures were measured at
    attn_fwd_tflops: float = 0.0  # attention forward
    attn_bwd_tflops: float = 0.0  # attention forward + backward, as 3 forwards' FLOPs
    attn_points: List[AttentionPoint] = field(default_factory=list)  # other backends and lengths (see AttentionPoint)
    # The lean layer's step (engine/model/lean.py) over what the time model gives for its FLOPs at the figures above,
    # on cuDNN's attention (sdpa) and on the Triton kernel: its token chunks and per-group attention calls run below
    # the plain layer's rates. `python -m bench.bench_lean_layer` prints it per length as `step_ratio`.
    lean_step_ratio_sdpa: float = 0.0  # on cuDNN's attention; 0: not measured, the time model's figures as they are
    lean_step_ratio_triton: float = 0.0  # on the Triton kernel; 0: not measured, likewise
    # mixture-of-experts layers' figures by model and micro-batch tokens (see MoeLayerFigures); MoE runs use them in
    # place of the dense layer's, which are far too fast for them
    moe_layers: List[MoeLayerFigures] = field(default_factory=list)
    # MoE layers inside training steps run this much longer than at the figures above, measured on one layer alone
    # (real tokens route less evenly than the calibration's random inputs): the median over MoE engine rows of the
    # measured backward over the planned one, which `python -m bench.plan_backtest` prints; 0: not measured
    moe_step_ratio: float = 0.0
    h2d_gbps: float = 0.0  # pinned host->device, alone
    d2h_gbps: float = 0.0  # pinned device->host, alone
    bidir_gbps: float = 0.0  # both directions at once, total
    # both directions at once while the host AdamW runs, total (they share host memory bandwidth); 0: not measured,
    # the planner then takes the link as fast under the optimizer as alone
    bidir_gbps_under_adam: float = 0.0
    cpu_adam_gparams_per_s: float = 0.0  # fused CPU AdamW, alone
    cpu_adam_gparams_per_s_under_pcie: float = 0.0  # the same while both PCIe directions stream
    # the host AdamW inside training steps (the parameters it updated over its pass, the median over engine rows:
    # `python -m bench.plan_backtest`), which the planner uses in place of the figure above where measured: the
    # calibration times the optimizer alone with the link busy, a step also runs the compute thread beside it
    cpu_adam_gparams_per_s_in_step: float = 0.0
    host_process_gib: float = 0.0  # host memory of a training process before any state (torch, CUDA, compiled code)
    # of host_process_gib, the part in torch.compile's worker processes, which a run without compiled templates
    # never starts (the planner leaves it out of an eager run's host memory)
    host_compile_workers_gib: float = 0.0
    calibration: str = ""  # where the measured figures come from (written by python -m engine.calibrate)
    # The NVMe tier (engine/streaming/nvme.py): Adam moments of host-updated units in a file on a local disk
    nvme_dir: Optional[str] = None  # a directory on that disk; None: no NVMe tier
    nvme_gib: float = 0.0  # disk space the tier may use (0: none)
    nvme_gbps: float = 0.0  # sequential read + write rate of that disk, for the planner's time model (0: unknown)
    nvme_direct_io: bool = True  # O_DIRECT (no page cache); false: buffered I/O, pages dropped after each write


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # `org/name`, as the Hugging Face Hub spells a repository


def is_hub_id(target: str) -> bool:
    """Whether `model.init=hf:<target>` names a Hub repository (resolved through huggingface_hub when the run
    starts) rather than a local directory."""
    return bool(HUB_ID.fullmatch(target)) and not os.path.exists(os.path.expanduser(target))


PACKED_SOURCES = ("text", "chat")  # data sources whose rows pack several documents (engine/batch.py)


@dataclass
class DataConfig:
    # stdlib | memmap | synthetic: token streams cut into windows; text | chat: records tokenized with the model's
    # tokenizer and packed into train.seq_len rows by document (engine/data/documents.py)
    name: str = one_of(MISSING, ("stdlib", "memmap", "synthetic", *PACKED_SOURCES))
    # memmap: the .bin file written by `python -m engine.data prepare`; text/chat: a json/jsonl/parquet/arrow/csv/txt
    # file, a folder of them, or the name of a dataset in the local Hugging Face cache
    path: Optional[str] = None
    val_path: Optional[str] = None  # text/chat: the validation records; None: hold out val_fraction of the documents
    val_fraction: float = 0.02  # text/chat: of the documents; the token streams: of the tokens (the stream's tail)
    vocab_size: Optional[int] = None  # tokens the data can produce; None: from the source (256 for bytes)
    # text/chat: a directory with tokenizer.json (and tokenizer_config.json: EOS, chat template); None: the
    # model.init checkpoint's directory
    tokenizer: Optional[str] = None
    # chat: the tokens the loss counts: assistant (the assistant turns / completions; the rest labelled -100) | all
    loss_on: str = one_of("assistant", ("assistant", "all"))
    # text/chat: where tokenized data is cached by content hash; None: $STREAMTRAIN_DATA_CACHE, else
    # ~/.cache/streamtrain/data
    cache_dir: Optional[str] = None
    num_proc: int = 0  # text/chat: tokenization processes; 0: min(8, cores)


@dataclass
class LoggerConfig:
    # wandb (offline by default: runs sync later) | none (metrics.jsonl and the terminal only)
    name: str = one_of(MISSING, ("wandb", "none"))
    project: Optional[str] = None  # None: $WANDB_PROJECT, else "streamtrain"
    entity: Optional[str] = None  # None: $WANDB_ENTITY, else W&B's default entity
    mode: str = one_of("offline", ("offline", "online", "disabled"))  # WANDB_MODE in the environment wins
    group: Optional[str] = None  # None: the multirun sweep dir name, so a sweep's jobs group together
    tags: List[str] = field(default_factory=list)  # W&B run tags
    progress: str = one_of("auto", ("auto", "bar", "lines"))  # auto: a bar on a terminal


@dataclass
class EngineConfig:
    # stream (state in host RAM, layers streamed) | reference (all on one device: the oracle)
    name: str = one_of(MISSING, ("reference", "stream"))
    slots: int = 2  # stream: GPU layer slots in the ring
    grads_tier: str = one_of("auto", TIER_CHOICES)  # stream: where full gradients wait for the global norm
    activation_tier: str = one_of("auto", TIER_CHOICES)  # stream: where layer-input activations wait for the backward
    # stream: keep a layer's compute-dtype weights on the GPU from forward to backward
    cache_weights: str = one_of("auto", AUTO_ON_OFF)
    # stream: the three update places (engine/placement.py), in forward order. The first `gpu_resident_units` units
    # (embedding, layer 1, ...) keep master and moments in GPU memory; the next `gpu_streamed_units` keep them in host
    # RAM and are updated on the GPU as the next forward loads them; the rest are updated by the host AdamW.
    # -1: the planner's split (the fastest predicted step that fits)
    gpu_resident_units: int = -1
    gpu_streamed_units: int = -1  # see gpu_resident_units
    # stream: the last N decoder layers keep their forward's autograd graph for the backward instead of recomputing
    # it (saves 2 x params x tokens FLOPs per layer, costs that layer's saved activations in GPU memory);
    # -1: as many as the planner finds fastest (spare HBM spent on compute)
    keep_activation_layers: int = -1
    # stream, the lean layer (train.lean_layer): the last N recomputed layers keep their attention output and its
    # log-sum-exp on the GPU from the forward, so their backward does not run attention's forward again (2 B x heads
    # x head_dim per token and layer); -1: as many as the HBM the chosen placement leaves allows (0 without the lean
    # layer)
    kept_attention_layers: int = -1
    # stream: recompute groups. Of the recomputed layers, only every N-th layer input is kept for the backward, which
    # regenerates the others group by group from it (N - 1 extra layer forwards per group, the group's N inputs on
    # the GPU meanwhile); -1: 1 (every input kept), or the smallest N with which the plan fits
    recompute_group: int = -1
    # stream: Triton gradient accumulation (streamtrain_kernels/grad_accum.py); off: torch ops
    fused_kernels: bool = True
    # stream: the Adam moments of the last N host-updated units live in the NVMe tier's file (hardware.nvme_dir);
    # -1: as few as the host memory plan needs (none without hardware.nvme_dir)
    nvme_units: int = -1
    # stream, bf16 gradients (train.grad_dtype): the held gradients of the last N GPU-streamed units wait for their
    # update in pinned host memory instead of GPU memory (2 B/param more over D2H in the backward and over H2D at
    # the update); -1: as few as the GPU memory plan needs
    host_grad_units: int = -1
    # stream: clip without holding gradients. on: a first backward takes the global gradient norm only, a second
    # computes the gradients again and updates each unit as soon as its gradient is finished, so no gradient waits
    # for the norm (exact; one more head and backward a step, each GPU-streamed unit's state crosses the link in the
    # backward instead of at the next forward). It recomputes every layer (no kept graphs or attention outputs, no
    # cached weights) and needs fp32 gradients and one process; auto: on only where no plan fits with the hold
    norm_pass: str = one_of("auto", AUTO_ON_OFF)
    # stream, several ranks (torchrun): each rank holds and updates the host state of its own units only, and
    # broadcasts their weights to the others (engine/distributed.py); false: every rank holds all of it
    shard_state: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0  # seeds initialisation, data order and stochastic rounding
    plan: bool = False  # print the memory plan and exit


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


# ---------------------------------------------------------------------------------------------------------------------
# Keys


def _unknown_key(path: str, section: type, prefix: str) -> ConfigError:
    if path in RENAMED:
        return ConfigError(f"{path} was renamed {RENAMED[path]}")
    valid = ", ".join(sorted(f.name for f in fields(section)))
    if prefix:
        return ConfigError(f"{path} is not a config key; valid keys of {prefix.rstrip('.')}: {valid}")
    groups = ", ".join(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")))
    return ConfigError(f"{path} is not a config key or config group; valid top-level keys: {valid}; "
                       f"config groups: {groups}")


def schema_field(path: str) -> Any:
    """The type of the schema field at the dotted `path`; ConfigError if the schema has no such key. Below a field
    that holds a container (rope_scaling, tags) any key is accepted: validate checks the contents."""
    node: Any = Config
    parts = path.split(".")
    for i, name in enumerate(parts):
        prefix = ".".join(parts[:i]) + "." if i else ""
        if not is_dataclass(node):
            if node is Any or typing.get_origin(node) in (list, dict):
                return node
            raise ConfigError(f"{path} is not a config key: {prefix.rstrip('.')} holds {_describe(node)}, "
                              "not a section")
        hints = typing.get_type_hints(node)
        if name not in hints:
            raise _unknown_key(".".join(parts[:i + 1]), node, prefix)
        node = hints[name]
    return node


def _describe(tp: Any) -> str:
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in words:
        return words[tp]
    if typing.get_origin(tp) is typing.Union:
        return f"{_describe(next(a for a in typing.get_args(tp) if a is not type(None)))} or null"
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if is_dataclass(item):
            return f"a list of entries with the keys {', '.join(f.name for f in fields(item))}"
        return "a list, like [a, b]"
    return "a value"


def _check_keys(node: DictConfig, section: type, prefix: str = "") -> None:
    hints = typing.get_type_hints(section)
    for key in node:
        if key not in hints:
            raise _unknown_key(f"{prefix}{key}", section, prefix)
        if is_dataclass(hints[key]):
            _check_keys(node[key], hints[key], f"{prefix}{key}.")
    for key in hints:
        if OmegaConf.is_missing(node, key):
            group = prefix.rstrip(".") or key
            raise ConfigError(f"{prefix}{key} is not set; pick a config group option ({group}=<option>, one of the "
                              f"files in conf/{group}/) or set {prefix}{key}=<value>")


def check_overrides(overrides: Iterable[str], conf_dirs: Iterable[Path] = (CONF_DIR,)) -> None:
    """Refuse command-line overrides that name no schema key, name a renamed key, or give a value (each value of a
    sweep) that the field's type does not accept. Config group choices (`model=qwen7b`, `experiment=...`) and
    Hydra's own `hydra.*` keys are left to Hydra, which lists a group's options when one does not exist."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.errors import OmegaConfBaseException

    parser = OverridesParser.create()
    typed = OmegaConf.structured(Config)
    group_dirs = list(conf_dirs)
    for override in parser.parse_overrides(list(overrides)):
        key = override.key_or_group
        if key == "experiment" and override.is_add():
            raise ConfigError(f"{override.input_line}: experiments are chosen without the '+' now (the group is in "
                              f"the defaults list): experiment={override.value()}")
        if override.is_hydra_override() or override.package is not None \
                or any((d / key).is_dir() for d in group_dirs):
            continue
        schema_field(key)
        if override.is_delete():
            continue
        if not override.is_sweep_override():
            values = [(override.get_value_element_as_str(), override.value())]
        elif override.is_discrete_sweep():
            values = [(text, parser.parse_override(f"{key}={text}").value())
                      for text in override.sweep_string_iterator()]
        else:
            continue  # an interval sweep's values exist only once a sweeper plugin draws them
        for text, value in values:
            try:
                OmegaConf.update(typed, key, value, merge=True)
            except OmegaConfBaseException as err:
                raise ConfigError(f"{key}={text} is not valid: {key} takes {_describe(schema_field(key))}") from err


# ---------------------------------------------------------------------------------------------------------------------
# Values


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: int, minimum: int = 1, why: str = "") -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}{why}")


def _real(key: str, value: float, low: float, high: float = math.inf, *, low_open: bool = False,
          high_open: bool = False, why: str = "") -> None:
    """A finite number within the interval (low_open/high_open: that bound excluded)."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        if high == math.inf:
            interval = f"{'>' if low_open else '>='} {low:g}"
        else:
            interval = f"within {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{key}={value} must be a finite number {interval}{why}")


def _name(key: str, value: Optional[str], optional: bool = False) -> None:
    if value is None and optional:
        return
    if not value or not value.strip():
        raise ConfigError(f"{key}={value!r} must be a non-empty string{' or null' if optional else ''}")


def validate(cfg: DictConfig) -> None:
    """Checks that need more than types. Raises ConfigError naming the key; allocates nothing."""
    _check_keys(cfg, Config)
    _validate_choices(cfg, Config)
    _validate_model(cfg)
    _validate_train(cfg)
    _validate_hardware(cfg)
    _validate_data(cfg)
    _validate_logger(cfg)
    _validate_engine(cfg)
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} must be within [0, 2**63)")


def _validate_choices(node: DictConfig, section: type, prefix: str = "") -> None:
    """Every field declared with `one_of`, in every section: its value is one of the field's choices."""
    hints = typing.get_type_hints(section)
    for f in fields(section):
        if "choices" in f.metadata:
            _choice(f"{prefix}{f.name}", node[f.name], f.metadata["choices"])
        elif is_dataclass(hints[f.name]):
            _validate_choices(node[f.name], hints[f.name], f"{prefix}{f.name}.")


def _validate_data(cfg: DictConfig) -> None:
    d = cfg.data
    if d.name == "memmap":
        if not d.path:
            raise ConfigError("data=memmap needs data.path=<tokens .bin written by `python -m engine.data prepare`>")
        if not os.path.isfile(d.path):
            raise ConfigError(f"data.path={d.path!r}: no such file; write it with `python -m engine.data prepare`")
    elif d.name in PACKED_SOURCES:
        if not d.path:
            raise ConfigError(f"data={d.name} needs data.path=<a json/jsonl/parquet/arrow/csv/txt file, a folder of "
                              "them, or a dataset name in the local Hugging Face cache>")
        if d.tokenizer is None and not cfg.model.init.startswith("hf:"):
            raise ConfigError(f"data={d.name} tokenizes with the model's tokenizer: set model.init=hf:<checkpoint dir> "
                              "or data.tokenizer=<dir with tokenizer.json>")
    elif d.path is not None:
        raise ConfigError(f"data.path={d.path!r} is read by data=memmap, text and chat only; got data={d.name}")
    if d.name not in PACKED_SOURCES:
        for key in ("val_path", "tokenizer"):
            if d[key] is not None:
                raise ConfigError(f"data.{key}={d[key]!r} is read by data=text and chat only; got data={d.name}")
    _real("data.val_fraction", d.val_fraction, 0, 1, low_open=True, high_open=True)
    if d.vocab_size is not None:
        _positive("data.vocab_size", d.vocab_size)
    _positive("data.num_proc", d.num_proc, 0)


def _validate_logger(cfg: DictConfig) -> None:
    lg = cfg.logger
    _name("logger.project", lg.project, optional=True)
    _name("logger.entity", lg.entity, optional=True)
    _name("logger.group", lg.group, optional=True)
    for tag in lg.tags:
        if not tag or len(tag) > 64:
            raise ConfigError(f"logger.tags has {tag!r}; a W&B tag is 1 to 64 characters")


def _set_formats(train: DictConfig) -> str:
    """The state-format fields set to a dtype, as overrides (for messages)."""
    return " ".join(f"train.{f}={train[f]}" for f in formats.FIELDS if train[f] != formats.AUTO)


def exact_state_required(cfg: DictConfig) -> bool:
    """Settings that run fp32 state only (the NVMe tier, bf16 gradient transfer, the fp32 update kernel): with
    them `auto` state formats can only be all-fp32."""
    t = cfg.train
    return cfg.engine.nvme_units > 0 or t.grad_transfer_dtype == "bf16" or t.fp32_update == "kernel"


def _validate_engine(cfg: DictConfig) -> None:
    e = cfg.engine
    _positive("engine.slots", e.slots, 2)
    _positive("engine.gpu_resident_units", e.gpu_resident_units, -1)
    _positive("engine.gpu_streamed_units", e.gpu_streamed_units, -1)
    _positive("engine.keep_activation_layers", e.keep_activation_layers, -1)
    _positive("engine.kept_attention_layers", e.kept_attention_layers, -1)
    if e.kept_attention_layers > cfg.model.num_hidden_layers:
        raise ConfigError(f"engine.kept_attention_layers={e.kept_attention_layers} must be <= "
                          f"model.num_hidden_layers={cfg.model.num_hidden_layers} (or -1: as many as fit)")
    if e.keep_activation_layers > cfg.model.num_hidden_layers:
        raise ConfigError(f"engine.keep_activation_layers={e.keep_activation_layers} must be <= "
                          f"model.num_hidden_layers={cfg.model.num_hidden_layers}")
    _positive("engine.nvme_units", e.nvme_units, -1)
    _positive("engine.host_grad_units", e.host_grad_units, -1)
    why_no_host_grads = {"fp32": "holds none (fp32 gradients have engine.grads_tier)",
                         "int8": "holds its gradients on the GPU only"}.get(cfg.train.grad_dtype)
    if e.host_grad_units > 0 and why_no_host_grads:
        raise ConfigError(f"engine.host_grad_units={e.host_grad_units} places held bf16 gradients, and "
                          f"train.grad_dtype={cfg.train.grad_dtype} {why_no_host_grads}; use "
                          "train.grad_dtype=bf16 or auto, or engine.host_grad_units=-1 or 0")
    _validate_norm_pass(cfg)
    inexact = _set_formats(cfg.train) if formats.fixed_inexact(cfg.train) else None
    if e.nvme_units > 0 and inexact:
        raise ConfigError(f"engine.nvme_units={e.nvme_units}: the NVMe tier holds the fp32 moments of host-updated "
                          f"units, and {inexact} updates every unit on the GPU; use engine.nvme_units=-1 or 0")
    if cfg.train.grad_transfer_dtype == "bf16":
        why = ("engine=reference sends no gradients to the host" if e.name == "reference" else
               f"{inexact} updates every unit on the GPU, so no gradient goes to the host" if inexact else None)
        if why:
            raise ConfigError(f"train.grad_transfer_dtype=bf16 applies to the gradients engine=stream sends to the "
                              f"host AdamW, which runs fp32 state only; here {why}. Valid: "
                              "train.grad_transfer_dtype=fp32, or bf16 with engine=stream and train.master_dtype, "
                              "train.moments_dtype and train.grad_dtype all fp32")
    if cfg.train.fp32_update == "kernel":
        why = (f"engine={e.name} updates fp32 state with torch's AdamW" if e.name != "reference"
               else f"{inexact} is always updated by the kernel" if inexact else None)
        if why:
            raise ConfigError(f"train.fp32_update=kernel runs engine=reference's fp32 state through the fused update "
                              f"kernel; here {why}. Valid: train.fp32_update=torch, or kernel with engine=reference "
                              "and train.master_dtype, train.moments_dtype and train.grad_dtype all fp32")
    if e.recompute_group == 0 or e.recompute_group < -1:
        raise ConfigError(f"engine.recompute_group={e.recompute_group} is not valid; use -1 (auto) or a number of "
                          "layers per recompute group >= 1")
    if e.recompute_group > cfg.model.num_hidden_layers:
        raise ConfigError(f"engine.recompute_group={e.recompute_group} must be <= "
                          f"model.num_hidden_layers={cfg.model.num_hidden_layers}")
    if e.name == "stream" and not cfg.train.activation_checkpointing:
        raise ConfigError("train.activation_checkpointing=false does not apply to engine=stream, which keeps layer "
                          "inputs and recomputes each layer in the backward (all but the last "
                          "engine.keep_activation_layers); engine=reference honours false")


# the engine settings a norm pass (engine.norm_pass) allows, each with the values it allows: the others keep what its
# first backward would consume (kept graphs, kept attention outputs, cached weights) or hold a gradient. The last
# value of each is the one a norm pass runs with
NORM_PASS_ENGINE_VALUES = {"grads_tier": ("auto", "host"), "keep_activation_layers": (-1, 0),
                           "kept_attention_layers": (-1, 0), "cache_weights": ("auto", "off"),
                           "host_grad_units": (-1, 0)}


def norm_pass_conflicts(engine) -> List[str]:
    """The settings of `engine` (the engine config, or any object with its fields) that rule a norm pass out, as
    `engine.<key>=<value>`."""
    return [f"engine.{key}={getattr(engine, key)}" for key, allowed in NORM_PASS_ENGINE_VALUES.items()
            if getattr(engine, key) not in allowed]


def _validate_norm_pass(cfg: DictConfig) -> None:
    """engine.norm_pass=on against the settings that keep or hold what its first backward cannot leave behind."""
    e = cfg.engine
    if e.norm_pass != "on":
        return
    grads = [] if cfg.train.grad_dtype in ("auto", "fp32") else [f"train.grad_dtype={cfg.train.grad_dtype}"]
    conflicts = grads + norm_pass_conflicts(e)
    if conflicts:
        raise ConfigError(f"engine.norm_pass=on holds no gradient and recomputes every layer, which "
                          f"{', '.join(conflicts)} contradicts; leave those at auto (-1) or set "
                          "train.grad_dtype=fp32, engine.grads_tier=host, engine.keep_activation_layers=0, "
                          "engine.kept_attention_layers=0, engine.cache_weights=off, engine.host_grad_units=0; "
                          "or engine.norm_pass=off")


def _validate_model(cfg: DictConfig) -> None:
    m = cfg.model
    _name("model.name", m.name)
    family = {"qwen2": (True, False), "qwen3": (False, True), "llama": (False, False), "qwen3_moe": (False, True),
              "gpt_oss": (False, False)}[m.model_type]
    if (m.qkv_bias, m.qk_norm) != family:
        raise ConfigError(f"model.model_type={m.model_type} has model.qkv_bias={family[0]} and model.qk_norm="
                          f"{family[1]} in its HF architecture; got model.qkv_bias={m.qkv_bias}, "
                          f"model.qk_norm={m.qk_norm}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        _positive(f"model.{key}", m[key])
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
                          f"model.num_key_value_heads={m.num_key_value_heads}")
    if m.head_dim is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                              f"{m.num_attention_heads}; set model.head_dim explicitly")
        derived = m.hidden_size // m.num_attention_heads
        if derived % 2:
            raise ConfigError(f"model.hidden_size / model.num_attention_heads = {derived} is odd; rotary embeddings "
                              "need an even head_dim (set model.head_dim)")
    elif m.head_dim < 2 or m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be an even integer >= 2 (rotary embeddings) or null")
    _real("model.rope_theta", m.rope_theta, 0, low_open=True)
    _validate_rope_scaling(m.rope_scaling)
    _real("model.rms_norm_eps", m.rms_norm_eps, 0, low_open=True)
    for key in ("bos_token_id", "eos_token_id"):
        if m[key] is not None and not 0 <= m[key] < m.vocab_size:
            raise ConfigError(f"model.{key}={m[key]} must be a token id within [0, model.vocab_size={m.vocab_size}) "
                              "or null")
    if m.expected_params is not None:
        _positive("model.expected_params", m.expected_params)
    if m.init != "random":
        if not m.init.startswith("hf:") or len(m.init) == 3:
            raise ConfigError(f"model.init={m.init!r} is not valid; use 'random', 'hf:<checkpoint dir>' or "
                              "'hf:<org>/<name>' (a Hugging Face Hub id)")
        hf_dir = os.path.expanduser(m.init[3:])
        if not is_hub_id(m.init[3:]) and not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise ConfigError(f"model.init={m.init!r}: {hf_dir} is not an HF checkpoint directory (no config.json)")
    _real("model.init_std", m.init_std, 0, low_open=True)
    _validate_moe(m)


def _validate_moe(m: DictConfig) -> None:
    moe = m.model_type in MOE_MODEL_TYPES
    if not moe:
        for key, dense_value in (("num_experts", 0), ("attention_bias", False), ("swiglu_limit", None),
                                 ("sliding_window", None), ("layer_types", None)):
            if m[key] != dense_value:
                raise ConfigError(f"model.{key}={m[key]} is only used by model_type in {MOE_MODEL_TYPES}; "
                                  f"model.model_type={m.model_type} needs model.{key}={dense_value}")
        return
    gpt_oss = m.model_type == "gpt_oss"
    if m.attention_bias != gpt_oss:
        raise ConfigError(f"model.model_type={m.model_type} has model.attention_bias={gpt_oss} in its HF "
                          f"architecture; got {m.attention_bias}")
    _positive("model.num_experts", m.num_experts)
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        raise ConfigError(f"model.num_experts_per_tok={m.num_experts_per_tok} must be within [1, "
                          f"model.num_experts={m.num_experts}]")
    if m.moe_intermediate_size is None:
        raise ConfigError(f"model.moe_intermediate_size is required for model_type={m.model_type} (the width of "
                          "one expert's MLP)")
    _positive("model.moe_intermediate_size", m.moe_intermediate_size)
    _real("model.router_aux_loss_coef", m.router_aux_loss_coef, 0)
    if gpt_oss and m.swiglu_limit is None:
        raise ConfigError("model.swiglu_limit is required for model_type=gpt_oss (7.0 in the published configs)")
    if m.swiglu_limit is not None:
        if not gpt_oss:
            raise ConfigError(f"model.swiglu_limit={m.swiglu_limit} is a gpt-oss field; model_type={m.model_type} "
                              "needs null")
        _real("model.swiglu_limit", m.swiglu_limit, 0, low_open=True)
    if m.layer_types is not None:
        # longer is allowed: a depth-truncated run (model.num_hidden_layers lowered) uses the first layers' types
        if len(m.layer_types) < m.num_hidden_layers:
            raise ConfigError(f"model.layer_types has {len(m.layer_types)} entries for model.num_hidden_layers="
                              f"{m.num_hidden_layers}; give one per layer")
        for i, kind in enumerate(m.layer_types):
            _choice(f"model.layer_types[{i}]", kind, LAYER_TYPES)
        if "sliding_attention" in m.layer_types and m.sliding_window is None:
            raise ConfigError("model.layer_types has sliding_attention layers but model.sliding_window is null")
    if m.sliding_window is not None:
        _positive("model.sliding_window", m.sliding_window)


YARN_KEYS = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "truncate", "attention_factor")


def _validate_rope_scaling(rs: Any) -> None:
    if rs is None:
        return
    valid = (f"null, {{rope_type: default}}, {{rope_type: llama3, {', '.join(LLAMA3_KEYS)}}} or {{rope_type: yarn, "
             f"{', '.join(YARN_KEYS)}[, {', '.join(YARN_OPTIONAL_KEYS)}]}}")
    if not isinstance(rs, DictConfig) or rs.get("rope_type") not in ("llama3", "yarn", "default"):
        raise ConfigError(f"model.rope_scaling={rs!r} is not supported; valid: {valid}")
    required = {"default": (), "llama3": LLAMA3_KEYS, "yarn": YARN_KEYS}[rs.rope_type]
    allowed = {"rope_type", *required, *(YARN_OPTIONAL_KEYS if rs.rope_type == "yarn" else ())}
    extra = sorted(set(rs.keys()) - allowed)
    if extra:
        raise ConfigError(f"model.rope_scaling has {', '.join(extra)}, which rope_type={rs.rope_type} does not take; "
                          f"valid: {valid}")
    missing = [k for k in required if k not in rs]
    if missing:
        raise ConfigError(f"model.rope_scaling ({rs.rope_type}) lacks {', '.join(missing)}")
    numbers = [k for k in (*required, *YARN_OPTIONAL_KEYS) if k in rs and k != "truncate" and rs[k] is not None]
    for key in numbers:
        if isinstance(rs[key], bool) or not isinstance(rs[key], (int, float)):
            raise ConfigError(f"model.rope_scaling.{key}={rs[key]!r} must be a number")
    if rs.rope_type == "default":
        return
    _real("model.rope_scaling.factor", rs.factor, 1)
    if rs.rope_type == "llama3":
        _real("model.rope_scaling.low_freq_factor", rs.low_freq_factor, 0, low_open=True)
        _real("model.rope_scaling.high_freq_factor", rs.high_freq_factor, rs.low_freq_factor, low_open=True,
              why=" (above low_freq_factor)")
    elif "truncate" in rs and not isinstance(rs.truncate, bool):
        raise ConfigError(f"model.rope_scaling.truncate={rs.truncate!r} must be true or false")
    if not isinstance(rs.original_max_position_embeddings, int):
        raise ConfigError(f"model.rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings}"
                          " must be an integer")
    _positive("model.rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings)


def _validate_train(cfg: DictConfig) -> None:
    m, t = cfg.model, cfg.train
    _positive("train.steps", t.steps)
    _positive("train.seq_len", t.seq_len)
    _positive("train.micro_batch_size", t.micro_batch_size)
    if t.grad_accum != GRAD_ACCUM_AUTO:
        _positive("train.grad_accum", t.grad_accum, why=f", or {GRAD_ACCUM_AUTO} (auto: chosen by the plan)")
    _positive("train.log_every", t.log_every)
    _positive("train.val_every", t.val_every, -1)
    _positive("train.val_batches", t.val_batches)
    _positive("train.warmup_steps", t.warmup_steps, 0)
    _real("train.lr", t.lr, 0, low_open=True)
    _real("train.min_lr_ratio", t.min_lr_ratio, 0, 1)
    _real("train.weight_decay", t.weight_decay, 0)
    _real("train.beta1", t.beta1, 0, 1, high_open=True)
    _real("train.beta2", t.beta2, 0, 1, high_open=True)
    _real("train.eps", t.eps, 0, low_open=True)
    _real("train.max_grad_norm", t.max_grad_norm, 0, why=" (0 disables clipping)")
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings} of model={m.name}; raise model.max_position_embeddings to "
                          "train past the published context")
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if t.deterministic and workspace is not None and workspace not in CUBLAS_DETERMINISTIC_WORKSPACES:
        raise ConfigError(f"train.deterministic=true, but the environment sets CUBLAS_WORKSPACE_CONFIG={workspace!r}, "
                          f"under which cuBLAS is not reproducible; unset it (the run then sets "
                          f"{CUBLAS_DETERMINISTIC_WORKSPACES[0]}) or use one of "
                          f"{', '.join(CUBLAS_DETERMINISTIC_WORKSPACES)}")
    lo, hi = BLOCK_SIZE_RANGE
    if not lo <= t.moments_block_size <= hi or t.moments_block_size & (t.moments_block_size - 1):
        raise ConfigError(f"train.moments_block_size={t.moments_block_size} is not valid; use a power of two in "
                          f"[{lo}, {hi}] (elements per fp32 scale of the int8 moments)")
    if t.mlp_chunk_tokens < -1:
        raise ConfigError(f"train.mlp_chunk_tokens={t.mlp_chunk_tokens} is not valid; use -1 (auto), 0 (off) or a "
                          "positive number of tokens per chunk")
    if t.resume not in ("none", "auto") and not os.path.isdir(os.path.expanduser(t.resume)):
        raise ConfigError(f"train.resume={t.resume!r} is not valid; use none, auto, or an existing checkpoint "
                          "directory (a run dir or its checkpoints/step_<N>)")
    _name("train.checkpoint_dir", t.checkpoint_dir, optional=True)
    if t.checkpoint_dir and os.path.exists(os.path.expanduser(t.checkpoint_dir)) \
            and not os.path.isdir(os.path.expanduser(t.checkpoint_dir)):
        raise ConfigError(f"train.checkpoint_dir={t.checkpoint_dir!r} is a file; it must be a directory (created "
                          "when missing) or null for <run dir>/checkpoints")
    for key in ("checkpoint_every", "keep_checkpoints", "stop_at", "max_consecutive_skips"):
        _positive(f"train.{key}", t[key], 0)
    _real("train.checkpoint_minutes", t.checkpoint_minutes, 0, why=" (0: no saves by time)")


TFLOPS_FIGURES = tuple(f"{k}_tflops_{mode}" for mode in ("compiled", "eager") for k in ("fwd", "bwd", "head"))
TRANSFER_FIGURES = ("h2d_gbps", "d2h_gbps", "bidir_gbps", "cpu_adam_gparams_per_s", "cpu_adam_gparams_per_s_under_pcie")
ATTENTION_FIGURES = ("attn_fwd_tflops", "attn_bwd_tflops")
MOE_FIGURES = tuple(f"{k}_tflops_{mode}" for mode in ("compiled", "eager") for k in ("fwd", "bwd"))
HARDWARE_FIGURES = ("gpu_mem_gib", "gpu_mem_cap_gib", "peak_bf16_tflops", "peak_fp32_tflops", "host_mem_gib",
                    "profile_host_mem_gib", "host_process_gib", "nvme_gib", "nvme_gbps", *TFLOPS_FIGURES,
                    *ATTENTION_FIGURES, *TRANSFER_FIGURES, "bidir_gbps_under_adam",
                    "host_compile_workers_gib", "lean_step_ratio_sdpa", "lean_step_ratio_triton", "moe_step_ratio",
                    "cpu_adam_gparams_per_s_in_step")
# what 0 means for the figures where it is not "unknown"
ZERO_MEANS = {"host_mem_gib": "this machine's memory",
              "profile_host_mem_gib": "unknown: a plan for this profile uses the memory of the machine it runs on",
              "gpu_mem_cap_gib": "no cap", "nvme_gib": "no NVMe tier",
              "bidir_gbps_under_adam": "not measured: the link as fast under the host AdamW as alone",
              "lean_step_ratio_sdpa": "not measured: the lean layer at the time model's figures",
              "lean_step_ratio_triton": "not measured: the lean layer at the time model's figures",
              "moe_step_ratio": "not measured: MoE layers at their calibrated figures",
              "cpu_adam_gparams_per_s_in_step": "not measured: the host AdamW at cpu_adam_gparams_per_s_under_pcie"}


def _validate_layer_widths(hw: DictConfig) -> None:
    _positive("hardware.layer_hidden", hw.layer_hidden, 0)
    if not hw.layer_widths:
        return
    if hw.layer_hidden < 1 or not hw.layer_model:
        raise ConfigError(f"hardware.layer_widths has {len(hw.layer_widths)} entries while hardware.layer_hidden="
                          f"{hw.layer_hidden}, hardware.layer_model={hw.layer_model!r}: the other widths are placed "
                          "beside the main layer figures' width; set both (python -m engine.calibrate writes them)")
    seen = {hw.layer_hidden: f"hardware.layer_hidden ({hw.layer_model})"}
    for i, width in enumerate(hw.layer_widths):
        key = f"hardware.layer_widths[{i}]"
        _name(f"{key}.model", width.model)
        _positive(f"{key}.hidden", width.hidden)
        if width.hidden in seen:
            raise ConfigError(f"{key}.hidden={width.hidden} ({width.model}) repeats the width of {seen[width.hidden]}; "
                              "give each calibrated width once")
        seen[width.hidden] = f"{key} ({width.model})"
        for k in TFLOPS_FIGURES:
            _real(f"{key}.{k}", width[k], 0, why=" (0: not measured)")
        _layer_figures_together(width, key)


def _validate_moe_layers(hw: DictConfig) -> None:
    seen = {}
    for i, entry in enumerate(hw.moe_layers):
        key = f"hardware.moe_layers[{i}]"
        _name(f"{key}.model", entry.model)
        for k in ("hidden", "experts", "experts_per_token", "expert_width", "tokens"):
            _positive(f"{key}.{k}", entry[k])
        if entry.experts_per_token > entry.experts:
            raise ConfigError(f"{key}.experts_per_token={entry.experts_per_token} exceeds {key}.experts="
                              f"{entry.experts}")
        for k in MOE_FIGURES:
            _real(f"{key}.{k}", entry[k], 0, why=" (0: not measured)")
        for mode in ("compiled", "eager"):
            fwd, bwd = f"fwd_tflops_{mode}", f"bwd_tflops_{mode}"  # the dense layer's figures have the same names
            if (entry[fwd] > 0) != (entry[bwd] > 0) or (entry[fwd] > 0 and hw[fwd] <= 0):
                raise ConfigError(f"{key}.{fwd}={entry[fwd]}, {key}.{bwd}={entry[bwd]}, hardware.{fwd}="
                                  f"{hw[fwd]}: a mode's MoE figures are used together, with the dense figures of "
                                  "that mode (python -m engine.calibrate --moe-models measures them), or both 0")
        if (entry.model, entry.tokens) in seen:
            raise ConfigError(f"{key} ({entry.model} at {entry.tokens} tokens) repeats {seen[entry.model, entry.tokens]}"
                              "; give each model and micro-batch size once")
        seen[entry.model, entry.tokens] = key


def _validate_attn_points(hw: DictConfig) -> None:
    if not hw.attn_points:
        return
    if hw.attn_fwd_tflops <= 0:
        raise ConfigError(f"hardware.attn_points has {len(hw.attn_points)} entries without the main attention "
                          "figures (hardware.attn_fwd_tflops, ...): python -m engine.calibrate --attn-points writes "
                          "both")
    seen = {(hw.attn_backend, hw.attn_seq_len): "hardware.attn_backend / attn_seq_len"}
    for i, point in enumerate(hw.attn_points):
        key = f"hardware.attn_points[{i}]"
        _choice(f"{key}.backend", point.backend, ATTENTION_BACKENDS[1:])
        _positive(f"{key}.seq_len", point.seq_len)
        for k in ("fwd_tflops", "bwd_tflops"):
            _real(f"{key}.{k}", point[k], 0, low_open=True)
        if (point.backend, point.seq_len) in seen:
            raise ConfigError(f"{key} ({point.backend} at {point.seq_len} tokens) repeats the point of "
                              f"{seen[point.backend, point.seq_len]}; give each backend and length once")
        seen[point.backend, point.seq_len] = key


def _layer_figures_together(node: DictConfig, key: str) -> None:
    """A mode's layer and head figures (LayerFigures) are used together: all of them set, or none."""
    for mode in ("compiled", "eager"):
        mode_keys = [k for k in TFLOPS_FIGURES if k.endswith(mode)]
        known = [k for k in mode_keys if node[k] > 0]
        if known and len(known) < len(mode_keys):
            missing = [k for k in mode_keys if k not in known]
            raise ConfigError(f"{key}.{missing[0]}={node[missing[0]]} while {key}.{known[0]}={node[known[0]]}: "
                              f"the {mode} figures are used together; set all of {', '.join(mode_keys)} "
                              "(python -m engine.calibrate measures them) or none")


def _validate_hardware(cfg: DictConfig) -> None:
    hw = cfg.hardware
    _name("hardware.name", hw.name)
    for key in HARDWARE_FIGURES:
        _real(f"hardware.{key}", hw[key], 0, why=f" (0: {ZERO_MEANS.get(key, 'unknown')})")
    _layer_figures_together(hw, "hardware")
    _validate_layer_widths(hw)
    _positive("hardware.attn_seq_len", hw.attn_seq_len, 0)
    _positive("hardware.gpus", hw.gpus)
    if any(hw[k] > 0 for k in ATTENTION_FIGURES):
        if min(hw[k] for k in ATTENTION_FIGURES) <= 0 or hw.attn_seq_len < 1 or not hw.attn_backend:
            raise ConfigError(f"hardware.attn_fwd_tflops={hw.attn_fwd_tflops}, hardware.attn_bwd_tflops="
                              f"{hw.attn_bwd_tflops}, hardware.attn_seq_len={hw.attn_seq_len}, hardware.attn_backend="
                              f"{hw.attn_backend!r}: the attention figures are used together; set both rates > 0, "
                              f"the length >= 1 and the backend one of {', '.join(ATTENTION_BACKENDS[1:])} "
                              "(python -m engine.calibrate measures them), or both rates to 0")
        if not any(hw[k] > 0 for k in TFLOPS_FIGURES):
            raise ConfigError(f"hardware.attn_fwd_tflops={hw.attn_fwd_tflops}, hardware.attn_bwd_tflops="
                              f"{hw.attn_bwd_tflops} without layer figures: they time a layer's attention beside its "
                              "other FLOPs (hardware.fwd_tflops_<mode>, python -m engine.calibrate measures both)")
    _validate_attn_points(hw)
    _validate_moe_layers(hw)
    if any(hw[k] > 0 for k in TFLOPS_FIGURES):
        for key in TRANSFER_FIGURES:
            _real(f"hardware.{key}", hw[key], 0, low_open=True,
                  why=" when TFLOPS figures are set: the planner's step-time model divides by it (python -m "
                      "engine.calibrate measures it), or set the TFLOPS figures to 0 for no prediction")
    if hw.nvme_gib > 0 or (cfg.engine.nvme_units > 0 and not cfg.plan):
        if not hw.nvme_dir:
            raise ConfigError(f"hardware.nvme_gib={hw.nvme_gib}, engine.nvme_units={cfg.engine.nvme_units}: the NVMe "
                              "tier needs hardware.nvme_dir (a directory on a local disk)")
        if not cfg.plan and not os.path.isdir(os.path.expanduser(hw.nvme_dir)):
            raise ConfigError(f"hardware.nvme_dir={hw.nvme_dir} is not a directory")
    if hw.device == "cuda" and cfg.plan:
        _real("hardware.gpu_mem_gib", hw.gpu_mem_gib, 0, low_open=True,
              why=f" for plan=true with hardware={hw.name}: it is the GPU memory planned for")
    if hw.device == "cuda" and not cfg.plan:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"hardware={hw.name} runs on CUDA (hardware.device=cuda) but torch sees no CUDA device "
                              f"(torch {torch.__version__}); train on this machine with hardware=cpu or hardware=auto, "
                              f"or add plan=true to print the memory plan for {hw.name} without a GPU")


def to_plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
