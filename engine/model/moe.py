"""Mixture-of-experts decoder templates: Qwen3-MoE and gpt-oss, as pure functions of (parameters, inputs).

A MoE layer is the dense layer's attention block (engine/model/dense.py; gpt-oss adds q/k/v/o biases, a learned
sink logit per head and a 128-key sliding window on every other layer) followed by a routed MLP:

- router: a linear map to E expert logits (gpt-oss: with a bias). Qwen3-MoE takes the softmax over all E, keeps the
  top k and renormalises them to sum to 1; gpt-oss keeps the top k logits and takes the softmax over those k.
- experts: token rows are sorted by expert (a stable argsort of the N*k choices), gathered, and pushed through two
  grouped matmuls (torch's `grouped_mm`: one launch for all experts, jagged by the per-expert counts; no Python loop
  over experts, no host sync). An expert with no tokens is an empty group: its weight gradient is exactly zero and
  its rows of the flat layout are untouched by any other expert's. Qwen3-MoE's experts are SwiGLU with
  `gate_up_proj` [E, 2I, D] (gate rows first) and `down_proj` [E, D, I], applied as x @ W^T; gpt-oss's are a
  clamped SwiGLU (gate <= limit, |up| <= limit, gate * sigmoid(1.702 gate) * (up + 1)) with gate and up
  interleaved in `gate_up_proj` [E, D, 2I] and `down_proj` [E, I, D], applied as x @ W, each with a bias.
- the k expert outputs of a token are weighted by its routing weights, put back in token order (a gather by the
  inverse permutation, which keeps only the index for the backward, where index_add_ would keep its [N*k, D]
  source), summed over the k in the residual stream's dtype and added to it.

Names and shapes are those of transformers' in-memory modules (v5), so `logits` and gradients compare directly;
engine/checkpoint/hf.py maps them to the on-disk tensors (per-expert tensors for Qwen3-MoE, MXFP4 for gpt-oss).

**Load-balancing loss.** Each layer computes the Switch-Transformer term E * sum_e f_e * P_e over its N tokens
(f_e: the fraction of the N*k choices that picked expert e, times k; P_e: the mean router probability of e, softmax
over all E). The training loss adds `router_aux_loss_coef` times its mean over the layers (and over the step's
micro-batches, weighted by their tokens). transformers pools f and P over all layers before taking the product; for
one layer the two agree, and for more they differ by the cross-layer terms, which a streamed engine cannot form
(each layer's backward runs before the others' forwards are known in the reference order). The term never enters
the activations: `RouterStats.attach` hands the layer output through unchanged and, in its backward, adds the
term's gradient with the right weight, so both engines train with it through their usual `spec.layer` calls.
That backward runs exactly once per layer and micro-batch (recomputes and regenerated inputs carry no grad), which
is also where the per-expert load is recorded for the metrics log.

Costs per token and layer: the router (2*D*E FLOPs forward), k experts (2 * 3*D*I each), and the gather/scatter of
k rows of D. `tflops` and `mfu` count the active parameters (engine/metrics.py).

**Token chunks.** The routed block's backward keeps, per token, k gathered rows of D and k expert intermediates of
3I (more in eager mode; `activation_bytes_per_token` counts them): for Qwen3-30B-A3B (k=8, D=2048, I=768) about
105 KiB per token and layer compiled in bf16, 52 GiB at 512K tokens. With `LayerCompute.mlp_chunk_tokens = C` (as
for the dense MLP, engine/model/dense.py) the post-attention norm, routing and experts run on C tokens at a time,
each chunk a non-reentrant checkpoint when autograd is on: the backward keeps only the chunk inputs and rebuilds
one chunk's routing and experts at a time, for one more forward of the block (+1/3 of its FLOPs). Routing is per
token, so every token picks the same experts with the same weights as unchunked; the weight gradients are summed
chunk by chunk (equal to fp32 rounding). The balance loss stays the layer's: each chunk returns its choices per
expert and its router probabilities summed over its tokens, and the product f * P is formed once from the sums
over all chunks, so its gradient reaches every chunk's probabilities through that chunk's recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.device import autocast_dtype
from engine.model import dense
from engine.model.layout import ParamSpec
from engine.model.rope import Positions

Params = Dict[str, torch.Tensor]

GPT_OSS_SWIGLU_ALPHA = 1.702  # the sigmoid's slope in gpt-oss's expert activation (fixed in its reference code)
GROUPED_MM_ALIGN_ELEMS = 8  # grouped_mm wants row strides that are multiples of 16 bytes (8 bf16 elements)

grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public name from torch 2.10; same op before


@dataclass(frozen=True)
class MoeArch:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    tied: bool
    qk_norm: bool  # Qwen3-MoE
    attention_bias: bool  # gpt-oss: q, k, v and o biases
    sinks: bool  # gpt-oss: one learned logit per head in every softmax row
    experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool  # Qwen3-MoE
    swiglu_limit: Optional[float]  # gpt-oss's clamped SwiGLU; None: SwiGLU with SiLU

    @property
    def gpt_oss(self) -> bool:
        return self.swiglu_limit is not None


def layer_specs(a: MoeArch) -> List[ParamSpec]:
    h, q_out, kv_out = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    E, I = a.experts, a.expert_intermediate
    specs = dense.attention_specs(a)
    if a.qk_norm:
        specs += [ParamSpec("self_attn.q_norm.weight", (a.head_dim,), "vector"),
                  ParamSpec("self_attn.k_norm.weight", (a.head_dim,), "vector")]
    if a.attention_bias:
        specs += [ParamSpec("self_attn.q_proj.bias", (q_out,), "vector"),
                  ParamSpec("self_attn.k_proj.bias", (kv_out,), "vector"),
                  ParamSpec("self_attn.v_proj.bias", (kv_out,), "vector"),
                  ParamSpec("self_attn.o_proj.bias", (h,), "vector")]
    if a.sinks:
        specs.append(ParamSpec("self_attn.sinks", (a.heads,), "vector"))
    if a.gpt_oss:
        specs += [ParamSpec("mlp.router.weight", (E, h), "matmul"),
                  ParamSpec("mlp.experts.gate_up_proj", (E, h, 2 * I), "matmul"),
                  ParamSpec("mlp.experts.down_proj", (E, I, h), "matmul"),
                  ParamSpec("mlp.router.bias", (E,), "vector"),
                  ParamSpec("mlp.experts.gate_up_proj_bias", (E, 2 * I), "vector"),
                  ParamSpec("mlp.experts.down_proj_bias", (E, h), "vector")]
    else:
        specs += [ParamSpec("mlp.gate.weight", (E, h), "matmul"),
                  ParamSpec("mlp.experts.gate_up_proj", (E, 2 * I, h), "matmul"),
                  ParamSpec("mlp.experts.down_proj", (E, h, I), "matmul")]
    return specs


def router_weight_name(a: MoeArch) -> str:
    return "mlp.router.weight" if a.gpt_oss else "mlp.gate.weight"


def route(p: Params, y_ND: torch.Tensor, a: MoeArch):
    """(router logits [N, E], routing weights [N, k], chosen experts [N, k]) as transformers computes them."""
    logits = F.linear(y_ND, p[router_weight_name(a)], p.get("mlp.router.bias"))
    if a.gpt_oss:
        top, chosen = torch.topk(logits, a.top_k, dim=-1)
        return logits, torch.softmax(top, dim=1, dtype=top.dtype), chosen
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, a.top_k, dim=-1)
    if a.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), chosen


def routing_sums(logits_NE: torch.Tensor, chosen_Nk: torch.Tensor, experts: int):
    """(choices per expert [E] int64, router probabilities summed over the N tokens [E] fp32): what the balance
    loss needs from a run of tokens; sums over chunks are the sums over their union."""
    probs = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    load = torch.zeros(experts, dtype=torch.int64, device=chosen_Nk.device)
    load.scatter_add_(0, chosen_Nk.reshape(-1), torch.ones_like(chosen_Nk.reshape(-1)))
    return load, probs.sum(dim=0)


def balance_loss(load_E: torch.Tensor, prob_sum_E: torch.Tensor, tokens: int) -> torch.Tensor:
    """E * sum_e f_e P_e (fp32 scalar) for one layer's `tokens` tokens, from their `routing_sums`."""
    f = load_E.float() / tokens
    return load_E.numel() * (f * (prob_sum_E / tokens)).sum()


