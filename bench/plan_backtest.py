"""Re-plan measured engine rows with the current planner: its step and phases against what each row measured.

    python -m bench.plan_backtest bench/results/engine_h200_2026-12-04.jsonl bench/results/engine_h100_2026-12-06.jsonl

Each `engine=stream` row that measured a step (`step_s`) with its `placement` and `overrides` is composed again
from those overrides, with the placement it ran fixed (`engine.gpu_resident_units=...` and the rest), on the profile
of the card it ran on (its `gpu` name mapped as `hardware=auto` maps it) unless its overrides name one, and planned
as `python train.py ... plan=true` plans it. Printed per row: the measured step, the plan the row carried from its
own run (`plan_step_s`, where it has one), today's plan and its error, the forward and backward phases, the GPU
peak (tensor memory), the host peak (the process and torch.compile's workers) and the host AdamW's pass, measured
and planned; then, per card, the median rate of the host AdamW inside the steps (the parameters it updated over its
pass: `hardware.cpu_adam_gparams_per_s_in_step`, rows with moments on NVMe left out), and the median over
mixture-of-experts rows of the measured backward over today's planned one, per model too (the backward is nearly all
MoE layer compute at these lengths: `hardware.moe_step_ratio` times that median is the profile's new figure). A row
whose overrides no longer compose is listed as skipped, with the reason (the renamed `train=throughput` and
`+experiment=<name>` are read as today's `train=bench` and `experiment=bench_<name>`). The rows come from older commits, so a
gap can be the engine's change as well as the planner's: the use is comparing a planner change on the same rows
before and after it. `--jsonl` writes the table's rows. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from engine.hardware import profile_for_gpu
from engine.model.lean import AUTO_LEAN_MIN_TOKENS
from engine.plan import GIB

ROOT = Path(__file__).resolve().parent.parent

PLACEMENT_KEYS = ("slots", "keep_activation_layers", "recompute_group", "activation_tier", "grads_tier",
                  "cache_weights", "gpu_resident_units", "gpu_streamed_units", "nvme_units")


def current_spelling(overrides) -> list:
    """A row's overrides in today's spelling: `train=throughput` became `train=bench` and `+experiment=<name>` the
    `experiment=bench_<name>` recipe (the learning rate and warm-up they changed do not enter a plan)."""
    out = []
    for o in overrides:
        if o == "train=throughput":
            o = "train=bench"
        elif o.startswith("+experiment="):
            name = o.split("=", 1)[1]
            bench = f"bench_{name}"
            o = f"experiment={bench if (ROOT / 'conf' / 'experiment' / f'{bench}.yaml').exists() else name}"
        out.append(o)
    return out


def replan(row: dict):
    """The current planner's MemoryPlan for a measured row, or the reason it cannot be re-planned."""
    planned = _replan(row)
    return planned if isinstance(planned, str) else planned[0]


