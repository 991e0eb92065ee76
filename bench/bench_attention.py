"""Attention kernel benchmark: streamtrain_kernels/attention.py against torch SDPA's backends, fwd and fwd+bwd, one GPU.

    python -m bench.bench_attention --out bench/results/attention.jsonl
    python -m bench.bench_attention --seq-lens 8192 32768 --cases qwen7b      # a subset
    python -m bench.bench_attention --sdpa-backends cudnn default --seq-lens 32768 524288
    python -m bench.bench_attention --docs --doc-lens 512 2048 8192 --seq-lens 32768   # packed vs per-document

Cases (B = 1, bf16, causal):
  qwen7b   Hq=28, Hkv=4, D=128 (Qwen2.5-7B)                       kernel and SDPA (each of --sdpa-backends)
  gptoss   Hq=64, Hkv=8, D=64, window=128, sinks (gpt-oss sliding)  kernel only: SDPA has neither
at T = 8K, 32K, 128K, 512K.

SDPA backends: `flash` (FlashAttention-2), `cudnn` (cuDNN's fused attention), `efficient` (memory-efficient), each
pinned with torch.nn.attention.sdpa_kernel, and `default`, pinned to none: what the engine's `train.attention=sdpa`
runs; `sdpa_default_choice` names the backend torch's dispatch picks for these inputs. On Hopper the default is not
the flash backend, and the two differ by ~1.7x: a comparison against one is not one against the other. GQA runs
natively (enable_gqa) where the backend takes it, else with K/V repeated (the note says which).

Timing: one fwd+bwd step = out = attn(q, k, v); torch.autograd.grad(out, (q, k, v), dO) (no grad accumulation).
Median of triton.testing.do_bench (25 ms warmup, 200 ms of reps, L2 flushed) up to 32K; above that one step takes
0.1-20 s, so a plain CUDA-event loop: 1 warmup + 3 timed steps at 128K, 1 warmup + 1 timed step at 512K, median.
The first call of each kernel key autotunes (and compiles, ~1-2 min in all on a fresh machine) before timing.

FLOPs (the flash-attn convention): forward = 2 matmuls (QK^T and PV) of 2*D flops per attended (query, key) pair
per head: 4 * B * Hq * D * pairs, pairs = T*T/2 causal (T*T full, T*W - W*(W-1)/2 for a causal window W);
backward = 2.5 x forward (5 matmuls); fwd+bwd = 3.5 x forward. The kernel's deterministic backward actually runs
7 matmuls (dQ recomputes QK^T and dO V^T), which the convention does not credit.

Peak memory: torch.cuda.max_memory_allocated over one step, inputs and dO included (what a training step holds
for this op), in GiB; measured on an extra untimed step up to 32K (do_bench's flush buffer stays out of it) and
over the timed steps above. SDPA rows that run out of memory keep sdpa_* null and say so in `sdpa_note`.

Rows (JSONL): bench case seq_len heads head_dim kernel_ms kernel_fwd_ms kernel_tflops kernel_fwd_tflops
kernel_peak_gib, per SDPA backend b: sdpa_b_ms sdpa_b_fwd_ms sdpa_b_tflops sdpa_b_fwd_tflops sdpa_b_peak_gib
sdpa_b_note ratio_b, sdpa_default_choice, gpu torch triton git_sha date (+ batch kv_heads window sinks flops).
ratio_b = sdpa_b_ms / kernel_ms (> 1: the kernel is faster). Forward-only timings run under no_grad, as the
engine's forward and recompute do. Rows before 2026-12-07 have one SDPA backend, flash, in sdpa_ms / sdpa_tflops /
ratio. Total runtime on an H100, all backends to 128K: a few minutes; 512K adds about a minute per backend.

--docs (packed rows, bench "attention_docs"): a row of T tokens packed from documents of length L (`--doc-lens`;
the last one takes the remainder), the same cases and the same fwd+bwd timing as above, three ways:
  packed_ms     one call with doc_start (engine/batch.py's doc_start_BT): what the engine runs for packed rows
  per_doc_ms    one call per document on its own leaves (q, k, v split beforehand, so no slicing in the timing)
  full_ms       one causal call over the whole row, documents ignored (the cost packing without masks would pay)
speedup = per_doc_ms / packed_ms (> 1: packing is faster); tflops credit only the per-document causal work
(flops = sum over documents). max_err_out: max |packed - per-document| of the outputs (the same math, blocks
aligned differently: bf16 rounding only).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import time
from pathlib import Path

from bench.kernel_bench import event_median_ms

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "qwen7b": dict(heads=28, kv_heads=4, head_dim=128, window=None, sinks=False, sdpa=True),
    "gptoss": dict(heads=64, kv_heads=8, head_dim=64, window=128, sinks=True, sdpa=False),
}
SEQ_LENS = [8192, 32768, 131072, 524288]


def fwd_flops(B, H, T, D, window=None, causal=True):
    if window is not None:
        W = min(window, T)
        pairs = T * W - W * (W - 1) / 2
    else:
        pairs = T * T / 2 if causal else T * T
    return 4.0 * B * H * D * pairs


def _step_fn(attn, q, k, v, do):
    import torch

    def step():
        out = attn(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)
    return step


def _time_ms(step, T):
    import triton

    if T <= 32768:
        return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    # one untimed step even at 512K: a new length can compile new kernel variants (strides past 2**31 elements
    # specialise differently), which once took 4.4 s of a 0.04 s windowed step
    warmup, reps = (1, 3) if T <= 131072 else (1, 1)
    for _ in range(warmup):
        step()
    return event_median_ms(step, reps)


def _measure(step, T):
    """(ms, peak GiB) of one fwd+bwd step."""
    import torch

    torch.cuda.synchronize()
    if T <= 32768:
        step()  # first call: autotune / compile, and the peak of a plain step
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = _time_ms(step, T)
    else:
        torch.cuda.reset_peak_memory_stats()
        ms = _time_ms(step, T)
        peak = torch.cuda.max_memory_allocated()
    return ms, peak / 2**30


def _doc_lengths(T, L):
    n, rest = divmod(T, L)
    return [L] * n + ([rest] if rest else [])


def run_docs_case(name, T, L, meta):
    """Packed row of documents of length L: one doc_start call vs one call per document vs plain causal."""
    import torch

    from streamtrain_kernels.attention import flash_attention

    c = CASES[name]
    B, H, Hkv, D = 1, c["heads"], c["kv_heads"], c["head_dim"]
    lens = _doc_lengths(T, L)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    doc_start = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, n in zip(starts, lens)]).view(1, T).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    def mk(h, grad=False):
        return torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)
    q, k, v = (mk(h, grad=True) for h in (H, Hkv, Hkv))
    do = mk(H)
    sinks = torch.randn(H, device="cuda", generator=g).requires_grad_() if c["sinks"] else None
    flops = 3.5 * sum(fwd_flops(B, H, n, D, c["window"]) for n in lens)
    row = dict(bench="attention_docs", case=name, seq_len=T, doc_len=L, n_docs=len(lens), batch=B, heads=H,
               kv_heads=Hkv, head_dim=D, window=c["window"], sinks=c["sinks"], causal=True, dtype="bf16", flops=flops)

    def packed(q, k, v):
        return flash_attention(q, k, v, causal=True, window=c["window"], sinks=sinks, doc_start=doc_start)

    def full(q, k, v):
        return flash_attention(q, k, v, causal=True, window=c["window"], sinks=sinks)

    # per document: leaves of their own, so the timing holds the attention calls only
    pieces = [tuple(t[:, :, s:s + n].detach().contiguous().requires_grad_(t.requires_grad) for t in (q, k, v, do))
              for s, n in zip(starts, lens)]

    def per_doc_step():
        outs = [flash_attention(pq, pk, pv, causal=True, window=c["window"], sinks=sinks)
                for pq, pk, pv, _ in pieces]
        torch.autograd.grad(outs, [t for p in pieces for t in p[:3]], [p[3] for p in pieces])

    with torch.no_grad():
        ref = torch.cat([flash_attention(pq, pk, pv, causal=True, window=c["window"], sinks=sinks)
                         for pq, pk, pv, _ in pieces], dim=2)
        row["max_err_out"] = (packed(q, k, v).float() - ref.float()).abs().max().item()
    ref = None
    ms_p, peak_p = _measure(_step_fn(packed, q, k, v, do), T)
    ms_d, peak_d = _measure(per_doc_step, T)
    ms_f, _ = _measure(_step_fn(full, q, k, v, do), T)
    row.update(packed_ms=ms_p, per_doc_ms=ms_d, full_ms=ms_f, speedup=ms_d / ms_p,
               packed_tflops=flops / ms_p / 1e9, per_doc_tflops=flops / ms_d / 1e9,
               packed_peak_gib=peak_p, per_doc_peak_gib=peak_d)
    row.update(meta, date=dt.datetime.now().isoformat(timespec="seconds"))
    q = k = v = do = pieces = None
    torch.cuda.empty_cache()
    return row


SDPA_BACKENDS = ("flash", "cudnn", "efficient", "default")  # default: no backend pinned, as the engine calls SDPA


def _sdpa_attn(backend: str, gqa_native: bool, G: int):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(backend)

    def attn(q, k, v):
        with sdpa_kernel(pinned) if pinned is not None else contextlib.nullcontext():
            if gqa_native:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                                  is_causal=True)
    return attn


def _fwd_fn(attn, q, k, v):
    import torch

    def fwd():
        with torch.no_grad():
            attn(q, k, v)
    return fwd


def _default_choice(q, k, v) -> str:
    """The backend SDPA picks for these inputs when none is pinned (torch's own dispatch rule)."""
    import torch
    from torch.nn.attention import SDPBackend

    return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True)).name.lower()


