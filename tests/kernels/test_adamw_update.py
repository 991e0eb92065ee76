"""streamtrain_kernels/adamw_update.py: the fused AdamW step in every state format.

fp32 against torch.optim.AdamW(fused=True) to at most 1 ulp; every format bit for bit against the torch reference
(same Philox streams, same 8-bit codes); stochastic rounding statistically; the int8 codes against their bound.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_adamw_update.py                 # CPU (interpreter)
    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_adamw_update.py          # GPU machine
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import streamtrain_kernels.adamw_update as A
from streamtrain_kernels.reference import (M_CODE, V_CODE, adamw_update_reference, code_decode_reference,
                                      code_encode_reference, stochastic_bits_reference)
from tests.kernels.test_tiles import small_layer

HP = dict(beta1=0.9, beta2=0.95, eps=1e-8)
LR = 2.0**-10 * 1.375  # an fp32 value, so torch's Python-float lr equals the kernel's tensor
CLIP = 0.734375
N_PRIME = 10007  # prime: no tile, block or Philox group divides it
# unaligned segments with different decay; the second boundary falls inside an int8 block and a tile
SEGMENTS = [(0, 3001, 0.1), (3001, 5000, 0.0), (8001, 2006, 0.05)]


@pytest.fixture(autouse=True)
def interpreter_tile_below_the_shapes(monkeypatch):
    """The shapes here (N_PRIME, a 16384-element int8 block) are sized against an 8192-element interpreter tile, so
    that one tensor crosses full and partial tiles and a block can exceed the tile; the engine's default interpreter
    tile is larger (fewer programs, which the interpreter pays for)."""
    monkeypatch.setattr(A, "TILE_INTERPRET", 8192)


def bits(t):
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def make_state(n, seed, master_dtype=torch.float32, moments="fp32", block_size=64):
    g = torch.Generator().manual_seed(seed)
    # weights away from 0 (|p| >= 0.02 >> lr): torch's update then moves p by less than its own magnitude
    p = (torch.rand(n, generator=g) * 0.08 + 0.02) * torch.sign(torch.randn(n, generator=g))
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6 * torch.exp(torch.randn(n, generator=g) * 2)
    state = {"master": p.to(master_dtype)}
    if moments == "int8":
        nb = -(-n // block_size)
        state.update(m=torch.zeros(n, dtype=torch.int8), v=torch.zeros(n, dtype=torch.uint8),
                     m_scales=torch.zeros(nb), v_scales=torch.zeros(nb), block_size=block_size)
    else:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[moments]
        state.update(m=m.to(dt), v=v.to(dt))
    return state


def grads(n, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 1e-3 * torch.exp(torch.randn(n, generator=g))).to(dtype)
            for _ in range(k)]


def run(fn, state, gs, segments, weights=False, seed=5, offset=0, hp=HP):
    """`fn` (kernel or reference) over the gradients, steps 1..k; returns the state and the last weights_out."""
    st = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in state.items()}
    w = torch.empty(st["master"].numel(), dtype=torch.bfloat16) if weights else None
    lr, clip = torch.tensor(LR), torch.tensor(CLIP)
    for i, g in enumerate(gs):
        fn(st["master"], st["m"], st["v"], g, lr=lr, clip=clip, step=i + 1, segments=segments, weights_out=w,
           m_scales=st.get("m_scales"), v_scales=st.get("v_scales"), block_size=st.get("block_size"),
           seed=seed + i, offset=offset, **hp)
    return st, w


def ulps(a, b):
    """|difference of the fp32 bit patterns as monotonic integers|."""
    def key(x):
        i = x.view(torch.int32).to(torch.int64)
        return torch.where(i >= 0, i, -(i & 0x7FFFFFFF))
    return (key(a) - key(b)).abs()


def assert_same_state(a, b):
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(bits(a[k]), bits(b[k])), k


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp takes its other branch for 1 - beta1 >= 0.5
def test_fp32_matches_torch_fused_adamw_within_one_ulp(beta1):
    n, k = N_PRIME, 4
    hp = {**HP, "beta1": beta1}
    state = make_state(n, seed=1)
    gs = grads(n, k, seed=2)
    got, _ = run(A.adamw_update, state, gs, SEGMENTS, hp=hp)
    params = [torch.nn.Parameter(state["master"][s:s + c].clone()) for s, c, _ in SEGMENTS]
    opt = torch.optim.AdamW([{"params": [p], "weight_decay": wd} for p, (_, _, wd) in zip(params, SEGMENTS)],
                            lr=LR, fused=True, betas=(beta1, HP["beta2"]), eps=HP["eps"])
    for p, (s, c, _) in zip(params, SEGMENTS):
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": state["m"][s:s + c].clone(),
                        "exp_avg_sq": state["v"][s:s + c].clone()}
    for g in gs:
        for p, (s, c, _) in zip(params, SEGMENTS):
            p.grad = g[s:s + c] * CLIP  # what clip_grad_norm_ leaves in .grad
        opt.step()
    want = {"master": torch.cat([p.detach() for p in params]),
            "m": torch.cat([opt.state[p]["exp_avg"] for p in params]),
            "v": torch.cat([opt.state[p]["exp_avg_sq"] for p in params])}
    for name in ("master", "m", "v"):
        d = ulps(got[name], want[name])
        print(f"{name}: {(d > 0).sum().item()} of {n} elements differ from torch, max {d.max().item()} ulp")
        assert d.max().item() <= 1
    ref, _ = run(adamw_update_reference, state, gs, SEGMENTS, hp=hp)
    assert_same_state(got, ref)


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_every_format_matches_reference_bit_for_bit(master_dtype, moments):
    n = N_PRIME
    state = make_state(n, seed=3, master_dtype=master_dtype, moments=moments, block_size=64)
    gs = grads(n, 2, seed=4, dtype=torch.bfloat16 if moments == "bf16" else torch.float32)
    got, w = run(A.adamw_update, state, gs, SEGMENTS, weights=True, offset=64)
    ref, w_ref = run(adamw_update_reference, state, gs, SEGMENTS, weights=True, offset=64)
    assert_same_state(got, ref)
    assert torch.equal(bits(w), bits(w_ref))
    assert torch.equal(bits(w), bits(got["master"].to(torch.bfloat16)))
    assert torch.isfinite(got["master"].float()).all()


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_many_programs_match_the_reference(monkeypatch, moments):
    """Tiles of 1024 (10 programs, the last one partial, masked) give the reference's bits: the tile and block
    indices, the Philox counters and the run lookup of every program but the first are checked."""
    monkeypatch.setattr(A, "TILE_INTERPRET", 1024)
    state = make_state(N_PRIME, seed=13, master_dtype=torch.bfloat16, moments=moments, block_size=64)
    gs = grads(N_PRIME, 2, seed=14)
    got, w = run(A.adamw_update, state, gs, SEGMENTS, weights=True, offset=8)
    ref, w_ref = run(adamw_update_reference, state, gs, SEGMENTS, weights=True, offset=8)
    assert_same_state(got, ref)
    assert torch.equal(bits(w), bits(w_ref))


def test_int8_block_larger_than_tile_and_layout_segments():
    layout = small_layer()
    n = layout.numel
    state = make_state(n, seed=6, moments="int8", block_size=16384)
    segs = A.layout_segments(layout, 0.1)
    assert segs[0][0] == 0 and sum(c for _, c, _ in segs) == n
    gs = grads(n, 2, seed=7)
    got, _ = run(A.adamw_update, state, gs, segs)
    ref, _ = run(adamw_update_reference, state, gs, segs)
    assert_same_state(got, ref)


def test_torch_fallback_is_the_reference(monkeypatch):
    state = make_state(1000, seed=8, master_dtype=torch.bfloat16, moments="bf16")
    gs = grads(1000, 1, seed=9)
    got, _ = run(A.adamw_update, state, gs, [(0, 1000, 0.1)])
    monkeypatch.setattr(A, "uses_triton", lambda device: False)
    fallback, _ = run(A.adamw_update, state, gs, [(0, 1000, 0.1)])
    assert_same_state(got, fallback)


def test_nonfinite_gradient_propagates():
    state = make_state(100, seed=10)
    g = grads(100, 1, seed=11)[0]
    g[3] = float("nan")
    g[7] = float("inf")
    got, _ = run(A.adamw_update, state, [g], [(0, 100, 0.1)])
    assert torch.isnan(got["master"][[3, 7]]).all() and torch.isfinite(got["master"][8:]).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_nan_gradient_makes_its_int8_blocks_scales_nan_and_no_other(device, request):
    """On the GPU a float max drops NaN; the kernel's integer max over the bits must not."""
    if device == "cuda":
        device = request.getfixturevalue("cuda")  # the compiled kernel, not the interpreter
    n, block = 300, 64
    state = make_state(n, seed=12, moments="int8", block_size=block)
    g = grads(n, 1, seed=13)[0]
    g[block + 5] = -float("nan")  # a NaN with its sign bit set, in the second block
    st = {k: (t.to(device, copy=True) if isinstance(t, torch.Tensor) else t) for k, t in state.items()}
    A.adamw_update(st["master"], st["m"], st["v"], g.to(device), lr=torch.tensor(LR, device=device),
                   clip=torch.tensor(CLIP, device=device), step=1, segments=[(0, n, 0.1)], m_scales=st["m_scales"],
                   v_scales=st["v_scales"], block_size=block, **HP)
    ref, _ = run(adamw_update_reference, state, [g], [(0, n, 0.1)])
    for name in ("m_scales", "v_scales"):
        got = st[name].cpu()
        assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2, 3, 4]]).all(), name
        torch.testing.assert_close(got, ref[name], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(bits(st["master"][:block].cpu()), bits(ref["master"][:block]))


# ---------------------------------------------------------------------------------------------------------------
# stochastic rounding of bf16 state
# ---------------------------------------------------------------------------------------------------------------
def test_stochastic_rounding_unbiased_reproducible_seeded():
    n = 2**15
    lo, ulp = 1.5 * 2.0**-3, 2.0**-10  # bf16 master in [lo, lo + ulp): each element rounds to lo or lo + ulp
    master = torch.full((n,), lo, dtype=torch.bfloat16)
    # an update of exactly frac * ulp: v = g^2 at step 1 and eps = 0 make |update| = lr; lr = frac * ulp
    frac = 0.3
    lr = torch.tensor(-frac * ulp)  # negative lr: the update moves p up by frac * ulp
    g = torch.full((n,), 1e-3)
    outs = []
    for seed in (1, 1, 2):
        p, m, v = master.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        A.adamw_update(p, m, v, g, lr=lr, clip=torch.tensor(1.0), step=1, beta1=0.9, beta2=0.95, eps=0.0,
                       segments=[(0, n, 0.0)], seed=seed)
        outs.append(p)
    y = outs[0].double()
    assert torch.all((y == lo) | (y == lo + ulp))
    se = math.sqrt(frac * (1 - frac) / n)  # standard error of the mean of n Bernoulli(frac) draws
    mean_err = (y.mean().item() - (lo + frac * ulp)) / ulp
    assert abs(mean_err) < 4 * se, mean_err
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    assert (bits(outs[0]) != bits(outs[2])).float().mean() > 0.2


def test_streams_are_decorrelated_and_offset_indexed():
    n = 4096
    state = make_state(n, seed=12, master_dtype=torch.bfloat16, moments="bf16")
    gs = grads(n, 1, seed=13)
    whole, _ = run(A.adamw_update, state, gs, [(0, n, 0.1)], seed=3, offset=0)
    # the second half updated alone with offset = its start gets the same bits
    half = {k: t[n // 2:] for k, t in state.items()}
    part, _ = run(A.adamw_update, half, [gs[0][n // 2:]], [(0, n // 2, 0.1)], seed=3, offset=n // 2)
    for k in ("master", "m", "v"):
        assert torch.equal(bits(part[k]), bits(whole[k][n // 2:]))
    keys = A.adamw_stream_seeds(3)
    assert len(set(keys)) == 3
    r = [stochastic_bits_reference(k, n).double() for k in keys]
    for i in range(3):
        for j in range(i + 1, 3):
            assert abs(torch.corrcoef(torch.stack([r[i], r[j]]))[0, 1].item()) < 4 / math.sqrt(n)


# ---------------------------------------------------------------------------------------------------------------
# 8-bit codes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("e_bits,m_bits", [M_CODE, V_CODE])
def test_code_round_trip_within_bound(e_bits, m_bits):
    emax = 2**e_bits - 1
    top = 2.0 - 2.0**-m_bits
    codes = torch.arange(2**(e_bits + m_bits))
    values = code_decode_reference(codes, e_bits, m_bits)
    assert values[-1].item() == top and torch.all(values[1:] > values[:-1])  # monotonic, top code = 1.875
    assert torch.equal(code_encode_reference(values, e_bits, m_bits), codes)  # every code round-trips
    x = torch.rand(100000) ** 8 * top  # many decades
    err = (code_decode_reference(code_encode_reference(x, e_bits, m_bits), e_bits, m_bits) - x).abs()
    min_normal = 2.0 ** (1 - emax)
    bound = torch.where(x >= min_normal, x * 2.0 ** -(m_bits + 1), torch.full_like(x, 2.0 ** (-emax - m_bits)))
    assert torch.all(err <= bound * (1 + 1e-6))


@triton.jit
def _div_by_constant_kernel(x_ptr, out_ptr, inv_bits, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, A._div_by_constant(x, inv_bits.to(tl.int64).to(tl.float64, bitcast=True)),
             mask=offs < n)


def divisor_cases():
    """Divisors the kernel uses: sqrt(1 - beta2**step) over the steps of a run, and the codes' top values."""
    cs = [A._fp32(math.sqrt(1.0 - beta2 ** float(step))) for beta2 in (0.95, 0.999, 0.99999)
          for step in (1, 2, 3, 7, 100, 12345)]
    return cs + [2.0 - 2.0 ** -M_CODE[1], 2.0 - 2.0 ** -V_CODE[1], A._fp32(math.pi)]


def dividends(c: float, n: int, seed: int) -> torch.Tensor:
    """Random fp32 over many binades, values whose quotient by c lies next to a midpoint between fp32 neighbours
    (the cases a wrong rounding would show), and 0, inf, NaN, the smallest normal and subnormal numbers."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-120, 100, (n,), generator=g).float()) * (1 + torch.rand(n, generator=g))
    q = torch.exp2(torch.randint(-100, 80, (n,), generator=g).float()) * (1 + torch.rand(n, generator=g))
    q_bits = q.view(torch.int32)
    mid = (q.double() + (q_bits + 1).view(torch.float32).double()) / 2
    near_mid = (mid * c).float()
    special = torch.tensor([0.0, float("inf"), float("nan"), 2.0**-126, 2.0**-149, 3.4e38, 1.0])
    subnormal = torch.arange(1, 4096, dtype=torch.int32).view(torch.float32)  # a block scale's amax can be one
    return torch.cat([spread, near_mid, (near_mid.view(torch.int32) + 1).view(torch.float32), special, subnormal])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_division_by_a_constant_is_correctly_rounded(device, request):
    request.getfixturevalue("cuda" if device == "cuda" else "interpreter")
    n = 200_000 if device == "cuda" else 20_000
    for i, c in enumerate(divisor_cases()):
        x = dividends(c, n, seed=i)
        want = x / torch.tensor(c, dtype=torch.float32)  # torch's fp32 division: IEEE, correctly rounded
        got = torch.empty_like(x, device=device)
        _div_by_constant_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(device), got, A._f64_bits(1.0 / c),
                                                                 x.numel(), BLOCK=1024)
        got = got.cpu()
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), f"c = {c}"  # NaN payloads may differ between devices
        assert torch.equal(bits(got[~nan]), bits(want[~nan])), f"c = {c}"


def test_int8_moments_error_bound_and_small_v_never_zero():
    n, bs = 4099, 128
    state = make_state(n, seed=14, moments="int8", block_size=bs)
    g = grads(n, 1, seed=15)[0]
    g[:bs] = 1.0
    g[5] = 1e-7  # v = (1 - beta2) g^2 is 1e-14 of its block's max: a linear code would store 0
    got, _ = run(A.adamw_update, state, [g], [(0, n, 0.0)])
    # from zero state, step 1: m = 0.1 * clip * g, v = 0.05 * (clip * g)^2 in fp32
    gc = g * CLIP
    m_true = torch.tensor(0.1) * gc
    v_true = (torch.tensor(0.05) * gc) * gc
    for signed, code, scales, true in ((True, got["m"], got["m_scales"], m_true),
                                       (False, got["v"], got["v_scales"], v_true)):
        e_bits, m_bits = M_CODE if signed else V_CODE
        emax = 2**e_bits - 1
        c = code.to(torch.int64) & 0xFF
        mag = code_decode_reference(c & 0x7F if signed else c, e_bits, m_bits)
        dec = torch.where(c >= 128, -mag, mag) * scales.repeat_interleave(bs)[:n] if signed else \
            mag * scales.repeat_interleave(bs)[:n]
        block_max = true.abs().reshape(-1).tolist()
        amax = torch.tensor([max(map(abs, block_max[i:i + bs])) for i in range(0, n, bs)])
        torch.testing.assert_close(scales, amax / (2 - 2.0**-m_bits), rtol=0, atol=0)
        scale_e = scales.repeat_interleave(bs)[:n]
        x = true.abs() / scale_e
        bound = torch.where(x >= 2.0 ** (1 - emax), true.abs() * 2.0 ** -(m_bits + 1),
                            scale_e * 2.0 ** (-emax - m_bits + (0 if signed else 1)))  # v: > 0 rounds up to code 1
        assert torch.all((dec - true).abs() <= bound * (1 + 1e-5) + 1e-30)
    v_dec = code_decode_reference(got["v"].to(torch.int64), *V_CODE) * got["v_scales"].repeat_interleave(bs)[:n]
    assert v_true[5] > 0 and v_dec[5] > 0
    assert torch.all(v_dec[v_true > 0] > 0)


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------
def test_refuses_bad_arguments():
    n = 100
    base = dict(master=torch.zeros(n), m=torch.zeros(n), v=torch.zeros(n), grad=torch.zeros(n),
                lr=torch.tensor(1e-3), clip=torch.tensor(1.0), step=1, segments=[(0, n, 0.0)], **HP)
    cases = [
        (dict(master=torch.zeros(n, dtype=torch.float16)), "master has dtype torch.float16"),
        (dict(grad=torch.zeros(n + 1)), "grad has 101 elements, master has 100"),
        (dict(m=torch.zeros(n, dtype=torch.bfloat16)), "v has dtype torch.float32; supported: torch.bfloat16"),
        (dict(m=torch.zeros(n, dtype=torch.int8), v=torch.zeros(n, dtype=torch.uint8), block_size=64),
         "int8 moments need m_scales"),
        (dict(m=torch.zeros(n, dtype=torch.int8), v=torch.zeros(n, dtype=torch.uint8), block_size=48,
              m_scales=torch.zeros(2), v_scales=torch.zeros(2)), "block_size, a power of two"),
        (dict(m=torch.zeros(n, dtype=torch.int8), v=torch.zeros(n, dtype=torch.uint8), block_size=64,
              m_scales=torch.zeros(2), v_scales=torch.zeros(3)), "v_scales has 3 elements"),
        (dict(block_size=64), "apply to int8 moments only"),
        (dict(segments=[(0, 60, 0.1)]), r"segments must tile \[0, 100\) in order: they end at 60"),
        (dict(segments=[(0, 60, 0.1), (61, 39, 0.0)]), r"segments\[1\] starts at 61, expected 60"),
        (dict(segments=[(0, 100, -1.0)]), r"segments\[0\]"),
        (dict(lr=1e-3), "lr must be a 0-d torch.float32 tensor"),
        (dict(clip=torch.ones(1)), "clip must be a 0-d torch.float32 tensor"),
        (dict(step=0), "step must be a Python int >= 1"),
        (dict(beta2=1.0), r"beta2 must be in \[0, 1\)"),
        (dict(offset=3), "offset must be a non-negative multiple of 8"),
        (dict(weights_out=torch.zeros(n)), "weights_out has dtype torch.float32"),
        (dict(master=torch.zeros(2, 50)), "master must be 1-D and contiguous"),
    ]
    assert_refusals(base, cases)


def assert_refusals(base: dict, cases) -> None:
    """Each (override, match) of `cases` applied to the adamw_update arguments `base` raises a ValueError matching."""
    for override, match in cases:
        kwargs = {**base, **override}
        args = [kwargs.pop(k) for k in ("master", "m", "v", "grad")]
        with pytest.raises(ValueError, match=match):
            A.adamw_update(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_gpu_matches_reference(cuda, master_dtype, moments):
    n = 3_000_017
    state = make_state(n, seed=20, master_dtype=master_dtype, moments=moments, block_size=256)
    gs = grads(n, 2, seed=21)
    segs = [(0, 1_000_003, 0.1), (1_000_003, 2_000_014, 0.0)]

    def on(st):
        return {k: (t.to(cuda) if isinstance(t, torch.Tensor) else t) for k, t in st.items()}

    st = on(state)
    lr, clip = torch.tensor(LR, device=cuda), torch.tensor(CLIP, device=cuda)
    w = torch.empty(n, dtype=torch.bfloat16, device=cuda)
    for i, g in enumerate(gs):
        A.adamw_update(st["master"], st["m"], st["v"], g.to(cuda), lr=lr, clip=clip, step=i + 1, segments=segs,
                       weights_out=w, m_scales=st.get("m_scales"), v_scales=st.get("v_scales"),
                       block_size=st.get("block_size"), seed=5 + i, **HP)
    ref, w_ref = run(adamw_update_reference, state, gs, segs, weights=True)
    assert_same_state({k: t.cpu() if isinstance(t, torch.Tensor) else t for k, t in st.items()}, ref)
    assert torch.equal(bits(w.cpu()), bits(w_ref))
