"""Engine benchmark: run a named grid of training jobs, one fresh process each, and write one JSONL row per job.

    python -m bench.bench_engine --grid stream7b --out bench/results/engine.jsonl

Each job is `python train.py <overrides> logger=none hydra.run.dir=<workdir>/<job>` (a job whose first override
is `nproc=N` runs under `torchrun --standalone --nproc_per_node=N` instead: data parallel over N GPUs); the row is
built from the run's summary.json and metrics.jsonl (medians over the steps after the first), so the figures are
exactly what a user's run reports. Rows carry the GPU, torch/triton versions, git sha, date and the overrides. A
job that fails (out of memory, a refused plan, its own time limit) still gets a row, with `error` and the tail of
its log, and so do the job running and those not yet run when the benchmark itself is stopped (SIGTERM from an
outer time limit): a grid never silently loses a configuration. Jobs of the same model and tokens per step get
`ratio_vs_reference` against the reference engine's row.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.report import run_row

ROOT = Path(__file__).resolve().parent.parent

SEQ = "train.seq_len=4096"
THROUGHPUT = ["train=bench", "data=stdlib"]

GRIDS = {
    # a few seconds per job: checks that every engine path runs on this machine
    "smoke": [
        ("tiny-reference", ["model=tiny", "engine=reference", "train.steps=4", "train.seq_len=512",
                            "train.micro_batch_size=4", "train.grad_accum=3"]),
        ("tiny-stream", ["model=tiny", "engine=stream", "train.steps=4", "train.seq_len=512",
                         "train.micro_batch_size=4", "train.grad_accum=3"]),
        ("qwen0_5b-stream-host", ["model=qwen0_5b", "engine=stream", *THROUGHPUT, "train.steps=3",
                                  "train.grad_accum=4", "engine.grads_tier=host", "engine.activation_tier=host",
                                  "engine.cache_weights=off"]),
    ],
    # the all-on-GPU baseline at the largest micro-batch that fits, seq 4096
    "reference": [
        ("qwen3b-reference-mb8", ["model=qwen3b", "engine=reference", *THROUGHPUT, SEQ, "train.steps=4",
                                  "train.micro_batch_size=8", "train.grad_accum=1"]),
        ("qwen7b-reference-mb2", ["model=qwen7b", "engine=reference", *THROUGHPUT, SEQ, "train.steps=4",
                                  "train.micro_batch_size=2", "train.grad_accum=1"]),
    ],
    # qwen7b streamed at 64K tokens per step, next to the reference at the same tokens per step
    "stream7b": [
        ("qwen7b-stream-64k", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=10",
                               "train.micro_batch_size=2", "train.grad_accum=8"]),
        ("qwen7b-reference-64k", ["model=qwen7b", "engine=reference", *THROUGHPUT, SEQ, "train.steps=4",
                                  "train.micro_batch_size=2", "train.grad_accum=8"]),
        ("qwen3b-stream-32k", ["model=qwen3b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                               "train.micro_batch_size=8", "train.grad_accum=1"]),
    ],
    # the planner's placement (GPU-updated leading units): at 64K tokens per step in eager templates with the Triton
    # gradient accumulation and with torch's, next to the compiled reference; at 16K compiled
    "perf7b": [
        ("qwen7b-stream-64k-auto", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                                    "train.micro_batch_size=2", "train.grad_accum=8", "train.compile=off"]),
        ("qwen7b-stream-64k-auto-torch-accum", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                                                "train.micro_batch_size=2", "train.grad_accum=8",
                                                "train.compile=off", "engine.fused_kernels=false"]),
        ("qwen7b-reference-64k-compiled", ["model=qwen7b", "engine=reference", *THROUGHPUT, SEQ, "train.steps=4",
                                           "train.micro_batch_size=2", "train.grad_accum=8"]),
        ("qwen7b-stream-16k-auto", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                                    "train.micro_batch_size=2", "train.grad_accum=2"]),
    ],
    # stream (the planner's three-place split) next to the compiled reference at 64K and 16K tokens per step
    "stream_vs_reference": [
        ("qwen7b-stream-64k", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                               "train.micro_batch_size=2", "train.grad_accum=8"]),
        ("qwen7b-reference-64k", ["model=qwen7b", "engine=reference", *THROUGHPUT, SEQ, "train.steps=4",
                                  "train.micro_batch_size=2", "train.grad_accum=8"]),
        ("qwen7b-stream-16k", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                               "train.micro_batch_size=2", "train.grad_accum=2"]),
        ("qwen7b-reference-16k", ["model=qwen7b", "engine=reference", *THROUGHPUT, SEQ, "train.steps=6",
                                  "train.micro_batch_size=2", "train.grad_accum=2"]),
    ],
    # qwen3b at 32K tokens per step, next to the peers measured in the same call (`--peers`)
    "compare3b": [
        ("qwen3b-stream-32k", ["model=qwen3b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                               "train.micro_batch_size=8", "train.grad_accum=1"]),
    ],
    # the planner on configurations the calibration (qwen7b layer, 2 x 4096, engine/calibrate.py) never saw: other
    # widths, eager templates, four sequences a micro-batch, a 24 GB cap (with compare3b's row, seven)
    "planner_unseen": [
        ("qwen3b-stream-32k", ["model=qwen3b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                               "train.micro_batch_size=8", "train.grad_accum=1"]),
        ("qwen3b-stream-64k-eager", ["model=qwen3b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                                     "train.micro_batch_size=4", "train.grad_accum=4", "train.compile=off"]),
        ("qwen7b-stream-16k-eager", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=5",
                                     "train.micro_batch_size=2", "train.grad_accum=2", "train.compile=off"]),
        ("qwen7b-stream-64k-mb4", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                                   "train.micro_batch_size=4", "train.grad_accum=4"]),
        ("qwen7b-stream-capped24gb-16k", ["model=qwen7b", "engine=stream", "hardware.gpu_mem_cap_gib=24", *THROUGHPUT,
                                          SEQ, "train.steps=5", "train.micro_batch_size=1", "train.grad_accum=4"]),
        ("qwen3b-stream-16k", ["model=qwen3b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                               "train.micro_batch_size=2", "train.grad_accum=2"]),
    ],
    # layers whose forward graph is kept (no recompute) at 64K tokens per step, next to the planner's default
    "kept_layers": [
        (f"qwen7b-stream-64k-kept{n}", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                                        "train.micro_batch_size=2", "train.grad_accum=8",
                                        f"engine.keep_activation_layers={n}"])
        for n in (1, 2, 4)
    ] + [
        ("qwen7b-stream-64k-mb4-kept2", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=4",
                                         "train.micro_batch_size=4", "train.grad_accum=4",
                                         "engine.keep_activation_layers=2"]),
    ],
    # the paths a full-GPU run never takes: a 24 GB cap, and gradients on the host with every unit updated by the host
    # AdamW (the last gradient D2H is still in flight when the step's timer is read)
    "capped_host_grads": [
        ("qwen7b-stream-capped24gb-16k", ["model=qwen7b", "engine=stream", "hardware.gpu_mem_cap_gib=24", *THROUGHPUT,
                                          SEQ, "train.steps=6", "train.micro_batch_size=1", "train.grad_accum=4"]),
        ("qwen3b-stream-hostgrads-hostadam-32k", ["model=qwen3b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                                                  "train.micro_batch_size=2", "train.grad_accum=4",
                                                  "engine.grads_tier=host", "engine.gpu_resident_units=0"]),
        ("qwen7b-stream-hostgrads-hostadam-16k", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                                                  "train.micro_batch_size=2", "train.grad_accum=2",
                                                  "engine.grads_tier=host", "engine.gpu_resident_units=0"]),
    ],
    # full-depth qwen14b and qwen32b in bf16 master + int8 moments + bf16 gradients (conf/experiment)
    "capacity_bf16_int8": [
        ("qwen14b-stream-64k-bf16-int8", ["experiment=bench_qwen14b_h200", "data=stdlib", "train.steps=5"]),
        ("qwen32b-stream-16k-bf16-int8", ["experiment=bench_qwen32b_h200", "data=stdlib", "train.steps=5"]),
    ],
    # qwen7b, one sequence per step, the Triton attention (train.attention=auto) and SDPA side by side
    "context_attention": [
        (f"qwen7b-stream-ctx{T // 1024}k{suffix}",
         ["model=qwen7b", "engine=stream", *THROUGHPUT, f"train.seq_len={T}", "model.max_position_embeddings=524288",
          "train.micro_batch_size=1", "train.grad_accum=1", f"train.steps={steps}", *extra])
        # 128K: the fp32 plan's host total is 123.8 of 125 GiB at the default budget; 118 leaves room for its error
        for T, steps, suffix, extra in [(32768, 4, "-triton", ["train.attention=triton"]),
                                        (131072, 3, "-triton", ["train.attention=triton", "hardware.host_mem_gib=118"]),
                                        (32768, 4, "-sdpa", ["train.attention=sdpa"]),
                                        (8192, 5, "-triton", ["train.attention=triton"])]
    ],
    # the context sweep's lengths (conf/sweep/context.yaml) from 4K to 256K, state formats and layer as the plan
    # chooses (train.*_dtype=auto, train.lean_layer=auto, train.attention=auto); 512K is `ctx512` (a step takes ~10
    # minutes: detached). The val split must hold a 256K window.
    "context_sweep": [
        (f"qwen7b-stream-sweep{T // 1024}k",
         ["model=qwen7b", "engine=stream", *THROUGHPUT, f"train.seq_len={T}", "model.max_position_embeddings=524288",
          "train.micro_batch_size=1", "train.grad_accum=1", f"train.steps={steps}", *extra])
        for T, steps, extra in [(4096, 4, []), (16384, 3, []), (32768, 3, []), (65536, 3, []), (131072, 2, []),
                                (262144, 2, ["data.val_fraction=0.06"])]
    ],
    # MoE through the streaming engine (conf/experiment): gpt-oss-120b at its width (4 of 36 layers),
    # gpt-oss-20b and Qwen3-30B-A3B at full depth; eager first (the compiled MoE layer is unmeasured on a GPU)
    "moe": [
        (f"{name}-stream-16k{suffix}", [f"experiment={experiment}", "data=stdlib", "train.steps=4", *extra])
        for name, experiment in [("gptoss120b-4l", "bench_gptoss120b_4l_h200"), ("gptoss20b", "bench_gptoss20b_h200"),
                                 ("qwen3-30b-a3b", "bench_qwen3_30b_a3b_h200")]
        for suffix, extra in [("-eager", ["train.compile=off"]), ("-compiled", ["train.compile=on"])]
    ],
    # gpt-oss-20b at full depth and 64K tokens a step (4 x 4096 x 4) on an 80 GB card: fits only with some held
    # bf16 gradients on the host (engine.host_grad_units, chosen by the planner); eager, then compiled
    "moe64k": [
        (f"gptoss20b-stream-64k-{mode}", ["experiment=bench_gptoss20b_h200", "data=stdlib", "train.steps=4",
                                          "train.micro_batch_size=4", "train.grad_accum=4", f"train.compile={flag}"])
        for mode, flag in [("eager", "off"), ("compiled", "on")]
    ],
    # gpt-oss-20b, compiled, at more tokens a step (4 x 4096 x 8 and x 12, and the count train.grad_accum=-1 takes):
    # the forward's stream of every unit's state then hides behind more compute; the planner puts layer inputs in
    # recompute groups and held gradients on the host to fit
    "moetokens": [
        (f"gptoss20b-stream-{name}-compiled", ["experiment=bench_gptoss20b_h200", "data=stdlib", "train.steps=4",
                                               "train.micro_batch_size=4", f"train.grad_accum={accum}",
                                               "train.compile=on"])
        for name, accum in (("128k", 8), ("192k", 12), ("auto", -1))
    ],
    # held gradients in int8 (1 B/param): Qwen3-30B-A3B at 64K tokens a step, which fits the H100 machine only so,
    # and gpt-oss-20b at 64K, whose held gradients then need no host tier
    "moeint8grads": [
        ("qwen3-30b-a3b-stream-64k-int8grads-compiled", ["experiment=bench_qwen3_30b_a3b_h100", "data=stdlib",
                                                         "train.steps=3"]),
        ("gptoss20b-stream-64k-int8grads-compiled", ["experiment=bench_gptoss20b_h100", "data=stdlib",
                                                     "train.steps=4", "train.grad_accum=4", "train.grad_dtype=int8"]),
    ],
    # the norm pass (engine.norm_pass=on: no gradient held, one more head and backward a step), measured beside the
    # hold it replaces: gpt-oss-20b at 64K tokens a step with int8 held gradients, then fp32 gradients and the norm
    # pass; and gpt-oss-120b at its published width (4 of 36 layers) with the norm pass on the 80 GB card, at the
    # 3 x 4096 tokens a step that its full depth fits with 512 GiB of host (4 x 4096 does not fit the GPU)
    "normpass": [
        ("gptoss20b-stream-64k-int8grads-compiled", ["experiment=bench_gptoss20b_h100", "data=stdlib",
                                                     "train.steps=4", "train.grad_accum=4", "train.grad_dtype=int8"]),
        ("gptoss20b-stream-64k-normpass-compiled", ["experiment=bench_gptoss20b_h100", "data=stdlib",
                                                    "train.steps=4", "train.grad_accum=4", "train.grad_dtype=fp32",
                                                    "engine.norm_pass=on"]),
        ("gptoss120b-4l-stream-16k-normpass-compiled", ["experiment=bench_gptoss120b_4l_h200", "hardware=h100",
                                                        "data=stdlib", "train.steps=4", "train.grad_dtype=fp32",
                                                        "train.grad_accum=3", "train.compile=on",
                                                        "engine.norm_pass=on"]),
    ],
    # qwen7b at 4K tokens a micro-batch, where the forward waits on the weight stream: one micro-batch a step, and the
    # count train.grad_accum=-1 chooses (the fewest whose forward hides the stream)
    "autotokens": [
        (f"qwen7b-stream-4k-ga{name}", ["model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.micro_batch_size=1",
                                        f"train.grad_accum={accum}", "train.steps=4"])
        for name, accum in (("1", 1), ("auto", -1))
    ],
    # gpt-oss-20b next to DeepSpeed ZeRO-3 offload measured in the same call (`--peers`): at its published width,
    # depth-truncated to the 3 of 24 layers whose DeepSpeed state a 128 GiB host holds (3.63B parameters, ~91 GiB by
    # DeepSpeed's 27 bytes a parameter; 4 layers would be ~112 GiB, full depth ~526 GiB), 64K tokens a step
    # (4 x 4096 x 4, as moe64k), compiled, the planner's state formats (fp32 here, as the peer's)
    "moepeer": [
        ("gptoss20b-3l-stream-64k", ["model=gptoss20b", "model.num_hidden_layers=3", "engine=stream", *THROUGHPUT, SEQ,
                                     "train.steps=4", "train.micro_batch_size=4", "train.grad_accum=4",
                                     "train.compile=on"]),
    ],
    # qwen14b in fp32 at full depth with the moments of 18 layers in the NVMe tier (/tmp on the device)
    "nvme_qwen14b": [
        ("qwen14b-stream-64k-fp32-nvme", ["experiment=bench_qwen14b_fp32_nvme_h200", "hardware.nvme_dir=/tmp/nvme",
                                          "data=stdlib", "train.steps=3"]),
    ],
    # the NVMe tier's cost on a model the host holds: qwen7b in fp32, the same run with the moments of 0
    # and of 4 host-updated layers on disk (fits an H100 as well as the H200)
    "nvme_vs_ram": [
        (f"qwen7b-stream-64k-nvme{n}", ["experiment=bench_qwen7b_stream_64k", "data=stdlib", "train.steps=6",
                                        "hardware.nvme_dir=/tmp/nvme", "hardware.nvme_gib=60",
                                        "hardware.nvme_gbps=2.0", f"engine.nvme_units={n}"])
        for n in (0, 4)
    ],
    # data parallel over 1, 2, 4, 8 GPUs of one host, 4 sequences of 4096 per GPU and step (weak scaling);
    # the fp32 state is sharded over the ranks (engine/distributed.py), each planning in 1/n of the host's RAM (the
    # machine's as measured, hardware.host_mem_gib=0)
    "data_parallel": [
        (f"qwen7b-stream-dp{n}", [f"nproc={n}", "model=qwen7b", "engine=stream", *THROUGHPUT, SEQ, "train.steps=6",
                                   "train.micro_batch_size=2", f"train.grad_accum={2 * n}",
                                   "hardware.host_mem_gib=0"])
        for n in (1, 2, 4, 8)
    ],
    # qwen7b streamed on a GPU capped at 24 GB (host RAM limits this one to 16K tokens per step)
    "rtx3090": [
        ("qwen7b-stream-rtx3090-16k", ["model=qwen7b", "engine=stream", "hardware=rtx3090", "hardware.other_card=true",
                                       *THROUGHPUT, SEQ,
                                       "train.steps=10", "train.micro_batch_size=1", "train.grad_accum=4"]),
    ],
}


class BenchStopped(Exception):
    """SIGTERM (an outer time limit) while a job ran: that job and the ones after it still get rows."""


def run_job(name: str, overrides: list, workdir: Path, timeout_s: int) -> dict:
    run_dir = workdir / name
    launch, ranks = [sys.executable, "train.py"], 1
    if overrides and overrides[0].startswith("nproc="):
        ranks = int(overrides[0].split("=", 1)[1])
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                  "train.py"]
        overrides = overrides[1:]
    cmd = [*launch, *overrides, "logger=none", f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    with open(workdir / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row = {"bench": "engine", "job": name, "overrides": overrides, "ranks": ranks,
           "wall_s": time.perf_counter() - start}
    summary_path = run_dir / "summary.json"
    if rc != 0 or not summary_path.exists():
        row["error"] = f"exit {rc}"
        row["log_tail"] = (workdir / f"{name}.log").read_text()[-3000:]
        return row
    row.update({k: v for k, v in run_row(run_dir).items() if k not in ("run_dir", "overrides")})
    return row


def add_ratios(rows: list, peer_rows: list = ()) -> None:
    """`ratio_vs_reference` against the reference engine's row of the same model, tokens per step and hardware;
    `scaling_vs_linear` of a data-parallel row against N times the one-rank row with its tokens per rank; and
    `ratio_vs_<system>` against each peer row (bench/peers/) of the same model, depth and tokens per step (a
    depth-truncated run is compared with the peer's run at that depth only); every row compared comes from the same
    call."""
    ref = {(r["model"], r["tokens_per_step"], r["hardware"]): r for r in rows
           if r.get("engine") == "reference" and r.get("tokens_per_s")}
    one_rank = {(r["model"], r["tokens_per_step"] // r.get("ranks", 1)): r for r in rows
                if r.get("ranks", 1) == 1 and r.get("tokens_per_s")}
    for r in rows:
        if not r.get("tokens_per_s"):
            continue
        single = one_rank.get((r.get("model"), r.get("tokens_per_step", 0) // r.get("ranks", 1)))
        if r.get("ranks", 1) > 1 and single is not None:  # weak scaling: the same tokens per rank and step
            r["scaling_vs_linear"] = r["tokens_per_s"] / (r["ranks"] * single["tokens_per_s"])
        base = ref.get((r.get("model"), r.get("tokens_per_step"), r.get("hardware")))
        if base is not None and r is not base:
            r["ratio_vs_reference"] = r["tokens_per_s"] / base["tokens_per_s"]
        for peer in peer_rows:
            if all(peer.get(k) == r.get(k) for k in ("model", "num_hidden_layers", "tokens_per_step")):
                key = f"ratio_vs_{peer['system']}"
                r[key] = r["tokens_per_s"] / peer["tokens_per_s"] if peer.get("tokens_per_s") else None
                if not peer.get("tokens_per_s"):
                    r[f"{key}_why"] = peer.get("error", "the peer row has no tokens_per_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", action="append", required=True, choices=sorted(GRIDS))
    ap.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    ap.add_argument("--workdir", default="runs/bench", help="where the jobs' run dirs and logs go")
    ap.add_argument("--timeout-s", type=int, default=900, help="per job")
    ap.add_argument("--only", action="append", help="run just the jobs whose name contains one of these")
    ap.add_argument("--peers", help="JSONL of bench/peers/ rows measured in this same call: adds ratio_vs_<system>")
    args = ap.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    from engine.metrics import run_environment

    meta = run_environment()
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.jsonl")  # rows as they finish, should the whole call be cut short
    jobs = [(grid, name, overrides) for grid in args.grid for name, overrides in GRIDS[grid]
            if not args.only or any(o in name for o in args.only)]

    def stop(signum, frame):
        raise BenchStopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    stopped = None
    for grid, name, overrides in jobs:
        if stopped is None:
            print(f"[bench] {grid}/{name}: {' '.join(overrides)}", flush=True)
            try:
                row = run_job(name, overrides, workdir, args.timeout_s)
            except (BenchStopped, KeyboardInterrupt) as e:
                stopped = str(e) or "SIGINT"
                row = {"bench": "engine", "job": name, "overrides": overrides,
                       "error": f"benchmark stopped ({stopped}) while this job ran"}
        else:
            row = {"bench": "engine", "job": name, "overrides": overrides,
                   "error": f"not run: the benchmark was stopped ({stopped}) before this job"}
        row = {**row, **meta, "grid": grid}
        rows.append(row)
        with open(partial, "a") as f:
            f.write(json.dumps(row) + "\n")
        status = row.get("error") or f"{row.get('tokens_per_s') or 0:,.0f} tok/s, {row.get('tflops') or 0:.1f} TFLOPS"
        print(f"[bench] {name}: {status}", flush=True)
    peer_rows = [json.loads(line) for line in Path(args.peers).read_text().splitlines() if line.strip()] \
        if args.peers and Path(args.peers).exists() else []
    add_ratios(rows, peer_rows)
    with open(out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'job':30} {'tok/s':>10} {'step s':>8} {'plan s':>7} {'TFLOPS':>8} {'MFU':>6} {'GPU GiB':>8} "
          f"{'plan':>6} {'host GiB':>9} {'plan':>6}  ratios")
    for r in rows:
        if r.get("error"):
            print(f"{r['job']:30} ERROR {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        ratios = " ".join(f"{k[len('ratio_vs_'):]} {v:.2f}" for k, v in r.items()
                          if k.startswith("ratio_vs_") and isinstance(v, float))

        def fmt(key, width, digits):
            return f"{r[key]:>{width}.{digits}f}" if isinstance(r.get(key), (int, float)) else f"{'-':>{width}}"

        print(f"{r['job']:30} {r['tokens_per_s']:>10,.0f} {fmt('step_s', 8, 2)} {fmt('plan_step_s', 7, 2)} "
              f"{fmt('tflops', 8, 1)} {mfu:>6} {fmt('gpu_mem_gib', 8, 1)} {fmt('plan_gpu_gib', 6, 1)} "
              f"{fmt('host_mem_gib', 9, 1)} {fmt('plan_host_gib', 6, 1)}  {ratios}")
    partial.unlink()


if __name__ == "__main__":
    main()
