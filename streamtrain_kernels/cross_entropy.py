"""Fused LM head + cross-entropy, forward and backward in one pass per token chunk.

    loss = fused_linear_cross_entropy(h_ND, weight_VD, labels_N, scale=1 / n_tokens)
    loss.backward()          # h_ND.grad [N, D], weight_VD.grad [V, D], in the inputs' dtype

loss = scale * sum_i CE(h_i @ W^T, label_i), a 0-dim fp32 tensor; tokens labelled `ignore_index` add 0.

Why. The unfused head (engine/model/dense.py `loss_sum`) splits the tokens into chunks, and for each chunk builds
the logits z = h W^T, takes F.cross_entropy(z.float()), and under activation checkpointing recomputes z in the
backward: 4 matmuls of 2*N*D*V flops each, plus an fp32 copy of every logit, its log-softmax and its gradient.
Here each chunk is finished in the forward: its logits become their own gradient in place, are multiplied into
dh and dW at once, and are dropped. The backward only multiplies the stored dh and dW by the incoming gradient.
Three matmuls instead of four, and the N x V logits never exist: working memory is one chunk of logits.

Per chunk of C = chunk_tokens rows (torch matmuls, cuBLAS on the GPU, in the compute dtype):
    z_CV  = h_CD @ W^T                              (C x V, compute dtype: the same logits F.linear gives)
    loss_C, z_CV <- Triton kernel, one program per row, everything in fp32:
             lse = log sum_v exp(z_v);  loss = lse - z[label];  z <- scale * (softmax(z) - onehot(label))
             rounded to the compute dtype (rows with label == ignore_index: loss 0, gradient 0)
    dh_CD  = dz_CV @ W                              (compute dtype, written into the saved N x D buffer)
    dW_VD += dz_CV^T @ h_CD                         (fp32 buffer over all chunks; on CUDA one cuBLAS call with
                                                     fp32 output, `out_dtype`, so no V x D temporary)
The kernel reads each row twice and writes it once: pass 1 keeps a running max and a rescaled sum of exponents
per lane of a BLOCK-wide slice, loops over V in BLOCK steps (masked tail), and combines the lanes at the end;
pass 2 turns the row into the gradient. BLOCK is a power of two no larger than V, so the first block of a row is
full and every lane's running max is finite after one step (no -inf - -inf = NaN to guard against).

Costs (Qwen2.5-7B head, V = 152064, D = 3584, bf16, per token): 3 matmuls = 6*D*V = 3.3 GFLOP (the checkpointed
unfused chain: 8*D*V), and the kernel moves 6 bytes per logit (read, read, write) against the unfused chain's
~30 (bf16 logits, fp32 copy, fp32 log-softmax, fp32 and bf16 gradients, each written and read). Measured on an
H200 (torch 2.11, triton 3.6; bench/bench_cross_entropy.py), one default chunk of 882 tokens: logits 1.34 ms,
kernel 0.23 ms, dh 1.29 ms, dW update 2.3 ms: the fp32 dW is read and written whole per chunk (4.4 GB), so that
GEMM is memory-bound at this chunk size. fwd+bwd at N = 8192: 51 ms (525 TFLOP/s of the 3 matmuls) against 83 ms
for the checkpointed chunked chain and 52 ms / 13.9 GiB for torch on the full logits; chunk_tokens = 3528
(4 x the default, 1 GiB of logits) gives 44 ms.

Memory, beyond inputs: one logits chunk (C x V, compute dtype), the saved dh (N x D, compute dtype) and dW (V x D,
fp32), and fp32 per-token losses (N); the backward adds dW in the weight's dtype while the fp32 buffer is alive.
Default C: the largest number of rows with C * V <= 2**27 elements (256 MiB of bf16 logits; 882 rows at V=152064),
like the unfused chain's LOSS_CHUNK_ELEMS.

Numerics. Forward logits come from the matmul F.linear runs (in the benchmark the fused and full-logits torch
losses agree to within 1e-6, the order of summation); loss and gradient are fp32 math on them, like
F.cross_entropy(z.float()); the gradient is rounded once to the compute dtype before its matmuls (as autograd's
cast back from z.float() does). dW accumulates in fp32 across chunks (the unfused chain sums chunk gradients in
the weight's dtype). backward() multiplies by grad_output without a host-side test for 1.0 (reading the value
would sync the device): a small Triton kernel reads the factor from device memory and computes dh * g in place
and dW * g fused into dW's cast to the weight's dtype, in fp32, rounded once (torch's CUDA `bf16.mul_(fp32
0-dim)` would round g to bf16 first). x * 1.0 is exact, so a plain loss.backward() gets exactly the forward's
gradients; the multiply costs nothing over the cast dW needs anyway (0.75 ms for the 7B head's dW on an H200),
plus one pass over dh (0.12 ms at N = 32K). Not twice differentiable.

Labels: int64 [N]. A label outside [0, V) that is not ignore_index makes that token's loss NaN (and so the total),
without a host-side check that would sync the device; its gradient row is then scale * softmax(z).

Interpreter (TRITON_INTERPRET=1, CPU tests): loads are upcast to fp32 at once, one small BLOCK (256) so that
test-sized vocabularies loop over several blocks, and its fp32 -> bf16 stores truncate (the GPU rounds to
nearest). On a CPU without the interpreter the per-chunk softmax step is the torch reference
(streamtrain_kernels/reference.py `cross_entropy_grad_reference`). Autocast is disabled inside: the matmuls run in
the dtype of the given tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK_ELEMS = 1 << 27  # logits elements per chunk for the default chunk_tokens
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch config of the row kernel: fixed (one row per program, memory-bound). GPU: 8192 columns per step, 16 warps
# (16 fp32 elements per thread for each of z, running max, running sum): 0.22 ms per 882 x 152064 bf16 chunk on an
# H200, 3.6 TB/s of reads and writes (bench/bench_cross_entropy.py --sweep; 8 warps: 0.27 ms, 4096 x 8: 0.23 ms).
# Interpreter: small blocks, see above.
BLOCK_GPU = 8192
NUM_WARPS_GPU = 16
BLOCK_INTERPRET = 256
SCALE_BLOCK_GPU = 4096  # elements per program of backward()'s scale-and-cast kernel
SCALE_BLOCK_INTERPRET = 1 << 16

__all__ = ["FusedLinearCrossEntropy", "default_chunk_tokens", "fused_linear_cross_entropy", "softmax_ce_grad_"]


@triton.jit
def _softmax_ce_grad_kernel(z_ptr, stride_row, labels_ptr, loss_ptr, V, scale, ignore_index,
                            BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr):
    """One row of logits z: loss_ptr[row] = lse - z[label]; with WITH_GRAD, z <- scale * (softmax(z) - onehot)."""
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_row
    label = tl.load(labels_ptr + row)
    cols0 = tl.arange(0, BLOCK)

    # pass 1: per-lane running max and sum of exp(z - max); BLOCK <= V makes the first block full
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    s_lane = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, z)
        s_lane = s_lane * tl.exp(m_lane - m_new) + tl.exp(z - m_new)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    lse = m + tl.log(tl.sum(s_lane * tl.exp(m_lane - m), axis=0))

    valid = label != ignore_index
    in_range = (label >= 0) & (label < V)
    z_label = tl.load(z_row + tl.where(in_range, label, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - z_label, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))

    if WITH_GRAD:  # pass 2: the row becomes its gradient (all zeros for an ignored row)
        row_scale = tl.where(valid, scale, 0.0)
        for start in range(0, V, BLOCK):
            cols = start + cols0
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            g = tl.where(cols == label, p - 1.0, p) * row_scale
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, g_ptr, numel, BLOCK: tl.constexpr):
    """dst = src * g[0] in fp32, stored in dst's dtype (dst may be src)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (x * tl.load(g_ptr)).to(dst_ptr.dtype.element_ty), mask=mask)


