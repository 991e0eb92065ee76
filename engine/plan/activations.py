"""Activation memory: what one decoder layer's autograd graph keeps per token, a recomputed layer's working set,
and the head's working memory, in the compute dtype's bytes. Estimates from the tensors autograd saves around
`decoder_layer`; tests/test_plan.py measures the eager figure on the CPU."""

from __future__ import annotations

from engine.model import moe
from engine.model.attention import HAVE_FLASH_ATTN
from engine.model.dense import FUSED_LOSS_CHUNK_ELEMS, LOSS_CHUNK_ELEMS, NORM_CHUNK_TOKENS, mlp_chunked
from engine.model.lean import kept_attention_bytes_per_token


def layer_activation_bytes_per_token(spec, compute_bytes: int, compiled: bool = True, mlp: bool = True) -> int:
    """Bytes per token one decoder layer's autograd graph keeps (the tensors saved-tensor hooks list around
    `decoder_layer` under autocast; the layer input itself is counted with the layer-input activations).
    `mlp=False`: without the MLP block's share (a chunked MLP keeps only its chunk inputs, which are the residual
    after attention, counted either way).

    Compiled (the partitioner keeps what the backward needs, in the compute dtype where it can): the two RMSNorm
    reciprocals and normed inputs, roped q and k, v, the attention output and its log-sum-exp, the residual after
    attention (fp32), gate, up and their product; with qk-norm, q and k before it and its reciprocals.
    Eager saves more (1.5-1.8x; tests/test_plan.py measures it on the CPU under bf16 autocast): each RMSNorm keeps
    its fp32 output, and each of the five projections of a normed input (q, k, v, gate, up) keeps its own autocast
    copy of it; SwiGLU keeps silu(gate) as well; SDPA keeps its output and the o_proj keeps the transposed copy;
    qk-norm keeps its fp32 upcast of q and k. A MoE layer's MLP share is its routed block's
    (engine/model/moe.py `activation_bytes_per_token`)."""
    a = spec.arch
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    fp32 = 4
    shared = (fp32  # the input norm's reciprocal
              + compute_bytes * (q + 2 * kv)  # roped q, k and v
              + compute_bytes * q + fp32 * a.heads  # attention output, log-sum-exp
              + fp32 * a.hidden)  # residual after attention
    if a.qk_norm:  # q and k before their norm, and the norms' reciprocals per head
        shared += compute_bytes * (q + kv) + fp32 * (a.heads + a.kv_heads)
    if compiled:
        attention = shared + compute_bytes * a.hidden
    else:
        attention_copy = 0 if HAVE_FLASH_ATTN else compute_bytes * q
        qk_norm_fp32 = fp32 * (q + kv) if a.qk_norm else 0  # eager qk-norm keeps its fp32 upcast too
        attention = shared + qk_norm_fp32 + fp32 * a.hidden + compute_bytes * a.hidden * 3 + attention_copy
    if not mlp:
        return attention
    if spec.moe:  # the routed block: router, gathered rows, expert intermediates, index tensors
        return attention + moe.activation_bytes_per_token(a, compute_bytes, compiled)
    if compiled:
        return attention + fp32 + compute_bytes * a.hidden + compute_bytes * a.intermediate * 3
    return attention + fp32 + fp32 * a.hidden + compute_bytes * a.hidden * 2 + compute_bytes * a.intermediate * 4


def layer_graph_bytes(spec, tokens: int, compute_bytes: int, compiled: bool, mlp_chunk_tokens: int,
                      lean: bool = False) -> int:
    """What one layer's autograd graph over `tokens` tokens keeps; a chunked MLP (`mlp_chunk_tokens > 0` and fewer
    than `tokens`) keeps none of its intermediates; the lean layer keeps its input (fp32) and the attention output
    with its log-sum-exp."""
    if lean:
        return (4 * spec.arch.hidden + kept_attention_bytes_per_token(spec.arch, compute_bytes)) * tokens
    mlp = not mlp_chunked(mlp_chunk_tokens, tokens)
    return layer_activation_bytes_per_token(spec, compute_bytes, compiled, mlp=mlp) * tokens


