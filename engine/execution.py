"""What a run will execute, decided in one place: compiled templates or eager, torch.compile's worker pool, the fused
LM head + cross-entropy, the attention backend, the MLP's token chunk and the lean long-context layer.

The planner prices exactly what the trainer then runs, so both read one `Execution`, resolved once from the config
and the device kind. `train.compile=auto` and `train.fused_loss=auto` are on with CUDA (on a CPU the Triton loss
kernel runs only under the interpreter, the tests' business); the compile workers run unless the templates run
eager or `train.compile_in_process` builds their kernels in the training process; `train.attention=auto` resolves
as engine/model/attention.py says. A plan for other hardware (`plan=true`) may name a backend that cannot run here:
it keeps the asked-for name (`strict=False`), where the trainer refuses the run (`strict=True`). With
`train.lean_layer=auto` on a GPU, the plain and the lean layer are both priced (`Execution.choices`) and the plan
takes the faster that fits (engine/plan/build.py): which layer is faster at a length depends on what each lets the
placement keep, which only the plan knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from engine.config import PACKED_SOURCES, ConfigError
from engine.device import resolve_compute_dtype
from engine.model.attention import resolve_attention
from engine.model.dense import LayerCompute, resolve_mlp_chunk_tokens
from engine.model.lean import lean_layer_wanted, resolve_lean_layer
from engine.model.lean_attention import CUDNN_ATTENTION_DTYPES, fused_sdpa_runs


@dataclass(frozen=True)
class Execution:
    on_gpu: bool
    compiled: bool  # the layer and head templates are torch.compiled
    compile_workers: bool  # Inductor's pool of compile worker processes is started
    fused_loss: bool  # the fused Triton LM head + cross-entropy
    attention: str  # a resolved backend (triton | sdpa | flash_attn), or the asked-for name a plan could not resolve
    mlp_chunk_tokens: int  # 0: the MLP block over all of a micro-batch's tokens at once
    lean: bool  # the lean long-context layer (engine/model/lean.py)

    @classmethod
    def of(cls, spec, cfg, on_gpu: bool, strict: bool = False) -> "Execution":
        """`strict`: a backend (or lean layer) that cannot run on this device is a ConfigError (else the asked-for
        name is kept)."""
        t = cfg.train
        try:
            return cls._resolve(spec, cfg, on_gpu, strict, t.lean_layer)
        except ConfigError:
            if strict:
                raise
            return cls._resolved(cfg, on_gpu, t.attention, t.lean_layer == "on")

    @classmethod
    def choices(cls, spec, cfg, on_gpu: bool, strict: bool = False) -> List["Execution"]:
        """The executions a plan chooses among (engine/plan/build.py, the faster that fits): with
        `train.lean_layer=auto` on a GPU where both layers run, `of`'s (the lean layer above AUTO_LEAN_MIN_TOKENS a
        micro-batch, the plain one below) and the other; otherwise `of`'s alone. Off the GPU nothing is timed, and
        `auto` keeps `of`'s rule."""
        first = cls.of(spec, cfg, on_gpu, strict)
        if cfg.train.lean_layer != "auto" or not on_gpu:
            return [first]
        try:
            other = cls._resolve(spec, cfg, on_gpu, strict, "off" if first.lean else "on")
        except ConfigError:  # the lean layer cannot run with this attention or data: the plain layer only
            return [first]
        return [first] if other.lean == first.lean else [first, other]

    @classmethod
    def _resolve(cls, spec, cfg, on_gpu: bool, strict: bool, lean_layer: str) -> "Execution":
        """`of` for `train.lean_layer=lean_layer`; a ConfigError when the backend or lean layer cannot run."""
        t = cfg.train
        mb_tokens = t.micro_batch_size * t.seq_len
        packed = cfg.data.name in PACKED_SOURCES
        # the lean layer's `sdpa` attention: cuDNN's fused kernel on CUDA computes 16-bit types only; `auto` takes it
        # unless the run asks for bitwise repeatability, which the Triton kernel's backward gives by construction
        fused_sdpa = not on_gpu or \
            resolve_compute_dtype(t.compute_dtype, torch.device("cuda")) in CUDNN_ATTENTION_DTYPES
        attention = resolve_attention(t.attention, "cuda" if on_gpu else "cpu", spec.arch.head_dim,
                                      spec.sinks_or_window, packed=packed,
                                      lean=lean_layer_wanted(lean_layer, mb_tokens),
                                      lean_sdpa=fused_sdpa and not t.deterministic)
        lean = resolve_lean_layer(lean_layer, attention, mb_tokens, packed, fused_sdpa)
        if strict and lean and attention == "sdpa" and on_gpu and torch.cuda.is_available():
            _require_fused_sdpa(resolve_compute_dtype(t.compute_dtype, torch.device("cuda")))
        return cls._resolved(cfg, on_gpu, attention, lean)

    @classmethod
    def _resolved(cls, cfg, on_gpu: bool, attention: str, lean: bool) -> "Execution":
        t = cfg.train
        compiled = t.compile == "on" or (t.compile == "auto" and on_gpu)
        return cls(on_gpu=on_gpu, compiled=compiled, compile_workers=compiled and not t.compile_in_process,
                   fused_loss=t.fused_loss == "on" or (t.fused_loss == "auto" and on_gpu), attention=attention,
                   mlp_chunk_tokens=resolve_mlp_chunk_tokens(t.mlp_chunk_tokens, t.micro_batch_size * t.seq_len,
                                                             lean),
                   lean=lean)

    @property
    def layer_compute(self) -> LayerCompute:
        """How the decoder layers compute (engine/model/dense.py)."""
        return LayerCompute(attention=self.attention, mlp_chunk_tokens=self.mlp_chunk_tokens, lean=self.lean)


def _require_fused_sdpa(compute_dtype: torch.dtype) -> None:
    """ConfigError unless this CUDA device runs the lean layer's `sdpa` attention (cuDNN's fused kernel)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not fused_sdpa_runs(device, compute_dtype):
        raise ConfigError(f"the lean layer with train.attention=sdpa runs cuDNN's fused attention, which needs cuDNN 9 "
                          f"or later on an Ampere or newer card in bf16/fp16; this device has cuDNN "
                          f"{torch.backends.cudnn.version()}, compute capability "
                          f"{torch.cuda.get_device_capability(device)}, compute dtype {compute_dtype}; set "
                          "train.attention=triton")
