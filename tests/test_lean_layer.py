"""The lean long-context layer (engine/model/lean.py) against the plain layer (engine/model/dense.py).

- Forward and all gradients equal the plain layer's with the same Triton attention: fp32 to rounding, bf16 autocast
  within 2x the plain layer's own error against an fp32 run; chunks that do not divide the tokens, several rows,
  packed rows with document boundaries, qwen3's q/k norms.
- The backward from the kept attention output equals the one that runs attention's forward again, bit for bit.
- The autograd wrapper the reference engine uses gives `lean_backward`'s gradients, and both engines train
  bit-identically through the lean layer.
- Mixture-of-experts layers (Qwen3-MoE, gpt-oss) equal the plain MoE layer, the balance loss's gradient included.
- `train.lean_layer=auto` resolves to it above 128K tokens a micro-batch (on cuDNN's attention, or the Triton kernel
  where that cannot serve), and on a GPU the plan takes whichever layer plans faster in the most precise state
  format that fits; `on` where it cannot run is refused; the planner counts its working set and times a kept lean
  graph as the lean backward runs.
"""

import pytest
import torch

from engine.config import ConfigError
from engine.execution import Execution
from engine.model import ModelSpec, dense
from engine.model.dense import AUTO_MLP_CHUNK_TOKENS, LEAN_CHUNK_TOKENS, LayerCompute, decoder_layer
from engine.model.lean import lean_backward, lean_forward, lean_layer
from engine.formats import StateFormat
from engine.plan import GIB, build_plan, layer_working_bytes
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds
from engine.plan.time_model import StepTimer
from tests.test_engine_equivalence import assert_same, train
from tests.util import FP32, SMALL, make_cfg

WIDE_HEADS = ["model.hidden_size=96", "model.num_attention_heads=6", "model.num_key_value_heads=2"]
QWEN3 = ["model.model_type=qwen3", "model.qkv_bias=false", "model.qk_norm=true"]


def _case(family=(), B=2, T=37, docs=False, weight_dtype=torch.float32):
    spec = ModelSpec(make_cfg([*SMALL, *WIDE_HEADS, *family]).model)
    unit = spec.units[1]
    params = unit.layout.views(torch.empty(unit.layout.numel))
    spec.init_unit(unit, params, seed=3)
    params = {k: (v.to(weight_dtype) if v.dim() == 2 else v).detach().clone() for k, v in params.items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, spec.arch.hidden, generator=gen)
    dy = torch.randn(B, T, spec.arch.hidden, generator=gen)
    pos = spec.positions(T, "cpu")
    if docs:  # row 0: documents of 10, 20 and 7 tokens; row 1: one document
        starts = torch.tensor([0] * 10 + [10] * 20 + [30] * 7, dtype=torch.int32)[:T]
        pos = pos.of_rows(torch.stack([starts, torch.zeros(T, dtype=torch.int32)])[:B])
    return spec, params, x, dy, pos


def _plain(spec, params, x, dy, pos, attention="triton"):
    p = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    x = x.detach().clone().requires_grad_()
    y = decoder_layer(p, x, pos, spec.arch, LayerCompute(attention=attention))
    grads = torch.autograd.grad(y, [x, *p.values()], grad_outputs=dy)
    return y.detach(), grads[0], dict(zip(p, grads[1:]))


def _lean(spec, params, x, dy, pos, chunk, kept=True, attention="triton"):
    with torch.no_grad():
        y, k = lean_forward(params, x, pos, spec.arch, chunk, keep=kept, attention=attention)
    dx, grads = lean_backward(params, x, dy, pos, spec.arch, chunk, kept=k, attention=attention)
    return y, dx, grads


def _assert_within_twice_the_plain_error(lean, plain, exact):
    """Each of (output, input gradient, {name: weight gradient}) of the lean run is within 2x the plain bf16 run's
    error against the fp32 one, plus a floor of bf16 rounding (2**-8 of the largest entry, / 16) for entries the
    plain run happens to get nearly exact."""
    lean, plain, exact = ({"y": y, "dx": dx, **grads} for y, dx, grads in (lean, plain, exact))
    for name in exact:
        lean_err = (lean[name].float() - exact[name]).abs().max().item()
        plain_err = (plain[name].float() - exact[name]).abs().max().item()
        floor = 2 ** -8 * exact[name].abs().max().item() / 16
        assert lean_err <= 2 * plain_err + floor, f"{name}: lean {lean_err:.3g} vs plain {plain_err:.3g}"


