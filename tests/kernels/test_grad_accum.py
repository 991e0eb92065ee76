"""streamtrain_kernels/grad_accum.py: accumulation into the flat fp32 layout, and fp32 -> bf16 stochastic rounding.

The exactness contract is tested bit for bit (scale 1 == torch add_ / copy_); scaled accumulation and norms to
fp32 rounding; stochastic rounding bit for bit against the torch reference of the same Philox stream, and
statistically for unbiasedness.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_grad_accum.py                 # CPU (interpreter)
    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_grad_accum.py          # GPU machine
"""

import math

import pytest
import torch

import streamtrain_kernels.grad_accum as G
import streamtrain_kernels.tiles as T
from streamtrain_kernels.reference import (accumulate_reference, philox_reference, sq_norms_reference,
                                      stochastic_bits_reference, stochastic_round_reference)
from tests.kernels.test_tiles import (ODD_SHAPES, CountingKernel, aligned_offsets, bits, qwen7b_layer,
                                      small_layer, values)

K_MICRO = 5


def micro_grads(shapes, dtypes, k, seed, device="cpu"):
    return [[values(s, dt, seed=seed + 100 * m + i, device=device) for i, (s, dt) in enumerate(zip(shapes, dtypes))]
            for m in range(k)]


def torch_sequence(flat, grad_lists, offsets):
    """What the engine did before this kernel: copy_ the first micro-batch, add_ the rest, on fp32 views."""
    for m, grads in enumerate(grad_lists):
        for g, off in zip(grads, offsets):
            view = flat[off:off + g.numel()]
            view.copy_(g.reshape(-1)) if m == 0 else view.add_(g.reshape(-1))


@pytest.mark.parametrize("mix", ["bf16", "fp32", "mixed"])
def test_accumulate_bit_identical_to_torch_and_close_to_fp64(mix):
    dtypes = {"bf16": [torch.bfloat16] * len(ODD_SHAPES), "fp32": [torch.float32] * len(ODD_SHAPES),
              "mixed": [(torch.bfloat16, torch.float32, torch.float16)[i % 3] for i in range(len(ODD_SHAPES))]}[mix]
    grads = micro_grads(ODD_SHAPES, dtypes, K_MICRO, seed=1)
    offsets, total = aligned_offsets([math.prod(s) for s in ODD_SHAPES])
    flat = torch.full((total + 64,), float("nan"))  # first=True must overwrite, not add to, the garbage
    pad = torch.ones(flat.numel(), dtype=torch.bool)
    for s, off in zip(ODD_SHAPES, offsets):
        pad[off:off + math.prod(s)] = False
    sq = torch.zeros(len(ODD_SHAPES))
    for m, gs in enumerate(grads):
        G.accumulate(flat, gs, offsets, first=m == 0, sq_norms_out=sq if m == K_MICRO - 1 else None)
    want = torch.full_like(flat, float("nan"))
    torch_sequence(want, grads, offsets)
    assert torch.equal(bits(flat), bits(want))
    assert torch.isnan(flat[pad]).all()  # padding untouched
    exact = [sum(gs[i].double() for gs in grads) for i in range(len(ODD_SHAPES))]
    for i, off in enumerate(offsets):
        got = flat[off:off + exact[i].numel()].double()
        scale = exact[i].abs().max().item()
        assert (got - exact[i].reshape(-1)).abs().max() <= K_MICRO * 2**-23 * scale * 2
    views = [flat[off:off + math.prod(s)] for s, off in zip(ODD_SHAPES, offsets)]
    torch.testing.assert_close(sq.double(), sq_norms_reference(views), rtol=1e-6, atol=0)


