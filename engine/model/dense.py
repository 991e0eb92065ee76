"""Dense decoder templates: Qwen2/Qwen2.5, Qwen3 and Llama 3.x as pure functions of (parameters, inputs).

No module owns a weight: every function takes a dict of tensors keyed by HF names (relative to the unit prefix), so
one template serves every layer and the streaming engine binds it to whatever GPU slot holds the layer. The three
families differ only in flags: q/k/v bias (Qwen2), q/k RMSNorm over head_dim before RoPE (Qwen3), llama3 RoPE
rescaling (in the rope tables, not here).

Precision follows transformers under autocast: the residual stream keeps the embedding's dtype (fp32), RMSNorm
normalises in fp32 and multiplies by its weight after casting back, linears run in the autocast dtype. Matmul
weights are only ever passed to F.linear, which is what lets the streaming engine hand them over already in bf16.

Cost per layer and token: 2 * (params of q, k, v, o, gate, up, down) FLOPs forward, plus 4 * nh * hd * T_ctx for
the attention scores and values (halved by the causal mask).

How a layer is computed (not what it computes) is a `LayerCompute`: the attention backend, and the token chunk of
the MLP block. Long sequences need the chunk: at 512K tokens a qwen7b layer's MLP holds four [T, 18944] bf16
intermediates (20 GB each) for its backward. With `mlp_chunk_tokens = C` the post-attention norm, the MLP and its
residual add run on C tokens at a time; with autograd on, each chunk is a non-reentrant checkpoint, so the backward
keeps only the chunk inputs (views of the layer's own tensors) and rebuilds one chunk's intermediates at a time, at
the cost of one more MLP forward (+1/3 of the MLP's FLOPs) in the backward. The chunks' matmuls are the same
per-token sums as the unchunked ones; their weight gradients are summed chunk by chunk, so chunked and unchunked
agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from streamtrain_kernels.cross_entropy import fused_linear_cross_entropy
from engine.model.attention import causal_attention
from engine.model.layout import ParamSpec
from engine.model.rope import Positions, apply_rope

Params = Dict[str, torch.Tensor]

LOSS_CHUNK_ELEMS = 1 << 27  # logits elements per loss chunk (fp32: 512 MiB) bound the head's working memory
# the fused loss: 1 GiB of bf16 logits per chunk; at smaller chunks its fp32 dW update (V x D read and written per
# chunk) is memory-bound (streamtrain_kernels/cross_entropy.py: 51 -> 44 ms at 8K tokens of the 7B head on an H200)
FUSED_LOSS_CHUNK_ELEMS = 1 << 29


AUTO_MLP_CHUNK_TOKENS = 32768  # train.mlp_chunk_tokens=-1 chunks micro-batches above twice this
# the lean layer's chunk under train.mlp_chunk_tokens=-1: its autograd graph with gradients is ~1.5 x 160 KB a token
# for qwen7b (1.8 GiB at 8K tokens), and 8K x 3584 x 18944 matmuls still run at full rate
LEAN_CHUNK_TOKENS = 8192


def mlp_chunked(chunk_tokens: int, tokens: int) -> bool:
    """Whether a layer over `tokens` tokens runs its MLP block in chunks of `chunk_tokens` (0: never)."""
    return 0 < chunk_tokens < tokens


def resolve_mlp_chunk_tokens(requested: int, micro_batch_tokens: int, lean: bool = False) -> int:
    """`train.mlp_chunk_tokens`: -1 (auto) chunks at AUTO_MLP_CHUNK_TOKENS when a micro-batch has more than twice
    as many tokens (below that the intermediates are small and a chunk's recompute would cost more than it saves),
    at LEAN_CHUNK_TOKENS in the lean layer, 0 never, N > 0 at N tokens."""
    if requested == -1 and lean:
        return LEAN_CHUNK_TOKENS
    if requested == -1:
        return AUTO_MLP_CHUNK_TOKENS if micro_batch_tokens > 2 * AUTO_MLP_CHUNK_TOKENS else 0
    return requested


DOWN_PROJ = "mlp.down_proj.weight"


@dataclass(frozen=True)
class LayerCompute:
    attention: str = "sdpa"  # a resolved backend of engine/model/attention.py (triton | sdpa | flash_attn)
    mlp_chunk_tokens: int = 0  # 0: the MLP block over all tokens at once
    lean: bool = False  # the lean layer (engine/model/lean.py): all per-token work in chunks of mlp_chunk_tokens


@dataclass(frozen=True)
class DenseArch:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    qkv_bias: bool
    qk_norm: bool
    tied: bool


def attention_specs(a) -> list[ParamSpec]:
    """The two norms and the q/k/v/o projections every decoder layer has (`a`: any arch with hidden, heads,
    kv_heads and head_dim); biases and q/k norms are added by each family."""
    h, q_out, kv_out = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    return [
        ParamSpec("input_layernorm.weight", (h,), "vector"),
        ParamSpec("self_attn.q_proj.weight", (q_out, h), "matmul"),
        ParamSpec("self_attn.k_proj.weight", (kv_out, h), "matmul"),
        ParamSpec("self_attn.v_proj.weight", (kv_out, h), "matmul"),
        ParamSpec("self_attn.o_proj.weight", (h, q_out), "matmul"),
        ParamSpec("post_attention_layernorm.weight", (h,), "vector"),
    ]


def layer_specs(a: DenseArch) -> list[ParamSpec]:
    h, q_out, kv_out = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    specs = attention_specs(a) + [
        ParamSpec("mlp.gate_proj.weight", (a.intermediate, h), "matmul"),
        ParamSpec("mlp.up_proj.weight", (a.intermediate, h), "matmul"),
        ParamSpec(DOWN_PROJ, (h, a.intermediate), "matmul"),
    ]
    if a.qkv_bias:
        specs += [ParamSpec("self_attn.q_proj.bias", (q_out,), "vector"),
                  ParamSpec("self_attn.k_proj.bias", (kv_out,), "vector"),
                  ParamSpec("self_attn.v_proj.bias", (kv_out,), "vector")]
    if a.qk_norm:
        specs += [ParamSpec("self_attn.q_norm.weight", (a.head_dim,), "vector"),
                  ParamSpec("self_attn.k_norm.weight", (a.head_dim,), "vector")]
    return specs


EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def embed_specs(a: DenseArch) -> list[ParamSpec]:
    return [ParamSpec(EMBED, (a.vocab, a.hidden), "embedding")]


def head_specs(a: DenseArch) -> list[ParamSpec]:
    """Final norm and LM head. With tied embeddings the head has no matrix of its own: callers pass the embedding."""
    specs = [ParamSpec(FINAL_NORM, (a.hidden,), "vector")]
    if not a.tied:
        specs.append(ParamSpec(LM_HEAD, (a.vocab, a.hidden), "matmul"))
    return specs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


NORM_CHUNK_TOKENS = 65536  # the fused head's final norm back-propagates in chunks of this many tokens above it


class _ChunkedRmsNorm(torch.autograd.Function):
    """rms_norm that saves only its input and weight; its backward rebuilds the norm chunk by chunk, so the fp32
    temporaries of the norm's backward span one chunk of tokens, not all of them (7 GiB each for qwen7b at 512K).
    The input gradient is the unchunked one row for row; the weight's is summed over chunks in fp32."""

    @staticmethod
    def forward(ctx, x_ND, weight, eps, chunk_tokens):
        ctx.save_for_backward(x_ND, weight)
        ctx.eps, ctx.chunk_tokens = eps, chunk_tokens
        return rms_norm(x_ND, weight, eps)

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, weight = ctx.saved_tensors
        w = weight.detach().requires_grad_()
        dx = torch.empty_like(x_ND)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, x_ND.shape[0], ctx.chunk_tokens):
            xs = x_ND[start:start + ctx.chunk_tokens].detach().requires_grad_()
            with torch.enable_grad():
                ys = rms_norm(xs, w, ctx.eps)
            gx, gw = torch.autograd.grad(ys, (xs, w), dy_ND[start:start + ctx.chunk_tokens])
            dx[start:start + ctx.chunk_tokens] = gx
            dw += gw
        return dx, dw.to(weight.dtype), None, None