MHA = ["model.num_key_value_heads=6"]


@pytest.mark.parametrize("family, B, T, docs, chunk, attention", [
    ((), 2, 37, False, 17, "triton"),  # 8 positions a chunk per row: 37 = 4 x 8 + 5
    (QWEN3, 1, 37, False, 11, "triton"),
    ((), 2, 37, True, 24, "triton"),  # chunks cross document boundaries
    ((), 1, 37, True, 1000, "triton"),  # one chunk
    ((), 2, 37, False, 17, "sdpa"),  # the fused attention, each K/V head's group in a call of its own
    (QWEN3, 1, 37, False, 1000, "sdpa"),
    (MHA, 2, 37, False, 11, "sdpa"),  # no GQA: one call over all heads
], ids=["qwen2-2rows", "qwen3", "packed", "one-chunk", "sdpa-2rows", "sdpa-qwen3-one-chunk", "sdpa-mha"])
def test_lean_layer_equals_the_plain_layer_in_fp32(family, B, T, docs, chunk, attention):
    spec, params, x, dy, pos = _case(family, B, T, docs)
    y_ref, dx_ref, g_ref = _plain(spec, params, x, dy, pos, attention)
    y, dx, g = _lean(spec, params, x, dy, pos, chunk, attention=attention)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    assert set(g) == set(g_ref)
    for name in g_ref:
        assert g[name].dtype == torch.float32
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("attention, docs", [("triton", True), ("sdpa", False)])
def test_lean_layer_under_bf16_autocast_is_within_twice_the_plain_layers_error(attention, docs):
    """bf16 weights under CPU autocast: each output's error against the fp32 plain layer is at most 2x the bf16 plain
    layer's own (plus a floor of a few bf16 ulps for entries the plain run happens to get nearly exact)."""
    spec, params, x, dy, pos = _case(QWEN3, 2, 37, docs=docs)
    y32, dx32, g32 = _plain(spec, params, x, dy, pos, attention)
    _, params16, _, _, _ = _case(QWEN3, 2, 37, docs=docs, weight_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, dx_ref, g_ref = _plain(spec, params16, x, dy, pos, attention)
        y, dx, g = _lean(spec, params16, x, dy, pos, chunk=20, attention=attention)
    _assert_within_twice_the_plain_error((y, dx, g), (y_ref, dx_ref, g_ref), (y32, dx32, g32))


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_the_backward_from_the_kept_attention_equals_the_one_that_recomputes_it(attention):
    spec, params, x, dy, pos = _case(B=2, T=29, docs=False)
    _, dx_kept, g_kept = _lean(spec, params, x, dy, pos, chunk=16, kept=True, attention=attention)
    _, dx_again, g_again = _lean(spec, params, x, dy, pos, chunk=16, kept=False, attention=attention)
    assert torch.equal(dx_kept, dx_again)
    for name in g_kept:
        assert torch.equal(g_kept[name], g_again[name]), name


def test_the_autograd_wrapper_gives_lean_backwards_gradients():
    spec, params, x, dy, pos = _case(QWEN3, B=2, T=23, docs=True)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    x_leaf = x.clone().requires_grad_()
    y = lean_layer(p, x_leaf, pos, spec.arch, 10)
    grads = torch.autograd.grad(y, [x_leaf, *p.values()], grad_outputs=dy)
    _, dx, g = _lean(spec, params, x, dy, pos, chunk=10)
    assert torch.equal(grads[0], dx)
    for name, got in zip(p, grads[1:]):
        assert torch.equal(got, g[name]), name


@pytest.mark.parametrize("attention, kept_attention", [("triton", 0), ("triton", 1), ("sdpa", 1)],
                         ids=["recomputed", "kept", "sdpa-kept"])
def test_stream_equals_reference_with_the_lean_layer(monkeypatch, attention, kept_attention):
    """Both engines train bit-identically through the lean layer: the reference's autograd Function keeps the
    attention output; the streaming engine's recomputed layers run attention's forward again in their backward (same
    kernel, same bits), or with engine.kept_attention_layers take the output their forward kept."""
    kept_forwards = []
    original = ModelSpec.forward_keeping

    def forward_keeping(self, p, x, pos, layer, attention=False):
        if attention:
            kept_forwards.append(layer)
        return original(self, p, x, pos, layer, attention)

    monkeypatch.setattr(ModelSpec, "forward_keeping", forward_keeping)
    over = [*WIDE_HEADS, f"train.attention={attention}", "train.lean_layer=on", "train.mlp_chunk_tokens=20",
            "train.grad_accum=1", "model.num_hidden_layers=2"]  # the interpreted kernel is slow: a small step
    rec_r, w_r, m_r, _ = train("reference", over, steps=2)
    rec_s, w_s, m_s, _ = train("stream", [*over, f"engine.kept_attention_layers={kept_attention}"], steps=2)
    assert kept_forwards == [1] * 2 * kept_attention  # the last layer (0-based 1), once a step
    assert [r["loss"] for r in rec_s] == [r["loss"] for r in rec_r]
    assert_same(w_s, w_r)
    assert_same(m_s, m_r)


def _moe_layer(spec, params, x, dy, pos, compute):
    """One MoE layer through `spec.layer` (balance term attached) under autograd: output, step stats, per-expert
    load and the gradients of x and every parameter for sum(y * dy) + coef * balance."""
    spec.set_layer_compute(compute)
    spec.begin_step(x.shape[0] * x.shape[1])
    x = x.detach().clone().requires_grad_()
    y = spec.layer(params, x, pos, 0)
    grads = torch.autograd.grad(y, [x, *params.values()], grad_outputs=dy)
    return y.detach(), spec.step_stats(), spec.router_stats.load[0], dict(zip(["x", *params], grads))


@pytest.mark.parametrize("case, chunk, docs, attention", [
    ("qwen3_moe_1layer", 16, False, "triton"), ("qwen3_moe_1layer", 30, True, "triton"),
    ("gpt_oss_1layer", 50, False, "triton"), ("qwen3_moe_1layer", 16, False, "sdpa"),
], ids=["qwen3-moe", "packed", "gpt-oss", "qwen3-moe-sdpa"])
def test_lean_moe_layer_equals_the_plain_moe_layer_in_fp32(case, chunk, docs, attention):
    """Qwen3-MoE (also on packed rows) and gpt-oss (sliding window, sinks, biases), balance coefficient 0.25, chunks
    that do not divide the 2 x 37 tokens: the lean layer's output, load, balance term and every gradient (the balance
    term's included) equal the plain layer's on the same kernel; the streaming engine's two calls (forward without
    autograd, `layer_grads` recomputing attention) give the reference path's output and gradients bit for bit."""
    from tests.test_moe_vs_hf import B, T, hf_model, make_spec, our_params

    spec = make_spec(case)
    params = our_params(spec, hf_model(case))[1]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, spec.arch.hidden, generator=gen)
    dy = torch.randn(B, T, spec.arch.hidden, generator=gen)
    pos = spec.positions(T, "cpu")
    if docs:  # row 0: documents of 10, 20 and 7 tokens; row 1: one document
        starts = torch.tensor([0] * 10 + [10] * 20 + [30] * 7, dtype=torch.int32)
        pos = pos.of_rows(torch.stack([starts, torch.zeros(T, dtype=torch.int32)]))
    y_ref, stats_ref, load_ref, g_ref = _moe_layer(spec, params, x, dy, pos, LayerCompute(attention=attention))
    lean_compute = LayerCompute(attention=attention, mlp_chunk_tokens=chunk, lean=True)
    y, stats, load, g = _moe_layer(spec, params, x, dy, pos, lean_compute)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(load, load_ref) and stats == pytest.approx(stats_ref, rel=1e-6)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5 * g_ref[name].abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    detached = {n: t.detach() for n, t in params.items()}
    with torch.no_grad():
        assert torch.equal(spec.layer(detached, x, pos, 0), y)
    spec.begin_step(B * T)
    dx, by_name = spec.layer_grads(detached, x.clone().requires_grad_(), dy.clone(), pos, 0)
    assert torch.equal(dx, g["x"])
    for name in params:
        assert torch.equal(by_name[name].to(g[name].dtype), g[name]), name
    assert spec.step_stats() == stats


