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
  source), summed over the k in the residual stream's dtype and added to it. The down projection and the
  weighting are one autograd Function (`weighted_down`) whose backward needs no expert outputs: a routing weight's
  gradient <d out, act @ W2 + b> is taken as <d out @ W2^T, act> + <d out, b>, from the matmul d act needs anyway.
  So autograd keeps no [N*k, D] output rows, and the streaming engine's recompute (`layer_backward`) stops before
  the down projection, reusing the routing the forward kept (`KeptRouting`): no top-k, no sort, and the same
  experts as the forward even where two compiled graphs round a router logit differently.

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
73 KiB per token and layer compiled in bf16, 36 GiB at 512K tokens. With `LayerCompute.mlp_chunk_tokens = C` (as
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
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.device import autocast_dtype
from engine.model import dense
from engine.model.layout import ParamSpec
from engine.model.rope import Positions

Params = Dict[str, torch.Tensor]
Balance = Callable[[torch.Tensor, torch.Tensor, int], float]  # (balance term, load [E], tokens) -> its loss weight

DOWN_PROJ = "mlp.experts.down_proj"
DOWN_PROJ_BIAS = "mlp.experts.down_proj_bias"
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
                  ParamSpec(DOWN_PROJ, (E, I, h), "matmul"),
                  ParamSpec("mlp.router.bias", (E,), "vector"),
                  ParamSpec("mlp.experts.gate_up_proj_bias", (E, 2 * I), "vector"),
                  ParamSpec(DOWN_PROJ_BIAS, (E, h), "vector")]
    else:
        specs += [ParamSpec("mlp.gate.weight", (E, h), "matmul"),
                  ParamSpec("mlp.experts.gate_up_proj", (E, 2 * I, h), "matmul"),
                  ParamSpec(DOWN_PROJ, (E, h, I), "matmul")]
    return specs


def router_weight_name(a: MoeArch) -> str:
    return "mlp.router.weight" if a.gpt_oss else "mlp.gate.weight"


def route(p: Params, y_ND: torch.Tensor, a: MoeArch, chosen_Nk: Optional[torch.Tensor] = None):
    """(router logits [N, E], routing weights [N, k], chosen experts [N, k]) as transformers computes them. Given
    `chosen_Nk` (the forward's choices, `KeptRouting`), the weights are those experts' instead of the top k: the
    same values (top-k returns the selected entries) without the selection, and the same gradient."""
    logits = F.linear(y_ND, p[router_weight_name(a)], p.get("mlp.router.bias"))
    if a.gpt_oss:
        if chosen_Nk is None:
            top, chosen_Nk = torch.topk(logits, a.top_k, dim=-1)
        else:
            top = logits.gather(1, chosen_Nk)
        return logits, torch.softmax(top, dim=1, dtype=top.dtype), chosen_Nk
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if chosen_Nk is None:
        top, chosen_Nk = torch.topk(probs, a.top_k, dim=-1)
    else:
        top = probs.gather(1, chosen_Nk)
    if a.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), chosen_Nk


def routing_sums(logits_NE: torch.Tensor, chosen_Nk: torch.Tensor, experts: int):
    """(choices per expert [E] int64, router probabilities summed over the N tokens [E] fp32): what the balance
    loss needs from a run of tokens; sums over chunks are the sums over their union."""
    load = torch.zeros(experts, dtype=torch.int64, device=chosen_Nk.device)
    load.scatter_add_(0, chosen_Nk.reshape(-1), torch.ones_like(chosen_Nk.reshape(-1)))
    return load, router_prob_sum(logits_NE)