def activation_bytes_per_token(a: MoeArch, compute_bytes: int, compiled: bool = True) -> int:
    """Bytes per token that one layer's routed block (post-attention norm, router, experts) keeps for its backward:
    the MoE counterpart of the dense MLP block's share in engine/plan.py `layer_activation_bytes_per_token` (the
    block's input, the residual after attention, is counted there either way). A chunked block keeps none of it
    beyond one chunk's, rebuilt in the backward. Not per token and not counted: the [E] group offsets (int32) of
    an unchunked block and the balance loss's [E] expert fractions (fp32).

    Eager is what saved-tensor hooks list on the CPU, under bf16 autocast and in fp32 (tests/test_moe_chunked.py).
    Compiled is what torch.compile's min-cut partitioner keeps, counted on the CPU under bf16 autocast (inductor on
    the GPU partitions the same way, but may choose to rematerialise differently): it recomputes the elementwise
    work (SiLU, gpt-oss's clamps and sigmoid, the softmax over all experts) instead of keeping it."""
    fp32, index = 4, 8
    cb, D, E, k, I = compute_bytes, a.hidden, a.experts, a.top_k, a.expert_intermediate
    kept = (fp32  # the norm's reciprocal
            + cb * D  # the router's input: the normed input (under autocast, F.linear's copy of it)
            + index * k  # the chosen experts
            + index * k * (4 if a.gpt_oss else 3)  # per expert-sorted row: token, sort position, place back (expert)
            + cb * k * D + cb * k)  # the gathered rows and their routing weights
    if compiled:
        if a.gpt_oss:
            return kept + (cb * E + 2 * fp32 + cb * k  # router logits, two softmax statistics, top-k softmax
                           + cb * k * 3 * I  # gate/up before the bias, the SwiGLU product
                           + fp32 * k * D)  # the expert outputs plus their (fp32) bias
        return kept + (fp32 * E + (fp32 * k if a.norm_topk_prob else 0)  # routing softmax, top-k probabilities
                       + cb * k * 3 * I + cb * k * D)  # gate/up, the SwiGLU product, the expert outputs
    kept += fp32 * D + fp32 * E  # the norm's fp32 output, the softmax of the routing sums
    if a.gpt_oss:
        return kept + (cb * k  # top-k softmax
                       + fp32 * k * 6 * I  # (fp32 bias) gate/up; clamped gate, its sigmoid, their product, up + 1
                       + cb * k * I  # the SwiGLU product's cast
                       + fp32 * k * D)  # the expert outputs plus their bias
    return kept + (fp32 * E + (fp32 * (k + 1) if a.norm_topk_prob else 0)  # routing softmax, renormalised top-k, sum
                   + cb * k * 4 * I + cb * k * D)  # gate/up, SiLU's output, the SwiGLU product, the expert outputs