def test_stream_equals_reference_with_the_lean_moe_layer():
    from tests.test_engine_equivalence import FAMILIES

    over = [*FAMILIES["qwen3_moe"], "train.attention=triton", "train.lean_layer=on", "train.mlp_chunk_tokens=20",
            "train.grad_accum=1", "model.num_hidden_layers=2"]
    rec_r, w_r, m_r, _ = train("reference", over, steps=2)
    rec_s, w_s, m_s, _ = train("stream", over, steps=2)
    assert [r["loss"] for r in rec_s] == [r["loss"] for r in rec_r]
    assert_same(w_s, w_r)
    assert_same(m_s, m_r)


def _execution(overrides, on_gpu=True):
    cfg = make_cfg(["model=qwen7b", "train.micro_batch_size=1", "train.grad_accum=1", *overrides])
    return Execution.of(ModelSpec(cfg.model), cfg, on_gpu=on_gpu, strict=True)


LONG = ["train.seq_len=524288", "model.max_position_embeddings=524288"]
PACKED = ["data=text", "data.path=docs.jsonl", "data.tokenizer=tokenizer_dir"]  # read only when a run starts


def _lean_and_attention(overrides, on_gpu=True):
    ex = _execution(overrides, on_gpu)
    return ex.lean, ex.attention