def _block(V: int, device: torch.device) -> int:
    cap = BLOCK_GPU if device.type == "cuda" else BLOCK_INTERPRET
    return min(cap, 1 << (V.bit_length() - 1))  # largest power of two <= V, capped


def softmax_ce_grad_(z_CV: torch.Tensor, labels_C: torch.Tensor, loss_C: torch.Tensor, scale: float,
                     ignore_index: int = -100, with_grad: bool = True) -> None:
    """Per-row cross-entropy of logits z_CV (C x V, last dim contiguous) against labels_C (int64), in fp32, written
    to loss_C (fp32 [C], contiguous; 0 for ignored rows). With `with_grad`, overwrites z_CV in place with
    scale * (softmax(z) - onehot(label)) rounded to z's dtype (0 rows where label == ignore_index)."""
    C, V = z_CV.shape
    if C == 0:
        return
    if z_CV.device.type != "cuda" and not INTERPRET:
        from streamtrain_kernels.reference import cross_entropy_grad_reference
        loss_C.copy_(cross_entropy_grad_reference(z_CV, labels_C, scale, ignore_index, with_grad))
        return
    num_warps = NUM_WARPS_GPU if z_CV.device.type == "cuda" else 1
    _softmax_ce_grad_kernel[(C,)](z_CV, z_CV.stride(0), labels_C, loss_C, V, float(scale), int(ignore_index),
                                  BLOCK=_block(V, z_CV.device), WITH_GRAD=bool(with_grad), num_warps=num_warps)