def router_prob_sum(logits_NE: torch.Tensor) -> torch.Tensor:
    """[E] fp32: the router probabilities (softmax over all E) summed over the N tokens."""
    return torch.softmax(logits_NE, dim=-1, dtype=torch.float32).sum(dim=0)


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
    work (SiLU, gpt-oss's clamps and sigmoid, the softmax over all experts) instead of keeping it. Neither keeps
    the expert outputs ([k, D] a token): the down projection's backward reads only its input
    (`weighted_down_backward`)."""
    fp32, index = 4, 8
    cb, D, E, k, I = compute_bytes, a.hidden, a.experts, a.top_k, a.expert_intermediate
    kept = (fp32  # the norm's reciprocal
            + cb * D  # the router's input: the normed input (under autocast, F.linear's copy of it)
            + index * k  # the chosen experts
            # per expert-sorted row: token, sort position, place back, expert (compiled Qwen3-MoE recomputes the
            # expert from the load; gpt-oss's bias gathers read it)
            + index * k * (3 if compiled and not a.gpt_oss else 4)
            + cb * k * D + cb * k)  # the gathered rows and their routing weights
    if compiled:
        if a.gpt_oss:
            return kept + (cb * E + 2 * fp32 + cb * k  # router logits, two softmax statistics, top-k softmax
                           + cb * k * 3 * I)  # gate/up before the bias, the SwiGLU product
        return kept + (fp32 * E + (fp32 * k if a.norm_topk_prob else 0)  # routing softmax, top-k probabilities
                       + cb * k * 3 * I)  # gate/up, the SwiGLU product
    kept += fp32 * D + fp32 * E  # the norm's fp32 output, the softmax of the routing sums
    if a.gpt_oss:
        return kept + (cb * k  # top-k softmax
                       + fp32 * k * 6 * I  # (fp32 bias) gate/up; clamped gate, its sigmoid, their product, up + 1
                       + cb * k * I)  # the SwiGLU product's cast
    return kept + (fp32 * E + (fp32 * (k + 1) if a.norm_topk_prob else 0)  # routing softmax, renormalised top-k, sum
                   + cb * k * 4 * I)  # gate/up, SiLU's output, the SwiGLU product


def _activation(h: torch.Tensor, a: MoeArch) -> torch.Tensor:
    if not a.gpt_oss:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=a.swiglu_limit)
    up = up.clamp(min=-a.swiglu_limit, max=a.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_SWIGLU_ALPHA))


class KeptRouting(NamedTuple):
    """One layer's routing from its forward, kept for the backward's recompute (`layer_to_down_proj`), which then
    runs no top-k and no sort and routes exactly as the forward did (a recompute in another compiled graph could
    otherwise break a near-tie the other way). 8 B per (token, slot) choice: 32 B a token for gpt-oss (k=4), 2 MiB
    per layer and micro-batch of 64K tokens."""
    order: torch.Tensor  # [N*k] int64: the (token * k + slot) choice in each expert-sorted row
    load: torch.Tensor  # [E] int64: rows per expert, the grouped matmuls' group sizes


def kept_routing_bytes(a: MoeArch, tokens: int) -> int:
    """The bytes of one layer's `KeptRouting` over `tokens` tokens."""
    return 8 * (a.top_k * tokens + a.experts)


class ExpertRows(NamedTuple):
    """The expert-sorted row layout of N tokens' k choices (R = N*k rows), which the grouped matmuls run on."""
    order: torch.Tensor  # [R] int64: the choice (token * k + slot) in each row
    load: torch.Tensor  # [E] int64: rows per expert
    token: torch.Tensor  # [R] int64: the token of each row
    expert_of_row: torch.Tensor  # [R] int64
    offs: torch.Tensor  # [E] int32: the end row of each expert's group
    unsort: torch.Tensor  # [R] int64: the row of each choice (the inverse of order)


def sort_choices(chosen_Nk: torch.Tensor, load_E: torch.Tensor) -> ExpertRows:
    """The rows of the choices `chosen_Nk` ([N, k] experts), by a stable sort on the expert."""
    return expert_rows(KeptRouting(torch.argsort(chosen_Nk.reshape(-1), stable=True), load_E), chosen_Nk.shape[1])


def expert_rows(kept: KeptRouting, k: int) -> ExpertRows:
    """The full row layout from its kept part: no sort (rows are grouped by expert, `load` rows each)."""
    order, load = kept
    R = order.numel()
    expert_of_row = torch.repeat_interleave(torch.arange(load.numel(), device=load.device), load, output_size=R)
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(R, device=order.device))
    return ExpertRows(order, load, order // k, expert_of_row, load.cumsum(0).to(torch.int32), unsort)


def chosen_experts(rows: ExpertRows, k: int) -> torch.Tensor:
    """[N, k] the expert of each (token, slot) choice."""
    return rows.expert_of_row[rows.unsort].view(-1, k)


def expert_activations(p: Params, y_ND: torch.Tensor, rows: ExpertRows, a: MoeArch) -> torch.Tensor:
    """[R, I] the input of the down projection in each row: the gate/up grouped matmul on the gathered tokens, its
    bias (gpt-oss) and the expert activation, in the compute dtype."""
    dtype = autocast_dtype(y_ND.device.type, y_ND.dtype)
    w1 = p["mlp.experts.gate_up_proj"].to(dtype)
    if not a.gpt_oss:  # stored as [E, out, in] (x @ W^T)
        w1 = w1.transpose(1, 2)
    h = grouped_mm(y_ND.to(dtype)[rows.token], w1, offs=rows.offs)
    if a.gpt_oss:
        h = h + p["mlp.experts.gate_up_proj_bias"][rows.expert_of_row]
    return _activation(h, a).to(dtype)


def _down_weight(p: Params, a: MoeArch, dtype: torch.dtype) -> torch.Tensor:
    """The down projections as [E, I, D] (x @ W) in `dtype`."""
    w2 = p[DOWN_PROJ].to(dtype)
    return w2 if a.gpt_oss else w2.transpose(1, 2)


def weighted_down(p: Params, act_RI: torch.Tensor, weights_R: torch.Tensor, rows: ExpertRows,
                  a: MoeArch) -> torch.Tensor:
    """[R, D] each row's expert output (down projection and its bias) times its routing weight."""
    return _WeightedDown.apply(act_RI, _down_weight(p, a, act_RI.dtype), p.get(DOWN_PROJ_BIAS), weights_R, rows.offs,
                               rows.expert_of_row)


def down_output_dtype(act_RI: torch.Tensor, bias_ED: Optional[torch.Tensor], weights_R: torch.Tensor):
    """The dtype of `weighted_down`'s rows (a gpt-oss fp32 bias promotes them)."""
    dtype = act_RI.dtype if bias_ED is None else torch.promote_types(act_RI.dtype, bias_ED.dtype)
    return torch.promote_types(dtype, weights_R.dtype)


def weighted_down_backward(d_out_RD: torch.Tensor, act_RI: torch.Tensor, w2_EID: torch.Tensor,
                           bias_ED: Optional[torch.Tensor], weights_R: torch.Tensor, offs: torch.Tensor,
                           expert_of_row: torch.Tensor):
    """(d act, d W2, d bias or None, d weights) of out = w * (act @ W2_e + b_e) per row, without out itself: the
    routing weight's gradient <d out, act @ W2 + b> is taken as <d out @ W2^T, act> + <d out, b>, and d out @ W2^T
    is also d act's matmul (before the weighting). So neither the forward nor the backward needs the product
    act @ W2: autograd keeps no [R, D] output rows, and a recompute can stop before the down projection
    (`layer_to_down_proj`), as the dense layer's does. Two grouped matmuls, as autograd's backward of the
    product; d act is rounded twice in bf16 (the matmul's output, then the weighting) instead of once."""
    dtype = act_RI.dtype
    weights_R1 = weights_R.unsqueeze(-1)
    g_RI = grouped_mm(d_out_RD.to(dtype), w2_EID.transpose(1, 2), offs=offs)
    d_act = (g_RI * weights_R1).to(dtype)
    d_weights = (g_RI * act_RI).sum(dim=-1, dtype=torch.float32)
    d_out_weighted = d_out_RD * weights_R1
    d_h = d_out_weighted.to(dtype)
    if w2_EID.transpose(1, 2).is_contiguous():  # stored [E, D, I] (Qwen3-MoE): its gradient in that layout
        d_w2 = grouped_mm(d_h.t(), act_RI, offs=offs).transpose(1, 2)
    else:
        d_w2 = grouped_mm(act_RI.t(), d_h, offs=offs)
    d_bias = None
    if bias_ED is not None:  # <d out, b_e> for each row: one [R, E] product in fp32, then the row's own expert's
        with torch.autocast(d_out_RD.device.type, enabled=False):
            d_out_bias_RE = d_out_RD.float() @ bias_ED.float().t()
        d_weights = d_weights + d_out_bias_RE.gather(1, expert_of_row.unsqueeze(1))[:, 0]
        d_bias = torch.zeros_like(bias_ED).index_add_(0, expert_of_row, d_out_weighted.to(bias_ED.dtype))
    return d_act, d_w2, d_bias, d_weights.to(weights_R.dtype)


class _WeightedDown(torch.autograd.Function):
    """`weighted_down` under autograd, keeping only its inputs for `weighted_down_backward`."""

    @staticmethod
    def forward(ctx, act_RI, w2_EID, bias_ED, weights_R, offs, expert_of_row):
        out = grouped_mm(act_RI, w2_EID, offs=offs)
        if bias_ED is not None:
            out = out + bias_ED[expert_of_row]
        ctx.save_for_backward(act_RI, w2_EID, bias_ED, weights_R, offs, expert_of_row)
        return out * weights_R.unsqueeze(-1)

    @staticmethod
    def backward(ctx, d_out_RD):
        return (*weighted_down_backward(d_out_RD, *ctx.saved_tensors), None, None)


def combine(out_RD: torch.Tensor, rows: ExpertRows, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """[N, D] in out_dtype: the rows back in (token, slot) order, summed over the k slots. Unlike index_add_,
    whose backward keeps its [R, D] source, a gather and a sum keep only the permutation."""
    return out_RD[rows.unsort].to(out_dtype).view(-1, k, out_RD.shape[-1]).sum(dim=1)


def experts(p: Params, y_ND: torch.Tensor, weights_Nk: torch.Tensor, rows: ExpertRows, a: MoeArch,
            out_dtype: torch.dtype) -> torch.Tensor:
    """The weighted sum of each token's k expert outputs, [N, D] in out_dtype (the residual stream's)."""
    act = expert_activations(p, y_ND, rows, a)
    return combine(weighted_down(p, act, weights_Nk.reshape(-1)[rows.order], rows, a), rows, a.top_k, out_dtype)


def routing(p: Params, x_ND: torch.Tensor, a: MoeArch, kept: Optional[KeptRouting] = None):
    """The routed block's input side over N tokens: (norm(x) [N, D], routing weights [N, k], `ExpertRows`,
    router probabilities summed over the tokens [E]) (`route`, `routing_sums`). Given `kept`, the forward's
    routing is reused: no top-k, no sort."""
    y_ND = dense.rms_norm(x_ND, p["post_attention_layernorm.weight"], a.eps)
    if kept is not None:  # the load is the kept one
        rows = expert_rows(kept, a.top_k)
        logits, weights, _ = route(p, y_ND, a, chosen_experts(rows, a.top_k))
        return y_ND, weights, rows, router_prob_sum(logits)
    logits, weights, chosen = route(p, y_ND, a)
    load, prob_sum = routing_sums(logits, chosen, a.experts)
    return y_ND, weights, sort_choices(chosen, load), prob_sum


def routed_block(p: Params, x_ND: torch.Tensor, a: MoeArch):
    """x + experts(norm(x)) over N tokens, with their routing: ([N, D], ExpertRows, prob_sum [E])."""
    y_ND, weights, rows, prob_sum = routing(p, x_ND, a)
    return x_ND + experts(p, y_ND, weights, rows, a, x_ND.dtype), rows, prob_sum


def decoder_layer(p: Params, x_BTD: torch.Tensor, pos: Positions, a: MoeArch,
                  c: dense.LayerCompute = dense.LayerCompute(), window: Optional[int] = None):
    """(layer output [B, T, D], this layer's balance loss (fp32 scalar), per-expert load [E] int64, the routing
    `KeptRouting` for a recompute, or None for a chunked routed block)."""
    x_BTD = dense.attention_residual(p, x_BTD, pos, a, c, window)
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    chunk = c.mlp_chunk_tokens
    if chunk <= 0 or B * T <= chunk:
        y_ND, rows, prob_sum = routed_block(p, x_ND, a)
        load, kept = rows.load, KeptRouting(rows.order, rows.load)
    else:
        parts = []
        for start in range(0, B * T, chunk):
            xs = x_ND[start:start + chunk]
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_block, p, xs, a, use_reentrant=False, preserve_rng_state=False))
            else:
                parts.append(_chunk_block(p, xs, a))
        outs, loads, prob_sums = zip(*parts)
        y_ND, load, prob_sum, kept = torch.cat(outs), torch.stack(loads).sum(0), torch.stack(prob_sums).sum(0), None
    return y_ND.view(B, T, D), balance_loss(load, prob_sum, B * T), load, kept