def test_auto_takes_the_lean_layer_and_its_attention_above_128k_tokens():
    """On a GPU `auto` takes the lean layer on cuDNN's fused attention (`sdpa`), and on the Triton kernel where that
    cannot serve: packed rows, gpt-oss's windows and sinks, fp32 compute, bitwise-repeatable runs."""
    ex = _execution(LONG)
    assert (ex.lean, ex.attention, ex.mlp_chunk_tokens) == (True, "sdpa", LEAN_CHUNK_TOKENS)
    assert ex.layer_compute.lean
    at_128k = _execution(["train.seq_len=131072", "model.max_position_embeddings=131072"])
    assert (at_128k.lean, at_128k.attention) == (False, "sdpa")
    assert _lean_and_attention(LONG, on_gpu=False) == (True, "sdpa")  # the CPU's flash kernel
    assert not _execution([*LONG, "train.lean_layer=off"]).lean
    assert _lean_and_attention([*LONG, "train.attention=triton"]) == (True, "triton")
    assert _lean_and_attention([*LONG, *PACKED]) == (True, "triton")
    assert _lean_and_attention([*LONG, "train.deterministic=true"]) == (True, "triton")
    assert _lean_and_attention([*LONG, "train.compute_dtype=fp32"]) == (True, "triton")
    assert _lean_and_attention([*LONG, "train.compute_dtype=fp32", "train.attention=sdpa"]) == (False, "sdpa")
    moe_long = _execution(["model=gptoss20b", *LONG])  # mixture-of-experts layers run lean too
    assert (moe_long.lean, moe_long.attention) == (True, "triton")
    assert _lean_and_attention(["model=qwen3_30b_a3b", *LONG]) == (True, "sdpa")


def _plan(seq_len, overrides=()):
    cfg = make_cfg(["model=qwen7b", "hardware=h100", "plan=true", f"train.seq_len={seq_len}",
                    "train.micro_batch_size=1", "train.grad_accum=1", "model.max_position_embeddings=524288",
                    *overrides])
    return build_plan(ModelSpec(cfg.model), cfg, cfg.hardware.gpu_mem_gib, cfg.hardware.profile_host_mem_gib,
                      on_gpu=True, check=False), cfg


def test_auto_offers_the_plan_both_layers_on_a_gpu_only(monkeypatch):
    """`Execution.choices`: the rule's layer first, then the other where it runs; one choice off the GPU, where
    `on` or `off` is asked, or where the lean layer cannot run (FlashAttention returns no kept-output backward)."""
    def lean_flags(overrides, on_gpu=True):
        cfg = make_cfg(["model=qwen7b", "train.micro_batch_size=1", "train.grad_accum=1", *overrides])
        return [ex.lean for ex in Execution.choices(ModelSpec(cfg.model), cfg, on_gpu=on_gpu, strict=True)]

    assert lean_flags(["train.seq_len=32768"]) == [False, True]
    assert lean_flags(LONG) == [True, False]
    assert lean_flags(LONG, on_gpu=False) == [True]
    assert lean_flags([*LONG, "train.lean_layer=off"]) == [False]
    assert lean_flags(["train.seq_len=32768", "train.lean_layer=on"]) == [True]
    monkeypatch.setattr("engine.model.attention.HAVE_FLASH_ATTN", True)  # past the check that it is installed
    assert lean_flags(["train.seq_len=32768", "train.attention=flash_attn"]) == [False]


