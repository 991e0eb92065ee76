"""streamtrain_kernels/tiles.py, the launch machinery of the flat-buffer kernels, through the op that uses all of it
(streamtrain_kernels/grad_accum.py's `accumulate`): the tensor table and its cache, the aligned and unaligned paths, the
launch configuration, the deterministic per-tensor norms and the argument checks. Also the helpers the other kernel
tests share (values, layouts, bit views).

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_tiles.py                 # CPU (interpreter)
    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_tiles.py          # GPU machine
"""

import math

import pytest
import torch

import streamtrain_kernels.grad_accum as G
import streamtrain_kernels.tiles as T
from streamtrain_kernels.reference import accumulate_reference, sq_norms_reference
from engine.model.layout import ALIGN_ELEMS, ParamSpec, UnitLayout

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


def n_blocks(numels, block):
    return sum(-(-n // block) for n in numels)


# ---------------------------------------------------------------------------------------------------------------
def test_one_launch_sized_by_the_total_over_mixed_dtypes(monkeypatch):
    tensors = [values(s, DTYPES[k % 3], seed=k) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    counter = CountingKernel(G._accumulate_kernel)
    monkeypatch.setattr(G, "_accumulate_kernel", counter)
    flat = torch.full((total,), SENTINEL)
    G.accumulate(flat, tensors, offsets, first=True)
    block, num_warps = T.launch_config(flat.device)
    assert (block, num_warps) == (T.BLOCK_INTERPRET, 1)
    assert counter.grids == [(n_blocks([t.numel() for t in tensors], block),)]
    for t, off in zip(tensors, offsets):
        assert torch.equal(bits(flat[off:off + t.numel()]), bits(t.reshape(-1).float()))


def test_launch_config_and_the_choice_of_kernel_or_torch():
    assert T.launch_config(torch.device("cuda")) == (T.BLOCK_GPU, T.NUM_WARPS_GPU)
    assert T.launch_config(torch.device("cpu")) == (T.BLOCK_INTERPRET, 1)
    assert T.uses_triton(torch.device("cpu")) == T.INTERPRETED
    if T.INTERPRETED:
        with pytest.raises(RuntimeError, match="CUDA tensors with TRITON_INTERPRET=1"):
            T.uses_triton(torch.device("cuda"))


def test_another_block_size_gets_its_own_table(monkeypatch):
    """The benchmarks' --sweep changes the block size at run time: grid and cached table must follow it."""
    tensors = [values(s, torch.bfloat16, seed=5 + k) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    flat = torch.zeros(total)
    G.accumulate(flat, tensors, offsets, first=True)
    counter = CountingKernel(G._accumulate_kernel)
    monkeypatch.setattr(G, "_accumulate_kernel", counter)
    monkeypatch.setattr(T, "BLOCK_INTERPRET", 1024)
    sq = torch.zeros(len(tensors))
    G.accumulate(flat, tensors, offsets, sq_norms_out=sq)
    assert counter.grids == [(n_blocks([t.numel() for t in tensors], 1024),)]
    for t, off in zip(tensors, offsets):
        assert torch.equal(flat[off:off + t.numel()], 2 * t.reshape(-1).float())
    views = [flat[off:off + t.numel()] for t, off in zip(tensors, offsets)]
    torch.testing.assert_close(sq.double(), sq_norms_reference(views), rtol=1e-6, atol=0)


def test_unaligned_tensors_take_the_unhinted_path():
    base = values((30000,), torch.float32, seed=50)
    tensors = [base[1:20000], base[20001:29999]]  # contiguous views 4 bytes past an aligned address
    offsets = [3, 20005]  # not multiples of 8 elements
    flat = torch.full((30100,), SENTINEL)
    block, _ = T.launch_config(flat.device)
    assert not T.tensor_table(tensors, offsets, flat, block).aligned
    want = flat.clone()
    sq, sq_want = torch.zeros(2), torch.zeros(2)
    for first in (True, False):
        G.accumulate(flat, tensors, offsets, first=first, sq_norms_out=sq)
        accumulate_reference(want, tensors, offsets, first=first, sq_norms_out=sq_want)
        assert torch.equal(bits(flat), bits(want))  # padding included
        torch.testing.assert_close(sq, sq_want, rtol=1e-6, atol=0)


def test_alignment_of_the_flat_buffer_is_not_cached():
    tensors = [values((20000,), torch.float32, seed=55)]
    block, _ = T.launch_config(torch.device("cpu"))
    aligned_flat = torch.zeros(20064)
    assert T.tensor_table(tensors, [0], aligned_flat, block).aligned
    assert not T.tensor_table(tensors, [0], aligned_flat[1:], block).aligned
    G.accumulate(aligned_flat[1:], tensors, [0], first=True)
    assert torch.equal(aligned_flat[1:20001], tensors[0])


def test_cached_table_sees_new_values():
    tensors = [values((3000,), torch.float32, seed=60), values((100,), torch.bfloat16, seed=61)]
    offsets, total = aligned_offsets([3000, 100])
    flat = torch.zeros(total)
    block, _ = T.launch_config(flat.device)
    assert T.tensor_table(tensors, offsets, flat, block) is T.tensor_table(tensors, offsets, flat, block)
    G.accumulate(flat, tensors, offsets, first=True)
    tensors[0].mul_(2)
    tensors[1].add_(1)
    G.accumulate(flat, tensors, offsets, first=True)  # same pointers: the cached table, current contents
    assert torch.equal(flat[:3000], tensors[0]) and torch.equal(flat[offsets[1]:offsets[1] + 100], tensors[1].float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sq_norms_deterministic_and_close_to_fp64(dtype):
    tensors = [values(s, dtype, seed=30 + k) for k, s in enumerate(ODD_SHAPES)]
    tensors.append(torch.empty(0, dtype=dtype))
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    flat = torch.empty(total)
    sq = torch.full((len(tensors),), -1.0)
    G.accumulate(flat, tensors, offsets, first=True, sq_norms_out=sq)
    torch.testing.assert_close(sq.double(), sq_norms_reference(tensors), rtol=1e-6, atol=0)
    assert sq[1] == tensors[1].float().square().item()  # one element: exact
    assert sq[-1] == 0
    again = torch.full_like(sq, -1.0)
    G.accumulate(flat, tensors, offsets, first=True, sq_norms_out=again)
    assert torch.equal(bits(sq), bits(again))


# ---------------------------------------------------------------------------------------------------------------
# refused arguments: ValueError naming the tensor and the problem, nothing written
# ---------------------------------------------------------------------------------------------------------------
def _refused(match, grads, offsets, flat=None):
    flat = torch.full((1000,), SENTINEL) if flat is None else flat
    before = flat.clone() if isinstance(flat, torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        G.accumulate(flat, grads, offsets)
    if before is not None:
        assert torch.equal(bits(flat), bits(before))


def test_refuses_non_contiguous():
    good = torch.ones(10)
    _refused(r"accumulate: tensor 1 is not contiguous \(shape \(4, 5\), stride \(1, 4\)\)",
             [good, torch.ones(5, 4).t()], [0, 64])
    _refused("flat_fp32 must be 1-D and contiguous", [good], [0], flat=torch.zeros(2000)[::2])
    _refused("flat_fp32 must be 1-D and contiguous", [good], [0], flat=torch.zeros(10, 100))
    _refused("flat_fp32 must be a torch.Tensor, got list", [good], [0], flat=[0.0] * 100)


def test_refuses_overlap_and_out_of_range():
    _refused(r"accumulate: tensor 1 at \[64, 164\) overlaps tensor 0 at \[0, 100\) in flat_fp32",
             [torch.ones(100), torch.ones(100)], [0, 64])
    _refused(r"tensor 2 runs past the end of flat_fp32: offset 960 \+ 50 elements = 1010 > 1000",
             [torch.ones(10), torch.ones(10), torch.ones(50)], [0, 64, 960])
    _refused("offset of tensor 0 is -64", [torch.ones(10)], [-64])
    _refused("offset of tensor 0 is 1.5", [torch.ones(10)], [1.5])
    _refused("2 tensors but 1 offsets", [torch.ones(10), torch.ones(10)], [0])


def test_refuses_dtypes_and_devices():
    _refused(r"tensor 1 has dtype torch.int32", [torch.ones(10), torch.ones(10, dtype=torch.int32)], [0, 64])
    _refused(r"tensor 0 has dtype torch.float64", [torch.ones(10, dtype=torch.float64)], [0])
    _refused(r"flat_fp32 has dtype torch.int64", [torch.ones(10)], [0], flat=torch.zeros(100, dtype=torch.int64))
    _refused(r"tensor 1 is on meta but flat_fp32 is on cpu", [torch.ones(10), torch.empty(10, device="meta")],
             [0, 64])
    _refused(r"tensor 0 is a list", [[1.0, 2.0]], [0])


def test_layout_labels_name_the_tensor():
    layout = small_layer()
    grads = {s.name: torch.zeros(s.shape) for s in layout.specs}
    flat = torch.zeros(layout.numel)
    with pytest.raises(ValueError, match=r"tensor 0 \('self_attn.q_proj.weight'\) is not contiguous"):
        G.accumulate_layout(layout, flat, {**grads, "self_attn.q_proj.weight": grads["self_attn.q_proj.weight"].t()})
    with pytest.raises(ValueError, match=r"tensor 11 \('self_attn.v_proj.bias'\) runs past the end of flat_fp32"):
        G.accumulate_layout(layout, flat[:layout.numel - 64], grads)


# ---------------------------------------------------------------------------------------------------------------
# GPU (needs TRITON_INTERPRET=0)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_odd_sizes_and_unaligned(cuda):
    tensors = [values(s, DTYPES[k % 3], seed=80 + k, device=cuda) for k, s in enumerate(ODD_SHAPES)]
    offsets, total = aligned_offsets([t.numel() for t in tensors])
    base = torch.randn(300001, device=cuda)
    cases = [(tensors, offsets, torch.full((total,), SENTINEL, device=cuda)),
             ([base[1:200000], base[200001:300001]], [5, 200013], torch.full((300100,), SENTINEL, device=cuda))]
    for grads, offs, flat in cases:
        block, _ = T.launch_config(flat.device)
        assert T.tensor_table(grads, offs, flat, block).aligned == (grads is tensors)
        want = flat.clone()
        sq, sq_want = torch.zeros(len(grads), device=cuda), torch.zeros(len(grads), device=cuda)
        for first in (True, False):
            G.accumulate(flat, grads, offs, first=first, sq_norms_out=sq)
            accumulate_reference(want, grads, offs, first=first, sq_norms_out=sq_want)
            assert torch.equal(bits(flat), bits(want))
            torch.testing.assert_close(sq, sq_want, rtol=2e-6, atol=0)