def _sdpa_columns(backend, q, k, v, do, T, fwd_flops_, G):
    """sdpa_<backend>_{ms, fwd_ms, tflops, fwd_tflops, peak_gib, note} of one SDPA backend (ms None where it cannot
    run, with the reason in the note). GQA natively (enable_gqa) where the backend takes it, else K/V repeated."""
    import torch

    key = f"sdpa_{backend}"
    cols = {f"{key}_{c}": None for c in ("ms", "fwd_ms", "tflops", "fwd_tflops", "peak_gib")}
    try:
        native = True
        try:
            with torch.no_grad():
                _sdpa_attn(backend, True, G)(q[:, :, :128], k[:, :, :128], v[:, :, :128])
        except RuntimeError:
            native = False
        torch.cuda.empty_cache()
        attn = _sdpa_attn(backend, native, G)
        ms, peak = _measure(_step_fn(attn, q, k, v, do), T)
        fwd_ms = _time_ms(_fwd_fn(attn, q, k, v), T)
        cols.update({f"{key}_ms": ms, f"{key}_fwd_ms": fwd_ms, f"{key}_tflops": 3.5 * fwd_flops_ / ms / 1e9,
                     f"{key}_fwd_tflops": fwd_flops_ / fwd_ms / 1e9, f"{key}_peak_gib": peak})
        cols[f"{key}_note"] = "enable_gqa" if native else "K/V repeated (no native GQA)"
    except torch.cuda.OutOfMemoryError as e:
        cols[f"{key}_note"] = f"skipped: out of memory ({str(e).splitlines()[0][:120]})"
    except RuntimeError as e:
        cols[f"{key}_note"] = f"skipped: {str(e).splitlines()[0][:160]}"
    torch.cuda.empty_cache()
    return cols