@pytest.mark.parametrize("lean_ratio", [1.0, 3.0])
def test_auto_takes_the_layer_whose_plan_is_faster(lean_ratio):
    """At 128K tokens both layers fit qwen7b in fp32 on the H100 profile: `auto` takes the one with the shorter
    planned step, and the lean layer's measured slowdown (hardware.lean_step_ratio_sdpa) moves the choice."""
    over = [f"hardware.lean_step_ratio_sdpa={lean_ratio}"]
    plan, cfg = _plan(131072, over)
    alone = {lean: _plan(131072, [*over, f"train.lean_layer={lean}"])[0] for lean in ("on", "off")}
    steps = {lean: p.times_s["step"] for lean, p in alone.items()}
    faster = min(steps, key=steps.get)
    assert plan.execution.lean == (faster == "on") and plan.times_s["step"] == steps[faster]
    assert plan.execution.lean == (lean_ratio == 1.0)  # at 3x the lean layer loses what it saves in recompute
    taken, other = ("lean", "plain") if plan.execution.lean else ("plain", "lean")
    assert plan.execution_choice == (f"train.lean_layer=auto: the {taken} layer ({steps[faster]:.2f} s a step "
                                     f"planned; the {other} layer: {max(steps.values()):.2f} s a step)")
    assert cfg.train.master_dtype == "fp32"


def test_auto_prefers_the_more_precise_state_format_to_the_faster_step():
    """At 256K tokens qwen7b's plain layer fits only in bf16 master + bf16 gradients, the lean layer in fp32: the
    lean layer is taken even when its step is planned longer (its slowdown set to 3x here)."""
    plan, cfg = _plan(262144, ["hardware.lean_step_ratio_sdpa=3.0"])
    plain, plain_cfg = _plan(262144, ["train.lean_layer=off"])
    assert plan.execution.lean and not plan.problem() and not plain.problem()
    assert plan.times_s["step"] > plain.times_s["step"]
    assert (cfg.train.master_dtype, plain_cfg.train.master_dtype) == ("fp32", "bf16")


def test_where_neither_layer_fits_the_refusal_is_the_rules_layers():
    plan, _ = _plan(524288, ["hardware.profile_host_mem_gib=40"])
    assert plan.problem() and plan.execution.lean  # above 128K tokens the rule's layer is the lean one
    assert plan.execution_choice == "train.lean_layer=auto: neither layer fits; the plan shown is the lean layer's"


