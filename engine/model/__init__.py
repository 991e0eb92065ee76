"""A model as a sequence of *units*: the embedding, each decoder layer, the head (final norm + LM head).

A unit is the granule of streaming and of the host optimizer: it has a flat parameter layout (`UnitLayout`) and a
template function. `ModelSpec` builds both from a model config and owns the deterministic initialisation, which is a
function of (seed, unit index) alone so that an engine can initialise its store one unit at a time, in any order or
in parallel, and still match every other engine bit for bit.

With tied embeddings the embedding matrix lives in the embedding unit only; the head template receives it as
`tied_weight` and its gradient is the sum of both uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from engine.config import MOE_MODEL_TYPES, ConfigError
from engine.model import dense, lean, moe
from engine.model.dense import backprop
from engine.model.layout import ParamSpec, UnitLayout
from engine.model.rope import Positions, rope_tables

__all__ = ["ModelSpec", "Unit", "ParamSpec", "UnitLayout", "Positions", "backprop"]


@dataclass
class Unit:
    index: int  # 0 = embedding, 1..L = decoder layers, L+1 = head
    kind: str  # embed | layer | head
    layout: UnitLayout
    layer: Optional[int] = None  # decoder layer number for kind == "layer"

    @property
    def name(self) -> str:
        return f"layer{self.layer}" if self.kind == "layer" else self.kind


class ModelSpec:
    def __init__(self, model_cfg):
        m = model_cfg
        self.cfg = m
        self.num_layers = m.num_hidden_layers
        head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
        self.moe = m.model_type in MOE_MODEL_TYPES
        if self.moe:
            self.arch = moe.MoeArch(
                hidden=m.hidden_size, heads=m.num_attention_heads, kv_heads=m.num_key_value_heads,
                head_dim=head_dim, vocab=m.vocab_size, eps=m.rms_norm_eps, tied=m.tie_word_embeddings,
                qk_norm=m.qk_norm, attention_bias=m.attention_bias, sinks=m.model_type == "gpt_oss",
                experts=m.num_experts, top_k=m.num_experts_per_tok, expert_intermediate=m.moe_intermediate_size,
                norm_topk_prob=m.norm_topk_prob, swiglu_limit=m.swiglu_limit)
            for key, value in (("hidden_size", m.hidden_size), ("moe_intermediate_size", m.moe_intermediate_size)):
                if value % moe.GROUPED_MM_ALIGN_ELEMS:
                    raise ConfigError(f"model.{key}={value}: the experts' grouped matmul needs a multiple of "
                                      f"{moe.GROUPED_MM_ALIGN_ELEMS} (rows aligned to 16 bytes in bf16)")
            layer_specs = moe.layer_specs(self.arch)
            self.router_stats = moe.RouterStats(self.num_layers, m.num_experts, m.router_aux_loss_coef)
        else:
            self.arch = dense.DenseArch(
                hidden=m.hidden_size, intermediate=m.intermediate_size, heads=m.num_attention_heads,
                kv_heads=m.num_key_value_heads, head_dim=head_dim, vocab=m.vocab_size, eps=m.rms_norm_eps,
                qkv_bias=m.qkv_bias, qk_norm=m.qk_norm, tied=m.tie_word_embeddings)
            layer_specs = dense.layer_specs(self.arch)
        self._layer_fn = moe.decoder_layer if self.moe else dense.decoder_layer
        self._lean_fns = lean.ChunkFns.of(self.moe)
        types = m.layer_types or []
        # keys seen per query on each layer (None: all earlier ones); a depth-truncated run takes the first types
        self.layer_windows: List[Optional[int]] = [
            m.sliding_window if i < len(types) and types[i] == "sliding_attention" else None
            for i in range(self.num_layers)]
        self.units: List[Unit] = [Unit(0, "embed", UnitLayout("", dense.embed_specs(self.arch)))]
        for i in range(self.num_layers):
            self.units.append(Unit(i + 1, "layer", UnitLayout(f"model.layers.{i}.", layer_specs), layer=i))
        self.units.append(Unit(self.num_layers + 1, "head", UnitLayout("", dense.head_specs(self.arch))))

    @property
    def sinks_or_window(self) -> bool:
        """Attention sinks or sliding-window layers: only the Triton attention backend computes them."""
        return bool(getattr(self.arch, "sinks", False)) or any(w is not None for w in self.layer_windows)

    @property
    def layer_units(self) -> List[Unit]:
        return self.units[1:-1]

    @property
    def tied(self) -> bool:
        return self.arch.tied

    def num_params(self) -> int:
        return sum(u.layout.param_numel for u in self.units)

    def check_expected_params(self) -> Optional[int]:
        """Check the built layout against `model.expected_params`. Returns None for the published model, or its
        full depth when this is a depth-truncated copy: fewer decoder layers of exactly the published width (the
        embedding, the head and L_full layers of this layout add up to the published count)."""
        expected = self.cfg.expected_params
        if expected is None or expected == self.num_params():
            return None
        per_layer = self.units[1].layout.param_numel
        rest = expected - self.units[0].layout.param_numel - self.units[-1].layout.param_numel
        if rest % per_layer == 0 and rest // per_layer > self.num_layers:
            return rest // per_layer
        raise ConfigError(f"model={self.cfg.name}: the built layout has {self.num_params():,} parameters but "
                          f"model.expected_params={expected:,}; the architecture fields do not describe the "
                          "published checkpoint (nor a depth-truncated copy of it: only model.num_hidden_layers may "
                          "be lowered)")

    def positions(self, seq_len: int, device: torch.device | str) -> Positions:
        """The rotary tables of positions 0..seq_len-1 (`Positions.of_rows` re-indexes them for packed rows)."""
        return rope_tables(self.arch.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling, seq_len, device)

    def init_unit(self, unit: Unit, params: Dict[str, torch.Tensor], seed: int) -> None:
        """Fill a unit's fp32 tensors in place: matrices N(0, init_std), norm weights 1, the other vectors (biases,
        attention sinks) 0."""
        gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + unit.index)
        for spec in unit.layout.specs:
            t = params[spec.name]
            if spec.kind == "vector":
                t.fill_(1.0 if spec.name.endswith("norm.weight") else 0.0)
            elif t.device.type == "cpu":
                t.normal_(0.0, self.cfg.init_std, generator=gen)
            else:
                t.copy_(torch.empty(t.shape).normal_(0.0, self.cfg.init_std, generator=gen))

    def compile_templates(self, in_process: bool = False) -> None:
        """torch.compile the decoder layer and the loss chunk: fuses the elementwise work around the matmuls
        (RMSNorm, RoPE, SwiGLU, residual adds, the fp32 cross-entropy), about a fifth of an eager layer's time.
        One compiled graph serves every layer (parameters are inputs, not module state); compiling costs about
        a minute on the first step.

        `in_process` (`train.compile_in_process`): Inductor builds the kernels in this process, serially, and starts
        no worker pool (whose host memory every other compiled plan reserves); a pool that an earlier run in this
        process started (a Hydra multirun) is shut down. Otherwise Inductor's own worker count applies."""
        from torch._inductor import async_compile
        from torch._inductor import config as inductor_config

        if in_process:
            inductor_config.compile_threads = 1
            async_compile.shutdown_compile_workers()
        else:
            inductor_config.compile_threads = inductor_config.decide_compile_threads()
        self._layer_fn = torch.compile(self._layer_fn, dynamic=False)
        self._layer_to_down_fn = torch.compile(self._layer_to_down_fn, dynamic=False)
        self._moe_to_down_fn = torch.compile(self._moe_to_down_fn, dynamic=False)
        self._moe_down_backward_fn = torch.compile(self._moe_down_backward_fn, dynamic=False)
        self._lean_fns = lean.ChunkFns.of(self.moe, lambda fn: torch.compile(fn, dynamic=False))
        self._loss_chunk_fn = torch.compile(dense.chunk_loss_sum, dynamic=False)

    def use_fused_loss(self) -> None:
        """Compute the head with the fused LM head + cross-entropy (streamtrain_kernels/cross_entropy.py) instead of the
        chunked, recomputed torch chain."""
        self.fused_loss = True

    def set_layer_compute(self, compute: dense.LayerCompute) -> None:
        """How the layer template computes (attention backend, MLP token chunk); the default is torch's SDPA over
        whole sequences. Set before `compile_templates` (the compiled layer specialises on it)."""
        self.compute = compute

    compute = dense.LayerCompute()
    _loss_chunk_fn = staticmethod(dense.chunk_loss_sum)
    _layer_to_down_fn = staticmethod(dense.decoder_layer_to_down_proj)
    _moe_to_down_fn = staticmethod(moe.layer_to_down_proj)
    _moe_down_backward_fn = staticmethod(moe.weighted_down_backward)
    fused_loss = False

    # Templates, bound to this architecture.
    def embed(self, p, ids_BT):
        return dense.embed(p, ids_BT)

    def layer(self, p, x_BTD, pos: Positions, layer: int):
        """Decoder layer number `layer` (0-based; it picks the attention window) applied to x."""
        if self.compute.lean:
            return lean.lean_layer(p, x_BTD, pos, self.arch, self.compute.mlp_chunk_tokens, self.layer_windows[layer],
                                   self._lean_fns, self._balance(layer), self.compute.attention)
        if not self.moe:
            return self._layer_fn(p, x_BTD, pos, self.arch, self.compute)
        y, aux, load, _ = self._layer_fn(p, x_BTD, pos, self.arch, self.compute, self.layer_windows[layer])
        return self.router_stats.attach(y, aux, load, layer)

    def _balance(self, layer: int) -> Optional[moe.Balance]:
        """The lean MoE layer's hook for its balance term: records it and returns its weight (`RouterStats`)."""
        if not self.moe:
            return None
        return lambda aux, load, tokens: self.router_stats.record(layer, tokens, aux, load)

    def forward_keeping(self, p, x_BTD, pos: Positions, layer: int, attention: bool = False):
        """(the layer's output, what its recompute will reuse or None) for a forward without autograd whose
        backward recomputes the layer (`layer_grads(kept=...)`): the lean layer's attention output when `attention`
        (`lean.KeptAttention`), a MoE layer's routing (`moe.KeptRouting`, unless its routed block is chunked)."""
        if self.compute.lean:
            if not attention:
                return self.layer(p, x_BTD, pos, layer), None
            return lean.lean_forward(p, x_BTD, pos, self.arch, self.compute.mlp_chunk_tokens,
                                     self.layer_windows[layer], keep=True, fns=self._lean_fns,
                                     attention=self.compute.attention)
        if not self.moe:
            return self.layer(p, x_BTD, pos, layer), None
        y, _, _, routing = self._layer_fn(p, x_BTD, pos, self.arch, self.compute, self.layer_windows[layer])
        return y, routing

    def recompute_stops_before_down_proj(self, chunked_mlp: bool, lean_layer: bool = False) -> bool:
        """Whether `layer_grads` leaves the down projection out of a layer's recompute: a dense or MoE layer with an
        unchunked MLP or routed block (a chunked one checkpoints whole blocks; the lean layer rebuilds its second
        half chunk by chunk)."""
        return not (chunked_mlp or lean_layer)

    def recompute_skipped_flops_per_token(self, chunked_mlp: bool, lean_layer: bool = False) -> int:
        """Forward FLOPs per token that `layer_grads` leaves out of a layer's recompute."""
        if not self.recompute_stops_before_down_proj(chunked_mlp, lean_layer):
            return 0
        return (moe if self.moe else dense).down_proj_flops_per_token(self.arch)

    def layer_grads(self, p, x_in, dy, pos: Positions, layer: int, kept=None):
        """(d x_in, {name: gradient} for every tensor of p) of decoder layer `layer` at x_in (a leaf that requires
        grad) for the output gradient dy: the forward recomputed with autograd, then back-propagated. A layer with
        an unchunked MLP recomputes up to the down projection only (`dense.decoder_layer_to_down_proj`,
        `moe.layer_to_down_proj`) and takes that matmul's gradients by hand, equal to autograd's; a MoE layer
        reuses the forward's routing when `kept` has it (`forward_keeping`). A chunked MLP's chunks recompute in
        full. The lean layer runs its own backward (`lean.lean_backward`, from the forward's `kept` attention
        output when given), writing d x over dy. Call under the run's autocast."""
        if self.compute.lean:
            return lean.lean_backward(p, x_in, dy, pos, self.arch, self.compute.mlp_chunk_tokens,
                                      self.layer_windows[layer], kept, self._lean_fns, in_place=True,
                                      balance=self._balance(layer), attention=self.compute.attention)
        B, T, _ = x_in.shape
        if not self.recompute_stops_before_down_proj(dense.mlp_chunked(self.compute.mlp_chunk_tokens, B * T)):
            return backprop(self.layer(p, x_in, pos, layer), x_in, p, dy)
        if self.moe:
            return moe.layer_backward(p, x_in, dy, pos, self.arch, self.compute, self.layer_windows[layer], kept,
                                      self._balance(layer), self._moe_to_down_fn, self._moe_down_backward_fn)
        x2, act = self._layer_to_down_fn(p, x_in, pos, self.arch, self.compute)
        with torch.no_grad():
            d_act, d_down = dense.down_proj_backward(dy, act, p[dense.DOWN_PROJ])
        rest = {n: t for n, t in p.items() if n != dense.DOWN_PROJ}
        dx, by_name = backprop((x2, act), x_in, rest, (dy, d_act))
        by_name[dense.DOWN_PROJ] = d_down
        return dx, by_name

    def begin_step(self, step_tokens: int) -> None:
        """Called by the engines at the start of a train step: the MoE balance loss is weighted by the step's
        tokens, and its statistics restart."""
        if self.moe:
            self.router_stats.begin_step(step_tokens)

    def step_stats(self) -> dict:
        """The last step's MoE routing figures (engine/model/moe.py `RouterStats.summary`); {} for dense models."""
        return self.router_stats.summary() if self.moe else {}

    def loss_sum(self, p, x_BTD, labels_BT, tied_weight=None):
        if self.fused_loss:
            return dense.fused_loss_sum(p, x_BTD, labels_BT, self.arch, tied_weight)
        return dense.loss_sum(p, x_BTD, labels_BT, self.arch, tied_weight, chunk_fn=self._loss_chunk_fn)

    @property
    def tied_weight_name(self) -> str:
        return dense.EMBED
