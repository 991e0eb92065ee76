"""The token-chunked MoE block (engine/model/moe.py, `LayerCompute.mlp_chunk_tokens`) and its memory model.

- Chunked and unchunked layers agree in fp32 (Qwen3-MoE with torch's SDPA, gpt-oss with the Triton attention under
  the interpreter): outputs, routing load, the balance loss the layer reports, and the gradients of the input and of
  every parameter, the balance term's injected gradient included (coef 0.25, `RouterStats.attach`), with chunks
  that do not divide the token count and that straddle the two sequences.
- `Execution` chunks MoE layers as it does dense ones: auto above 64K tokens per micro-batch, N as asked.
- Both engines train bit-identically with a chunked MoE block.
- `moe.activation_bytes_per_token` is what autograd saves for the routed block, per token: saved-tensor hooks on the
  CPU, eager (bf16 autocast, fp32) and compiled (torch.compile's min-cut partitioner, bf16 autocast), with the [E]
  group offsets of the grouped matmuls as the only other tensor; around the whole Qwen3-MoE layer it adds to the
  planner's attention share, and a chunked layer keeps only that share.
"""

from __future__ import annotations

import pytest
import torch

from engine.model import ModelSpec, moe
from engine.model.dense import AUTO_MLP_CHUNK_TOKENS, LayerCompute
from engine.plan import layer_activation_bytes_per_token
from engine.execution import Execution
from tests.test_engine_equivalence import FAMILIES, assert_same, train
from tests.test_moe_vs_hf import B, COMMON, CASES, T, case_cfg, hf_model, make_spec, our_params
from tests.test_plan import _SdpaLike
from tests.util import make_cfg


def _run_layer(spec: ModelSpec, params, x, dy, chunk: int):
    """One layer through `spec.layer` (balance term attached) with the given MLP chunk: output, step stats and the
    gradients of x and of every parameter for the loss sum(y * dy) + coef * balance."""
    spec.set_layer_compute(LayerCompute(attention=spec.compute.attention, mlp_chunk_tokens=chunk))
    spec.begin_step(x.shape[0] * x.shape[1])
    y = spec.layer(params, x, spec.positions(T, "cpu"), 0)
    names = list(params)
    grads = torch.autograd.grad(y, [x] + [params[n] for n in names], grad_outputs=dy)
    return y.detach(), spec.step_stats(), dict(zip(["x"] + names, grads)), spec.router_stats.load[0]


@pytest.mark.parametrize("chunk", [16, 50])
@pytest.mark.parametrize("case", ["qwen3_moe_1layer", "gpt_oss_1layer"])
def test_chunked_layer_matches_unchunked(case, chunk):
    spec = make_spec(case)
    params = our_params(spec, hf_model(case))[1]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, spec.arch.hidden, generator=gen).requires_grad_()
    dy = torch.randn(B, T, spec.arch.hidden, generator=gen)
    y_ref, stats_ref, g_ref, load_ref = _run_layer(spec, params, x, dy, 0)
    y, stats, g, load = _run_layer(spec, params, x, dy, chunk)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(load, load_ref) and load.sum() == B * T * spec.arch.top_k
    assert stats == pytest.approx(stats_ref, rel=1e-6)
    for name in g_ref:  # weight gradients summed chunk by chunk: fp32 rounding, relative to the tensor's scale
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5 * g_ref[name].abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        y_nograd, aux, load_nograd, _ = moe.decoder_layer(params, x, spec.positions(T, "cpu"), spec.arch, spec.compute,
                                                       spec.layer_windows[0])
    assert torch.equal(y_nograd, y) and torch.equal(load_nograd, load)
    assert aux.item() == pytest.approx(stats["balance_loss"], rel=1e-6)


def test_layer_compute_chunks_moe_layers_like_dense_ones():
    def chunk(overrides):
        cfg = make_cfg([*COMMON, *CASES["qwen3_moe"], *overrides])
        return Execution.of(ModelSpec(cfg.model), cfg, on_gpu=False, strict=True).mlp_chunk_tokens

    long = ["model.max_position_embeddings=131072", "train.seq_len=131072", "train.micro_batch_size=1"]
    assert chunk(long) == AUTO_MLP_CHUNK_TOKENS
    assert chunk([*long, "train.mlp_chunk_tokens=0"]) == 0
    assert chunk(["train.micro_batch_size=2"]) == 0  # 64 tokens: auto leaves it whole
    assert chunk(["train.mlp_chunk_tokens=16"]) == 16


