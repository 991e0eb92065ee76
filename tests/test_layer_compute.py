"""How a layer is computed (engine/model/dense.py `LayerCompute`): the attention backend and the MLP token chunk.

- `train.attention` resolves to a backend that can run, or is refused with the value and what would be valid.
- The Triton attention (under the interpreter, fp32: exact dots) gives the layer SDPA's output and gradients to
  fp32 rounding; the chunked MLP gives the unchunked layer's, with chunks that do not divide the token count.
- Both engines train bit-identically with the Triton attention and a chunked MLP (they share the templates).
- The streaming engine's recompute (`ModelSpec.layer_grads`) leaves out the down projection's forward and still
  gives autograd's gradients bit for bit.
- The planner counts a chunked MLP's memory as one chunk's, not the micro-batch's.
"""

import pytest
import torch

from engine.config import ConfigError
from engine.model import ModelSpec
from engine.model import attention as attention_mod
from engine.model.attention import resolve_attention
from engine.model.dense import AUTO_MLP_CHUNK_TOKENS, LayerCompute, decoder_layer, resolve_mlp_chunk_tokens
from engine.plan import build_plan, layer_working_bytes
from tests.test_engine_equivalence import assert_same, train
from tests.util import SMALL, make_cfg

# SMALL's width with head_dim 16, which the Triton kernel takes
WIDE_HEADS = ["model.hidden_size=96", "model.num_attention_heads=6", "model.num_key_value_heads=2"]


def test_auto_picks_the_backend_measured_faster_in_the_layer():
    assert resolve_attention("auto", "cuda", 128) == "sdpa"  # see engine/model/attention.py for the figures
    assert resolve_attention("auto", "cpu", 128) == "sdpa"
    assert resolve_attention("triton", "cuda", 128) == "triton"
    assert resolve_attention("sdpa", "cuda", 80) == "sdpa"


def test_sinks_or_windows_run_on_the_triton_kernel_only(monkeypatch):
    """gpt-oss: `auto` takes the Triton kernel; SDPA and flash-attn are refused; without CUDA (or the interpreter)
    the refusal says why, not "use sdpa"."""
    assert resolve_attention("auto", "cuda", 64, sinks_or_window=True) == "triton"
    for other in ("sdpa", "flash_attn"):
        with pytest.raises(ConfigError, match="only the Triton kernel computes; use train.attention=triton or auto"):
            resolve_attention(other, "cuda", 64, sinks_or_window=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="it needs a CUDA device; the run is on cpu"):
        resolve_attention("auto", "cpu", 64, sinks_or_window=True)


@pytest.mark.parametrize("requested, device, head_dim, message", [
    ("triton", "cuda", 80, "head_dim=80 is not supported"),
    ("triton", "cpu", 128, "needs a CUDA device"),
    ("flash_attn", "cuda", 128, "flash-attn package is not installed"),
    ("xformers", "cuda", 128, "train.attention='xformers' is not valid"),
])
def test_an_asked_for_backend_that_cannot_run_is_refused(monkeypatch, requested, device, head_dim, message):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(attention_mod, "HAVE_FLASH_ATTN", False)
    with pytest.raises(ConfigError, match=message):
        resolve_attention(requested, device, head_dim)


def test_auto_mlp_chunk_only_for_long_micro_batches():
    assert resolve_mlp_chunk_tokens(-1, 2 * AUTO_MLP_CHUNK_TOKENS) == 0
    assert resolve_mlp_chunk_tokens(-1, 524288) == AUTO_MLP_CHUNK_TOKENS
    assert resolve_mlp_chunk_tokens(0, 524288) == 0
    assert resolve_mlp_chunk_tokens(1000, 4096) == 1000


def _layer_case(B=2, T=37):
    spec = ModelSpec(make_cfg([*SMALL, *WIDE_HEADS]).model)
    unit = spec.units[1]
    flat = torch.empty(unit.layout.numel)
    params = unit.layout.views(flat)
    spec.init_unit(unit, params, seed=3)
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, spec.arch.hidden, generator=gen).requires_grad_()
    dy = torch.randn(B, T, spec.arch.hidden, generator=gen)
    return spec, params, x, dy, spec.positions(T, "cpu")


def _run_layer(spec, params, x, dy, rope, compute):
    y = decoder_layer(params, x, rope, spec.arch, compute)
    names = list(params)
    grads = torch.autograd.grad(y, [x] + [params[n] for n in names], grad_outputs=dy)
    return y.detach(), dict(zip(["x"] + names, grads))


@pytest.mark.parametrize("compute", [LayerCompute(attention="triton"), LayerCompute(mlp_chunk_tokens=17),
                                     LayerCompute(attention="triton", mlp_chunk_tokens=30)],
                         ids=["triton", "chunk17", "triton+chunk30"])
