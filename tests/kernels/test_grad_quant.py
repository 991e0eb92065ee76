"""streamtrain_kernels/grad_quant.py: int8 gradients (m's 8-bit code, stochastically rounded) and adamw_update
reading them.

Kernel against the torch reference bit for bit; code values as fixed points; unbiasedness against the rounding's
own variance; non-finite blocks; the update from int8 codes against the update from their dequantized values.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_grad_quant.py                 # CPU (interpreter)
    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_grad_quant.py          # GPU machine
"""

import math

import pytest
import torch

import streamtrain_kernels.adamw_update as A
import streamtrain_kernels.grad_quant as Q
from streamtrain_kernels.reference import (M_CODE, adamw_update_reference, code_decode_reference,
                                           dequantize_blocks_reference, quantize_grad_int8_reference)
from tests.kernels.test_adamw_update import (CLIP, HP, LR, assert_refusals, assert_same_state, bits, grads,
                                             make_state)

TOP = 2.0 - 2.0 ** -M_CODE[1]
CODE_VALUES = code_decode_reference(torch.arange(128), *M_CODE).double()  # magnitude code -> value, increasing


@pytest.fixture(autouse=True)
def small_interpreter_tiles(monkeypatch):
    """Tiles of 256 elements under the interpreter, so that the small sizes here span several programs, partial
    tiles and blocks larger than a tile."""
    monkeypatch.setattr(Q, "TILE_INTERPRET", 256)