def _activation(h: torch.Tensor, a: MoeArch) -> torch.Tensor:
    if not a.gpt_oss:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=a.swiglu_limit)
    up = up.clamp(min=-a.swiglu_limit, max=a.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_SWIGLU_ALPHA))


def experts(p: Params, y_ND: torch.Tensor, weights_Nk: torch.Tensor, chosen_Nk: torch.Tensor, load_E: torch.Tensor,
            a: MoeArch, out_dtype: torch.dtype) -> torch.Tensor:
    """The weighted sum of each token's k expert outputs, [N, D] in out_dtype (the residual stream's). `load_E`:
    the choices per expert (`routing_sums`), the sizes of the grouped matmuls' groups."""
    N, k = chosen_Nk.shape
    flat = chosen_Nk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    expert_of_row = flat[order]
    offs = load_E.cumsum(0).to(torch.int32)
    dtype = autocast_dtype(y_ND.device.type, y_ND.dtype)
    w1, w2 = p["mlp.experts.gate_up_proj"].to(dtype), p["mlp.experts.down_proj"].to(dtype)
    if not a.gpt_oss:  # stored as [E, out, in] (x @ W^T)
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    rows = y_ND.to(dtype)[token]
    h = grouped_mm(rows, w1, offs=offs)
    if a.gpt_oss:
        h = h + p["mlp.experts.gate_up_proj_bias"][expert_of_row]
    out = grouped_mm(_activation(h, a).to(dtype), w2, offs=offs)
    if a.gpt_oss:
        out = out + p["mlp.experts.down_proj_bias"][expert_of_row]
    out = out * weights_Nk.reshape(-1)[order].unsqueeze(-1)
    # back to the (token, slot) order and summed over the k slots: unlike index_add_, whose backward keeps its
    # [N*k, D] source, a gather and a sum keep only the permutation
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=order.device))
    return out[unsort].to(out_dtype).view(N, k, -1).sum(dim=1)


def routing(p: Params, x_ND: torch.Tensor, a: MoeArch):
    """The routed block's input side over N tokens: (norm(x) [N, D], routing weights [N, k], chosen experts [N, k],
    load [E] int64, prob_sum [E]) (`route`, `routing_sums`)."""
    y_ND = dense.rms_norm(x_ND, p["post_attention_layernorm.weight"], a.eps)
    logits, weights, chosen = route(p, y_ND, a)
    return (y_ND, weights, chosen, *routing_sums(logits, chosen, a.experts))


