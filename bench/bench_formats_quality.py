"""Training quality of the low-precision state formats: the same model, seed and data in each format, side by side.

    python -m bench.bench_formats_quality --out bench/results/formats_quality.jsonl --workdir /tmp/quality
    python -m bench.bench_formats_quality --plot bench/results/formats_quality.jsonl --png docs/formats_quality.png

Each format is one `train.py` run of `engine=reference` (the plain-PyTorch run of the format: engine/reference.py)
on the byte-level standard-library corpus (real text), all started at once so that they advance together on one
GPU: a run cut short by the time limit leaves its validation curve up to the same step as the others, and the
comparison at the last step every run reached stays fair. One row per format: the validation and training curves,
the final validation loss and `ratio_vs_fp32` (final validation loss over the fp32 run's at the same step), plus
the machine and versions of `engine.metrics.run_environment`. The bar they are held to: bf16 master + bf16 moments
within 1% of fp32, bf16 master + int8 moments within 2%, after at least 16M tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = {
    "fp32": [],
    "bf16": ["train.master_dtype=bf16", "train.moments_dtype=bf16"],
    "int8": ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.grad_dtype=bf16"],
    "int8_grads": ["train.master_dtype=bf16", "train.moments_dtype=int8", "train.grad_dtype=int8"],
    # to tell the update path from the formats (bf16 + bf16 ended 2-4% below fp32 on two seeds): fp32 state through
    # the fused kernel that updates the low-precision formats, and each half of bf16 + bf16 alone
    "fp32_kernel": ["train.fp32_update=kernel"],
    "bf16_master": ["train.master_dtype=bf16"],
    "bf16_moments": ["train.moments_dtype=bf16"],
}
DEFAULT_FORMATS = ("fp32", "bf16", "int8")  # the formats with a quality bar; the others on request (--formats)
LABELS = {"fp32": "fp32 master + moments + grads", "bf16": "bf16 master + bf16 moments",
          "int8": "bf16 master + int8 moments + bf16 grads", "int8_grads": "bf16 master + int8 moments + int8 grads",
          "fp32_kernel": "fp32 state, the fused kernel's update",
          "bf16_master": "bf16 master + fp32 moments", "bf16_moments": "fp32 master + bf16 moments"}


def recipe(args) -> list:
    return [f"seed={args.seed}", f"model={args.model}", "engine=reference", "data=stdlib",
            f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch_size}", "train.grad_accum=1", f"train.steps={args.steps}",
            f"train.lr={args.lr}", f"train.warmup_steps={args.warmup_steps}", f"train.val_every={args.val_every}",
            "train.val_batches=8", "train.log_every=10", "logger=none",
            f"train.deterministic={str(args.deterministic).lower()}"]


def read_run(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    return {"val_curve": val, "train_curve": train}


def run(args) -> None:
    from engine.metrics import run_environment

    meta = run_environment()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name in args.formats:
        log = open(workdir / f"{name}.log", "w")
        cmd = [sys.executable, "train.py", *recipe(args), *FORMATS[name], f"hydra.run.dir={workdir / name}"]
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log)
    start = time.perf_counter()
    for name, (proc, log) in procs.items():
        try:
            proc.wait(timeout=max(1.0, args.timeout_s - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.terminate()  # the trainer stops at a step boundary on SIGTERM; metrics so far are on disk
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    rows = {}
    for name, (proc, _) in procs.items():
        row = {"bench": "formats_quality", "format": name, "seed": args.seed, "overrides": recipe(args) + FORMATS[name],
               "returncode": proc.returncode, "tokens_per_step": args.seq_len * args.micro_batch_size, **meta}
        row.update(read_run(workdir / name))
        if not row["val_curve"]:
            row["error"] = f"exit {proc.returncode}: " + (workdir / f"{name}.log").read_text()[-2000:]
        rows[name] = row
    common = min((r["val_curve"][-1][0] for r in rows.values() if r["val_curve"]), default=None)
    base = dict(rows["fp32"]["val_curve"]).get(common) if "fp32" in rows else None
    for row in rows.values():
        at = dict(row["val_curve"]).get(common)
        row.update(compared_at_step=common, tokens_at_step=common * row["tokens_per_step"] if common else None,
                   final_val_loss=at, ratio_vs_fp32=at / base if at and base else None)
    with open(args.out, "a") as f:
        for row in rows.values():
            f.write(json.dumps(row) + "\n")
    for name, row in rows.items():
        print(f"{name:6} step {row['compared_at_step']} val {row['final_val_loss']} ratio_vs_fp32 "
              f"{row['ratio_vs_fp32']} {row.get('error', '')[:300]}")


def plot(rows_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row.get("val_curve"):
            steps, losses = zip(*row["val_curve"][1:])  # from the first validation after step 0 (12 nats there)
            tokens_m = [s * row["tokens_per_step"] / 1e6 for s in steps]
            # a call without an fp32 run has no ratio: the label gives the final loss itself
            ratio = row["ratio_vs_fp32"]
            versus = f"x{ratio:.4f} of fp32" if ratio is not None else f"{row['final_val_loss']:.4f}"
            ax.plot(tokens_m, losses, marker=".", label=f"{LABELS[row['format']]}, seed {row.get('seed', 0)}: "
                                                        f"{versus} at step {row['compared_at_step']}")
    first = rows[0]
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("validation loss (nats/byte)")
    model = next(o for o in first["overrides"] if o.startswith("model="))
    ax.set_title(f"state formats, {model}, {first['gpu']}, git {first['git_sha']}")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/formats_quality.jsonl"))
    ap.add_argument("--workdir", default="runs/quality")
    ap.add_argument("--model", default="qwen0_5b")
    ap.add_argument("--seed", type=int, default=0, help="model init and data order of every run")
    ap.add_argument("--deterministic", action="store_true",
                    help="train.deterministic=true: a rerun of a format repeats its curve bit for bit")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), choices=list(FORMATS))
    ap.add_argument("--timeout-s", type=float, default=3600, help="for all runs together")
    ap.add_argument("--plot", type=Path, help="render this rows file as a PNG (--png) instead of running")
    ap.add_argument("--png", type=Path, default=ROOT / "bench/results/formats_quality.png")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.png)
    else:
        run(args)


if __name__ == "__main__":
    main()