def _replan(row: dict):
    """`replan`'s plan and the parameters its host AdamW updates each step, or the reason it cannot be re-planned."""
    from hydra import compose, initialize_config_dir

    from engine import hardware
    from engine.config import register, validate
    from engine.model import ModelSpec
    from engine.plan import build_plan

    overrides = current_spelling(row.get("overrides") or [])
    if any(o.startswith("nproc=") for o in overrides):
        return "data-parallel row"
    profile = profile_for_gpu(row.get("gpu", ""))
    if not any(o.startswith("hardware=") for o in overrides):
        if profile is None:
            return f"no profile for gpu {row.get('gpu')!r}"
        overrides.append(f"hardware={profile}")
    placement = row["placement"]
    overrides += [f"engine.{k}={placement[k]}" for k in PLACEMENT_KEYS if k in placement]
    # the micro-batches the row ran, which `train.grad_accum=-1` leaves to the plan
    if row.get("grad_accum"):
        overrides.append(f"train.grad_accum={row['grad_accum']}")
    # the layer the row ran, which `train.lean_layer=auto` now leaves to the plan: recorded since (`lean_layer`);
    # an older row ran the plain layer up to AUTO_LEAN_MIN_TOKENS a micro-batch
    lean = row.get("lean_layer")
    if lean is None and row.get("seq_len", 0) * row.get("micro_batch_size", 1) <= AUTO_LEAN_MIN_TOKENS:
        lean = False
    if lean is not None and not any(o.startswith("train.lean_layer=") for o in overrides):
        overrides.append(f"train.lean_layer={'on' if lean else 'off'}")
    register()
    try:  # an older row's overrides may name keys renamed or gone since
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["logger=none", *overrides, "plan=true"])
        hardware.resolve(cfg)
        validate(cfg)
    except Exception as err:  # noqa: BLE001 - reported in the table, the other rows go on
        return f"its overrides no longer compose: {str(err).splitlines()[0]}"
    gpu_gib = hardware.usable_gpu_gib(cfg.hardware, 0.0)
    # the host of the machine the row ran on: the row's override, else its profile's, wherever this replans it
    hw = cfg.hardware
    host_gib = hardware.HostBudget(hw.host_mem_gib, "hardware.host_mem_gib") if hw.host_mem_gib > 0 else \
        hardware.HostBudget(hw.profile_host_mem_gib, f"hardware.profile_host_mem_gib of hardware={hw.name}")
    spec = ModelSpec(cfg.model)
    plan = build_plan(spec, cfg, gpu_gib, host_gib, on_gpu=True, check=False)
    return plan, sum(spec.units[u].layout.numel for u in plan.placement.host_units)


def host_gib(row: dict):
    """The row's host peak as the plan counts it: the process and its children (torch.compile's workers)."""
    if row.get("host_mem_gib") is None:
        return None
    return row["host_mem_gib"] + (row.get("host_children_mem_gib") or 0.0)


def backtest(rows):
    out = []
    for row in rows:
        if row.get("engine") != "stream" or not row.get("step_s") or not row.get("placement"):
            continue
        planned = _replan(row)
        entry = {"job": row.get("job"), "model": row.get("model"), "gpu": row.get("gpu"), "git_sha": row.get("git_sha"),
                 "step_s": row["step_s"], "plan_then_s": row.get("plan_step_s")}
        if isinstance(planned, str):
            entry["skipped"] = planned
        else:
            plan, host_params = planned
            times = plan.times_s
            entry.update(plan_now_s=times["step"], error_now=times["step"] / row["step_s"] - 1,
                         forward_s=row.get("median_forward_s"), plan_forward_s=times["forward"],
                         backward_s=row.get("median_backward_s"), plan_backward_s=times["backward"],
                         gpu_gib=row.get("gpu_mem_gib"), plan_gpu_gib=plan.allocated("gpu") / GIB,
                         host_gib=host_gib(row), plan_host_gib=plan.total("host") / GIB,
                         host_adamw_s=row.get("median_optimizer_s"), plan_host_adamw_s=times["host_adamw"],
                         host_adamw_gparams_per_s=host_adamw_rate(row, host_params),
                         moe_bwd_ratio=moe_bwd_ratio(row, plan))
        out.append(entry)
    return out


def host_adamw_rate(row: dict, host_params: int):
    """The host AdamW's rate in the row's steps (G parameters/s): the parameters it updated over its median pass
    (`optimizer_s`); None without host-updated units, or with moments on NVMe (the pass then waits on the disk)."""
    if not host_params or not row.get("median_optimizer_s") or row["placement"].get("nvme_units"):
        return None
    return host_params / row["median_optimizer_s"] / 1e9


def moe_bwd_ratio(row: dict, plan):
    """A MoE row's measured backward over its plan's; None for other rows and for rows that measured no backward."""
    if "MoE layers at the figures" not in plan.speeds or not row.get("median_backward_s"):
        return None
    return row["median_backward_s"] / plan.times_s["backward"]