def final_norm(x_ND: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The head's norm over [N, D]; above NORM_CHUNK_TOKENS tokens with autograd on, `_ChunkedRmsNorm`."""
    if torch.is_grad_enabled() and x_ND.shape[0] > NORM_CHUNK_TOKENS:
        return _ChunkedRmsNorm.apply(x_ND, weight, eps, NORM_CHUNK_TOKENS)
    return rms_norm(x_ND, weight, eps)


def embed(p: Params, ids_BT: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids_BT, p[EMBED])


def _down_proj_input(x_ND: torch.Tensor, norm_w: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """SwiGLU of the normed MLP input: what the down projection multiplies."""
    y = rms_norm(x_ND, norm_w, eps)
    return F.silu(F.linear(y, gate_w)) * F.linear(y, up_w)


def _mlp_block(x_ND: torch.Tensor, norm_w: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
               down_w: torch.Tensor, eps: float) -> torch.Tensor:
    return x_ND + F.linear(_down_proj_input(x_ND, norm_w, gate_w, up_w, eps), down_w)


def _mlp_weights(p: Params) -> tuple:
    """The MLP block's weights in `_mlp_block`'s order."""
    return p["post_attention_layernorm.weight"], p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p[DOWN_PROJ]


def _mlp(p: Params, x_BTD: torch.Tensor, a: DenseArch, chunk_tokens: int) -> torch.Tensor:
    weights = _mlp_weights(p)
    B, T, D = x_BTD.shape
    if not mlp_chunked(chunk_tokens, B * T):
        return _mlp_block(x_BTD, *weights, a.eps)
    x_ND = x_BTD.reshape(B * T, D)
    parts = []
    for start in range(0, B * T, chunk_tokens):
        xs = x_ND[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_mlp_block, xs, *weights, a.eps, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_mlp_block(xs, *weights, a.eps))
    return torch.cat(parts).view(B, T, D)


def project_qkv(p: Params, x_BTD: torch.Tensor, pos: Positions, a):
    """(q [B, nh, T, hd], k, v [B, kv, T, hd]): the input norm, the q/k/v projections, the q/k norms and RoPE, in the
    dtypes these ops give (q and k fp32 after RoPE, v the autocast dtype); attention casts them to the compute dtype.
    Per token: a chunk of tokens with its slice of `pos` gives the chunk's rows (engine/model/lean.py)."""
    B, T, _ = x_BTD.shape
    y = rms_norm(x_BTD, p["input_layernorm.weight"], a.eps)
    q = F.linear(y, p["self_attn.q_proj.weight"], p.get("self_attn.q_proj.bias"))
    k = F.linear(y, p["self_attn.k_proj.weight"], p.get("self_attn.k_proj.bias"))
    v = F.linear(y, p["self_attn.v_proj.weight"], p.get("self_attn.v_proj.bias"))
    q = q.view(B, T, a.heads, a.head_dim)
    k = k.view(B, T, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q = rms_norm(q, p["self_attn.q_norm.weight"], a.eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], a.eps)
    q = apply_rope(q.transpose(1, 2), pos)
    k = apply_rope(k.transpose(1, 2), pos)
    return q, k, v.view(B, T, a.kv_heads, a.head_dim).transpose(1, 2)


def output_residual(p: Params, x_BTD: torch.Tensor, attn_BTF: torch.Tensor) -> torch.Tensor:
    """x + o_proj(attention output [B, T, nh * hd])."""
    return x_BTD + F.linear(attn_BTF, p["self_attn.o_proj.weight"], p.get("self_attn.o_proj.bias"))


def attention_residual(p: Params, x_BTD: torch.Tensor, pos: Positions, a, c: LayerCompute = LayerCompute(),
                       window: Optional[int] = None) -> torch.Tensor:
    """x + attention(norm(x)): the first half of a decoder layer, shared with the MoE templates (engine/model/moe.py).
    `a` is any arch with heads, kv_heads, head_dim, eps and qk_norm; biases and sinks are used when `p` has them."""
    q, k, v = project_qkv(p, x_BTD, pos, a)
    attn = causal_attention(q, k, v, c.attention, window=window, sinks=p.get("self_attn.sinks"),
                            doc_start_BT=pos.doc_start_BT)
    return output_residual(p, x_BTD, attn)


def mlp_residual(p: Params, x_BTD: torch.Tensor, a: DenseArch) -> torch.Tensor:
    """x + MLP(norm(x)): the second half of a dense decoder layer, per token."""
    return _mlp_block(x_BTD, *_mlp_weights(p), a.eps)


def decoder_layer(p: Params, x_BTD: torch.Tensor, pos: Positions, a: DenseArch,
                  c: LayerCompute = LayerCompute()) -> torch.Tensor:
    return _mlp(p, attention_residual(p, x_BTD, pos, a, c), a, c.mlp_chunk_tokens)


def decoder_layer_to_down_proj(p: Params, x_BTD: torch.Tensor, pos: Positions, a: DenseArch,
                               c: LayerCompute = LayerCompute()):
    """(the MLP block's input x2 [B, T, D], the down projection's input act [B, T, I]): `decoder_layer` without its
    last matmul, whose output the backward never reads (layer output = x2 + act @ W_down^T). The recompute of a
    layer's backward stops here (`down_proj_backward` does the rest): 2*D*I FLOPs per token less, 27% of a qwen7b
    layer's forward (`down_proj_flops_per_token`). An unchunked MLP only (a chunked one checkpoints whole blocks)."""
    x2 = attention_residual(p, x_BTD, pos, a, c)
    return x2, _down_proj_input(x2, p["post_attention_layernorm.weight"], p["mlp.gate_proj.weight"],
                                p["mlp.up_proj.weight"], a.eps)


def down_proj_flops_per_token(a: DenseArch) -> int:
    return 2 * a.hidden * a.intermediate


def down_proj_backward(dy_BTD: torch.Tensor, act_BTI: torch.Tensor, down_w: torch.Tensor):
    """(d act, d W_down) of y = x2 + F.linear(act, W_down) for the output gradient dy, with the ops autograd runs for
    that linear (its matmul on the flattened tokens), so the two agree bit for bit: the residual add hands dy to the
    projection cast to its output dtype (act's: the autocast dtype on CUDA), d act = dy @ W, d W = dy^T @ act (its
    own dtype, as autocast's cast of W gives it back)."""
    g_ND = dy_BTD.to(act_BTI.dtype).reshape(-1, dy_BTD.shape[-1])
    act_NI = act_BTI.reshape(-1, act_BTI.shape[-1])
    w = down_w.to(act_BTI.dtype)
    d_act = g_ND.mm(w).view(act_BTI.shape)
    return d_act, g_ND.t().mm(act_NI).to(down_w.dtype)


def backprop(y, x_in: torch.Tensor, p: Dict[str, torch.Tensor], dy):
    """(d x_in, {name: gradient} for every tensor of p) of an output y (or a tuple of outputs, dy then a tuple of
    their gradients) computed with autograd from x_in and p."""
    names = list(p)
    grads = torch.autograd.grad(y, [x_in] + [p[n] for n in names], grad_outputs=dy)
    return grads[0], dict(zip(names, grads[1:]))


def _lm_weight(p: Params, tied_weight: Optional[torch.Tensor]) -> torch.Tensor:
    return tied_weight if tied_weight is not None else p[LM_HEAD]


def logits(p: Params, x_BTD: torch.Tensor, a: DenseArch, tied_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(rms_norm(x_BTD, p[FINAL_NORM], a.eps), _lm_weight(p, tied_weight))


def chunk_loss_sum(norm_w: torch.Tensor, lm_w: torch.Tensor, x_ND: torch.Tensor, labels_N: torch.Tensor,
                    eps: float) -> torch.Tensor:
    z = F.linear(rms_norm(x_ND, norm_w, eps), lm_w)
    return F.cross_entropy(z.float(), labels_N, reduction="sum")


def fused_loss_sum(p: Params, x_BTD: torch.Tensor, labels_BT: torch.Tensor, a: DenseArch,
                   tied_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`loss_sum` with the LM head and cross-entropy fused (streamtrain_kernels/cross_entropy.py): each chunk's gradient
    is finished in the forward, so the backward recomputes no logits (3 head matmuls instead of 4). The final norm runs
    in torch over all tokens; its output and the head matrix are cast to the autocast dtype as F.linear would."""
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    y_ND = final_norm(x_ND, p[FINAL_NORM], a.eps)
    lm_w = _lm_weight(p, tied_weight)
    if torch.is_autocast_enabled(x_ND.device.type):
        dtype = torch.get_autocast_dtype(x_ND.device.type)
        y_ND, lm_w = y_ND.to(dtype), lm_w.to(dtype)
    chunk = max(1, FUSED_LOSS_CHUNK_ELEMS // a.vocab)
    return fused_linear_cross_entropy(y_ND, lm_w, labels_BT.reshape(-1), chunk_tokens=chunk)


def loss_sum(p: Params, x_BTD: torch.Tensor, labels_BT: torch.Tensor, a: DenseArch,
             tied_weight: Optional[torch.Tensor] = None, chunk_fn=chunk_loss_sum) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the tokens of x, computed in token chunks so that at most
    LOSS_CHUNK_ELEMS logits exist at a time; each chunk's logits are recomputed in backward, not stored."""
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    labels_N = labels_BT.reshape(-1)
    chunk = max(1, LOSS_CHUNK_ELEMS // a.vocab)
    lm_w, norm_w = _lm_weight(p, tied_weight), p[FINAL_NORM]
    total = x_ND.new_zeros((), dtype=torch.float32)
    for start in range(0, x_ND.shape[0], chunk):
        xs, ls = x_ND[start:start + chunk], labels_N[start:start + chunk]
        if torch.is_grad_enabled():
            part = checkpoint(chunk_fn, norm_w, lm_w, xs, ls, a.eps, use_reentrant=False,
                              preserve_rng_state=False)
        else:
            part = chunk_fn(norm_w, lm_w, xs, ls, a.eps)
        total = total + part
    return total
