"""engine/kernels/pack.py against engine/kernels/reference.py and torch.

CPU tests run the kernels under TRITON_INTERPRET=1 (tests/conftest.py) at small, odd sizes; the interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest even, so CPU checks of bf16 casts allow one bf16 ulp and
same-dtype copies are checked bit for bit. `gpu` tests run a real qwen7b layer and need TRITON_INTERPRET=0:

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_pack.py                 # CPU (interpreter)
    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_pack.py          # GPU machine
"""

import math

import pytest
import torch

import engine.kernels.pack as P
from engine.model.layout import ALIGN_ELEMS, ParamSpec, UnitLayout
from engine.kernels.reference import pack_reference, sq_norms_reference, unpack_reference

SENTINEL = -1234.5  # exactly representable in fp32, bf16 and fp16


def aligned_offsets(numels):
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off = -(-(off + n) // ALIGN_ELEMS) * ALIGN_ELEMS
    return offsets, off


def values(shape, dtype, seed, specials=False, device="cpu"):
    """Normal values over a few decades of magnitude (so casts round in every direction), optionally with
    Inf / NaN / -0 / subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2).clamp(max=500)
    if specials and n >= 8:
        tiny = 1e-40 if dtype != torch.float16 else 1e-7
        x[:8] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0, tiny, -tiny, 1.0])
    return x.to(dtype).reshape(shape).to(device)


def bits(t):
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def bf16_ulps(a, b):
    """Distance in bf16 ulps between two bf16 tensors (signs compared through a monotonic integer key)."""
    def key(x):
        v = x.view(torch.int16).to(torch.int32)
        return torch.where(v >= 0, v, -(v + 32768))
    return (key(a) - key(b)).abs()


class CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def qwen2_layer(h, i, kv):
    """A Qwen2-style decoder layer layout (q/k/v biases): 12 tensors, hidden h, intermediate i, kv width kv."""
    m, v = "matmul", "vector"
    shapes = [("self_attn.q_proj.weight", (h, h), m), ("self_attn.k_proj.weight", (kv, h), m),
              ("self_attn.v_proj.weight", (kv, h), m), ("self_attn.o_proj.weight", (h, h), m),
              ("mlp.gate_proj.weight", (i, h), m), ("mlp.up_proj.weight", (i, h), m),
              ("mlp.down_proj.weight", (h, i), m), ("input_layernorm.weight", (h,), v),
              ("post_attention_layernorm.weight", (h,), v), ("self_attn.q_proj.bias", (h,), v),
              ("self_attn.k_proj.bias", (kv,), v), ("self_attn.v_proj.bias", (kv,), v)]
    return UnitLayout("model.layers.0.", [ParamSpec(*x) for x in shapes])


def small_layer():
    return qwen2_layer(72, 100, 24)  # odd sizes, 6 heads / 2 kv heads of 12


def qwen7b_layer():
    return qwen2_layer(3584, 18944, 4 * 128)  # Qwen2.5-7B: 28 heads, 4 kv heads, head_dim 128


ODD_SHAPES = [(7919,), (1,), (104729,), (33, 17), (8192,), (8193,), (5, 3, 7)]  # around BLOCK = 8192
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_same_dtype_is_bit_exact(dtype):
    tensors = [values(s, dtype, seed=k, specials=True) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    out = torch.full((total + 100,), SENTINEL, dtype=dtype)
    assert P.pack(tensors, offsets, out) is None
    for t, off in zip(tensors, offsets):
        assert torch.equal(bits(out[off:off + t.numel()]), bits(t.reshape(-1)))  # NaN payloads included
    back = [torch.full_like(t, 7.0) for t in tensors]
    P.unpack(out, offsets, back)
    for t, b in zip(tensors, back):
        assert torch.equal(bits(b), bits(t))


def test_padding_is_left_untouched():
    tensors = [values(s, torch.float32, seed=k) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    out = torch.full((total + 77,), SENTINEL)
    P.pack(tensors, offsets, out, compute_sq_norms=True)
    covered = torch.zeros(out.numel(), dtype=torch.bool)
    for t, off in zip(tensors, offsets):
        covered[off:off + t.numel()] = True
    assert (~covered).sum() > 0
    assert torch.all(out[~covered] == SENTINEL)
    expected = torch.full_like(out, SENTINEL)
    pack_reference(tensors, offsets, expected)
    assert torch.equal(bits(out), bits(expected))


def test_fp32_to_bf16_within_one_ulp_and_back_exact():
    tensors = [values(s, torch.float32, seed=10 + k, specials=True) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    out = torch.full((total,), SENTINEL, dtype=torch.bfloat16)
    P.pack(tensors, offsets, out)
    for t, off in zip(tensors, offsets):
        got, want = out[off:off + t.numel()], t.reshape(-1).to(torch.bfloat16)
        finite = torch.isfinite(want)
        if P.INTERPRETED:  # the interpreter's fp32 -> bf16 also mangles subnormals (the GPU test checks them)
            finite &= (want == 0) | (want.abs() >= torch.finfo(torch.float32).tiny)
        assert bf16_ulps(got[finite], want[finite]).max() <= 1
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got[torch.isinf(want)], want[torch.isinf(want)])
    # bf16 -> fp32 is exact
    back = [torch.empty(t.shape, dtype=torch.float32) for t in tensors]
    P.unpack(out, offsets, back)
    for b, off in zip(back, offsets):
        assert torch.equal(bits(b.reshape(-1)), bits(out[off:off + b.numel()].float()))


def test_bf16_and_fp16_to_fp32_exact_and_fp32_to_fp16_like_torch():
    tensors = [values(s, DTYPES[k % 3], seed=20 + k, specials=True) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    out = torch.full((total,), SENTINEL)
    P.pack(tensors, offsets, out)
    for t, off in zip(tensors, offsets):
        assert torch.equal(bits(out[off:off + t.numel()]), bits(t.reshape(-1).float()))
    halves = [torch.empty(t.shape, dtype=torch.float16) for t in tensors]
    P.unpack(out, offsets, halves)  # fp32 -> fp16: round to nearest even, as torch (the interpreter too)
    for h, off in zip(halves, offsets):
        want = out[off:off + h.numel()].to(torch.float16)
        assert torch.equal(bits(h.reshape(-1)), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sq_norms_match_fp64(dtype):
    tensors = [values(s, dtype, seed=30 + k) for k, s in enumerate(ODD_SHAPES)]
    tensors.append(torch.empty(0, dtype=dtype))
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    out = torch.empty(total, dtype=torch.bfloat16)
    norms = P.pack(tensors, offsets, out, compute_sq_norms=True)
    assert norms.dtype == torch.float32 and norms.shape == (len(tensors),)
    want = sq_norms_reference(tensors)
    torch.testing.assert_close(norms.double(), want, rtol=1e-6, atol=0)
    assert norms[1] == tensors[1].float().square().item()  # one element: exact
    assert norms[-1] == 0
    again = P.pack(tensors, offsets, out, compute_sq_norms=True)
    assert torch.equal(bits(norms), bits(again))  # deterministic


def test_layer_of_mixed_dtypes_one_launch(monkeypatch):
    layout = small_layer()
    # as the stream engine's gradients arrive: matmul tensors in the compute dtype, the rest fp32
    params = {s.name: values(s.shape, torch.bfloat16 if s.kind == "matmul" else torch.float32, seed=40 + k)
              for k, s in enumerate(layout.specs)}
    counter = CountingKernel(P._pack_kernel)
    monkeypatch.setattr(P, "_pack_kernel", counter)
    out = torch.full((layout.numel,), SENTINEL)
    norms = P.pack_layout(layout, params, out, compute_sq_norms=True)
    block, _ = P.launch_config(out.device)
    assert counter.grids == [(sum(-(-s.numel // block) for s in layout.specs),)]  # one launch, sized by the total
    views = layout.views(out)
    for s in layout.specs:
        assert torch.equal(bits(views[s.name]), bits(params[s.name].float()))
    torch.testing.assert_close(norms.double(), sq_norms_reference([params[s.name] for s in layout.specs]),
                               rtol=1e-6, atol=0)
    # unpack into the same mixture of dtypes: exact (values came from those dtypes)
    back = {name: torch.empty_like(t) for name, t in params.items()}
    P.unpack_layout(layout, out, back)
    for name, t in params.items():
        assert torch.equal(bits(back[name]), bits(t))
    # and a bf16 flat buffer of the same layout
    flat_bf16 = torch.zeros(layout.numel, dtype=torch.bfloat16)
    P.pack_layout(layout, params, flat_bf16)
    for s in layout.specs:
        got, want = layout.views(flat_bf16)[s.name], params[s.name].to(torch.bfloat16)
        assert bf16_ulps(got, want).max() <= 1


def test_unaligned_tensors_take_the_unhinted_path():
    base = values((30000,), torch.float32, seed=50)
    tensors = [base[1:20000], base[20001:29999]]  # contiguous views 4 bytes past an aligned address
    offsets = [3, 20005]  # not multiples of 8 elements
    out = torch.full((30100,), SENTINEL)
    block, _ = P.launch_config(out.device)
    assert not P.tensor_table(tensors, offsets, out, block).aligned
    norms = P.pack(tensors, offsets, out, compute_sq_norms=True)
    want = torch.full_like(out, SENTINEL)
    pack_reference(tensors, offsets, want)
    assert torch.equal(bits(out), bits(want))
    torch.testing.assert_close(norms.double(), sq_norms_reference(tensors), rtol=1e-6, atol=0)
    back = [torch.empty(n) for n in (19999, 9998)]
    P.unpack(out, offsets, back)
    assert torch.equal(back[0], tensors[0]) and torch.equal(back[1], tensors[1])


def test_alignment_of_the_flat_buffer_is_not_cached():
    tensors = [values((20000,), torch.float32, seed=55)]
    block, _ = P.launch_config(torch.device("cpu"))
    aligned_out = torch.zeros(20064)
    assert P.tensor_table(tensors, [0], aligned_out, block).aligned
    assert not P.tensor_table(tensors, [0], aligned_out[1:], block).aligned
    P.pack(tensors, [0], aligned_out[1:])
    assert torch.equal(aligned_out[1:20001], tensors[0])


def test_cached_table_sees_new_values():
    tensors = [values((3000,), torch.float32, seed=60), values((100,), torch.bfloat16, seed=61)]
    offsets, total = aligned_offsets([3000, 100])
    out = torch.zeros(total)
    P.pack(tensors, offsets, out)
    tensors[0].mul_(2)
    tensors[1].add_(1)
    P.pack(tensors, offsets, out)  # same pointers: the cached table, current contents
    assert torch.equal(out[:3000], tensors[0]) and torch.equal(out[offsets[1]:offsets[1] + 100], tensors[1].float())


def test_empty_inputs():
    out = torch.full((64,), SENTINEL)
    assert P.pack([], [], out, compute_sq_norms=True).shape == (0,)
    norms = P.pack([torch.empty(0), torch.empty(0, dtype=torch.bfloat16)], [0, 0], out, compute_sq_norms=True)
    assert torch.equal(norms, torch.zeros(2)) and torch.all(out == SENTINEL)
    P.unpack(out, [], [])


def test_torch_fallback_matches(monkeypatch):
    tensors = [values(s, DTYPES[k % 3], seed=70 + k) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    out_kernel = torch.full((total,), SENTINEL)
    norms_kernel = P.pack(tensors, offsets, out_kernel, compute_sq_norms=True)
    monkeypatch.setattr(P, "uses_triton", lambda device: False)
    out_torch = torch.full((total,), SENTINEL)
    norms_torch = P.pack(tensors, offsets, out_torch, compute_sq_norms=True)
    assert torch.equal(bits(out_kernel), bits(out_torch))
    torch.testing.assert_close(norms_kernel, norms_torch, rtol=1e-6, atol=0)
    back = [torch.empty_like(t) for t in tensors]
    P.unpack(out_torch, offsets, back)
    assert all(torch.equal(b, t) for b, t in zip(back, tensors))


# ---------------------------------------------------------------------------------------------------------------
# refused arguments: ValueError naming the tensor and the problem, nothing written
# ---------------------------------------------------------------------------------------------------------------
def _refused(match, tensors, offsets, out=None, fn=P.pack):
    out = torch.full((1000,), SENTINEL) if out is None else out
    before = out.clone()
    with pytest.raises(ValueError, match=match):
        fn(tensors, offsets, out)
    assert torch.equal(bits(out), bits(before))


def test_refuses_non_contiguous():
    good = torch.ones(10)
    _refused(r"pack: tensor 1 is not contiguous \(shape \(4, 5\), stride \(1, 4\)\)",
             [good, torch.ones(5, 4).t()], [0, 64])
    _refused("out must be 1-D and contiguous", [good], [0], out=torch.zeros(2000)[::2])
    _refused("out must be 1-D and contiguous", [good], [0], out=torch.zeros(10, 100))


def test_refuses_overlap_and_out_of_range():
    _refused(r"pack: tensor 1 at \[64, 164\) overlaps tensor 0 at \[0, 100\)", [torch.ones(100), torch.ones(100)],
             [0, 64])
    _refused(r"tensor 2 runs past the end of out: offset 960 \+ 50 elements = 1010 > 1000",
             [torch.ones(10), torch.ones(10), torch.ones(50)], [0, 64, 960])
    _refused("offset of tensor 0 is -64", [torch.ones(10)], [-64])
    _refused("offset of tensor 0 is 1.5", [torch.ones(10)], [1.5])
    _refused("2 tensors but 1 offsets", [torch.ones(10), torch.ones(10)], [0])


def test_refuses_dtypes_and_devices():
    _refused(r"tensor 1 has dtype torch.int32", [torch.ones(10), torch.ones(10, dtype=torch.int32)], [0, 64])
    _refused(r"tensor 0 has dtype torch.float64", [torch.ones(10, dtype=torch.float64)], [0])
    _refused(r"out has dtype torch.int64", [torch.ones(10)], [0], out=torch.zeros(100, dtype=torch.int64))
    _refused(r"tensor 1 is on meta but out is on cpu", [torch.ones(10), torch.empty(10, device="meta")], [0, 64])
    _refused(r"tensor 0 is a list", [[1.0, 2.0]], [0])


def test_unpack_refuses_like_pack():
    flat = torch.zeros(100)
    with pytest.raises(ValueError, match=r"unpack: tensor 0 is not contiguous"):
        P.unpack(flat, [0], [torch.zeros(4, 5).t()])
    with pytest.raises(ValueError, match=r"unpack: tensor 0 runs past the end of flat"):
        P.unpack(flat, [64], [torch.zeros(40)])


def test_layout_helpers_name_the_tensor():
    layout = small_layer()
    params = {s.name: torch.zeros(s.shape) for s in layout.specs}
    out = torch.zeros(layout.numel)
    with pytest.raises(ValueError, match=r"params lack \['mlp.up_proj.weight'\]"):
        P.pack_layout(layout, {k: v for k, v in params.items() if k != "mlp.up_proj.weight"}, out)
    with pytest.raises(ValueError, match=r"tensor 4 \('mlp.gate_proj.weight'\) has shape \(3,\)"):
        P.pack_layout(layout, {**params, "mlp.gate_proj.weight": torch.zeros(3)}, out)
    with pytest.raises(ValueError, match=r"tensor 0 \('self_attn.q_proj.weight'\) is not contiguous"):
        P.pack_layout(layout, {**params, "self_attn.q_proj.weight": params["self_attn.q_proj.weight"].t()}, out)
    with pytest.raises(ValueError, match=r"tensor 11 \('self_attn.v_proj.bias'\) runs past the end of out"):
        P.pack_layout(layout, params, out[:layout.numel - 64])
    with pytest.raises(ValueError, match=r"params \['extra'\] are not in layout"):
        P.unpack_layout(layout, out, {**params, "extra": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------------------------
# GPU: a real qwen7b layer (needs TRITON_INTERPRET=0)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_qwen7b_layer(cuda, src_dtype):
    layout = qwen7b_layer()
    params = {s.name: torch.randn(s.shape, device=cuda, dtype=src_dtype) * 0.02 for s in layout.specs}
    tensors = [params[s.name] for s in layout.specs]
    for out_dtype in (torch.bfloat16, torch.float32):
        out = torch.full((layout.numel,), SENTINEL, dtype=out_dtype, device=cuda)
        norms = P.pack_layout(layout, params, out, compute_sq_norms=True)
        want = torch.full_like(out, SENTINEL)
        pack_reference(tensors, layout.offsets, want)
        assert torch.equal(bits(out), bits(want))  # the GPU rounds fp32 -> bf16 to nearest even, like torch
        torch.testing.assert_close(norms.double(), sq_norms_reference(tensors), rtol=2e-6, atol=0)
        again = P.pack_layout(layout, params, out, compute_sq_norms=True)
        assert torch.equal(bits(norms), bits(again))
        back = {k: torch.empty_like(v) for k, v in params.items()}
        P.unpack_layout(layout, out, back)
        ref = {k: torch.empty_like(v) for k, v in params.items()}
        unpack_reference(out, layout.offsets, [ref[s.name] for s in layout.specs])
        for k in params:
            assert torch.equal(bits(back[k]), bits(ref[k]))
    # the stream engine's mixture: bf16 matmul tensors, fp32 vectors, one launch
    mixed = {s.name: params[s.name].to(torch.bfloat16 if s.kind == "matmul" else torch.float32)
             for s in layout.specs}
    out = torch.zeros(layout.numel, device=cuda)
    norms = P.pack_layout(layout, mixed, out, compute_sq_norms=True)
    for s in layout.specs:
        assert torch.equal(layout.views(out)[s.name], mixed[s.name].float())
    torch.testing.assert_close(norms.double(), sq_norms_reference([mixed[s.name] for s in layout.specs]),
                               rtol=2e-6, atol=0)


@pytest.mark.gpu
def test_gpu_odd_sizes_and_unaligned(cuda):
    tensors = [values(s, DTYPES[k % 3], seed=80 + k, specials=True, device=cuda) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    for out_dtype in DTYPES:
        out = torch.full((total,), SENTINEL, dtype=out_dtype, device=cuda)
        P.pack(tensors, offsets, out)
        want = torch.full_like(out, SENTINEL)
        pack_reference(tensors, offsets, want)
        assert torch.equal(bits(out), bits(want))
    base = torch.randn(300001, device=cuda)
    tensors, offsets = [base[1:200000], base[200001:300001]], [5, 200013]
    out = torch.zeros(300100, device=cuda, dtype=torch.bfloat16)
    P.pack(tensors, offsets, out)
    want = torch.zeros_like(out)
    pack_reference(tensors, offsets, want)
    assert torch.equal(bits(out), bits(want))
