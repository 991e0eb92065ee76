"""Sweep report: run dirs -> one row per job (JSONL), a printed table, and a PNG of TFLOPS and memory.

    python -m engine.report runs/multirun/<date>/<time>                        # the context or model-size sweep
    python -m engine.report <sweep dir> --x seq_len --png context.png --jsonl context.jsonl

Depth-truncated runs (fewer decoder layers of a published model's width, e.g. `model=qwen72b
model.num_hidden_layers=4`) are labelled as such in every row and line, with the full-depth step extrapolated from
the measured per-layer forward + backward time and the planner's full-depth memory and step next to it. For
engine=stream rows, `layer_tflops` is the decoder layers' model FLOPs (3 x forward, recompute not counted) over
the forward + backward phase time: the per-layer throughput, comparable across model widths whatever the depth.
`layer_compute_tflops` is the same over those phases less the compute stream's stalls in them (waits for weights,
gradients or the host optimizer): at 70B-class widths four layers cannot hide their host AdamW, a stall that a
full-depth model spreads over 80 layers, so the two figures apart tell a width's own rate from that stall.

Every directory below the given ones that holds a `summary.json` (a finished run) or a `refused.json` (a job the
trainer refused before it started, e.g. a memory plan that does not fit) becomes a row; a run dir with neither (a
crash, a kill) is listed as `incomplete`. `run_row` is the one place that turns a run's files into a row, shared
with bench/bench_engine.py.

The plot puts `--x` (seq_len for the context sweep, `published_params` for the model-size sweep) on a log
axis: model TFLOPS (engine/metrics.py's count, attention included) on the left, peak GPU and host memory on the
right, with the planner's predicted memory dashed. It needs matplotlib (`pip install -e '.[report]'`); the table and
the rows do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf

from engine.metrics import count_params, model_flops_per_token


def _numbers(rows, key) -> list:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def _median(rows, key):
    vals = _numbers(rows, key)
    return statistics.median(vals) if vals else None


def _peak(rows, key):
    return max(_numbers(rows, key), default=None)


def _overrides(run_dir: Path) -> List[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    return [line[2:].strip() for line in path.read_text().splitlines() if line.startswith("- ")]


def run_row(run_dir: Path) -> dict:
    """One row for a run dir: measured medians (steps after the first), peaks, the plan's figures and the config's
    shape; `refused` or `error` when the run did not finish."""
    run_dir = Path(run_dir)
    row = {"run_dir": str(run_dir), "overrides": _overrides(run_dir)}
    metrics_path = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    steps = [s for s in steps if "loss" in s]
    # the host memory of this process and of its children (torch.compile's workers) at each logged step, kept
    # for a run that died too: the trail of a host out-of-memory kill
    row.update({"steps_logged": len(steps), "host_rss_peak_logged_gib": _peak(steps, "host_mem_gib"),
                "host_children_mem_gib": _peak(steps, "host_children_mem_gib")})
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        refused = run_dir / "refused.json"
        if refused.exists():
            record = json.loads(refused.read_text())
            shape = record.get("shape") or {}
            row.update({"model": shape.get("model.name"), "num_hidden_layers": shape.get("model.num_hidden_layers"),
                        "seq_len": shape.get("train.seq_len"), "engine": shape.get("engine.name"),
                        "hardware": shape.get("hardware.name"), **(record.get("environment") or {}),
                        "refused": record.get("error")})
        else:
            row["error"] = "incomplete: no summary.json (the run crashed, was killed, or is still running)"
        return row
    summary = json.loads(summary_path.read_text())
    row.update(summary.get("environment") or {})  # GPU, torch / triton, git revision, date of the run
    timed = steps[1:] if len(steps) > 1 else steps
    cfg = summary["config"]
    t = cfg["train"]
    row.update({
        "model": cfg["model"]["name"], "engine": cfg["engine"]["name"], "hardware": cfg["hardware"]["name"],
        "num_hidden_layers": cfg["model"]["num_hidden_layers"], "published_params": cfg["model"].get("expected_params"),
        "seq_len": t["seq_len"], "micro_batch_size": t["micro_batch_size"], "grad_accum": t["grad_accum"],
        "tokens_per_step": t["seq_len"] * t["micro_batch_size"] * t["grad_accum"], "steps": len(steps),
        "tokens_per_s": summary.get("median_tokens_per_s"), "step_s": summary.get("median_step_s"),
        "tflops": summary.get("median_tflops"), "mfu": summary.get("median_mfu"),
        "tflops_6n": _median(timed, "tflops_6n"),
        "gpu_mem_gib": summary.get("peak_gpu_mem_gib"), "gpu_reserved_gib": summary.get("peak_gpu_reserved_gib"),
        "host_mem_gib": summary.get("peak_host_mem_gib"),
        "num_params": summary.get("num_params"), "memory_plan_gib": summary.get("memory_plan_gib"),
        "losses": [s.get("loss") for s in steps], "initial_val_loss": summary.get("initial_val_loss"),
        "final_val_loss": summary.get("final_val_loss"), "placement": cfg.get("plan_placement"),
        "skipped_steps": summary.get("skipped_steps"),
        "attention": summary.get("attention"), "mlp_chunk_tokens": summary.get("mlp_chunk_tokens"),
        "lean_layer": summary.get("lean_layer"),
        "state_format": {k: t.get(k) for k in ("master_dtype", "moments_dtype", "grad_dtype", "moments_block_size")},
        "plan_step_s": (summary.get("plan_times_s") or {}).get("step"),
        # the predicted peak of tensor memory, the figure `gpu_mem_gib` measures (the budget adds the reserve)
        "plan_gpu_gib": (summary.get("memory_plan_allocated_gib") or {}).get("gpu"),
        "plan_gpu_budget_gib": (summary.get("memory_plan_gib") or {}).get("gpu"),
        "plan_host_gib": (summary.get("memory_plan_gib") or {}).get("host"),
        # data parallel: the job's ranks, and the host memory of all of them (host_mem_gib is rank 0's)
        "ranks": summary.get("ranks", 1), "host_mem_gib_all_ranks": summary.get("peak_host_mem_gib_all_ranks"),
    })
    for key in sorted({k for s in timed for k in s if k.endswith(("_s", "_gbps")) and k not in ("step_s",)}):
        row[f"median_{key}"] = _median(timed, key)
    # the planner's phases next to the measured medians (plan_forward_s by median_forward_s, ...): where a miss is
    row.update({f"plan_{phase}_s": t_s for phase, t_s in (summary.get("plan_times_s") or {}).items()
                if phase != "step"})
    if cfg["model"].get("num_experts"):  # MoE: active parameters, and routing as the last logged step saw it
        row["active_params"] = count_params(OmegaConf.create(cfg["model"]), active=True)
        row.update({k: steps[-1].get(k) for k in ("balance_loss", "expert_load_max", "expert_load_min")
                    if steps and k in steps[-1]})
    fwd, bwd = row.get("median_forward_s"), row.get("median_backward_s")
    if fwd and bwd:  # the decoder layers alone (engine=stream's phase times): comparable across depths and heads
        layer_flops = model_flops_per_token(OmegaConf.create(cfg["model"]), t["seq_len"])[
            "layer_forward_flops_per_token"]
        work = 3 * layer_flops * row["tokens_per_step"] * row["num_hidden_layers"]
        row["layer_tflops"] = work / (fwd + bwd) / 1e12
        # the same without the compute stream's stalls inside those phases (its waits for weights, gradients, the
        # host optimizer: `exposed_s` less the gap between steps), each step's own: what the layers run at when
        # fed, apart from what a short, depth-truncated model cannot hide
        busy = [s["forward_s"] + s["backward_s"] - s["exposed_s"] + s.get("between_steps_stall_s", 0.0)
                for s in timed if all(isinstance(s.get(k), (int, float)) for k in ("forward_s", "backward_s",
                                                                                      "exposed_s"))]
        if busy and statistics.median(busy) > 0:
            row["layer_compute_tflops"] = work / statistics.median(busy) / 1e12
    truncated = summary.get("depth_truncated")
    if truncated:
        row.update(depth_truncated=True, **{k: v for k, v in truncated.items() if k != "layers"})
        layers, full = truncated["layers"], truncated["full_depth_layers"]
        if row["step_s"] and fwd is not None and bwd is not None:
            # the step plus the measured per-layer forward + backward time of each missing layer
            row["full_depth_step_s_extrapolated"] = row["step_s"] + (full - layers) * (fwd + bwd) / layers
            row["full_depth_tokens_per_s_extrapolated"] = \
                row["tokens_per_step"] / row["full_depth_step_s_extrapolated"]
    return row


def find_run_dirs(roots: List[Path]) -> List[Path]:
    found = set()
    for root in roots:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory (give a sweep dir such as runs/multirun/<date>/<time>)")
        for marker in ("summary.json", "refused.json", "train.log"):
            found.update(p.parent for p in root.rglob(marker))
    return sorted(found)


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _last(values) -> Optional[float]:
    return values[-1] if values else None


def table(rows: List[dict]) -> str:
    lines = [f"{'model':10} {'seq':>7} {'tok/step':>9} {'tok/s':>8} {'TFLOPS':>7} {'layer':>7} {'fed':>7} "
             f"{'GPU GiB (plan)':>15} "
             f"{'host GiB (plan)':>16} {'attention':>9} {'loss':>7} {'val loss':>15}  overrides; note"]
    for r in rows:
        note = r.get("refused") or r.get("error") or ""
        if r.get("depth_truncated"):
            extrapolated = r.get("full_depth_step_s_extrapolated")
            note = (f"DEPTH-TRUNCATED {r['num_hidden_layers']}/{r['full_depth_layers']} layers"
                    + (f"; full depth ~{extrapolated:.1f} s/step (extrapolated), plan "
                       f"{_fmt(r.get('full_depth_plan_step_s'), '.1f')} s" if extrapolated else "") + ". " + note)
        lines.append(
            f"{r.get('model') or '?':10} {_fmt(r.get('seq_len'), 'd'):>7} {_fmt(r.get('tokens_per_step'), 'd'):>9} "
            f"{_fmt(r.get('tokens_per_s'), '.0f'):>8} {_fmt(r.get('tflops')):>7} {_fmt(r.get('layer_tflops')):>7} "
            f"{_fmt(r.get('layer_compute_tflops')):>7} "
            f"{_fmt(r.get('gpu_mem_gib')) + ' (' + _fmt(r.get('plan_gpu_gib')) + ')':>15} "
            f"{_fmt(r.get('host_mem_gib')) + ' (' + _fmt(r.get('plan_host_gib')) + ')':>16} "
            f"{r.get('attention') or '-':>9} {_fmt(_last(r.get('losses')), '.3f'):>7} "
            f"{_fmt(r.get('initial_val_loss'), '.3f') + ' -> ' + _fmt(r.get('final_val_loss'), '.3f'):>15}  "
            f"{' '.join(r.get('overrides') or []) or '-'}" + (f"; {note.splitlines()[0][:100]}" if note else ""))
    return "\n".join(lines)


def plot_title(rows: List[dict]) -> str:
    """What the rows have in common: the model (or the models, in x order, for a model-size sweep), the hardware
    and the engine, of the finished runs (the ones on the plot)."""
    rows = [r for r in rows if r.get("tflops") is not None] or rows

    def common(key: str) -> str:
        seen = list(dict.fromkeys(str(r[key]) for r in rows if r.get(key) is not None))
        return ", ".join(seen) if seen else "?"
    return f"{common('model')} on {common('hardware')} ({common('gpu')}), engine {common('engine')}"


def plot(rows: List[dict], x_key: str, png: Path, title: str) -> bool:
    """Write the PNG; False (and a note) without matplotlib, which the rows and the table do not need."""
    try:
        import matplotlib
    except ImportError:
        print("engine.report: no plot: it needs matplotlib (pip install -e '.[report]'); the rows and the table were "
              "written without it", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = sorted((r for r in rows if r.get("tflops") is not None and r.get(x_key) is not None),
                  key=lambda r: r[x_key])
    if not done:
        raise SystemExit(f"engine.report: no finished run has {x_key}: nothing to plot")
    xs = [r[x_key] for r in done]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(xs, [r["tflops"] for r in done], "o-", color="tab:blue", label="model TFLOPS")
    if any(r.get("layer_tflops") is not None for r in done):
        ax.plot(xs, [r.get("layer_tflops") for r in done], "^:", color="tab:purple", label="decoder-layer TFLOPS")
    if any(r.get("layer_compute_tflops") is not None for r in done):
        ax.plot(xs, [r.get("layer_compute_tflops") for r in done], "v--", color="tab:pink",
                label="decoder-layer TFLOPS, stalls out")
    models = {r.get("model") for r in done}
    for r in done:  # name each point by what varies (the model in a size sweep) and mark depth-truncated runs
        label = r.get("model") if len(models) > 1 else ""
        if r.get("depth_truncated"):
            label += f" (depth-truncated {r['num_hidden_layers']}/{r['full_depth_layers']})"
        if label:
            ax.annotate(label.strip(), (r[x_key], r["tflops"]), fontsize=7, textcoords="offset points",
                        xytext=(4, 4))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_key)
    ax.set_ylabel("model TFLOPS", color="tab:blue")
    mem = ax.twinx()
    for key, plan_key, color in (("gpu_mem_gib", "plan_gpu_gib", "tab:red"),
                                 ("host_mem_gib", "plan_host_gib", "tab:green")):
        mem.plot(xs, [r.get(key) for r in done], "s-", color=color, label=key.replace("_mem_gib", " peak GiB"))
        mem.plot(xs, [r.get(plan_key) for r in done], "--", color=color, alpha=0.6,
                 label=plan_key.replace("plan_", "plan ").replace("_gib", " GiB"))
    mem.set_ylabel("GiB")
    lines = ax.get_legend_handles_labels()
    more = mem.get_legend_handles_labels()
    # below the axes: inside them the legend hid points (e.g. the 7B layer figure of a two-model sweep)
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=3)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    return True


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep dirs (or run dirs) to collect")
    ap.add_argument("--x", default="seq_len", help="row key on the plot's x axis (seq_len, num_params, ...)")
    ap.add_argument("--png", type=Path, help="write the plot here (default: <first dir>/report.png)")
    ap.add_argument("--jsonl", type=Path, help="write the rows here (default: <first dir>/report.jsonl)")
    args = ap.parse_args(argv)
    try:
        run_dirs = find_run_dirs(args.dirs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not run_dirs:
        print(f"error: no run dirs below {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    rows = [run_row(d) for d in run_dirs]
    print(table(rows))
    jsonl = args.jsonl or args.dirs[0] / "report.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = args.png or args.dirs[0] / "report.png"
    print(f"rows -> {jsonl}")
    if plot(rows, args.x, png, plot_title(rows)):
        print(f"plot -> {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