def test_layer_matches_sdpa_unchunked_in_fp32(compute):
    spec, params, x, dy, rope = _layer_case()
    y_ref, g_ref = _run_layer(spec, params, x, dy, rope, LayerCompute())
    y, g = _run_layer(spec, params, x, dy, rope, compute)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_chunked_mlp_forward_without_grad_equals_the_chunked_one_with_grad():
    spec, params, x, dy, rope = _layer_case()
    compute = LayerCompute(mlp_chunk_tokens=17)
    with torch.no_grad():
        y_nograd = decoder_layer(params, x, rope, spec.arch, compute)
    y, _ = _run_layer(spec, params, x, dy, rope, compute)
    assert torch.equal(y, y_nograd)


def test_stream_equals_reference_with_triton_attention_and_chunked_mlp():
    over = [*WIDE_HEADS, "train.attention=triton", "train.mlp_chunk_tokens=20",
            "train.grad_accum=1", "model.num_hidden_layers=2"]  # the interpreted kernel is slow: a small step
    rec_r, w_r, m_r, _ = train("reference", over, steps=2)
    rec_s, w_s, m_s, _ = train("stream", over, steps=2)
    assert [r["loss"] for r in rec_s] == [r["loss"] for r in rec_r]
    assert_same(w_s, w_r)
    assert_same(m_s, m_r)


def test_planner_counts_sdpas_expanded_gqa_backward():
    """SDPA's GQA backward works on K and V expanded to the query heads (and their gradients): four [T, 28 x 128]
    bf16 tensors more than the Triton kernel for qwen7b (28 query, 4 K/V heads); none where the heads match."""
    T = 131072
    gqa = ModelSpec(make_cfg(["model=qwen7b"]).model)
    assert layer_working_bytes(gqa, T, 2, True, 0, "sdpa") - layer_working_bytes(gqa, T, 2, True, 0, "triton") \
        == 4 * 2 * 28 * 128 * T
    full = ModelSpec(make_cfg(["model=tiny", "model.num_key_value_heads=6"]).model)
    assert layer_working_bytes(full, T, 2, True, 0, "sdpa") == layer_working_bytes(full, T, 2, True, 0, "triton")


def test_planner_counts_one_chunk_of_mlp_memory():
    spec = ModelSpec(make_cfg(["model=qwen7b"]).model)
    T = 524288
    whole = layer_working_bytes(spec, T, 2, True, 0, "triton")
    chunked = layer_working_bytes(spec, T, 2, True, AUTO_MLP_CHUNK_TOKENS, "triton")
    # qwen7b's MLP is most of a layer's graph (3 x 18944 of ~8.7K x 2 B per token): chunking removes most of it
    assert chunked < 0.5 * whole
    cfg = make_cfg(["model=qwen7b", "engine=stream", "train=bench", "train.micro_batch_size=1",
                    "train.grad_accum=1", f"train.seq_len={T}", f"model.max_position_embeddings={T}"])
    chunked_plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False)
    cfg.train.mlp_chunk_tokens = 0
    whole_plan = build_plan(ModelSpec(cfg.model), cfg, gpu_gib=139.0, host_gib=125.0, on_gpu=True, check=False)
    assert chunked_plan.total("gpu") < whole_plan.total("gpu")


@pytest.mark.parametrize("family", [[], ["model.model_type=qwen3", "model.qkv_bias=false", "model.qk_norm=true"],
                                    ["model.model_type=llama", "model.qkv_bias=false"]],
                         ids=["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_layer_grads_equal_autograd_through_the_whole_layer_without_the_down_projections_forward(family, dtype):
    """The engine's recompute (`ModelSpec.layer_grads`) stops before the down projection and takes its gradients by
    hand: bit for bit autograd's through the whole layer (fp32, and bf16 weights under CPU autocast), on 3 x 29
    tokens, with one matmul forward fewer: 2 * T * D * I FLOPs less than the whole layer's forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = ModelSpec(make_cfg([*SMALL, *family]).model)
    unit = spec.units[1]
    params = unit.layout.views(torch.empty(unit.layout.numel))
    spec.init_unit(unit, params, seed=3)
    params = {k: (v.to(dtype) if v.dim() == 2 else v).detach().clone().requires_grad_() for k, v in params.items()}
    gen = torch.Generator().manual_seed(0)
    B, T, D = 3, 29, spec.arch.hidden
    x = torch.randn(B, T, D, generator=gen).requires_grad_()
    dy = torch.randn(B, T, D, generator=gen)
    rope, names = spec.positions(T, "cpu"), list(params)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        with FlopCounterMode(display=False) as whole_flops:
            y = spec.layer(params, x, rope, 0)
            ref = torch.autograd.grad(y, [x] + [params[n] for n in names], grad_outputs=dy)
        with FlopCounterMode(display=False) as flops:
            dx, grads = spec.layer_grads(params, x, dy, rope, 0)
    assert torch.equal(dx, ref[0])
    for name, g_ref in zip(names, ref[1:]):
        assert grads[name].dtype == g_ref.dtype and torch.equal(grads[name], g_ref), name
    assert whole_flops.get_total_flops() - flops.get_total_flops() == 2 * B * T * D * spec.arch.intermediate
    assert spec.recompute_skipped_flops_per_token(chunked_mlp=False) == 2 * D * spec.arch.intermediate
    assert spec.recompute_skipped_flops_per_token(chunked_mlp=True) == 0