def wide_values(n: int, seed: int) -> torch.Tensor:
    """fp32 of both signs over ~40 binades, a few exact zeros: every branch of the code (subnormal, normal, 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randn(n, generator=g) * 6)
    x[::17] = 0.0
    return x


def quantize(x, seed, block_size, device="cpu", deq="separate"):
    """(codes, scales, dequantized or None) from the kernel; deq: None, "separate" or "in_place"."""
    n = x.numel()
    x = x.to(device, copy=True)
    codes = torch.empty(n, dtype=torch.int8, device=device)
    scales = torch.empty(-(-n // block_size), device=device)
    out = {None: None, "separate": torch.empty(n, device=device), "in_place": x}[deq]
    Q.quantize_grad_int8(x, codes, scales, seed, block_size, dequantized_out=out)
    return codes.cpu(), scales.cpu(), None if out is None else out.cpu()


@pytest.mark.parametrize("block_size", [64, 512])  # 4 blocks a tile, and a block of two tiles' size
@pytest.mark.parametrize("deq", [None, "separate", "in_place"])
def test_kernel_matches_reference_bit_for_bit(block_size, deq):
    for n in (0, 5, 37, 1001, 3 * block_size + 13):
        x = wide_values(n, seed=n)
        codes, scales, out = quantize(x, seed=7 + n, block_size=block_size, deq=deq)
        ref_codes, ref_scales = quantize_grad_int8_reference(x, 7 + n, block_size)
        assert torch.equal(codes, ref_codes), n
        assert torch.equal(bits(scales), bits(ref_scales)), n
        ref_deq = dequantize_blocks_reference(ref_codes, ref_scales, block_size, signed=True)
        if out is not None:
            assert torch.equal(bits(out), bits(ref_deq)), n
        back = Q.dequantize_grad_int8(codes, scales, block_size, torch.empty(n))
        assert torch.equal(bits(back), bits(ref_deq)), n


def test_torch_fallback_is_the_reference(monkeypatch):
    x = wide_values(1001, seed=1)
    kernel = quantize(x, seed=3, block_size=64)
    monkeypatch.setattr(Q, "uses_triton", lambda device: False)
    fallback = quantize(x, seed=3, block_size=64)
    for a, b in zip(kernel, fallback):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(Q.dequantize_grad_int8(kernel[0], kernel[1], 64, torch.empty(1001))), bits(kernel[2]))


@pytest.mark.parametrize("scale_exp", [-20, 3])
def test_code_values_times_a_power_of_two_scale_are_fixed_points(scale_exp):
    """A block whose largest magnitude is the top code times 2**k has scale 2**k: then every value that is a code
    value times 2**k is a code position with no fraction, and no random bits move it."""
    block, n_blocks = 64, 4
    g = torch.Generator().manual_seed(scale_exp + 100)
    mag = torch.randint(0, 128, (block * n_blocks,), generator=g)
    mag[::block] = 127  # the top code in every block
    neg = (torch.rand(mag.numel(), generator=g) < 0.5) & (mag > 0)
    x = (torch.where(neg, -1.0, 1.0) * CODE_VALUES[mag] * 2.0**scale_exp).float()
    want_codes = torch.where(neg, mag - 128, mag).to(torch.int8)
    for seed in (1, 2, 3):
        codes, scales, out = quantize(x, seed, block)
        assert torch.equal(codes, want_codes)
        assert torch.all(scales == 2.0**scale_exp)
        assert torch.equal(bits(out), bits(x))


def test_rounding_is_unbiased_and_picks_a_neighbour(monkeypatch):
    """Many copies of one block in one buffer: each copy's elements draw their own random bits (their indices
    differ), all copies share the scale. Per element the mean over copies must lie within a few standard errors
    of x, the standard error from the rounding's own variance: step**2 * q * (1 - q) / copies for a step of
    hi - lo and q = (y - lo) / step. Plus the deterministic part: the probability is floored to 16 bits, so the
    mean is low by less than 2**-16 of a step. The scale is a power of two, so y = |x| / scale and the decoded
    values are exact and nothing else enters."""
    monkeypatch.setattr(Q, "TILE_INTERPRET", 16384)  # 8 programs, not 512: the interpreter pays per program
    block, copies, scale = 256, 512, 2.0**-5
    g = torch.Generator().manual_seed(11)
    # |x| / scale spread over [2**-22, 1] * TOP: below the smallest normal code 2**-14 and the subnormal step 2**-17
    y = (TOP * torch.exp2(-22 * torch.rand(block, generator=g))).float()
    y[0] = TOP  # the block's max: scale = TOP * scale / TOP, exactly
    sign = torch.where(torch.rand(block, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * y * scale).float()
    _, scales, out = quantize(x.repeat(copies), seed=5, block_size=block)
    assert torch.all(scales == scale)
    deq = out.double().view(copies, block)

    yd = y.double()
    i_lo = torch.searchsorted(CODE_VALUES, yd, right=True) - 1
    lo, hi = CODE_VALUES[i_lo], CODE_VALUES[(i_lo + 1).clamp(max=127)]
    assert torch.all((lo <= yd) & (yd <= hi))
    sd = sign.double()
    assert torch.all((deq == sd * lo * scale) | (deq == sd * hi * scale))
    step = (hi - lo) * scale
    q = torch.where(hi > lo, (yd - lo) / (hi - lo), torch.zeros_like(yd))
    se = step * torch.sqrt(q * (1 - q) / copies)
    err = deq.mean(dim=0) - x.double()
    assert torch.all(err.abs() <= 5 * se + step * 2.0**-16), (err.abs() - 5 * se).max()
    # no systematic bias across the block either: the mean z-score of the elements that round at all
    rounding = q > 0
    z = (err / se)[rounding] * sd[rounding]
    assert abs(z.mean().item()) < 4 / math.sqrt(rounding.sum().item())
    assert rounding.sum() > block // 2 and (yd < 2.0**-14).sum() > block // 4  # the subnormal range is exercised


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0, on purpose
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_inf_and_zero_blocks(device, request):
    """NaN -> NaN scale, the block decodes to NaN; +-inf -> non-finite decoded sum of squares (the engine then
    skips the step); zeros -> codes 0, scale 0; the other blocks unaffected. On the GPU a float max drops NaN and
    the float compares differ from numpy's: the codes must still be the reference's."""
    if device == "cuda":
        device = request.getfixturevalue("cuda")
    block = 64
    x = wide_values(5 * block + 10, seed=4)
    x[block + 3] = -float("nan")  # block 1, with its sign bit set
    x[2 * block + 7] = float("inf")  # block 2
    x[3 * block:4 * block] = 0.0  # block 3
    x[4 * block + 1] = -float("inf")  # block 4
    codes, scales, out = quantize(x, seed=9, block_size=block, device=device)
    ref_codes, ref_scales = quantize_grad_int8_reference(x, 9, block)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(scales[1]) and torch.isnan(out[block:2 * block]).all()
    for b in (2, 4):
        assert not math.isfinite(out[b * block:(b + 1) * block].double().square().sum().item())
        assert not math.isfinite(scales[b].item())
    assert scales[3] == 0 and torch.all(codes[3 * block:4 * block] == 0) and torch.all(out[3 * block:4 * block] == 0)
    assert torch.isfinite(scales[[0, 5]]).all() and torch.isfinite(out[:block]).all() and torch.isfinite(
        out[5 * block:]).all()


def test_same_seed_same_bits_other_seed_other_bits():
    x = wide_values(2048, seed=6)
    a, b, c = (quantize(x, seed, 256)[0] for seed in (42, 42, 43))
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.2


def test_refuses_bad_arguments():
    n = 100
    x, codes, scales = torch.zeros(n), torch.zeros(n, dtype=torch.int8), torch.zeros(2)
    cases = [
        (dict(flat_fp32=x.double()), "flat_fp32 has dtype torch.float64"),
        (dict(flat_fp32=torch.zeros(10, 10)), "flat_fp32 must be 1-D and contiguous"),
        (dict(block_size=48), r"block_size must be a power of two in \[8, 16384\], got 48"),
        (dict(block_size=32768), "got 32768"),
        (dict(codes_out=torch.zeros(n, dtype=torch.uint8)), "codes_out has dtype torch.uint8"),
        (dict(codes_out=torch.zeros(n + 1, dtype=torch.int8)), r"codes_out must hold 100 elements .* got 101"),
        (dict(scales_out=torch.zeros(3)), r"scales_out must hold 2 elements \(one per block of 64\)"),
        (dict(dequantized_out=torch.zeros(n - 1)), "dequantized_out must hold 100 elements"),
        (dict(dequantized_out=torch.zeros(n, dtype=torch.bfloat16)), "dequantized_out has dtype torch.bfloat16"),
        (dict(scales_out=x[:2]), "flat_fp32 and scales_out overlap"),
        (dict(seed=1.5), "seed must be an integer, got 1.5"),
    ]
    for override, match in cases:
        kwargs = {**dict(flat_fp32=x, codes_out=codes, scales_out=scales, seed=0, block_size=64), **override}
        with pytest.raises(ValueError, match=match):
            Q.quantize_grad_int8(**kwargs)
    with pytest.raises(ValueError, match="out_fp32 must hold 100 elements"):
        Q.dequantize_grad_int8(codes, scales, 64, torch.zeros(n + 1))
    with pytest.raises(ValueError, match="scales must hold 1 elements"):
        Q.dequantize_grad_int8(codes, scales, 128, torch.zeros(n))


# ---------------------------------------------------------------------------------------------------------------
# adamw_update with an int8 gradient
# ---------------------------------------------------------------------------------------------------------------
N_ODD = 3001  # not a multiple of 8; three tiles of 1024
SEGMENTS = [(0, 1001, 0.1), (1001, 1200, 0.0), (2201, 800, 0.05)]


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_adamw_int8_grad_equals_the_dequantized_fp32_grad(monkeypatch, master_dtype, moments):
    """Tiles of 1024 elements: the int8 moments' rows are their 64-element blocks, the other formats' one row is
    the tile. Grad blocks of 64, 1024 and 2048 take the per-row scale where they equal the row, else the gather,
    including blocks larger than a tile (a tile starting inside a block)."""
    monkeypatch.setattr(A, "TILE_INTERPRET", 1024)
    state = make_state(N_ODD, seed=3, master_dtype=master_dtype, moments=moments, block_size=64)
    g = grads(N_ODD, 1, seed=4)[0]
    lr, clip = torch.tensor(LR), torch.tensor(CLIP)
    for grad_block in (64, 1024, 2048):
        codes, scales, g_deq = quantize(g, seed=grad_block, block_size=grad_block)
        results = []
        for fn, grad, extra in ((A.adamw_update, codes, dict(grad_scales=scales, grad_block_size=grad_block)),
                                (A.adamw_update, g_deq, {}),
                                (adamw_update_reference, codes, dict(grad_scales=scales, grad_block_size=grad_block))):
            st = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in state.items()}
            fn(st["master"], st["m"], st["v"], grad, lr=lr, clip=clip, step=2, segments=SEGMENTS,
               m_scales=st.get("m_scales"), v_scales=st.get("v_scales"), block_size=st.get("block_size"), seed=5,
               **extra, **HP)
            results.append(st)
        assert_same_state(results[0], results[1])
        assert_same_state(results[0], results[2])


def test_adamw_refuses_bad_int8_grad_arguments():
    n = 100
    base = dict(master=torch.zeros(n), m=torch.zeros(n), v=torch.zeros(n), grad=torch.zeros(n, dtype=torch.int8),
                lr=torch.tensor(1e-3), clip=torch.tensor(1.0), step=1, segments=[(0, n, 0.0)],
                grad_scales=torch.zeros(2), grad_block_size=64, **HP)
    cases = [
        (dict(grad_scales=None), r"an int8 grad needs grad_scales \(fp32, 2 elements"),
        (dict(grad_block_size=None), r"an int8 grad needs grad_block_size, a power of two in \[8, 16384\]"),
        (dict(grad_block_size=96), "got 96"),
        (dict(grad_scales=torch.zeros(3)), "grad_scales has 3 elements"),
        (dict(grad_scales=torch.zeros(2, dtype=torch.bfloat16)), "grad_scales has dtype torch.bfloat16"),
        (dict(grad=torch.zeros(n)), "grad_scales and grad_block_size apply to an int8 grad only"),
        (dict(grad=torch.zeros(n, dtype=torch.uint8)), "grad has dtype torch.uint8"),
    ]
    assert_refusals(base, cases)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 256, 16384])
def test_gpu_matches_reference(cuda, block_size):
    n = 3_000_017
    x = wide_values(n, seed=20)
    codes, scales, out = quantize(x, seed=21, block_size=block_size, device=cuda)
    ref_codes, ref_scales = quantize_grad_int8_reference(x, 21, block_size)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(bits(scales), bits(ref_scales))
    assert torch.equal(bits(out), bits(dequantize_blocks_reference(ref_codes, ref_scales, block_size, True)))
    back = Q.dequantize_grad_int8(codes.to(cuda), scales.to(cuda), block_size, torch.empty(n, device=cuda))
    assert torch.equal(bits(back.cpu()), bits(out))


@pytest.mark.gpu
@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_gpu_adamw_int8_grad_equals_the_dequantized_fp32_grad(cuda, moments):
    n = 1_000_003
    state = make_state(n, seed=22, master_dtype=torch.bfloat16, moments=moments, block_size=256)
    segs = [(0, 400_001, 0.1), (400_001, n - 400_001, 0.0)]
    g = grads(n, 1, seed=23)[0]
    lr, clip = torch.tensor(LR, device=cuda), torch.tensor(CLIP, device=cuda)
    for grad_block in (256, 4096):
        codes, scales, g_deq = quantize(g, seed=24, block_size=grad_block, device=cuda)
        results = []
        for grad, extra in ((codes, dict(grad_scales=scales.to(cuda), grad_block_size=grad_block)), (g_deq, {})):
            st = {k: (t.to(cuda, copy=True) if isinstance(t, torch.Tensor) else t) for k, t in state.items()}
            A.adamw_update(st["master"], st["m"], st["v"], grad.to(cuda), lr=lr, clip=clip, step=2, segments=segs,
                           m_scales=st.get("m_scales"), v_scales=st.get("v_scales"),
                           block_size=st.get("block_size"), seed=5, **extra, **HP)
            results.append({k: (t.cpu() if isinstance(t, torch.Tensor) else t) for k, t in st.items()})
        assert_same_state(results[0], results[1])