def routed_block(p: Params, x_ND: torch.Tensor, a: MoeArch):
    """x + experts(norm(x)) over N tokens, with their `routing_sums`: ([N, D], load [E] int64, prob_sum [E])."""
    y_ND, weights, chosen, load, prob_sum = routing(p, x_ND, a)
    return x_ND + experts(p, y_ND, weights, chosen, load, a, x_ND.dtype), load, prob_sum


def decoder_layer(p: Params, x_BTD: torch.Tensor, pos: Positions, a: MoeArch,
                  c: dense.LayerCompute = dense.LayerCompute(), window: Optional[int] = None):
    """(layer output [B, T, D], this layer's balance loss (fp32 scalar), per-expert load [E] int64)."""
    x_BTD = dense.attention_residual(p, x_BTD, pos, a, c, window)
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    chunk = c.mlp_chunk_tokens
    if chunk <= 0 or B * T <= chunk:
        y_ND, load, prob_sum = routed_block(p, x_ND, a)
    else:
        parts = []
        for start in range(0, B * T, chunk):
            xs = x_ND[start:start + chunk]
            if torch.is_grad_enabled():
                parts.append(checkpoint(routed_block, p, xs, a, use_reentrant=False, preserve_rng_state=False))
            else:
                parts.append(routed_block(p, xs, a))
        outs, loads, prob_sums = zip(*parts)
        y_ND, load, prob_sum = torch.cat(outs), torch.stack(loads).sum(0), torch.stack(prob_sums).sum(0)
    return y_ND.view(B, T, D), balance_loss(load, prob_sum, B * T), load


class RouterStats:
    """The load-balancing loss's gradient, and the step's routing statistics for the metrics log.

    `attach(y, aux, load, layer)` returns y; in the backward it adds d(weight * aux) with weight =
    coef * T_m / (step_tokens * L), T_m the micro-batch's tokens, and records aux and load. `begin_step(n)` sets
    step_tokens and clears the record; a backward outside a train step (calibration) weighs only its own tokens."""

    def __init__(self, num_layers: int, experts: int, coef: float):
        self.num_layers, self.experts, self.coef = num_layers, experts, coef
        self.begin_step(None)

    def begin_step(self, step_tokens: Optional[int]) -> None:
        self.step_tokens = step_tokens
        self.aux_mean: Optional[torch.Tensor] = None  # sum of weight/coef * aux: the step's mean balance loss
        self.load: Dict[int, torch.Tensor] = {}  # layer -> choices per expert, summed over micro-batches

    def attach(self, y: torch.Tensor, aux: torch.Tensor, load: torch.Tensor, layer: int) -> torch.Tensor:
        return _AttachBalanceLoss.apply(y, aux, load, self, layer)

    def record(self, layer: int, tokens: int, aux: torch.Tensor, load: torch.Tensor) -> float:
        """Records one layer's balance term and load over `tokens` tokens of a micro-batch's backward; returns the
        term's weight in the loss."""
        share = tokens / ((self.step_tokens or tokens) * self.num_layers)
        term = aux.detach().double() * share
        self.aux_mean = term if self.aux_mean is None else self.aux_mean + term
        self.load[layer] = load if layer not in self.load else self.load[layer] + load
        return self.coef * share

    def summary(self) -> dict:
        """`balance_loss`: the step's mean per-layer balance term (top_k when routing is uniform, up to E when all
        tokens choose the same experts; the training loss added coef times it); `expert_load_max`/`_min`: over
        layers and experts, an expert's share of its layer's choices relative to a uniform share (1.0 = balanced).
        Empty before any backward of the step. Syncs the device once."""
        if self.aux_mean is None:
            return {}
        loads = torch.stack([self.load[i] for i in sorted(self.load)]).double()
        rel = loads * self.experts / loads.sum(dim=1, keepdim=True).clamp(min=1)
        return {"balance_loss": float(self.aux_mean), "expert_load_max": float(rel.max()),
                "expert_load_min": float(rel.min())}


class _AttachBalanceLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, aux, load, stats: RouterStats, layer: int):
        ctx.stats, ctx.layer, ctx.tokens = stats, layer, y.shape[0] * y.shape[1]
        ctx.aux, ctx.load = aux.detach(), load
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        weight = ctx.stats.record(ctx.layer, ctx.tokens, ctx.aux, ctx.load)
        return dy, torch.full_like(ctx.aux, weight), None, None, None