def moe_summary(table) -> str:
    """Per card, the MoE rows' backward measured over planned: the median over them and per model (the profile's
    `hardware.moe_step_ratio` times it is the figure that would have planned them right)."""
    lines = []
    for card in sorted({profile_for_gpu(e["gpu"] or "") or "?" for e in table}):
        rows = [e for e in table if e.get("moe_bwd_ratio") and (profile_for_gpu(e["gpu"] or "") or "?") == card]
        groups = {m: [e["moe_bwd_ratio"] for e in rows if e["model"] == m] for m in sorted({e["model"] for e in rows})}
        if rows:
            each = ", ".join(f"{m} {statistics.median(r):.3f} ({len(r)})" for m, r in groups.items())
            median = statistics.median(e["moe_bwd_ratio"] for e in rows)
            lines.append(f"{card}: MoE backward measured over planned, median {median:.3f} over {len(rows)} rows "
                         f"({each}; times hardware.moe_step_ratio: its figure)")
    return "\n".join(lines)


def host_adamw_summary(table) -> str:
    """The median in-step host AdamW rate per card, for `hardware.cpu_adam_gparams_per_s_in_step`."""
    lines = []
    for card in sorted({profile_for_gpu(e["gpu"] or "") or "?" for e in table}):
        rates = sorted(e["host_adamw_gparams_per_s"] for e in table if e.get("host_adamw_gparams_per_s")
                       and (profile_for_gpu(e["gpu"] or "") or "?") == card)
        if rates:
            lines.append(f"{card}: host AdamW in steps, median {statistics.median(rates):.3f} G parameters/s over "
                         f"{len(rates)} rows ({rates[0]:.2f}-{rates[-1]:.2f}; hardware.cpu_adam_gparams_per_s_in_step)")
    return "\n".join(lines)


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", type=Path, help="engine JSONL files (bench/bench_engine.py rows)")
    ap.add_argument("--jsonl", type=Path, help="also write the table's rows here")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for path in args.rows for line in path.read_text().splitlines() if line.strip()]
    table = backtest(rows)
    print(f"{'job':44} {'gpu':5} {'sha':8} {'step s':>7} {'then':>6} {'now':>6} {'err now':>8} "
          f"{'fwd s':>6} {'plan':>6} {'bwd s':>6} {'plan':>6} {'GPU GiB':>8} {'plan':>6} {'host GiB':>9} {'plan':>6} "
          f"{'AdamW s':>7} {'plan':>6}")
    for e in table:
        gpu = profile_for_gpu(e["gpu"] or "") or "?"
        if "skipped" in e:
            print(f"{e['job']:44} {gpu:5} {(e['git_sha'] or '-')[:8]:8} skipped: {e['skipped']}")
            continue
        print(f"{e['job']:44} {gpu:5} {(e['git_sha'] or '-')[:8]:8} {e['step_s']:7.2f} {_f(e['plan_then_s']):>6} "
              f"{e['plan_now_s']:6.2f} {e['error_now']:+8.1%} {_f(e['forward_s']):>6} {e['plan_forward_s']:6.2f} "
              f"{_f(e['backward_s']):>6} {e['plan_backward_s']:6.2f} {_f(e['gpu_gib'], '{:.1f}'):>8} "
              f"{e['plan_gpu_gib']:6.1f} {_f(e['host_gib'], '{:.1f}'):>9} {e['plan_host_gib']:6.1f} "
              f"{_f(e['host_adamw_s']):>7} {e['plan_host_adamw_s']:6.2f}")
    for summary in (host_adamw_summary([e for e in table if "skipped" not in e]),
                    moe_summary([e for e in table if "skipped" not in e])):
        if summary:
            print(summary)
    if args.jsonl is not None:
        with open(args.jsonl, "w") as f:
            for e in table:
                f.write(json.dumps(e) + "\n")


if __name__ == "__main__":
    main()
