"""The lean decoder layer (dense or MoE) for long contexts: the layer's forward and backward written out in token
chunks around an attention that returns its log-sum-exp and back-propagates from a kept output
(engine/model/lean_attention.py: the Triton kernel, or cuDNN's fused attention under `sdpa`), so that nothing but q,
k, v, the attention output and its gradient ever spans a whole row.

Why. At 512K tokens a qwen7b layer under autograd keeps, for its backward, the normed inputs, the MLP's three
[T, 18944] intermediates and (with SDPA) K and V expanded to the query heads: 33-47 GiB of working memory, more
than the card has beside everything else. The chunked MLP (engine/model/dense.py) removes the MLP's share; this
layer removes the rest and the attention recompute:

Forward (`lean_forward`, no autograd): for each chunk of `chunk_tokens` tokens (split over the rows: a chunk is
every row's slice of `chunk_tokens // B` positions), the input norm, the q/k/v projections, the q/k norms and RoPE
(`dense.project_qkv`, the same per-token ops as the plain layer) are written into q [B, nh, T, hd] and k, v
[B, kv, T, hd] in the compute dtype; the attention runs over whole rows (document boundaries included on the Triton
kernel) and returns the output and its log-sum-exp; then, chunk by chunk, the output projection, the residual add
and the MLP block with its residual add (`dense.output_residual`, `dense.mlp_residual`). The forward can keep the attention
output and log-sum-exp (`KeptAttention`, 2 B x nh x hd + 4 B x nh per token) for the backward.

Backward (`lean_backward`): q, k, v are rebuilt chunk by chunk (no autograd); the attention forward runs again only
when nothing was kept. Then, chunk by chunk, the layer's second half (o_proj, residual, MLP) is rebuilt with autograd
over that chunk alone and back-propagated, giving the chunk's share of the weight gradients, its residual gradient and
the gradient of the attention output; the attention's backward takes the whole rows' dO with the kept (or recomputed)
output and log-sum-exp; and chunk by chunk the first half (norm, projections, q/k norms, RoPE) is back-propagated from
dq, dk, dv. Weight gradients are summed over chunks in fp32.

Working memory beyond the layer's input and the residual gradient, per token: q, k, v, out, dO, dk, dv in the
compute dtype (3 x nh x hd + 4 x kv x hd elements; dq is written over out, which only the kernel's first backward
pass reads) and the log-sum-exp, plus one chunk's autograd graph. No tensor spanning every query head is expanded
from K/V (the Triton kernel reads each K/V head for its group of query heads; `sdpa` expands one group at a time).

Mixture-of-experts layers (engine/model/moe.py) run the same way: their second half is the output projection and
the routed block (norm, router, experts) of one chunk, which also returns the chunk's routing sums. The balance
loss E * sum_e f_e P_e needs the whole layer's load f, which no chunk knows alone: the backward first routes every
chunk without autograd (o_proj, norm and router only) to count the load and the probability sums, hands the
layer's balance term to `balance` (which records it and returns its weight in the loss, `RouterStats`), and then
back-propagates each chunk from its output gradient and, through its probability sums, the balance term's
gradient weight * E * f_e / N (f_e = load_e / N). Every token routes as in the plain layer, so the two agree as the
chunked MoE block does.

Exactness: every op is the plain layer's on a subset of tokens, so the forward equals the plain layer's row for row
up to the matmuls' blocking, and weight gradients summed over chunks equal the unchunked sums to fp32 rounding (not
bit for bit). Both engines run this same code (the reference through `lean_layer`'s autograd Function), so they stay
bit-identical to each other. The attention is one that returns the log-sum-exp and takes a kept output in its
backward (`resolve_lean_layer` refuses other backends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from engine.config import ConfigError
from engine.device import autocast_dtype
from engine.model import dense, moe
from engine.model.rope import Positions
from engine.model.lean_attention import LEAN_BACKENDS, attention_ops

Params = Dict[str, torch.Tensor]

# train.lean_layer=auto takes the lean layer above this many tokens a micro-batch: where the plain layer's working
# set (33-47 GiB for qwen7b at 512K) no longer leaves an 80 GB card room for the rest
AUTO_LEAN_MIN_TOKENS = 131072


def lean_layer_wanted(requested: str, micro_batch_tokens: int) -> bool:
    """Whether a run of `train.lean_layer=requested` (auto | on | off) is one the lean layer is for (`on`, or `auto`
    above AUTO_LEAN_MIN_TOKENS a micro-batch), before the attention backend is known: `train.attention=auto` then
    takes a backend the lean layer runs (engine/model/attention.py `resolve_attention`)."""
    return requested == "on" or (requested == "auto" and micro_batch_tokens > AUTO_LEAN_MIN_TOKENS)


def resolve_lean_layer(requested: str, attention: str, micro_batch_tokens: int, packed: bool = False,
                       fused_sdpa: bool = True) -> bool:
    """Whether the layers run lean, for `train.lean_layer=requested` (auto | on | off) with the resolved attention
    backend: one of LEAN_BACKENDS, and `sdpa` only on rows of one document (`packed`: data=text/chat rows) where its
    fused attention runs (`fused_sdpa`: engine/model/lean_attention.py `fused_sdpa_runs`). Raises ConfigError naming
    what would be valid when `on` cannot run."""
    sdpa_blocked = ("its fused attention takes no document boundaries and the rows are packed (data=text/chat)"
                    if packed else "" if fused_sdpa else
                    "cuDNN's fused attention computes bf16 or fp16 only (train.compute_dtype=fp32 here)")
    if requested == "on":
        if attention not in LEAN_BACKENDS:
            raise ConfigError(f"train.lean_layer=on needs an attention that returns its log-sum-exp and takes a kept "
                              f"output in its backward ({' or '.join(LEAN_BACKENDS)}), but train.attention resolved "
                              f"to {attention}; set train.attention=triton, sdpa or auto")
        if attention == "sdpa" and sdpa_blocked:
            raise ConfigError(f"train.lean_layer=on with train.attention=sdpa: {sdpa_blocked}; set "
                              "train.attention=triton or auto")
        return True
    runs = attention == "triton" or (attention == "sdpa" and not sdpa_blocked)
    return runs and lean_layer_wanted(requested, micro_batch_tokens)


SINKS = "self_attn.sinks"
# the parameters of the first half, which feeds the attention; the second half (reading its output) has all others
# but the sinks, which only the attention reads
PRE_ATTENTION = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight")


@dataclass
class KeptAttention:
    """What the forward keeps so that the backward need not run attention's forward again."""
    out_BHTD: torch.Tensor  # attention output, compute dtype
    lse_BHT: torch.Tensor  # its log-sum-exp, fp32

    @property
    def nbytes(self) -> int:
        return self.out_BHTD.nbytes + self.lse_BHT.nbytes