def _chunk_block(p: Params, x_ND: torch.Tensor, a: MoeArch):
    """`routed_block` of one chunk of tokens, with its load in place of its rows: ([C, D], load [E], prob_sum [E])."""
    y_ND, rows, prob_sum = routed_block(p, x_ND, a)
    return y_ND, rows.load, prob_sum


def layer_to_down_proj(p: Params, x_BTD: torch.Tensor, pos: Positions, a: MoeArch,
                       c: dense.LayerCompute = dense.LayerCompute(), window: Optional[int] = None,
                       kept: Optional[KeptRouting] = None):
    """`decoder_layer` (unchunked routed block) without its down projection, whose output no gradient reads
    (`weighted_down_backward`): (the routed block's input x2 [N, D], the down projection's input act [R, I],
    the rows' routing weights [R], the balance loss, `ExpertRows`). The recompute of a layer's backward stops here,
    2*k*D*I FLOPs per token less (`layer_backward`); given `kept` it reuses the forward's routing."""
    x2 = dense.attention_residual(p, x_BTD, pos, a, c, window)
    B, T, D = x2.shape
    x2_ND = x2.reshape(B * T, D)
    y_ND, weights, rows, prob_sum = routing(p, x2_ND, a, kept)
    act = expert_activations(p, y_ND, rows, a)
    return x2_ND, act, weights.reshape(-1)[rows.order], balance_loss(rows.load, prob_sum, B * T), rows