def default_chunk_tokens(vocab: int) -> int:
    """The largest number of tokens whose logits fit CHUNK_ELEMS elements (at least 1)."""
    return max(1, CHUNK_ELEMS // vocab)


def _accumulate_dW(dW_VD: torch.Tensor, dz_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """dW_VD (fp32) += dz_CV^T @ h_CD."""
    if dz_CV.dtype == torch.float32:
        dW_VD.addmm_(dz_CV.t(), h_CD)
    elif dz_CV.is_cuda:  # bf16/fp16 operands, fp32 accumulation and output in one cuBLAS call
        torch.addmm(dW_VD, dz_CV.t(), h_CD, out_dtype=torch.float32, out=dW_VD)
    else:  # CPU has no mixed-dtype addmm: round the chunk's product to the compute dtype, add in fp32
        dW_VD.add_(dz_CV.t() @ h_CD)


def _forward(h_ND, weight_VD, labels_N, scale, chunk_tokens, ignore_index, need_dh, need_dW):
    """(loss fp32 0-dim, dh_ND or None, dW_VD fp32 or None), chunk by chunk."""
    N, D = h_ND.shape
    V = weight_VD.shape[0]
    with_grad = need_dh or need_dW
    dh_ND = torch.empty_like(h_ND, memory_format=torch.contiguous_format) if need_dh else None
    dW_VD = torch.zeros(V, D, dtype=torch.float32, device=h_ND.device) if need_dW else None
    loss_N = torch.empty(N, dtype=torch.float32, device=h_ND.device)
    z_buf = torch.empty(min(chunk_tokens, N), V, dtype=h_ND.dtype, device=h_ND.device)
    for start in range(0, N, chunk_tokens):
        end = min(start + chunk_tokens, N)
        h_CD = h_ND[start:end]
        z_CV = z_buf[:end - start]
        torch.mm(h_CD, weight_VD.t(), out=z_CV)
        softmax_ce_grad_(z_CV, labels_N[start:end], loss_N[start:end], scale, ignore_index, with_grad)
        if need_dh:
            torch.mm(z_CV, weight_VD, out=dh_ND[start:end])
        if need_dW:
            _accumulate_dW(dW_VD, z_CV, h_CD)
    return loss_N.sum() * scale, dh_ND, dW_VD


def _scale_into(src: torch.Tensor, grad_loss: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst = src * grad_loss (0-dim fp32 on the device, never read on the host), computed in fp32 and rounded once
    to dst's dtype; src and dst contiguous, of one shape, the same tensor or not overlapping."""
    if not src.is_cuda and not INTERPRET:
        return dst.copy_(src.float() * grad_loss)
    numel = src.numel()
    block = SCALE_BLOCK_GPU if src.is_cuda else SCALE_BLOCK_INTERPRET
    if numel:
        _scale_cast_kernel[(triton.cdiv(numel, block),)](src, dst, grad_loss, numel, BLOCK=block,
                                                         num_warps=8 if src.is_cuda else 1)
    return dst


class FusedLinearCrossEntropy(torch.autograd.Function):
    """(h_ND, weight_VD, labels_N, scale, chunk_tokens, ignore_index) -> loss; gradients computed in forward."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N, scale, chunk_tokens, ignore_index):
        need_dh, need_dW = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dh_ND, dW_VD = _forward(h_ND, weight_VD, labels_N, scale, chunk_tokens, ignore_index,
                                      need_dh, need_dW)
        ctx.save_for_backward(dh_ND, dW_VD)
        ctx.weight_dtype = weight_VD.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dh_ND, dW_VD = ctx.saved_tensors
        grad_loss = grad_loss.float().contiguous()
        if dh_ND is not None:
            dh_ND = _scale_into(dh_ND, grad_loss, dh_ND)
        if dW_VD is not None:
            out = dW_VD if ctx.weight_dtype == torch.float32 else torch.empty_like(dW_VD, dtype=ctx.weight_dtype)
            dW_VD = _scale_into(dW_VD, grad_loss, out)
        return dh_ND, dW_VD, None, None, None, None


def _check(h_ND, weight_VD, labels_N, chunk_tokens) -> None:
    for name, t in (("h_ND", h_ND), ("weight_VD", weight_VD), ("labels_N", labels_N)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_linear_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: h_ND must be [N, D] and weight_VD [V, D] with the same D; got "
                         f"{tuple(h_ND.shape)} and {tuple(weight_VD.shape)}")
    if weight_VD.shape[0] == 0:
        raise ValueError("fused_linear_cross_entropy: weight_VD has an empty vocabulary (V = 0)")
    if h_ND.dtype != weight_VD.dtype or h_ND.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"fused_linear_cross_entropy: h_ND and weight_VD must share one dtype among bf16 / fp16 / "
                         f"fp32 (the compute dtype); got {h_ND.dtype} and {weight_VD.dtype}")
    if labels_N.dtype != torch.int64 or labels_N.shape != (h_ND.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: labels_N must be int64 [N] = [{h_ND.shape[0]}]; got "
                         f"{labels_N.dtype} {tuple(labels_N.shape)}")
    if not (h_ND.device == weight_VD.device == labels_N.device):
        raise ValueError(f"fused_linear_cross_entropy: h_ND, weight_VD, labels_N must be on one device; got "
                         f"{h_ND.device}, {weight_VD.device}, {labels_N.device}")
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")


def fused_linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor,
                               scale: float = 1.0, chunk_tokens: int | None = None,
                               ignore_index: int = -100) -> torch.Tensor:
    """scale * sum over tokens of cross_entropy(h_ND @ weight_VD^T, labels_N): 0-dim fp32, differentiable in h_ND
    and weight_VD (computed in their dtype, autocast off). Works chunk_tokens rows at a time (default: the most
    with chunk_tokens * V <= 2**27); tokens with label == ignore_index contribute 0. Raises ValueError on a bad
    argument (shapes, mixed or unsupported dtypes, non-int64 labels, devices, chunk_tokens < 1), TypeError on a
    non-tensor."""
    _check(h_ND, weight_VD, labels_N, chunk_tokens)
    chunk_tokens = default_chunk_tokens(weight_VD.shape[0]) if chunk_tokens is None else int(chunk_tokens)
    labels_N = labels_N.contiguous()
    with torch.autocast(device_type=h_ND.device.type, enabled=False):
        if torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad):
            return FusedLinearCrossEntropy.apply(h_ND, weight_VD, labels_N, float(scale), chunk_tokens,
                                                 int(ignore_index))
        return _forward(h_ND, weight_VD, labels_N, float(scale), chunk_tokens, int(ignore_index), False, False)[0]