def kept_attention_bytes_per_token(a, compute_bytes: int) -> int:
    """Bytes per token of a `KeptAttention`."""
    return compute_bytes * a.heads * a.head_dim + 4 * a.heads


def _chunks(T: int, B: int, chunk_tokens: int) -> Iterator[Tuple[int, int]]:
    """(start, stop) positions of each chunk: `chunk_tokens` tokens over the B rows (at least one position)."""
    step = max(1, chunk_tokens // B) if chunk_tokens > 0 else T
    for start in range(0, T, step):
        yield start, min(T, start + step)


def _qkv(p: Params, x_BTD: torch.Tensor, pos: Positions, a, chunk_tokens: int, fns: ChunkFns):
    """q, k, v over whole rows in the compute dtype, built chunk by chunk."""
    B, T, _ = x_BTD.shape
    q = k = v = None
    for start, stop in _chunks(T, B, chunk_tokens):
        parts = fns.qkv(p, x_BTD[:, start:stop], pos.tokens(start, stop), a)
        if q is None:
            dtype = autocast_dtype(x_BTD.device.type, parts[0].dtype)
            q, k, v = (x_BTD.new_empty((B, t.shape[1], T, a.head_dim), dtype=dtype) for t in parts)
        for whole, part in zip((q, k, v), parts):
            whole[:, :, start:stop] = part
    return q, k, v


def _rows(out_BHTD: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens start..stop-1 of the attention output as [B, C, nh * hd], the layout o_proj reads."""
    B, H, _, hd = out_BHTD.shape
    return out_BHTD[:, :, start:stop].transpose(1, 2).reshape(B, stop - start, H * hd)


def second_half(p: Params, x_BTD: torch.Tensor, attn_BTF: torch.Tensor, a) -> torch.Tensor:
    """The layer after attention: output projection and residual, MLP block and residual."""
    return dense.mlp_residual(p, dense.output_residual(p, x_BTD, attn_BTF), a)


def moe_second_half(p: Params, x_BTD: torch.Tensor, attn_BTF: torch.Tensor, a):
    """A MoE layer after attention: output projection and residual, routed block and residual; with the chunk's
    routing sums: (y [B, C, D], choices per expert [E], router probabilities summed over the chunk [E])."""
    x_BTD = dense.output_residual(p, x_BTD, attn_BTF)
    B, C, D = x_BTD.shape
    y_ND, rows, prob_sum = moe.routed_block(p, x_BTD.reshape(B * C, D), a)
    return y_ND.view(B, C, D), rows.load, prob_sum


def moe_routing(p: Params, x_BTD: torch.Tensor, attn_BTF: torch.Tensor, a):
    """The routing sums of `moe_second_half` without its experts: (choices per expert [E], probability sums [E])."""
    x_BTD = dense.output_residual(p, x_BTD, attn_BTF)
    _, _, rows, prob_sum = moe.routing(p, x_BTD.reshape(-1, x_BTD.shape[-1]), a)
    return rows.load, prob_sum


@dataclass(frozen=True)
class ChunkFns:
    """The per-chunk templates, plain or torch.compiled (`ModelSpec.compile_templates`): the layer's first half up to
    the attention inputs, and its second half from the attention output."""
    qkv: Callable = dense.project_qkv
    second_half: Callable = second_half  # `moe_second_half` for MoE layers

    @staticmethod
    def of(moe_layers: bool, compile_fn: Callable = lambda f: f) -> "ChunkFns":
        """The templates of a dense or a MoE layer, each passed through `compile_fn` (torch.compile, or none)."""
        return ChunkFns(qkv=compile_fn(dense.project_qkv),
                        second_half=compile_fn(moe_second_half if moe_layers else second_half))


def lean_forward(p: Params, x_BTD: torch.Tensor, pos: Positions, a, chunk_tokens: int,
                 window: Optional[int] = None, keep: bool = False, fns: ChunkFns = ChunkFns(),
                 attention: str = "triton"):
    """(layer output [B, T, D] in x's dtype, KeptAttention or None). `attention`: the backend
    (engine/model/lean_attention.py). Call without autograd."""
    B, T, _ = x_BTD.shape
    q, k, v = _qkv(p, x_BTD, pos, a, chunk_tokens, fns)
    out, lse = attention_ops(attention)[0](q, k, v, window, p.get(SINKS), pos.doc_start_BT)
    del q, k, v
    y = torch.empty_like(x_BTD)
    moe_layer = isinstance(a, moe.MoeArch)
    for start, stop in _chunks(T, B, chunk_tokens):
        y_c = fns.second_half(p, x_BTD[:, start:stop], _rows(out, start, stop), a)
        y[:, start:stop] = y_c[0] if moe_layer else y_c
    return y, (KeptAttention(out, lse) if keep else None)


def _balance_grad(p: Params, x_BTD: torch.Tensor, out_BHTD: torch.Tensor, a, chunk_tokens: int,
                  balance: moe.Balance) -> torch.Tensor:
    """A MoE layer's balance term: routes every chunk without autograd for the layer's load and probability sums,
    hands the term to `balance`, and returns its gradient on each chunk's probability sums, weight * E * f / N
    (fp32 [E], f = load / N the layer's expert fractions: the term is E * sum_e f_e * prob_sum_e / N)."""
    B, T, _ = x_BTD.shape
    load = prob_sum = None
    with torch.no_grad():
        for start, stop in _chunks(T, B, chunk_tokens):
            load_c, prob_c = moe_routing(p, x_BTD[:, start:stop], _rows(out_BHTD, start, stop), a)
            load, prob_sum = (load_c, prob_c) if load is None else (load + load_c, prob_sum + prob_c)
    N = B * T
    weight = balance(moe.balance_loss(load, prob_sum, N), load, N)
    return weight * a.experts * (load.float() / N) / N


def _accumulate(total: Dict[str, torch.Tensor], names, grads) -> None:
    for name, g in zip(names, grads):
        if name in total:
            total[name] += g
        else:
            total[name] = g.float()


def lean_backward(p: Params, x_BTD: torch.Tensor, dy_BTD: torch.Tensor, pos: Positions, a, chunk_tokens: int,
                  window: Optional[int] = None, kept: Optional[KeptAttention] = None, fns: ChunkFns = ChunkFns(),
                  in_place: bool = False, balance: Optional[moe.Balance] = None, attention: str = "triton"):
    """(d x [B, T, D], {name: fp32 gradient} for every tensor of p) of `lean_forward` at x for the output gradient dy.
    `kept`: the forward's attention output and log-sum-exp (else attention's forward runs again); its output tensor
    is overwritten (dq is written over it). `in_place`: d x is written over dy (a caller that no longer needs dy
    saves a [B, T, D] buffer). `balance` (MoE layers): takes the layer's balance term and returns its weight in the
    loss (`RouterStats`). `attention`: the backend the forward ran (its kept log-sum-exp is that backend's). Call
    under the run's autocast; p's tensors need not require grad."""
    attention_forward, attention_backward = attention_ops(attention)
    moe_layer = isinstance(a, moe.MoeArch)
    if moe_layer and balance is None:
        raise ValueError("lean_backward: a MoE layer's backward needs `balance` (its balance term's loss weight)")
    B, T, _ = x_BTD.shape
    x_BTD = x_BTD.detach()
    with torch.no_grad():
        q, k, v = _qkv(p, x_BTD, pos, a, chunk_tokens, fns)
        if kept is None:
            kept = KeptAttention(*attention_forward(q, k, v, window, p.get(SINKS), pos.doc_start_BT))
    grads: Dict[str, torch.Tensor] = {}
    dx = dy_BTD if in_place else torch.empty_like(x_BTD)
    d_out = torch.empty_like(kept.out_BHTD)
    post = {n: t.detach().requires_grad_() for n, t in p.items() if n not in PRE_ATTENTION and n != SINKS}
    prob_grad = _balance_grad(p, x_BTD, kept.out_BHTD, a, chunk_tokens, balance) if moe_layer else None
    for start, stop in _chunks(T, B, chunk_tokens):
        x_c = x_BTD[:, start:stop].detach().requires_grad_()
        attn_c = _rows(kept.out_BHTD, start, stop).detach().requires_grad_()
        with torch.enable_grad():
            y_c = fns.second_half(post, x_c, attn_c, a)
        # a MoE chunk also back-propagates the balance term through its probability sums
        outputs, out_grads = ((y_c[0], y_c[2]), (dy_BTD[:, start:stop], prob_grad)) if moe_layer else \
            (y_c, dy_BTD[:, start:stop])
        dx_c, d_attn_c, *g = torch.autograd.grad(outputs, [x_c, attn_c, *post.values()], out_grads)
        dx[:, start:stop] = dx_c
        d_out[:, :, start:stop] = d_attn_c.view(B, stop - start, a.heads, a.head_dim).transpose(1, 2)
        _accumulate(grads, post, g)
    dq, dk, dv, d_sinks = attention_backward(d_out, q, k, v, kept.out_BHTD, kept.lse_BHT, window, p.get(SINKS),
                                             pos.doc_start_BT)
    del d_out, q, k, v, kept
    pre = {n: p[n].detach().requires_grad_() for n in PRE_ATTENTION if n in p}
    for start, stop in _chunks(T, B, chunk_tokens):
        x_c = x_BTD[:, start:stop].detach().requires_grad_()
        with torch.enable_grad():
            q_c, k_c, v_c = fns.qkv(pre, x_c, pos.tokens(start, stop), a)
        dx_c, *g = torch.autograd.grad((q_c, k_c, v_c), [x_c, *pre.values()],
                                       (dq[:, :, start:stop], dk[:, :, start:stop], dv[:, :, start:stop]))
        dx[:, start:stop] += dx_c
        _accumulate(grads, pre, g)
    if SINKS in p:
        grads[SINKS] = d_sinks.float()
    return dx, grads


class _LeanLayer(torch.autograd.Function):
    """`lean_forward` under autograd: the forward keeps the attention output, the backward is `lean_backward` under
    the forward's autocast state. The engines' plain-autograd paths (engine=reference, kept layer graphs) use it."""

    @staticmethod
    def forward(ctx, x_BTD, pos, a, chunk_tokens, window, fns, balance, attention, names, *values):
        p = dict(zip(names, values))
        y, kept = lean_forward(p, x_BTD, pos, a, chunk_tokens, window, keep=True, fns=fns, attention=attention)
        ctx.save_for_backward(x_BTD, kept.out_BHTD, kept.lse_BHT, *values)
        ctx.cfg = (pos, a, chunk_tokens, window, fns, balance, attention, names)
        device_type = x_BTD.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return y

    @staticmethod
    def backward(ctx, dy_BTD):
        x_BTD, out, lse, *values = ctx.saved_tensors
        pos, a, chunk_tokens, window, fns, balance, attention, names = ctx.cfg
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            dx, grads = lean_backward(dict(zip(names, values)), x_BTD, dy_BTD, pos, a, chunk_tokens, window,
                                      KeptAttention(out, lse), fns, balance=balance, attention=attention)
        return (dx, None, None, None, None, None, None, None, None,
                *(grads[n].to(t.dtype) for n, t in zip(names, values)))


def lean_layer(p: Params, x_BTD: torch.Tensor, pos: Positions, a, chunk_tokens: int,
               window: Optional[int] = None, fns: ChunkFns = ChunkFns(),
               balance: Optional[moe.Balance] = None, attention: str = "triton") -> torch.Tensor:
    """The decoder layer (dense or MoE), lean: differentiable in x and p when autograd is on (the backward reuses
    the forward's attention output; a MoE layer's adds its balance term's gradient, `balance` giving its weight),
    `lean_forward` without it."""
    if not torch.is_grad_enabled():
        return lean_forward(p, x_BTD, pos, a, chunk_tokens, window, fns=fns, attention=attention)[0]
    names = tuple(p)
    return _LeanLayer.apply(x_BTD, pos, a, chunk_tokens, window, fns, balance, attention, names,
                            *(p[n] for n in names))