def down_proj_flops_per_token(a: MoeArch) -> int:
    """The down projection's forward FLOPs per token: k experts' [I] x [I, D]."""
    return 2 * a.top_k * a.expert_intermediate * a.hidden


def layer_backward(p: Params, x_BTD: torch.Tensor, dy_BTD: torch.Tensor, pos: Positions, a: MoeArch,
                   c: dense.LayerCompute, window: Optional[int], kept: Optional[KeptRouting],
                   balance: Balance, to_down_fn=layer_to_down_proj, down_backward_fn=weighted_down_backward):
    """(d x, {name: gradient} for every tensor of p) of `decoder_layer` (unchunked routed block, with the balance
    term's gradient) at x (a leaf that requires grad) for the output gradient dy: the forward recomputed with
    autograd up to the down projection's input (`to_down_fn`, reusing `kept` routing when given), the down
    projection's gradients by hand (`down_backward_fn`, the ops `_WeightedDown`'s backward runs, so both engines
    agree bit for bit), then autograd for the rest. `balance` records the layer's term and returns its weight."""
    x2_ND, act, weights_R, aux, rows = to_down_fn(p, x_BTD, pos, a, c, window, kept)
    dy_ND = dy_BTD.reshape(x2_ND.shape)
    weight = balance(aux.detach(), rows.load, x2_ND.shape[0])
    bias = p.get(DOWN_PROJ_BIAS)
    with torch.no_grad():
        d_out = dy_ND.to(down_output_dtype(act, bias, weights_R))[rows.token]
        d_act, d_w2, d_bias, d_weights = down_backward_fn(d_out, act, _down_weight(p, a, act.dtype), bias,
                                                          weights_R, rows.offs, rows.expert_of_row)
        del d_out
    rest = {n: t for n, t in p.items() if n not in (DOWN_PROJ, DOWN_PROJ_BIAS)}
    # dy enters where the plain layer's residual add hands it on, at the [N, D] view (autograd then sums the
    # contributions to that view in the plain layer's order: bit-identical)
    dx, by_name = dense.backprop((x2_ND, act, weights_R, aux), x_BTD, rest,
                                 (dy_ND, d_act, d_weights, torch.full_like(aux, weight)))
    down = p[DOWN_PROJ]
    by_name[DOWN_PROJ] = (d_w2 if a.gpt_oss else d_w2.transpose(1, 2)).to(down.dtype)
    if d_bias is not None:
        by_name[DOWN_PROJ_BIAS] = d_bias
    return dx, by_name


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
