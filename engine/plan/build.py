"""`build_plan`: the plan of the configured engine, and what a refusal suggests (smaller state formats, building
the compiled kernels in this process)."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from engine.execution import Execution
from engine.config import GRAD_ACCUM_AUTO, ConfigError, exact_state_required, norm_pass_conflicts
from engine.formats import AUTO_GRAD_DTYPES, FIELDS, StateFormat, all_formats, candidate_formats, format_is_open
from engine.plan.memory import GIB, MemoryPlan, PlanError
from engine.plan.micro_batches import choose_micro_batches
from engine.plan.reference import reference_plan
from engine.plan.stream import StreamPlanner, data_parallel_ranks, norm_pass_unfit_note


def build_plan(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, check: bool = True,
               state_ranks: int = 1, executions: Optional[Sequence[Execution]] = None) -> MemoryPlan:
    """The plan of `cfg.engine` for `spec` (`_plan_executions`). `train.grad_accum=-1` is resolved in `cfg` first
    (engine/plan/micro_batches.py): each count tried is planned in full, from the state formats as configured, and
    the plan's `grad_accum_choice` says what was taken. `check`: raise PlanError when the plan does not fit, with
    the table and what would fit."""
    if cfg.train.grad_accum != GRAD_ACCUM_AUTO:
        plan = _plan_executions(spec, cfg, gpu_gib, host_gib, on_gpu, state_ranks, executions)
    else:
        plan = _plan_micro_batches(spec, cfg, gpu_gib, host_gib, on_gpu, state_ranks, executions)
    if check and plan.problem():
        raise PlanError(f"{plan.table()}\n\n{plan.problem()}")
    return plan


def _plan_micro_batches(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, state_ranks: int,
                        executions: Optional[Sequence[Execution]]) -> MemoryPlan:
    """`train.grad_accum=-1` resolved in `cfg` (with the state format the chosen count's plan was made in): the plan
    of the count taken, whose `grad_accum_choice` says why. A plan without step times cannot choose: refused."""
    asked = {f: cfg.train[f] for f in FIELDS}

    def plan_with(n: int) -> MemoryPlan:
        cfg.train.grad_accum = n
        _set_fields(cfg.train, asked)
        plan = _plan_executions(spec, cfg, gpu_gib, host_gib, on_gpu, state_ranks, executions, explain=False)
        if not plan.times_s:
            raise ConfigError(f"train.grad_accum={GRAD_ACCUM_AUTO} (auto) chooses the micro-batches from the plan's "
                              "step times, and this plan has none (engine=stream's plan on a GPU or for a GPU "
                              "profile has them): set train.grad_accum to a number of micro-batches, 1 or more")
        return plan

    # a norm pass costs a backward that the counts' comparison (their forward's stream against its compute) does
    # not see: with engine.norm_pass=auto the counts are planned holding the gradients, and only where not even one
    # micro-batch fits so are they planned again with the norm pass allowed
    norm_pass = cfg.engine.norm_pass
    if norm_pass == "auto":
        cfg.engine.norm_pass = "off"
    try:
        choice = choose_micro_batches(plan_with)
    finally:
        cfg.engine.norm_pass = norm_pass
    if norm_pass == "auto" and choice.plan.problem():
        choice = choose_micro_batches(plan_with)
    cfg.train.grad_accum = choice.grad_accum
    plan = choice.plan
    _set_state_format(cfg.train, plan.state_format)
    plan.grad_accum_choice = choice.line
    if plan.problem():
        _explain_refusal(spec, cfg, gpu_gib, host_gib, plan, state_ranks)
    return plan


def _plan_executions(spec, cfg, gpu_gib: float, host_gib: float, on_gpu: bool, state_ranks: int,
                     executions: Optional[Sequence[Execution]], explain: bool = True) -> MemoryPlan:
    """The plan of `cfg.engine` for `spec`, within `gpu_gib` of HBM (when `on_gpu`) and `host_gib` of host RAM.
    `state_ranks`: the data-parallel ranks the stream engine's host state is sharded over (engine/distributed.py);
    the host rows are those of the rank holding the most. `executions`: what the run may execute (the trainer's
    `Execution.choices`, so that both price the same run), resolved from the config when not given; of several,
    the plan takes the one with the most precise state format that fits, then the shortest step (`plan.execution`
    is the one taken, `plan.execution_choice` says why), and a refusal is the first one's. Where `host_gib` comes
    from (a `HostBudget`'s source, engine/hardware.py) is the plan's `host_source`. State-format fields left `auto`
    are resolved in `cfg` first (`choose_state_format`); the plan's `format_choice` says what was chosen.
    `explain`: a plan that does not fit looks for what would (`_explain_refusal`)."""
    options = list(executions or Execution.choices(spec, cfg, on_gpu))
    asked = {f: cfg.train[f] for f in FIELDS}
    planned = []
    for ex in options:
        _set_fields(cfg.train, asked)
        planned.append(_plan_of(spec, cfg, gpu_gib, host_gib, ex, state_ranks))
    format_rank = {fmt: rank for rank, fmt in enumerate(all_formats(cfg.train.moments_block_size))}  # 0: most precise
    taken = min(range(len(options)), key=lambda i: _preference(i, planned[i], format_rank[planned[i].state_format]))
    plan = planned[taken]
    plan.execution = options[taken]
    _set_state_format(cfg.train, plan.state_format)
    if len(options) > 1:
        plan.execution_choice = _execution_choice_line(options, planned, taken)
    if explain and plan.problem():  # for the refusal of the plan taken only
        _explain_refusal(spec, cfg, gpu_gib, host_gib, plan, state_ranks)
    return plan


def _explain_refusal(spec, cfg, gpu_gib: float, host_gib: float, plan: MemoryPlan, state_ranks: int) -> None:
    """What would fit, for a refusal of `plan` (made from `cfg`): smaller state formats, building the compiled
    kernels in this process."""
    ex = plan.execution
    plan.suggestions = formats_that_fit(spec, cfg, gpu_gib, host_gib, ex, plan.state_format, state_ranks)
    plan.notes.extend(in_process_compile_fits(spec, cfg, gpu_gib, host_gib, ex, state_ranks))
    plan.notes.extend(norm_pass_fits(spec, cfg, gpu_gib, host_gib, ex, state_ranks))


def _plan_of(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution, state_ranks: int) -> MemoryPlan:
    """The unchecked plan of one execution, its state format resolved in `cfg` (and kept as `plan.state_format`)."""
    choice, plan = choose_state_format(spec, cfg, gpu_gib, host_gib, ex, state_ranks)
    fmt = StateFormat.of(cfg.train)
    if plan is None:
        plan = _engine_plan(spec, cfg, gpu_gib, host_gib, ex, fmt, state_ranks)
    plan.state_format = fmt
    plan.format_choice = choice or f"state format: {fmt.overrides()} (as configured)"
    plan.host_source = getattr(host_gib, "source", "")
    plan.gpu_cap_gib = cfg.hardware.gpu_mem_cap_gib
    return plan


def _set_state_format(train_cfg, fmt: StateFormat) -> None:
    """Write `fmt`'s dtypes into `train.master_dtype/moments_dtype/grad_dtype`."""
    _set_fields(train_cfg, {f: getattr(fmt, f.split("_")[0]) for f in FIELDS})


def _set_fields(train_cfg, values: dict) -> None:
    for f, value in values.items():
        train_cfg[f] = value


def _preference(index: int, plan: MemoryPlan, format_rank: int) -> tuple:
    """Sort key of one execution's plan: those that fit first, the most precise state format (`format_rank` 0),
    the shortest step, then the order given (ties keep the first)."""
    if plan.problem():
        return (1, index)
    return (0, format_rank, plan.times_s.get("step", 0.0), index)


def _execution_choice_line(options: Sequence[Execution], plans: Sequence[MemoryPlan], taken: int) -> str:
    """For the banner: which layer `train.lean_layer=auto` took and the planned step of each."""
    def name(ex: Execution) -> str:
        return "the lean layer" if ex.lean else "the plain layer"

    def planned(plan: MemoryPlan) -> str:
        return "does not fit" if plan.problem() else f"{plan.times_s.get('step', 0.0):.2f} s a step"

    if plans[taken].problem():
        return f"train.lean_layer=auto: neither layer fits; the plan shown is {name(options[taken])}'s"
    others = "; ".join(f"{name(ex)}: {planned(p)}" for i, (ex, p) in enumerate(zip(options, plans)) if i != taken)
    return f"train.lean_layer=auto: {name(options[taken])} ({planned(plans[taken])} planned; {others})"


def _norm_pass_rounds(cfg, candidates: Sequence[StateFormat], state_ranks: int) -> List[Tuple[str, list]]:
    """The rounds of the state-format choice: (the norm pass's mode to plan with, the formats to try in it). A
    norm pass holds no gradient, so it plans fp32 gradients only; with `engine.norm_pass=auto` every format is
    tried without it first (a step without it is the shorter), and it is tried only where none fits that way."""
    fp32_grads = [fmt for fmt in candidates if fmt.grad == "fp32"]
    mode = cfg.engine.norm_pass if cfg.engine.name == "stream" else "off"
    if mode == "on":
        return [("on", fp32_grads)]
    if mode == "auto" and fp32_grads and not norm_pass_conflicts(cfg.engine) \
            and data_parallel_ranks(cfg, state_ranks) == 1:
        return [("off", list(candidates)), ("on", fp32_grads)]
    return [("off", list(candidates))]


def choose_state_format(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution,
                        state_ranks: int = 1) -> Tuple[str, Optional[MemoryPlan]]:
    """Resolve `train.master_dtype/moments_dtype/grad_dtype=auto` in `cfg`: the most precise format the set fields
    allow with which the engine's plan fits (all-fp32 only where a setting needs exact state), holding the
    gradients where any format fits so, else with a norm pass (`_norm_pass_rounds`). When none fits, the most
    precise one is kept and the plan's refusal names it and what would fit. Returns a line for the start banner
    ('' when every field was set) and the chosen format's plan where it was made here (a plan takes seconds: the
    caller need not make it again), else None."""
    t = cfg.train
    if not format_is_open(t):
        return "", None
    candidates = candidate_formats(t, exact_only=exact_state_required(cfg))
    chosen, chosen_mode, tried = None, "off", 0
    plans = {}  # the plan of each (format, norm pass mode) planned
    numel = spec.num_params()
    for mode, formats in _norm_pass_rounds(cfg, candidates, state_ranks):
        for tried, fmt in enumerate(formats, 1):
            # master and moments live on the host or the GPU (without an NVMe tier): a format whose state alone
            # exceeds both cannot fit, and is skipped without planning it
            if not cfg.hardware.nvme_dir and fmt.state_bytes(numel) / state_ranks > (host_gib + gpu_gib) * GIB:
                continue
            try:
                plan = plans[fmt, mode] = _engine_plan(spec, cfg, gpu_gib, host_gib, ex, fmt, state_ranks, mode)
            except PlanError:  # the config fixes a placement this format cannot take
                continue
            if not plan.problem():
                chosen, chosen_mode = fmt, mode
                break
        if chosen:
            break
    fits = chosen is not None
    chosen = chosen or candidates[0]
    _set_state_format(t, chosen)
    why = ("the most precise that fits" if tried == 1 else
           f"the most precise that fits ({tried - 1} more precise do not)") if fits else \
        "none of the allowed formats fits; planning the most precise"
    if fits and chosen_mode == "on" and cfg.engine.norm_pass == "auto":
        why += " with a norm pass, none fitting with the gradients held"
    plan = plans.get((chosen, chosen_mode))
    if not fits and (chosen, "on") in plans and plan is not None:  # the refusal shows the hold, and what else it tried
        plan.notes.append(norm_pass_unfit_note(plans[chosen, "on"]))
    return f"state format: {chosen.overrides()} ({why}; train.*_dtype=auto)", plan


def _engine_plan(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution, fmt: StateFormat,
                 state_ranks: int, norm_pass: Optional[str] = None) -> MemoryPlan:
    """The unchecked plan of `cfg.engine` in the state format `fmt` (`norm_pass`: the stream engine's norm pass
    mode in place of engine.norm_pass)."""
    if cfg.engine.name == "reference":
        return reference_plan(spec, cfg, gpu_gib, host_gib, ex, fmt)
    return StreamPlanner(spec, cfg, gpu_gib, host_gib, ex, fmt, state_ranks, norm_pass).plan()


def in_process_compile_fits(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution,
                            state_ranks: int) -> List[str]:
    """For a refusal of a run that would start Inductor's compile workers: a note when the plan fits without them
    (`train.compile_in_process=true`), else nothing."""
    if not ex.compile_workers or not cfg.hardware.host_compile_workers_gib:
        return []
    try:
        plan = _engine_plan(spec, cfg, gpu_gib, host_gib, replace(ex, compile_workers=False),
                            StateFormat.of(cfg.train), state_ranks)
    except PlanError:
        return []
    if plan.problem():
        return []
    return [f"With train.compile_in_process=true (the compiled kernels built in this process, no worker pool: "
            f"{cfg.hardware.host_compile_workers_gib:.1f} GiB less host) it fits: host {plan.total('host') / GIB:.1f} "
            f"GiB, GPU {plan.total('gpu') / GIB:.1f} GiB."]


def norm_pass_fits(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution, state_ranks: int) -> List[str]:
    """For a refusal of a run that did not plan a norm pass (`engine.norm_pass=off`, or auto with a held gradient
    format set): a note when the plan fits with one (with fp32 gradients), else nothing."""
    fmt = StateFormat.of(cfg.train)
    planned = cfg.engine.norm_pass == "on" or (cfg.engine.norm_pass == "auto" and fmt.grad == "fp32")
    if cfg.engine.name != "stream" or planned or norm_pass_conflicts(cfg.engine) \
            or data_parallel_ranks(cfg, state_ranks) > 1:
        return []
    fp32_grads = replace(fmt, grad="fp32")
    try:
        plan = _engine_plan(spec, cfg, gpu_gib, host_gib, ex, fp32_grads, state_ranks, "on")
    except PlanError:
        return []
    if plan.problem():
        return []
    grads = "" if fmt.grad == "fp32" else " train.grad_dtype=fp32"
    step = plan.times_s.get("step")
    step_text = f", {step:.1f} s a step planned" if step else ""
    return [f"With engine.norm_pass=on{grads} (clip without holding gradients: one more head and backward a "
            f"step{step_text}) it fits: host {plan.total('host') / GIB:.1f} GiB, GPU "
            f"{plan.total('gpu') / GIB:.1f} GiB."]


def formats_that_fit(spec, cfg, gpu_gib: float, host_gib: float, ex: Execution, current: StateFormat,
                     state_ranks: int, limit: int = 3) -> List[str]:
    """For a refusal: up to `limit` smaller state formats with which the streaming engine's plan fits (the most
    precise first, those that fit holding the gradients before those that need a norm pass, as `auto` would take
    them: `_norm_pass_rounds`), each with its host and GPU totals; the rest of the config is kept, the sharding
    too."""
    found = []
    smaller = [fmt for fmt in all_formats(current.block_size) if fmt.bytes_per_param() < current.bytes_per_param()]
    for mode, formats in _norm_pass_rounds(cfg, smaller, state_ranks):
        for fmt in formats:
            if len(found) == limit:
                return found
            try:
                plan = StreamPlanner(spec, cfg, gpu_gib, host_gib, ex, fmt, state_ranks, mode).plan()
            except PlanError:  # the config fixes a placement this format cannot take
                continue
            if not plan.problem():
                found.append(_fitting_format_line(cfg, fmt, plan))
    return found


def _fitting_format_line(cfg, fmt: StateFormat, plan: MemoryPlan) -> str:
    """One line of `formats_that_fit`: the settings with which `plan` (in `fmt`) fits, and its totals."""
    engine = "engine=stream " if cfg.engine.name != "stream" else ""
    g = plan.placement.recompute_group
    placement = (f" engine.recompute_group={g}" if g > 1 else "") + (
        " engine.norm_pass=on" if plan.placement.norm_pass else "")
    below_bar = "" if fmt.grad in AUTO_GRAD_DTYPES else \
        (" (int8 gradients train worse than bf16 ones on real text, outside the quality bar: "
         "bench/results/formats-quality.md; auto never takes them)")
    return (f"model={cfg.model.name}: fits with {engine}{fmt.overrides()}{placement}: "
            f"host {plan.total('host') / GIB:.1f} GiB, GPU {plan.total('gpu') / GIB:.1f} GiB{below_bar}")