def test_first_overwrites_and_norms_of_first():
    grads = [values(s, torch.bfloat16, seed=7 + i) for i, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([g.numel() for g in grads])
    flat = torch.full((total,), 3.0)
    sq = torch.full((len(grads),), -1.0)
    G.accumulate(flat, grads, offsets, first=True, sq_norms_out=sq)
    for g, off in zip(grads, offsets):
        assert torch.equal(bits(flat[off:off + g.numel()]), bits(g.reshape(-1).float()))
    torch.testing.assert_close(sq.double(), sq_norms_reference(grads), rtol=1e-6, atol=0)
    G.accumulate(flat, grads, offsets)  # then add: exactly 2 g (doubling is exact)
    for g, off in zip(grads, offsets):
        assert torch.equal(flat[off:off + g.numel()], 2 * g.reshape(-1).float())


@pytest.mark.parametrize("scale", [0.37, 1e-3])
def test_scaled_accumulate(scale):
    dtypes = [torch.bfloat16, torch.float32] * 4
    grads = micro_grads(ODD_SHAPES, dtypes, 3, seed=11)
    offsets, total = aligned_offsets([math.prod(s) for s in ODD_SHAPES])
    flat, want = torch.zeros(total), torch.zeros(total)
    sq, sq_want = torch.zeros(len(ODD_SHAPES)), torch.zeros(len(ODD_SHAPES))
    for m, gs in enumerate(grads):
        G.accumulate(flat, gs, offsets, scale=scale, first=m == 0, sq_norms_out=sq)
        accumulate_reference(want, gs, offsets, scale=scale, first=m == 0, sq_norms_out=sq_want)
    # the GPU may contract a + s * g into one FMA; the interpreter rounds twice, as the reference does
    torch.testing.assert_close(flat, want, rtol=3e-7, atol=1e-30)
    torch.testing.assert_close(sq, sq_want, rtol=1e-6, atol=0)


def test_layer_one_launch_and_layout_helper(monkeypatch):
    layout = small_layer()
    counter = CountingKernel(G._accumulate_kernel)
    monkeypatch.setattr(G, "_accumulate_kernel", counter)
    grads = [{s.name: values(s.shape, torch.bfloat16 if s.kind == "matmul" else torch.float32, seed=20 + 50 * m + k)
              for k, s in enumerate(layout.specs)} for m in range(3)]
    flat = torch.zeros(layout.numel)
    for m, g in enumerate(grads):
        G.accumulate_layout(layout, flat, g, first=m == 0)
    block, _ = T.launch_config(flat.device)
    assert counter.grids == [(sum(-(-s.numel // block) for s in layout.specs),)] * 3
    want = torch.zeros(layout.numel)
    views = layout.views(want)
    for m, g in enumerate(grads):
        for name, t in g.items():
            views[name].copy_(t) if m == 0 else views[name].add_(t)
    assert torch.equal(bits(flat), bits(want))
    # a subset (e.g. a tied weight's second use), with its norm
    sq = torch.zeros(1)
    G.accumulate_layout(layout, flat, {"mlp.up_proj.weight": grads[0]["mlp.up_proj.weight"]}, sq_norms_out=sq)
    views["mlp.up_proj.weight"].add_(grads[0]["mlp.up_proj.weight"])
    assert torch.equal(bits(flat), bits(want))
    torch.testing.assert_close(sq.double(), sq_norms_reference([views["mlp.up_proj.weight"]]), rtol=1e-6, atol=0)


def test_accumulate_empty_inputs():
    flat = torch.full((128,), 5.0)
    sq = torch.full((2,), -1.0)
    G.accumulate(flat, [torch.empty(0), torch.empty(0, dtype=torch.bfloat16)], [0, 64], sq_norms_out=sq)
    assert torch.equal(sq, torch.zeros(2)) and torch.all(flat == 5.0)
    G.accumulate(flat, [], [], sq_norms_out=torch.zeros(0))


def test_torch_fallback_matches(monkeypatch):
    grads = micro_grads(ODD_SHAPES, [torch.bfloat16, torch.float32] * 4, 2, seed=30)
    offsets, total = aligned_offsets([math.prod(s) for s in ODD_SHAPES])
    a, b = torch.zeros(total), torch.zeros(total)
    for m, gs in enumerate(grads):
        G.accumulate(a, gs, offsets, first=m == 0)
    monkeypatch.setattr(G, "uses_triton", lambda device: False)
    for m, gs in enumerate(grads):
        G.accumulate(b, gs, offsets, first=m == 0)
    assert torch.equal(bits(a), bits(b))


def test_accumulate_refuses_bad_arguments():
    flat = torch.zeros(1000)
    before = flat.clone()
    cases = [
        (dict(flat_fp32=torch.zeros(100, dtype=torch.bfloat16), grads=[torch.ones(10)], offsets=[0]),
         "flat_fp32 has dtype torch.bfloat16"),
        (dict(grads=[torch.ones(10), torch.ones(4, 5).t()], offsets=[0, 64]), r"tensor 1 is not contiguous"),
        (dict(grads=[torch.ones(10, dtype=torch.int64)], offsets=[0]), r"tensor 0 has dtype torch.int64"),
        (dict(grads=[torch.ones(100), torch.ones(10)], offsets=[0, 64]), r"tensor 1 at \[64, 74\) overlaps tensor 0"),
        (dict(grads=[torch.ones(100)], offsets=[960]), r"tensor 0 runs past the end of flat_fp32"),
        (dict(grads=[torch.ones(10)], offsets=[0], sq_norms_out=torch.zeros(2)), r"sq_norms_out must hold 1 elements"),
        (dict(grads=[torch.ones(10)], offsets=[0], sq_norms_out=torch.zeros(1, dtype=torch.float64)),
         r"sq_norms_out has dtype torch.float64"),
    ]
    for kwargs, match in cases:
        kwargs.setdefault("flat_fp32", flat)
        with pytest.raises(ValueError, match=match):
            G.accumulate(**kwargs)
    assert torch.equal(flat, before)
    with pytest.raises(ValueError, match=r"grads \['nope'\] are not in layout"):
        G.accumulate_layout(small_layer(), torch.zeros(small_layer().numel), {"nope": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------------------------
# stochastic rounding
# ---------------------------------------------------------------------------------------------------------------
def sr(x, seed, offset=0):
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    return G.to_bf16_stochastic(x, out, seed, offset)


def test_philox_reference_matches_triton_randint4x():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out_ptr, seed, N: tl.constexpr):
        i = tl.arange(0, N)
        a, b, c, d = tl.randint4x(seed, i)
        tl.store(out_ptr + 4 * i, a)
        tl.store(out_ptr + 4 * i + 1, b)
        tl.store(out_ptr + 4 * i + 2, c)
        tl.store(out_ptr + 4 * i + 3, d)

    out = torch.zeros(4 * 64, dtype=torch.int32)
    draw[(1,)](out, 12345, N=64)
    want = torch.stack(philox_reference(12345, torch.arange(64)), dim=1)
    assert torch.equal(out.view(64, 4).to(torch.int64) & 0xFFFFFFFF, want)


@pytest.mark.parametrize("seed,offset", [(0, 0), (2**40 + 17, 8), (99, 3), (2**64 - 1, 2**33 + 5)])
def test_stochastic_rounding_matches_reference(seed, offset):
    x = values((10007,), torch.float32, seed=40, specials=True)
    got = sr(x, seed, offset)
    want = stochastic_round_reference(x, seed, offset)
    assert torch.equal(bits(got), bits(want))


def test_stochastic_rounding_reproducible_and_seeded():
    x = values((3001, 3), torch.float32, seed=41)
    a, b = sr(x, 7), sr(x, 7)
    assert torch.equal(bits(a), bits(b))
    c = sr(x, 8)
    assert (bits(a) != bits(c)).float().mean() > 0.3  # about half the inexact elements round the other way
    # chunked conversion with offset = chunk start gives the same bits as one call, for any chunk boundary
    flat = x.reshape(-1)
    parts = [sr(flat[:1003], 7, 0), sr(flat[1003:5000], 7, 1003), sr(flat[5000:], 7, 5000)]
    assert torch.equal(bits(torch.cat(parts)), bits(a.reshape(-1)))


def test_stochastic_rounding_gives_a_neighbour():
    x = values((20011,), torch.float32, seed=42)
    y = bits(sr(x, 3)).to(torch.int64) & 0xFFFF
    low = (bits(x).to(torch.int64) & 0xFFFFFFFF) >> 16  # truncation toward zero
    up = y - low
    assert torch.all((up == 0) | (up == 1))
    exact = (bits(x) & 0xFFFF) == 0
    assert torch.all(up[exact] == 0)  # representable values never move


@pytest.mark.parametrize("frac", [0.01, 0.3, 0.5, 0.93])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(frac, sign):
    n = 2**15
    lo = torch.tensor(1.5 * 2.0**-3)  # a bf16 value; its bf16 ulp is 2**-10
    ulp = 2.0**-10
    x = torch.full((n,), sign * (lo.item() + frac * ulp))
    y = sr(x, seed=1000 + int(frac * 100)).double()
    assert torch.all((y.abs() == lo.item()) | (y.abs() == lo.item() + ulp))
    p_up = ((y.abs() - lo.item()) / ulp).mean().item()
    se = math.sqrt(frac * (1 - frac) / n)
    assert abs(p_up - frac) < 4 * se
    assert abs(y.mean().item() - x[0].item()) < 4 * se * ulp


def test_stochastic_rounding_special_values():
    f32 = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1.0, -2.5, torch.finfo(torch.float32).max])
    nan_bits = torch.tensor([0x7FC00000, 0x7F800001, 0xFF800001 - 2**32, 0x7FFFFFFF, 0x7F80FFFF], dtype=torch.int64)
    nans = nan_bits.to(torch.int32).view(torch.float32)
    x = torch.cat([f32, nans]).repeat(50)
    y = sr(x, 5).float()
    for j in range(6):
        assert torch.equal(bits(y[j::12]), bits(f32[j].repeat(50)))
    top = y[6::12]  # just above the largest bf16: Inf or bf16 max, never NaN
    assert torch.all(torch.isinf(top) | (top == torch.finfo(torch.bfloat16).max))
    for j in range(7, 12):
        assert torch.isnan(y[j::12]).all()


def test_stochastic_rounding_refuses_bad_arguments():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="out_bf16 must be a contiguous torch.bfloat16"):
        G.to_bf16_stochastic(x, torch.zeros(10, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match="flat_fp32 must be a contiguous torch.float32"):
        G.to_bf16_stochastic(torch.zeros(10, 2).t(), torch.zeros(20, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match=r"out_bf16 \(9 elements on cpu\) must match flat_fp32 \(10 elements"):
        G.to_bf16_stochastic(x, torch.zeros(9, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        G.to_bf16_stochastic(x, torch.zeros(10, dtype=torch.bfloat16), 0, offset=-1)


def test_stochastic_bits_layout():
    """Element k takes half k % 2 of Philox word (k // 2) % 4 of counter k // 8."""
    r = stochastic_bits_reference(5, 16)
    words = philox_reference(5, torch.tensor([0, 1]))
    assert r[0] == words[0][0] & 0xFFFF and r[1] == words[0][0] >> 16
    assert r[6] == words[3][0] & 0xFFFF and r[9] == words[0][1] >> 16


# ---------------------------------------------------------------------------------------------------------------
# GPU: a real qwen7b layer (needs TRITON_INTERPRET=0)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["bf16", "fp32", "mixed"])
def test_gpu_qwen7b_layer_accumulate(cuda, grad_dtype):
    layout = qwen7b_layer()
    def dt(s):
        return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
            grad_dtype, torch.bfloat16 if s.kind == "matmul" else torch.float32)
    flat = torch.full((layout.numel,), float("nan"), device=cuda)
    want = flat.clone()
    views = layout.views(want)
    sq = torch.zeros(len(layout.specs), device=cuda)
    for m in range(3):
        g = {s.name: (torch.randn(s.shape, device=cuda) * 1e-3).to(dt(s)) for s in layout.specs}
        G.accumulate_layout(layout, flat, g, first=m == 0, sq_norms_out=sq if m == 2 else None)
        for name, t in g.items():
            views[name].copy_(t) if m == 0 else views[name].add_(t)
    assert torch.equal(bits(flat), bits(want))
    ref = sq_norms_reference([views[s.name] for s in layout.specs])
    torch.testing.assert_close(sq.double(), ref, rtol=2e-6, atol=0)
    g = {s.name: torch.randn(s.shape, device=cuda).to(dt(s)) for s in layout.specs}
    a, b = flat.clone(), flat.clone()
    G.accumulate_layout(layout, a, g, scale=0.123)
    accumulate_reference(b, [g[s.name] for s in layout.specs], layout.offsets, scale=0.123)
    # The kernel fuses the multiply into the add (one rounding); the reference rounds the product, then the sum.
    # They differ by at most the product's rounding plus one ulp of the (twice rounded) sum: one ulp of each term
    # bounds it. Near cancellation that is large relative to the result, so the bound is not relative to it.
    product_abs = torch.zeros_like(flat)
    for spec, off in zip(layout.specs, layout.offsets):
        product_abs[off:off + spec.numel] = (g[spec.name].float() * 0.123).abs().reshape(-1)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    written = ~torch.isnan(b)
    ratio = (a - b).abs()[written] / (2.0**-23 * (product_abs + b.abs())[written])
    print(f"fused vs unfused scale-add: worst error {ratio.max().item():.3f} of the bound")
    assert ratio.max().item() <= 1.0


@pytest.mark.gpu
def test_gpu_stochastic_rounding(cuda):
    x = torch.randn(2**26 + 13, device=cuda)
    got = sr(x, 2024, 8)
    want = stochastic_round_reference(x, 2024, 8)
    assert torch.equal(bits(got), bits(want))
    p = torch.full((2**24,), 1.0 + 0.25 * 2**-7, device=cuda)
    up = (sr(p, 9).float() > 1.0).double().mean().item()
    assert abs(up - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 2**24)