def lean_working_bytes(spec, tokens: int, compute_bytes: int, compiled: bool, chunk_tokens: int,
                       attention: str = "triton") -> int:
    """The lean layer's working set (engine/model/lean.py), at its backward's peak: q, k, v, the attention output
    (dq is written over it), its gradient and dk, dv over whole rows in the compute dtype, the log-sum-exp and the
    kernel's row sums (fp32 per head), one chunk's autograd graph with its gradients, and the layer's weight
    gradients summed over the chunks in fp32 (a whole layer's worth, whatever the length: 0.87 GiB for qwen7b,
    measured on an H100 as the constant left between this count and the layer's peak at 32K and 128K,
    bench/results/lean_layer_h100_2026-12-07.jsonl). The layer's output gradient is written over the residual
    stream's (counted with it). The Triton kernel never expands K and V to the query heads; the `sdpa` backend
    (engine/model/lean_attention.py) expands one K/V head's K and V to its group of query heads at a time and gets
    their gradients and the group's dq at that width: five [tokens, group x head_dim] tensors live in one group's
    backward (without GQA, one call over all heads: only its dq beside the rest), and cuDNN's backward adds a
    workspace counted as two fp32 tensors of the group's width (measured on an H100, qwen7b: 3.2 GiB above the rest
    at 512K tokens; this count is then 1% over the measured peak at 512K and 13% over at 128K,
    bench/results/lean_layer_h100_2026-12-07c.jsonl)."""
    a = spec.arch
    whole_rows = compute_bytes * (3 * a.heads + 4 * a.kv_heads) * a.head_dim + 2 * 4 * a.heads
    if attention == "sdpa":
        group = a.heads // a.kv_heads if a.kv_heads < a.heads else a.heads
        ours = 5 * group if a.kv_heads < a.heads else a.heads
        whole_rows += a.head_dim * (compute_bytes * ours + 2 * 4 * group)
    chunk = min(tokens, chunk_tokens) if chunk_tokens > 0 else tokens
    weight_grads = 4 * spec.layer_units[0].layout.numel
    return (whole_rows * tokens + int(1.5 * layer_activation_bytes_per_token(spec, compute_bytes, compiled) * chunk)
            + weight_grads)


def layer_working_bytes(spec, tokens: int, compute_bytes: int, compiled: bool, mlp_chunk_tokens: int,
                        attention: str, lean: bool = False) -> int:
    """A recomputed layer's working set: its graph plus the gradients of the same tensors, live transiently; a
    chunked MLP adds one chunk's intermediates, rebuilt in the backward. `attention`: the resolved backend; torch's
    SDPA computes a GQA backward (fewer K/V heads than query heads) on K and V expanded to the query heads, and
    their gradients at that width, before it sums them back: four [tokens, heads x head_dim] tensors (measured on
    an H100 at 128K tokens, qwen7b's 28/4 heads: 3.24 GiB above the Triton kernel's backward, 93% of this count).
    `lean`: the lean layer's (`lean_working_bytes`)."""
    if lean:
        return lean_working_bytes(spec, tokens, compute_bytes, compiled, mlp_chunk_tokens, attention)
    graph = layer_graph_bytes(spec, tokens, compute_bytes, compiled, mlp_chunk_tokens)
    if 0 < mlp_chunk_tokens < tokens:
        mlp_per_token = (layer_activation_bytes_per_token(spec, compute_bytes, compiled)
                         - layer_activation_bytes_per_token(spec, compute_bytes, compiled, mlp=False))
        graph += mlp_per_token * mlp_chunk_tokens
    a = spec.arch
    gqa_expanded = 4 * compute_bytes * a.heads * a.head_dim * tokens if attention == "sdpa" and \
        a.kv_heads < a.heads else 0
    return int(graph * 1.5) + gqa_expanded


def loss_activation_bytes(spec, tokens: int, compute_bytes: int, fused: bool) -> int:
    """The head's working memory for one micro-batch of `tokens`."""
    a = spec.arch
    if fused:  # one chunk of logits, the saved dh and the fp32 dW (+ its copy in the weight's dtype), the residual
        # gradient, and two fp32 temporaries of the final norm's backward, over one norm chunk (qwen7b at 512K on an
        # H100 ran out of memory asking for a 7 GiB [tokens, hidden] fp32 buffer there when the norm back-propagated
        # over all tokens at once: bench/results/long-context_h100_2026-12-07.md)
        chunk = min(tokens, max(1, FUSED_LOSS_CHUNK_ELEMS // a.vocab))
        norm_chunk = min(tokens, NORM_CHUNK_TOKENS) if tokens > NORM_CHUNK_TOKENS else tokens
        return (compute_bytes * chunk * a.vocab + compute_bytes * tokens * a.hidden
                + (4 + compute_bytes) * a.vocab * a.hidden + 4 * tokens * a.hidden + 2 * 4 * norm_chunk * a.hidden)
    chunk = min(tokens, max(1, LOSS_CHUNK_ELEMS // a.vocab))
    return chunk * a.vocab * (2 + 4 + 4)  # bf16 logits, fp32 upcast, its gradient

