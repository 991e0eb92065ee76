"""The MoE layer's backward without the down projection's output (engine/model/moe.py `weighted_down_backward`) and
the streaming engine's recompute that reuses the forward's routing (`ModelSpec.forward_keeping`, `layer_grads`).

- The down projection's hand backward equals autograd's on the plain formula w * (act @ W2_e + b_e) in fp32, in
  both weight layouts (Qwen3-MoE's [E, D, I], gpt-oss's [E, I, D] with a bias), with an empty expert, with one
  expert taking every row, and with row counts no block size divides.
- A MoE layer's `layer_grads` (recompute up to the down projection's input, that matmul's gradients by hand, the
  balance term's gradient) equals autograd through the plain layer bit for bit in fp32, with the forward's routing
  kept or recomputed, and records the same balance term and load.
- With the routing kept, the recompute runs no top-k and no sort; it routes as the forward did even where a fresh
  routing would choose other experts.
- The planner's recompute leaves the down projection's FLOPs out for MoE layers as for dense ones.
- torch.compile's graph capture of these templates (AOT autograd, no Inductor) equals eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine.model import moe
from engine.model.dense import LayerCompute
from tests.test_moe_vs_hf import B, T, hf_model, make_spec, our_params


def _plain_down(act_RI, w2_EID, bias_ED, weights_R, load_E):
    """w * (act @ W2_e + b_e) per row, one expert at a time: the formula autograd differentiates for the reference."""
    out, start = [], 0
    for e, n in enumerate(load_E.tolist()):
        rows = act_RI[start:start + n] @ w2_EID[e]
        if bias_ED is not None:
            rows = rows + bias_ED[e]
        out.append(rows)
        start += n
    return torch.cat(out) * weights_R.unsqueeze(-1)


@pytest.mark.parametrize("layout", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("load", [[3, 0, 5, 9], [0, 17, 0, 0], [1, 1, 1, 4]], ids=["empty", "one-takes-all", "odd"])
def test_down_projection_backward_equals_autograd(layout, load):
    E, I, D = len(load), 16, 24
    R = sum(load)
    gen = torch.Generator().manual_seed(sum(load) + len(layout))
    act = torch.randn(R, I, generator=gen, dtype=torch.float64).float().requires_grad_()
    if layout == "qwen3_moe":  # stored [E, D, I], used as its transpose
        stored = torch.randn(E, D, I, generator=gen).requires_grad_()
        w2, bias = stored.transpose(1, 2), None
    else:
        stored = torch.randn(E, I, D, generator=gen).requires_grad_()
        w2, bias = stored, torch.randn(E, D, generator=gen).requires_grad_()
    weights = torch.rand(R, generator=gen).requires_grad_()
    load_E = torch.tensor(load)
    d_out = torch.randn(R, D, generator=gen)
    leaves = [act, stored, weights] + ([bias] if bias is not None else [])
    expected = torch.autograd.grad(_plain_down(act, w2, bias, weights, load_E), leaves, d_out)

    offs = load_E.cumsum(0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(torch.arange(E), load_E)
    out = moe._WeightedDown.apply(act, w2, bias, weights, offs, expert_of_row)
    torch.testing.assert_close(out, _plain_down(act, w2, bias, weights, load_E), rtol=1e-6, atol=1e-6)
    got = torch.autograd.grad(out, leaves, d_out)
    for name, g, ref in zip(["act", "W2", "weights", "bias"], got, expected):
        assert g.shape == ref.shape and g.is_contiguous(), name
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{name}: {m}")
    if load[0] == 0:  # an expert without rows gets exactly zero
        assert not got[1][0].any() and (bias is None or not got[3][0].any())


def _layer_case(case: str):
    spec = make_spec(case)
    spec.set_layer_compute(LayerCompute(attention=spec.compute.attention))
    params = our_params(spec, hf_model(case))[1]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, spec.arch.hidden, generator=gen)
    dy = torch.randn(B, T, spec.arch.hidden, generator=gen)
    return spec, params, x, dy, spec.positions(T, "cpu")


def _autograd_layer(spec, params, x, dy, pos):
    spec.begin_step(B * T)
    x = x.clone().requires_grad_()
    names = list(params)
    grads = torch.autograd.grad(spec.layer(params, x, pos, 0), [x, *params.values()], dy)
    return grads[0], dict(zip(names, grads[1:])), spec.step_stats()


def _recomputed_layer(spec, params, x, dy, pos, kept):
    spec.begin_step(B * T)
    dx, grads = spec.layer_grads(params, x.clone().requires_grad_(), dy, pos, 0, kept=kept)
    return dx, grads, spec.step_stats()


@pytest.mark.parametrize("case", ["qwen3_moe_1layer", "gpt_oss_1layer"])
@pytest.mark.parametrize("keep_routing", [True, False], ids=["kept-routing", "rerouted"])
def test_recompute_equals_autograd_bit_for_bit(case, keep_routing):
    spec, params, x, dy, pos = _layer_case(case)
    assert spec.recompute_stops_before_down_proj(chunked_mlp=False)
    dx_ref, g_ref, stats_ref = _autograd_layer(spec, params, x, dy, pos)
    with torch.no_grad():
        y, kept = spec.forward_keeping(params, x, pos, 0)
    assert isinstance(kept, moe.KeptRouting) and kept.order.numel() == B * T * spec.arch.top_k
    dx, grads, stats = _recomputed_layer(spec, params, x, dy, pos, kept if keep_routing else None)
    assert torch.equal(dx, dx_ref)
    assert grads.keys() == g_ref.keys()
    for name in g_ref:
        assert torch.equal(grads[name], g_ref[name]), name
    assert stats == stats_ref and stats["balance_loss"] > 0


def test_kept_routing_runs_no_topk_and_no_sort(monkeypatch):
    spec, params, x, dy, pos = _layer_case("qwen3_moe_1layer")
    with torch.no_grad():
        _, kept = spec.forward_keeping(params, x, pos, 0)
    dx_ref, g_ref, _ = _recomputed_layer(spec, params, x, dy, pos, None)

    def refused(*args, **kwargs):
        raise AssertionError("the recompute routed again")

    monkeypatch.setattr(torch, "topk", refused)
    monkeypatch.setattr(torch, "argsort", refused)
    dx, grads, _ = _recomputed_layer(spec, params, x, dy, pos, kept)
    assert torch.equal(dx, dx_ref) and all(torch.equal(grads[n], g_ref[n]) for n in g_ref)


def test_recompute_follows_the_kept_routing_not_a_fresh_one():
    """Routing kept from another input (a stand-in for a forward whose router broke a near-tie the other way):
    the recompute's expert gradients follow the kept choices, so they differ from a fresh routing's; the unused
    experts of the kept routing get exactly zero."""
    spec, params, x, dy, pos = _layer_case("qwen3_moe_1layer")
    a = spec.arch
    order = torch.arange(B * T * a.top_k)  # every choice to expert 0: rows already in expert order
    load = torch.zeros(a.experts, dtype=torch.int64)
    load[0] = B * T * a.top_k
    forced = moe.KeptRouting(order, load)
    rows = moe.expert_rows(forced, a.top_k)
    # the top k choices of a token must be distinct experts for a real routing; one expert twice still shows which
    # routing the recompute used
    assert torch.equal(moe.chosen_experts(rows, a.top_k), torch.zeros(B * T, a.top_k, dtype=torch.int64))
    _, grads, stats = _recomputed_layer(spec, params, x, dy, pos, forced)
    _, fresh, _ = _recomputed_layer(spec, params, x, dy, pos, None)
    assert grads["mlp.experts.down_proj"][0].any() and not grads["mlp.experts.down_proj"][1:].any()
    assert fresh["mlp.experts.down_proj"][1:].any()
    assert stats["expert_load_max"] == a.experts


def test_planner_leaves_the_moe_down_projection_out_of_the_recompute():
    spec = make_spec("gpt_oss_1layer")
    a = spec.arch
    assert spec.recompute_skipped_flops_per_token(chunked_mlp=False) == 2 * a.top_k * a.expert_intermediate * a.hidden
    assert spec.recompute_skipped_flops_per_token(chunked_mlp=True) == 0
    assert spec.recompute_skipped_flops_per_token(chunked_mlp=False, lean_layer=True) == 0


@pytest.mark.parametrize("case", ["gpt_oss_1layer"])  # the biased layout: the Function's every input
def test_the_traced_templates_equal_eager_under_bf16_autocast(case):
    """torch.compile's graph capture of the MoE templates (the plain layer with its `_WeightedDown` Function, the
    recompute up to the down projection, the hand backward), through AOT autograd without Inductor: the forward,
    the recompute's gradients and autograd's through the plain layer equal eager's bit for bit."""
    spec, params, x, dy, pos = _layer_case(case)
    params = {k: v.detach().to(torch.bfloat16 if v.dim() > 1 else torch.float32).requires_grad_()
              for k, v in params.items()}

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                y, kept = spec.forward_keeping(params, x, pos, 0)
            dx, grads, _ = _recomputed_layer(spec, params, x, dy, pos, kept)
            dx_a, grads_a, _ = _autograd_layer(spec, params, x, dy, pos)
        return [y, dx, dx_a, *grads.values(), *grads_a.values()]

    def traced(fn):
        return torch.compile(fn, backend="aot_eager_decomp_partition", dynamic=False)

    eager = run()
    torch._dynamo.reset()
    spec._layer_fn, spec._moe_to_down_fn = traced(moe.decoder_layer), traced(moe.layer_to_down_proj)
    spec._moe_down_backward_fn = traced(moe.weighted_down_backward)
    assert all(torch.equal(a, b) for a, b in zip(run(), eager))