def test_the_trainer_runs_the_execution_its_plan_took(monkeypatch, tmp_path):
    """The trainer builds the layer the plan chose, not the one the length rule alone gives: here the plan is
    offered only the lean layer at 24 tokens, where the rule takes the plain one."""
    from engine.trainer import Trainer

    def lean_only(cls, spec, cfg, on_gpu, strict=False):
        return [cls._resolve(spec, cfg, on_gpu, strict, "on")]

    monkeypatch.setattr(Execution, "choices", classmethod(lean_only))
    cfg = make_cfg(["engine=stream", *SMALL, "train.seq_len=24", "train.steps=1", "train.val_every=-1"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        assert trainer.execution is trainer.plan.execution and trainer.execution.lean
        assert trainer.spec.compute.lean and not Execution.of(trainer.spec, cfg, on_gpu=False).lean
    finally:
        trainer.close()


def test_a_kept_lean_layers_graph_is_timed_as_its_backward_runs():
    """A lean layer that keeps its graph (engine.keep_activation_layers) back-propagates through the lean layer's
    own backward, which rebuilds every op but attention's forward: the time model prices it as a recomputed layer
    with its attention output kept, not as a plain layer's graph (two forwards' worth)."""
    cfg = make_cfg(["model=qwen7b", "hardware=h100", "plan=true", "train.micro_batch_size=1", "train.grad_accum=1",
                    "train.seq_len=65536", "train.lean_layer=on"])
    spec = ModelSpec(cfg.model)
    ex = Execution.of(spec, cfg, on_gpu=True)
    s = StepShape(spec, cfg, True, StateFormat(), execution=ex)
    sp = Speeds.of_step(cfg.hardware, spec, s, compiled=True)
    assert sp.lean_ratio > 1  # the lean layer's speeds
    timer = StepTimer(s, sp)
    assert timer.bwd_kept == timer.bwd_attention_kept
    assert timer.bwd_kept > sp.layer_bwd_s(s, 2)


@pytest.mark.parametrize("overrides, message", [
    (["train.attention=flash_attn"], "needs an attention that returns its log-sum-exp.*resolved to flash_attn"),
    (["train.attention=sdpa", *PACKED], "takes no document boundaries and the rows are packed"),
    (["train.attention=sdpa", "train.compute_dtype=fp32"], "computes bf16 or fp16 only"),
], ids=["flash-attn", "sdpa-packed", "sdpa-fp32"])
def test_the_lean_layer_asked_for_where_it_cannot_run_is_refused(overrides, message, monkeypatch):
    monkeypatch.setattr("engine.model.attention.HAVE_FLASH_ATTN", True)  # past the check that it is installed
    with pytest.raises(ConfigError, match=message):
        _execution(["train.lean_layer=on", *overrides])


def test_the_planner_counts_the_lean_layers_working_set():
    """qwen7b at 512K tokens in bf16: q, k, v, out (dq over it), dO, dk, dv over whole rows, the lse and the kernel's
    row sums, the layer's weight gradients in fp32 and one 8K chunk's graph; under half of the plain layer's with
    the same kernel (33.4 GiB)."""
    spec, T = ModelSpec(make_cfg(["model=qwen7b"]).model), 524288
    lean = layer_working_bytes(spec, T, 2, True, LEAN_CHUNK_TOKENS, "triton", lean=True)
    plain = layer_working_bytes(spec, T, 2, True, AUTO_MLP_CHUNK_TOKENS, "triton")
    whole_rows = 2 * (3 * 28 + 4 * 4) * 128 * T + 2 * 4 * 28 * T
    weight_grads = 4 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)  # q, o; k, v; gate, up, down
    assert whole_rows + weight_grads < lean < whole_rows + weight_grads + 2 * GIB
    assert lean < 0.5 * plain
    # on cuDNN's fused attention, one K/V head's K and V expanded to its 7 query heads, their gradients and the
    # group's dq, and cuDNN's workspace (two fp32 tensors of the group's width): 7.9 GiB more, where expanding the
    # whole width would cost 17.5 before any workspace
    on_sdpa = layer_working_bytes(spec, T, 2, True, LEAN_CHUNK_TOKENS, "sdpa", lean=True)
    assert on_sdpa - lean == (5 * 2 + 2 * 4) * 7 * 128 * T


@pytest.mark.gpu
@pytest.mark.parametrize("docs, attention", [(False, "triton"), (True, "triton"), (False, "sdpa")],
                         ids=["one-doc", "packed", "cudnn"])
def test_gpu_compiled_lean_layer_is_within_twice_the_plain_layers_bf16_error(docs, attention):
    """On the GPU, compiled as the engine runs it (`ModelSpec.forward_keeping`, then `layer_grads` from the
    kept output), bf16 weights under autocast, 2 x 4099 tokens in 2000-token chunks: the lean layer's output and
    gradients against an fp32 plain layer, within 2x the bf16 plain layer's own error (+ a floor)."""
    T = 4099
    cfg = make_cfg(["model=qwen7b", "model.num_hidden_layers=1", f"train.seq_len={T}"])
    spec = ModelSpec(cfg.model)
    unit = spec.units[1]
    flat = torch.empty(unit.layout.numel, device="cuda")
    params = unit.layout.views(flat)
    spec.init_unit(unit, params, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, T, spec.arch.hidden, device="cuda", generator=gen)
    dy = torch.randn(2, T, spec.arch.hidden, device="cuda", generator=gen)
    pos = spec.positions(T, "cuda")
    if docs:
        starts = torch.arange(T, device="cuda", dtype=torch.int32) // 1500 * 1500
        pos = pos.of_rows(torch.stack([starts, torch.zeros_like(starts)]))
    y32, dx32, g32 = _plain(spec, params, x, dy, pos, attention)
    p16 = {k: (v.to(torch.bfloat16) if v.dim() == 2 else v) for k, v in params.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref, dx_ref, g_ref = _plain(spec, p16, x, dy, pos, attention)
        spec.set_layer_compute(LayerCompute(attention=attention, mlp_chunk_tokens=2000, lean=True))
        spec.compile_templates()
        with torch.no_grad():
            y, kept = spec.forward_keeping(p16, x, pos, 0, attention=True)
        dx, g = spec.layer_grads(p16, x, dy.clone(), pos, 0, kept=kept)
    _assert_within_twice_the_plain_error((y, dx, g), (y_ref, dx_ref, g_ref), (y32, dx32, g32))


@pytest.mark.gpu
def test_gpu_stream_with_the_lean_layer_matches_the_reference_in_fp32():
    """On the GPU, fp32, compiled: the streaming engine with the lean layer, a kept attention output and a recompute
    group regenerated into host memory trains as the reference engine with the lean layer, to fp32 rounding (the two
    run different AdamW kernels)."""
    from tests.test_stream_gpu import run

    over = [*WIDE_HEADS, "model.num_hidden_layers=4", "train.attention=triton", "train.lean_layer=on",
            "train.mlp_chunk_tokens=150", *FP32]
    stream = ["engine.kept_attention_layers=1", "engine.recompute_group=2", "engine.activation_tier=host",
              "engine.grads_tier=host", "engine.cache_weights=off", "engine.keep_activation_layers=0"]
    losses_r, w_r, _ = run("reference", over, "fp32", compile_mode="on")
    losses_s, w_s, _ = run("stream", [*over, *stream], "fp32", compile_mode="on")
    torch.testing.assert_close(torch.tensor(losses_s), torch.tensor(losses_r), rtol=1e-5, atol=0)
    assert_same(w_s, w_r, exact=False, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_stream_on_the_cudnn_lean_layer_trains_as_the_reference_at_8k():
    """On the GPU, bf16, compiled, one 8K-token sequence a micro-batch, head_dim 64: the streaming engine with the
    lean layer on cuDNN's fused attention (the last layer's attention output kept, the others recomputed, a recompute
    group regenerated into host memory) has the reference engine's first loss (the same forward) and stays within
    bf16 rounding of its losses after."""
    from tests.test_stream_gpu import run

    over = ["model.hidden_size=384", "model.num_attention_heads=6", "model.num_key_value_heads=2",
            "model.num_hidden_layers=4", "model.max_position_embeddings=8192", "train.seq_len=8192",
            "train.micro_batch_size=1", "train.attention=sdpa", "train.lean_layer=on", "train.mlp_chunk_tokens=3000"]
    stream = ["engine.kept_attention_layers=1", "engine.recompute_group=2", "engine.activation_tier=host"]
    losses_r, _, _ = run("reference", over, "bf16", compile_mode="on")
    losses_s, _, _ = run("stream", [*over, *stream], "bf16", compile_mode="on")
    assert losses_s[0] == pytest.approx(losses_r[0], rel=1e-5)
    torch.testing.assert_close(torch.tensor(losses_s), torch.tensor(losses_r), rtol=1e-2, atol=0)


def test_the_heads_chunked_norm_back_propagates_as_the_plain_one(monkeypatch):
    """Above NORM_CHUNK_TOKENS the head's final norm saves only its input and rebuilds itself chunk by chunk in
    the backward: the input gradient equals the plain norm's row for row, the weight's to fp32 rounding."""
    monkeypatch.setattr(dense, "NORM_CHUNK_TOKENS", 16)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(53, 24, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(24, generator=gen)).requires_grad_()
    dy = torch.randn(53, 24, generator=gen)
    want = torch.autograd.grad(dense.rms_norm(x, w, 1e-6), (x, w), dy)
    y = dense.final_norm(x, w, 1e-6)
    assert torch.equal(y, dense.rms_norm(x, w, 1e-6)) and y.grad_fn.name().endswith("_ChunkedRmsNormBackward")
    got = torch.autograd.grad(y, (x, w), dy)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