def test_stream_equals_reference_with_chunked_moe_block():
    over = [*FAMILIES["qwen3_moe"], "train.mlp_chunk_tokens=20"]
    rec_r, w_r, m_r, _ = train("reference", over, steps=2)
    rec_s, w_s, m_s, _ = train("stream", over, steps=2)
    assert [r["loss"] for r in rec_s] == [r["loss"] for r in rec_r]
    assert_same(w_s, w_r)
    assert_same(m_s, m_r)


def _saved_bytes(fn, elsewhere, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves while fn runs, those in `elsewhere` (inputs, parameters) not
    counted."""
    skip = {t.untyped_storage().data_ptr() for t in elsewhere}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


def _layer_params(spec: ModelSpec, dtype: torch.dtype):
    """Random layer parameters, matrices in `dtype` as the engine's slots hold them."""
    gen = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=gen).to(dtype if s.kind == "matmul" else torch.float32)
            .requires_grad_() for s in spec.units[1].layout.specs}


@pytest.mark.parametrize("mode, compute_bytes", [("eager", 2), ("eager", 4), ("compiled", 2)])
@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_unnormalised", "gpt_oss"])
def test_routed_block_bytes_are_what_autograd_saves(case, mode, compute_bytes):
    overrides = [*CASES["qwen3_moe"], "model.norm_topk_prob=false"] if case == "qwen3_moe_unnormalised" \
        else CASES[case]
    spec = ModelSpec(make_cfg([*COMMON, *overrides]).model)
    a = spec.arch
    params = _layer_params(spec, torch.bfloat16 if compute_bytes == 2 else torch.float32)
    x = torch.randn(B * T, a.hidden, requires_grad=True)
    block = moe.routed_block
    if mode == "compiled":
        torch._dynamo.reset()
        block = torch.compile(block, backend="aot_eager_decomp_partition", dynamic=False)
    measured = _saved_bytes(lambda: block(params, x, a), [x, *params.values()], autocast=compute_bytes == 2)
    offsets = 4 * a.experts  # the grouped matmuls' group offsets (int32), one per call
    counted = moe.activation_bytes_per_token(a, compute_bytes, compiled=mode == "compiled")
    assert (measured - offsets) / (B * T) == counted


def test_whole_moe_layer_bytes_are_the_attention_share_plus_the_routed_block(monkeypatch):
    """Around `decoder_layer` (SDPA stood in for as in tests/test_plan.py): the planner's eager attention share plus
    the routed block's count; chunked, the attention share alone (the checkpoints keep their chunk inputs only)."""
    from engine.model import attention

    monkeypatch.setattr(attention, "HAVE_FLASH_ATTN", False)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, is_causal, enable_gqa: _SdpaLike.apply(q, k, v))
    spec = ModelSpec(case_cfg("qwen3_moe"))
    params = _layer_params(spec, torch.bfloat16)
    x = torch.randn(B, T, spec.arch.hidden, requires_grad=True)
    rope = spec.positions(T, "cpu")
    elsewhere = [x, rope.cos, rope.sin, *params.values()]
    attention_share = layer_activation_bytes_per_token(spec, 2, compiled=False, mlp=False)
    per_expert = 4 * spec.arch.experts  # the balance loss's f (fp32) and, unchunked, the group offsets (int32)
    whole = _saved_bytes(lambda: moe.decoder_layer(params, x, rope, spec.arch), elsewhere, autocast=True)
    assert (whole - 2 * per_expert) / (B * T) == attention_share + moe.activation_bytes_per_token(
        spec.arch, 2, compiled=False)
    chunked = _saved_bytes(lambda: moe.decoder_layer(params, x, rope, spec.arch, LayerCompute(mlp_chunk_tokens=16)),
                           elsewhere, autocast=True)
    assert (chunked - per_expert) / (B * T) == attention_share


def test_planner_counts_the_routed_block_for_moe_layers():
    spec = ModelSpec(case_cfg("qwen3_moe"))
    for compiled in (False, True):
        assert layer_activation_bytes_per_token(spec, 2, compiled) == (
            layer_activation_bytes_per_token(spec, 2, compiled, mlp=False)
            + moe.activation_bytes_per_token(spec.arch, 2, compiled))