def run_case(name, T, meta, layout="bhtd", sdpa_backends=("flash",)):
    import torch

    from streamtrain_kernels.attention import flash_attention

    c = CASES[name]
    B, H, Hkv, D = 1, c["heads"], c["kv_heads"], c["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(0)
    def mk(h, grad=False):
        if layout == "bhtd":
            return torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)
        # the layer's layout: [B, T, H, D] projections viewed as [B, H, T, D] (stride H*D along T)
        return torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad) \
            .transpose(1, 2)
    q, k, v = (mk(h, grad=True) for h in (H, Hkv, Hkv))
    do = mk(H)
    sinks = torch.randn(H, device="cuda", generator=g).requires_grad_() if c["sinks"] else None
    f1 = fwd_flops(B, H, T, D, c["window"])
    flops = 3.5 * f1
    row = dict(bench="attention", case=name, seq_len=T, batch=B, heads=H, kv_heads=Hkv, head_dim=D, layout=layout,
               window=c["window"], sinks=c["sinks"], causal=True, dtype="bf16", flops=flops)

    def kernel_attn(q, k, v):
        return flash_attention(q, k, v, causal=True, window=c["window"], sinks=sinks)

    ms, peak = _measure(_step_fn(kernel_attn, q, k, v, do), T)
    fwd_ms = _time_ms(_fwd_fn(kernel_attn, q, k, v), T)
    row.update(kernel_ms=ms, kernel_tflops=flops / ms / 1e9, kernel_peak_gib=peak, kernel_fwd_ms=fwd_ms,
               kernel_fwd_tflops=f1 / fwd_ms / 1e9)
    if not c["sdpa"]:
        row["sdpa_note"] = "not run: SDPA has no sliding window / sinks"
    else:
        row["sdpa_default_choice"] = _default_choice(q, k, v)
        for backend in sdpa_backends:
            row.update(_sdpa_columns(backend, q, k, v, do, T, f1, H // Hkv))
            if row[f"sdpa_{backend}_ms"] is not None:
                row[f"ratio_{backend}"] = row[f"sdpa_{backend}_ms"] / ms
    row.update(meta, date=dt.datetime.now().isoformat(timespec="seconds"))
    q = k = v = do = None
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention.jsonl"))
    ap.add_argument("--seq-lens", type=int, nargs="+", default=SEQ_LENS)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--layout", default="bhtd", choices=("bhtd", "bthd"),
                    help="inputs contiguous as [B, H, T, D], or [B, T, H, D] viewed as [B, H, T, D] (the layer's)")
    ap.add_argument("--sdpa-backends", nargs="+", default=list(SDPA_BACKENDS), choices=SDPA_BACKENDS,
                    help="SDPA backends to time beside the kernel (default: all; `default` pins none, as the "
                         "engine's sdpa attention runs)")
    ap.add_argument("--docs", action="store_true",
                    help="packed rows: one doc_start call vs one call per document vs plain causal (see --doc-lens)")
    ap.add_argument("--doc-lens", type=int, nargs="+", default=[512, 2048, 8192],
                    help="document lengths of the --docs rows (each row: documents of one length, last one shorter)")
    args = ap.parse_args(argv)
    if args.docs and min(args.doc_lens) < 1:
        ap.error("--doc-lens must be >= 1")

    import torch
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    import triton

    from engine.metrics import git_sha

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                git_sha=git_sha())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    if args.docs:
        return _main_docs(args, meta, out, t0)
    def f_(x, p=".1f"):
        return "-" if x is None else format(x, p)
    print(f"{'case':8s} {'T':>7s} {'kernel ms':>10s} {'fwd ms':>9s} {'TFLOP/s':>8s} "
          + " ".join(f"{b + ' ms':>12s} {'TFLOP/s':>8s}" for b in args.sdpa_backends) + "  default picks", flush=True)
    for name in args.cases:
        for T in sorted(args.seq_lens):
            row = run_case(name, T, meta, args.layout, args.sdpa_backends)
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name:8s} {T:7d} {f_(row['kernel_ms'], '.2f'):>10s} {f_(row['kernel_fwd_ms'], '.2f'):>9s} "
                  f"{f_(row['kernel_tflops'], '.0f'):>8s} "
                  + " ".join(f"{f_(row.get(f'sdpa_{b}_ms'), '.2f'):>12s} {f_(row.get(f'sdpa_{b}_tflops'), '.0f'):>8s}"
                             for b in args.sdpa_backends)
                  + f"  {row.get('sdpa_default_choice', '-')}", flush=True)
    print(f"{len(rows)} rows -> {out}  ({time.time() - t0:.0f} s)")
    return 0


def _main_docs(args, meta, out, t0):
    rows = []
    print(f"{'case':8s} {'T':>7s} {'doc len':>7s} {'docs':>5s} {'packed ms':>10s} {'per-doc ms':>10s} "
          f"{'full ms':>9s} {'speedup':>7s} {'TFLOP/s':>8s} {'err':>8s}", flush=True)
    for name in args.cases:
        for T in sorted(args.seq_lens):
            for L in sorted(args.doc_lens):
                row = run_docs_case(name, T, L, meta)
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name:8s} {T:7d} {L:7d} {row['n_docs']:5d} {row['packed_ms']:10.3f} {row['per_doc_ms']:10.3f} "
                      f"{row['full_ms']:9.3f} {row['speedup']:7.2f} {row['packed_tflops']:8.0f} "
                      f"{row['max_err_out']:8.2g}", flush=True)
    print(f"{len(rows)} rows -> {out}  ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
