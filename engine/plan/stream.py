"""The plan of `engine=stream`: the placement search and the memory rows of a placement (the package docstring has
the rules: what HBM is spent on, in which order, and how recompute groups and the NVMe tier enter)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from engine.config import NORM_PASS_ENGINE_VALUES, norm_pass_conflicts
from engine.execution import Execution
from engine.formats import StateFormat
from engine.model.lean import kept_attention_bytes_per_token
from engine.placement import Placement, kept_layer_inputs, nvme_layers
from engine.plan.memory import GIB, MemoryPlan, PlanError, add_process_row, process_host_bytes
from engine.plan.shape import StepShape
from engine.plan.speeds import Speeds
from engine.plan.time_model import StepTimer
from engine.streaming.host_store import init_copies
from engine.streaming.nvme import STAGING_BUFFERS
from engine.streaming.nvme import file_bytes as nvme_file_bytes
from engine.streaming.slots import STAGING_ELEMS

Candidate = Tuple[Placement, float]  # a placement that fits HBM, and the GPU bytes it leaves free

# what a norm pass's search takes for the engine settings it needs (its first backward consumes nothing the forward
# kept but the layer inputs, and nothing holds a gradient): `Placement` checks the same
NORM_PASS_SETTINGS = {key: allowed[-1] for key, allowed in NORM_PASS_ENGINE_VALUES.items()}


def data_parallel_ranks(cfg, state_ranks: int) -> int:
    """The data-parallel ranks a plan is made for: the ranks the state is sharded over, or with `plan=true` the
    profile's `hardware.gpus` (whose ranks share the state when engine.shard_state=false)."""
    return state_ranks if state_ranks > 1 else (cfg.hardware.gpus if cfg.get("plan") else 1)


def norm_pass_unfit_note(plan: MemoryPlan) -> str:
    """For a refusal under engine.norm_pass=auto: what the plan with a norm pass, tried too, needed."""
    return (f"With a norm pass (engine.norm_pass=auto: no gradient held, one more head and backward a step) it does "
            f"not fit either: GPU {plan.total('gpu') / GIB:.1f} GiB, host {plan.total('host') / GIB:.1f} GiB.")


def _take(extra_gpu_bytes: float, forced: str, free: float) -> Tuple[bool, float]:
    """Whether an optional GPU placement is made (`forced`: gpu | host | auto, auto when the bytes are free), and
    the free bytes after it."""
    on = forced == "gpu" or (forced == "auto" and extra_gpu_bytes <= free)
    return on, free - extra_gpu_bytes if on else free


def _placements(s: StepShape, e, n_kept: int, g: int, splits, fixed_split: bool, nbytes: Dict[str, float],
                gpu_grad_bytes: Callable[[int], int], norm_pass: bool) -> Tuple[List[Candidate], Placement]:
    """(every split that fits with `n_kept` kept graphs and recompute groups of `g`, the forced placement of the
    first split). HBM left after the fixed working set is spent in the package docstring's order. `gpu_grad_bytes`:
    the gradients on the GPU with their tier there, by GPU-resident units (`StreamPlanner.gpu_grad_bytes`).
    `norm_pass`: the step clips by a norm pass, which holds no gradient anywhere (`e` then has the settings it
    needs: nothing kept or cached, the gradients' tier the host)."""
    host_free = nbytes["host_free"]
    # a recompute group's inputs wait where the activations live: the whole group on the GPU, or all but its kept
    # input on the host, with one input fetched ahead on the GPU
    acts_on_gpu, free = _take(nbytes["activation"] + nbytes["regenerated"], e.activation_tier, nbytes["free"])
    if not acts_on_gpu:
        host_free -= nbytes["activation"] + nbytes["regenerated_host"]
        free -= nbytes["fetched"]
    # the host cannot hold them (or the config says gpu): they outrank everything below (with sharded state what
    # a rank holds on the GPU depends on the split, so they are taken split by split, from the same free bytes)
    grads_first = not norm_pass and (nbytes["grad_host"] > host_free or e.grads_tier == "gpu")
    base = Placement(n_units=len(s.layouts), slots=min(e.slots, s.L), keep_activation_layers=n_kept,
                     recompute_group=g, activation_tier="gpu" if acts_on_gpu else "host",
                     cache_weights=e.cache_weights == "on", norm_pass=norm_pass)

    def complete(n_res: int, n_str: int, force: bool = False) -> Optional[Candidate]:
        """The placement with this split and the rest of HBM spent (weights cached, gradients), or None when the
        split does not fit (unless `force`: the config fixed it, or nothing fits and the plan will say so)."""
        grads_on_gpu, left = _take(gpu_grad_bytes(n_res) - nbytes["side_grad"], e.grads_tier, free) \
            if grads_first else (False, free)
        left -= s.split_bytes(n_res, n_str, grads_on_gpu, base.cache_weights, norm_pass)
        n_host_grads = 0
        if s.fmt.grad == "bf16" and not grads_on_gpu and n_str:  # held bf16 gradients may wait on the host
            n_host_grads = min(e.host_grad_units, n_str) if e.host_grad_units >= 0 else (
                s.host_grads_freeing(n_res, n_str, -left) if left < 0 else 0)
            left += s.host_grads_gpu_saving(n_res, n_str, n_host_grads)
        if left < 0 and not force:
            return None
        cached = base.cache_weights
        if not cached:
            cached, left = _take(nbytes["cache"] - nbytes["ring"] - s.own_slot_bytes(n_res),
                                 "host" if e.cache_weights == "off" else "auto", left)
        grads_tier = "gpu" if grads_on_gpu else "host"
        # held gradients sent to the host keep the gradients' tier there; a norm pass holds none
        if not grads_first and not n_host_grads and not norm_pass:
            on, left = _take(gpu_grad_bytes(n_res) - nbytes["side_grad"]
                             - s.own_accumulator_bytes(n_res, n_res + n_str), e.grads_tier, left)
            grads_tier = "gpu" if on else "host"
        return replace(base, cache_weights=cached, grads_tier=grads_tier, gpu_resident_units=n_res,
                       gpu_streamed_units=n_str, host_grad_units=n_host_grads), left

    found = [c for c in (complete(*split, force=fixed_split) for split in splits) if c is not None]
    return found, complete(*splits[0], force=True)[0]


def choose_split(timer: Optional[StepTimer], candidates: List[Candidate]) -> Optional[Candidate]:
    """The fastest predicted of the candidates (`timer`: None without calibrated speeds, the first then). Among those
    within 1% of the fastest, the one with the most slack: the least busy of its forward's non-compute resources
    (host AdamW, H2D, D2H) relative to the forward's compute, so that an error in a calibrated rate costs the least."""
    if not candidates or timer is None:
        return candidates[0] if candidates else None
    scored = []
    for placement, free in candidates:
        times, _ = timer.predict(placement)
        load = max(times["host_adamw"], times["forward_h2d"], times["forward_d2h"]) / times["forward_compute"]
        scored.append((times["step"], load, -free, placement, free))
    best = min(c[0] for c in scored)
    chosen = min((c for c in scored if c[0] <= 1.01 * best), key=lambda c: (c[1], c[2]))
    return chosen[3], chosen[4]


class StreamPlanner:
    """One streamed run's plan: the figures every placement shares are computed once here; `plan()` searches the
    placements (or, on a CPU, takes the configured one) and returns the chosen one's rows and predicted step."""

    def __init__(self, spec, cfg, gpu_gib: float, host_gib: float, ex: Execution, fmt: StateFormat,
                 state_ranks: int = 1, norm_pass: Optional[str] = None):
        # the engine config as plain attributes: the placement search reads it some 10^5 times, and an OmegaConf
        # attribute read costs ~40 us (half the search's time on a qwen3b plan)
        self.e = SimpleNamespace(**OmegaConf.to_container(cfg.engine, resolve=True))
        self.norm_pass = self._norm_pass_mode(norm_pass or self.e.norm_pass, fmt,
                                              data_parallel_ranks(cfg, state_ranks), cfg.hardware.gpus)
        self.spec, self.hw, self.fmt = spec, cfg.hardware, fmt
        self.nvme_gib = self.hw.nvme_gib if self.hw.nvme_dir else 0.0
        self.gpu_gib, self.host_gib, self.on_gpu, self.state_ranks = gpu_gib, host_gib, ex.on_gpu, state_ranks
        s = self.s = StepShape(spec, cfg, ex.on_gpu, fmt, state_ranks, execution=ex)
        self.sp = Speeds.of_step(self.hw, spec, s, ex.compiled)
        self.timer = StepTimer(s, self.sp) if self.sp.known else None  # times every placement the search tries
        layouts, L = self.layouts, self.L = s.layouts, s.L
        self.n_units = len(layouts)
        self.compute_tier = "gpu" if ex.on_gpu else "host"
        self.ring_bytes = min(self.e.slots, L) * (s.compute_bytes * s.layer_cast + 4 * (s.layer_numel - s.layer_cast))
        self.side_grad_bytes = 4 * (layouts[0].numel + layouts[-1].numel + min(2, L) * s.layer_numel)
        self.cache_bytes = sum(s.slot_bytes(lay) for lay in layouts[1:-1])
        self.margin_gib = 2.0 + 0.05 * gpu_gib if ex.on_gpu else 0.0
        self.process_bytes = process_host_bytes(self.hw, s.compile_workers)  # in every placement's rows
        self.state_bytes = [fmt.state_bytes(lay.numel) for lay in layouts]  # master + m + v in their formats
        # the host-state units of the rank holding the most of them with none GPU-resident (the most any rank's host
        # is asked to hold), and their gradients (bf16 or int8 ones with the shared accumulators): the search puts
        # the gradients on the GPU first when that rank's host could not hold them
        fullest = self.held_units(0)
        self.fullest_state_bytes = sum(self.state_bytes[u] for u in fullest)
        self._gpu_grad_bytes: Dict[int, int] = {}  # `gpu_grad_bytes` by GPU-resident units
        self.fullest_grad_bytes = sum(fmt.grad_bytes(layouts[u].numel) for u in fullest) + (
            0 if fmt.grad == "fp32" else self.side_grad_bytes)
        self.moment_bytes = [fmt.state_bytes(lay.numel) - fmt.master_bytes(lay.numel) for lay in layouts]
        self.state_name = f"{fmt.master} master, {fmt.moments} Adam m + v"
        # the fixed working set but the kept graphs (`fixed_rows`, in every placement's rows)
        self.working_set_rows = [
            ("H2D staging buffer (fp32)", 4 * min(STAGING_ELEMS, max(lay.cast_numel for lay in layouts))),
            ("embedding + head slots", s.slot_bytes(layouts[0]) + s.slot_bytes(layouts[-1])),
            # both live at once in the backward; with a norm pass through its first backward too, the residual
            # stream being the head input its second head reads
            ("residual stream + its gradient, all micro-batches", 2 * 4 * s.h * s.step_tokens),
            ("working activations (one layer, or the loss chunk)", s.act)]
        self.kept_graph_bytes = s.kept_graph_bytes
        self.nvme_on = bool(self.hw.nvme_dir) and self.hw.nvme_gib > 0 and fmt.exact
        # the most host memory the NVMe tier could take over: every unit's moments, within its disk budget
        self.nvme_room = min(self.hw.nvme_gib * GIB, sum(self.moment_bytes)) if self.nvme_on else 0
        # the host AdamW updates fp32 state only: a low-precision format puts every unit on the GPU for its update
        self.gpu_updated_only = not fmt.exact
        self._check_fixed_split()

    def _norm_pass_mode(self, asked: str, fmt: StateFormat, ranks: int, gpus: int) -> str:
        """The norm pass's mode, `asked` (engine.norm_pass, or what the state-format choice plans) checked against
        what a norm pass needs, fp32 gradients and one process: on is refused without them, auto is off."""
        if ranks > 1:
            blocker = (f"this plan is one of {ranks} data-parallel ranks (hardware.gpus={gpus} with plan=true, or "
                       "torchrun's ranks), and the norm pass runs in one process only; set engine.norm_pass=auto "
                       "or off, or hardware.gpus=1")
        else:
            blocker = "" if fmt.grad == "fp32" else (
                f"it holds no gradient, so train.grad_dtype={fmt.grad} (a held copy's format) has no place in it; "
                "set train.grad_dtype=fp32 or auto, or engine.norm_pass=auto or off")
        if asked == "on" and blocker:
            raise PlanError(f"engine.norm_pass=on: {blocker}")
        if asked == "auto" and (blocker or norm_pass_conflicts(self.e)):
            return "off"
        return asked

    def gpu_grad_bytes(self, n_res: int) -> int:
        """The gradients on the GPU with the gradients' tier there, on the rank holding the most (`n_res`
        GPU-resident units): fp32, every unit's accumulator (each rank accumulates every unit's gradient before the
        sum over ranks); bf16 or int8, the shared accumulators (side_grad_bytes) and the held copies the rank reads
        at its updates (`StepShape.held_copy_bytes`: with sharded state, of the GPU-resident units and its own)."""
        if n_res not in self._gpu_grad_bytes:  # asked for every split of every search
            self._gpu_grad_bytes[n_res] = self.fmt.grad_bytes(sum(self.s.numels)) if self.fmt.grad == "fp32" else \
                self.side_grad_bytes + self.s.held_copy_bytes(n_res, self.n_units)
        return self._gpu_grad_bytes[n_res]

    # ---- the rows of one placement ------------------------------------------------------------------------------
    def fixed_rows(self, n_kept: int) -> List[Tuple[str, int]]:
        rows = [*self.working_set_rows,
                (f"autograd graphs of the last {n_kept} layers (no recompute)", n_kept * self.kept_graph_bytes)]
        if self.s.kept_routing_bytes:
            recomputed = self.L - n_kept
            rows.append((f"MoE routing kept for the recompute ({recomputed} layers, all micro-batches)",
                         recomputed * self.s.kept_routing_bytes))
        return rows

    def activation_bytes(self, n_kept: int, g: int) -> int:
        """The kept inputs of the recomputed layers (kept layers' inputs live in their graphs)."""
        return len(kept_layer_inputs(self.L, n_kept, g)) * 4 * self.s.h * self.s.step_tokens

    def regenerated_bytes(self, n_kept: int, g: int) -> int:
        """One recompute group's inputs, held on the GPU during its backward when the activations live there."""
        return min(g, self.L - n_kept) * 4 * self.s.h * self.s.step_tokens if g > 1 else 0

    def regenerated_host_bytes(self, n_kept: int, g: int) -> int:
        """On the host tier: the spare entries a recompute group's regenerated inputs wait in (g - 1 per micro-batch,
        the group's first input being a kept one)."""
        return (min(g, self.L - n_kept) - 1) * 4 * self.s.h * self.s.step_tokens if g > 1 else 0

    def kept_attention_bytes(self, layers: int) -> int:
        """The attention outputs and log-sum-exps `layers` lean layers keep on the GPU, all micro-batches."""
        return layers * kept_attention_bytes_per_token(self.spec.arch, self.s.compute_bytes) * self.s.step_tokens

    def with_kept_attention(self, placement: Placement, free: float) -> Placement:
        """`placement` with the kept attention outputs of engine.kept_attention_layers (-1: as many of the recomputed
        layers as `free` GPU bytes hold, the lean layer only), checked against the placement's own rows."""
        recomputed = self.L - placement.keep_activation_layers
        if self.e.kept_attention_layers >= 0:
            return replace(placement, kept_attention_layers=min(self.e.kept_attention_layers, recomputed))
        per_layer = self.kept_attention_bytes(1)
        n = min(recomputed, int(max(0.0, free) // per_layer)) if self.s.lean else 0
        while n > 0 and self.rows_for(replace(placement, kept_attention_layers=n)).problem():
            n -= 1
        return replace(placement, kept_attention_layers=n)

    def fetched_input_bytes(self) -> int:
        """On the host tier: the layer input fetched one micro-batch ahead for the backward, beside the current one."""
        return 4 * self.s.h * self.s.mb_tokens

    def held_units(self, n_res: int) -> set:
        """The host-state units of the rank that holds the most of them (all of them on one rank)."""
        if self.state_ranks <= 1:
            return set(range(n_res, self.n_units))
        owner = self.s.owners(n_res)
        per_rank = [{u for u, r in owner.items() if r == rank} for rank in range(self.state_ranks)]
        return max(per_rank, key=lambda units: sum(self.state_bytes[u] for u in units))

    def rows_for(self, placement: Placement) -> MemoryPlan:
        """The memory plan of one placement: every row, both tiers."""
        plan = MemoryPlan(engine="stream", limits_gib={
            "gpu": self.gpu_gib if self.on_gpu else 0.0, "host": self.host_gib,
            "nvme": self.nvme_gib})
        plan.placement = placement
        held = self.held_units(placement.gpu_resident_units)
        self._state_rows(plan, placement, held)
        for item, nbytes in self.fixed_rows(placement.keep_activation_layers):
            plan.add(self.compute_tier, item, nbytes)
        self._update_place_rows(plan, placement)
        self._gradient_rows(plan, placement, held)
        if placement.cache_weights:
            plan.add(self.compute_tier, "layer slots: one per layer (weights cached fwd -> bwd)", self.cache_bytes)
        else:
            plan.add(self.compute_tier, f"layer slots: ring of {min(self.e.slots, self.L)} (+ one per GPU-resident "
                     "layer)", self.ring_bytes + self.s.own_slot_bytes(placement.gpu_resident_units))
        if placement.kept_attention_layers:
            plan.add(self.compute_tier, f"attention outputs kept for the backward ({placement.kept_attention_layers} "
                     "lean layers, all micro-batches)", self.kept_attention_bytes(placement.kept_attention_layers))
        if self.on_gpu:
            plan.reserve("gpu", "allocator margin + CUDA context (reserved, not allocated)", int(self.margin_gib * GIB))
        add_process_row(plan, self.process_bytes, self.s.compile_workers)
        self._startup_row(plan, held, self.process_bytes)
        return plan

    def _state_rows(self, plan: MemoryPlan, placement: Placement, held: set) -> None:
        """The host-held state (master + moments, less what the NVMe tier holds) and the tier's own rows."""
        n_str = placement.gpu_streamed_units
        disk = [u for u in placement.disk_units if u in held]
        shard = f", this rank's {len(held)} of them" if self.state_ranks > 1 else ""
        plan.add("host", f"{self.state_name}: {n_str} GPU-streamed + {len(placement.host_units)} host-updated "
                 f"units{shard}" + (f" ({len(disk)} of them master only)" if disk else ""),
                 sum(self.state_bytes[u] for u in held) - sum(self.moment_bytes[u] for u in disk))
        if disk:
            plan.add("nvme", f"Adam m + v of the last {len(disk)} host-updated layers (a file in hardware.nvme_dir)",
                     nvme_file_bytes([self.layouts[u].numel for u in disk]))
            plan.add("host", f"NVMe tier staging ({STAGING_BUFFERS} x the largest such unit's m + v)",
                     STAGING_BUFFERS * nvme_file_bytes([max(self.layouts[u].numel for u in disk)]))

    def _update_place_rows(self, plan: MemoryPlan, placement: Placement) -> None:
        """GPU-resident state, the streamed updates' staging, the kept layer inputs and a regenerated group."""
        n_res, n_str = placement.gpu_resident_units, placement.gpu_streamed_units
        n_kept, g = placement.keep_activation_layers, placement.recompute_group
        if n_res:
            plan.add(self.compute_tier, f"{self.state_name}: {n_res} leading units resident, updated on the GPU",
                     self.s.resident_state_bytes(n_res))
        if n_str:
            with_grads = ", with its gradient from the host" if placement.host_grad_units else ""
            plan.add(self.compute_tier, f"staging for GPU-streamed updates (state of the largest of {n_str} units"
                     f"{with_grads}, x2)", self.s.staging_bytes(n_res, n_str, placement.host_grad_units))
        on_gpu = placement.activation_tier == "gpu"
        plan.add(self.compute_tier if on_gpu else "host", "layer-input activations (all micro-batches)",
                 self.activation_bytes(n_kept, g))
        if g > 1 and on_gpu:
            plan.add(self.compute_tier, f"regenerated layer inputs (one group of {g}, all micro-batches)",
                     self.regenerated_bytes(n_kept, g))
        if g > 1 and not on_gpu:
            plan.add("host", f"regenerated layer inputs (one group of {g} less its kept input, all micro-batches)",
                     self.regenerated_host_bytes(n_kept, g))
        if not on_gpu and self.on_gpu:
            plan.add(self.compute_tier, "layer input fetched ahead for the backward (one micro-batch)",
                     self.fetched_input_bytes())

    def _gradient_rows(self, plan: MemoryPlan, placement: Placement, held: set) -> None:
        """Where the gradients wait for the global norm, and the bf16 transfer's copies. Each GPU row is that of the
        rank holding the most of it (held copies, wire copies), the host rows those of `held`'s rank, but for the
        held bf16 gradients waiting there: the rank holding the most of those."""
        s, fmt, layouts, tier = self.s, self.fmt, self.layouts, self.compute_tier
        n_res = placement.gpu_resident_units
        n_gpu = n_res + placement.gpu_streamed_units
        n_host = len(placement.host_units)
        largest_host = max([layouts[u].numel for u in placement.host_units], default=0)
        grads_on_gpu = placement.grads_tier == "gpu"
        host_grads = placement.host_grad_units_range
        if grads_on_gpu:
            if fmt.grad == "fp32":
                plan.add(tier, f"{fmt.grad} gradients of every unit until the norm is known",
                         self.gpu_grad_bytes(n_res))
            if n_host:
                plan.add("host", f"pinned gradient staging ({s.grad_transfer}, 2 x largest host-updated unit)",
                         2 * s.transfer_bytes(largest_host))
        else:
            host_updated = s.transfer_bytes(sum(layouts[u].numel for u in held if u >= n_gpu))
            if placement.norm_pass:
                if host_updated:  # they wait for the host AdamW after the step, as without a norm pass
                    plan.add("host", f"{s.grad_transfer} gradients of host-updated units until the host AdamW",
                             host_updated)
                # every gradient is finished in these and used at once (or sent to the host)
                plan.add(tier, "accumulators: embedding, head, 2 layers (fp32), the norm pass's only gradients",
                         self.side_grad_bytes)
            else:
                plan.add("host", f"{s.grad_transfer} gradients of host-updated units until the global norm is known",
                         host_updated)
            if fmt.grad == "fp32" and not placement.norm_pass:
                plan.add(tier, f"accumulators: embedding, head, 2 layers (fp32); GPU-updated layers ({fmt.grad})",
                         self.side_grad_bytes + s.own_accumulator_bytes(n_res, n_gpu))
        if fmt.grad != "fp32":  # whatever the tier: the shared accumulators and the copies held for the updates
            plan.add(tier, "accumulators: embedding, head, 2 layers (fp32)", self.side_grad_bytes)
            plan.add(tier, f"{fmt.grad} gradients held until the norm is known ({self._held_copies_item(placement)})",
                     s.held_copy_bytes(n_res, n_gpu, len(host_grads)))
        if host_grads:
            mine = ", this rank's share" if self.state_ranks > 1 else ""
            plan.add("host", f"{fmt.grad} gradients of the last {len(host_grads)} GPU-streamed units until their "
                     f"update{mine}", s.host_held_grad_bytes(n_res, n_gpu, len(host_grads)))
            plan.add(tier, f"{fmt.grad} copies of those gradients for the D2H (stochastic rounding)",
                     s.host_grad_wire_bytes(n_res, host_grads))
        if n_host and s.grad_transfer == "bf16":
            # the bf16 copies the D2H reads: of the accumulators that serve host-updated units (the head, the
            # embedding when it is host-updated, the shared pair of layers when a layer is), or the fetch's pair
            wired = 2 * largest_host if grads_on_gpu else (
                layouts[-1].numel + (layouts[0].numel if n_gpu == 0 else 0)
                + (min(2, self.L) * s.layer_numel if n_gpu <= self.L else 0))
            plan.add(tier, "bf16 copies of host-updated units' gradients for the D2H (stochastic rounding)",
                     2 * wired)
            plan.add("host", "fp32 scratch the host AdamW upcasts each bf16 gradient into (largest host-updated unit)",
                     4 * largest_host)

    def _held_copies_item(self, placement: Placement) -> str:
        """Whose held gradient copies the GPU keeps (`StepShape.held_copy_bytes`)."""
        whose = "every unit" if self.state_ranks <= 1 else (
            "the GPU-resident units and this rank's own" if placement.gpu_resident_units else "this rank's units")
        return f"{whose} but the last {placement.host_grad_units} GPU-streamed" if placement.host_grad_units else whose

    def _startup_row(self, plan: MemoryPlan, held: set, process_bytes: int) -> None:
        """Start-up: the host masters are written while the other host buffers are not yet touched, but with a
        low-precision master each unit being initialised also holds an fp32 copy (HostStore); the plan's host
        figure is the larger of the two."""
        fmt = self.fmt
        held_numels = [self.layouts[u].numel for u in held]
        copies = init_copies(fmt.master, held_numels)
        startup = (sum(fmt.master_bytes(n) for n in held_numels) + copies * 4 * max(held_numels, default=0)
                   + process_bytes)
        if startup > plan.total("host"):
            plan.add("host", f"start-up peak above the rest: fp32 copies of the {copies} units initialised at once "
                     f"({fmt.master} master)", startup - plan.total("host"))

    # ---- choosing the placement ---------------------------------------------------------------------------------
    def _check_fixed_split(self) -> None:
        e, n_units = self.e, self.n_units
        if self.gpu_updated_only and e.gpu_resident_units >= 0 and e.gpu_streamed_units >= 0 \
                and e.gpu_resident_units + e.gpu_streamed_units < n_units:
            raise PlanError(f"{self.fmt.overrides()} is updated on the GPU only (the host AdamW runs fp32 state), "
                            f"but engine.gpu_resident_units={e.gpu_resident_units} + engine.gpu_streamed_units="
                            f"{e.gpu_streamed_units} leave {n_units - e.gpu_resident_units - e.gpu_streamed_units} "
                            f"of the {n_units} units (embedding, {self.L} layers, head) to it; make them add up to "
                            f"{n_units}, or leave one of them at -1 (auto)")

    def streamed_default(self, n_res: int) -> int:
        e = self.e
        return e.gpu_streamed_units if e.gpu_streamed_units >= 0 else (
            self.n_units - n_res if self.gpu_updated_only else 0)

    def with_nvme(self, placement: Placement) -> Placement:
        """`placement` with its `nvme_units`: the configured count, or (-1) the fewest host-updated units, last
        first, whose moments on disk make the host fit, within hardware.nvme_gib."""
        if self.e.nvme_units >= 0 or not self.nvme_on:
            n = max(0, self.e.nvme_units)
            return placement if placement.nvme_units == n else replace(placement, nvme_units=n)
        host_layers = len(nvme_layers(self.n_units, placement.host_units.start, self.n_units))
        best = replace(placement, nvme_units=0)
        best_host = self.rows_for(best).total("host")
        for n in range(1, host_layers + 1):  # the staging buffers cost host memory too: keep the n that saves most
            if best_host <= self.host_gib * GIB:
                break
            if nvme_file_bytes([self.layouts[u].numel for u in range(self.L + 1 - n, self.L + 1)]) \
                    > self.hw.nvme_gib * GIB:
                break
            candidate = replace(placement, nvme_units=n)
            host = self.rows_for(candidate).total("host")
            if host < best_host:
                best, best_host = candidate, host
        return best

    def fewest_host_grads(self, placement: Placement) -> Placement:
        """A fitting `placement` with as few held gradients on the host as its exact rows allow (the search's count
        is a conservative estimate), unless engine.host_grad_units fixes the count."""
        if self.e.host_grad_units >= 0 or self.rows_for(placement).problem():
            return placement
        while placement.host_grad_units:
            fewer = replace(placement, host_grad_units=placement.host_grad_units - 1)
            if self.rows_for(fewer).problem():
                break
            placement = fewer
        return placement

    def cpu_placement(self) -> Placement:
        """One memory: explicit choices are honoured so that CPU runs exercise every code path."""
        e = self.e
        # a low-precision format with nothing fixed: every unit resident
        n_res = self.n_units if self.gpu_updated_only and e.gpu_resident_units < 0 and e.gpu_streamed_units < 0 \
            else min(max(0, e.gpu_resident_units), self.n_units)
        return self.with_nvme(Placement(
            n_units=self.n_units, slots=min(e.slots, self.L), keep_activation_layers=max(0, e.keep_activation_layers),
            recompute_group=max(1, e.recompute_group), activation_tier="gpu" if e.activation_tier == "gpu" else "host",
            grads_tier="gpu" if e.grads_tier == "gpu" else "host", cache_weights=e.cache_weights == "on",
            gpu_resident_units=n_res, gpu_streamed_units=min(self.streamed_default(n_res), self.n_units - n_res),
            kept_attention_layers=min(max(0, e.kept_attention_layers), self.L - max(0, e.keep_activation_layers))
            if self.s.lean else 0,
            host_grad_units=min(max(0, e.host_grad_units), self.streamed_default(n_res), self.n_units - n_res)
            if self.fmt.grad == "bf16" and e.grads_tier != "gpu" else 0, norm_pass=self.norm_pass == "on"))

    def gpu_placement(self) -> Tuple[Placement, str]:
        """(the placement, a note for a refusal) of the search on a GPU in the norm pass's mode: off or on, one
        search; auto, the search that holds the gradients first and, only when nothing fits with it, the search with
        a norm pass, taken when it fits (a refusal then shows the first and says what the second needed)."""
        placement, unfit_note = _GpuSearch(self, norm_pass=self.norm_pass == "on").run()
        if self.norm_pass != "auto" or not self.rows_for(placement).problem():
            return placement, unfit_note
        norm_pass, norm_pass_note = _GpuSearch(self, norm_pass=True).run()
        rows = self.rows_for(norm_pass)
        if not rows.problem():
            return norm_pass, norm_pass_note
        return placement, (f"{unfit_note} " if unfit_note else "") + norm_pass_unfit_note(rows)

    def plan(self) -> MemoryPlan:
        unfit_note = ""
        if not self.on_gpu:
            placement = self.cpu_placement()
        else:
            placement, unfit_note = self.gpu_placement()
        plan = self.rows_for(placement)
        if unfit_note:
            plan.notes.append(unfit_note)
        if self.timer:
            plan.times_s, plan.binding = self.timer.predict(placement)
            plan.speeds = self.sp.describe(self.hw)
        return plan


class _GpuSearch:
    """The search over splits, kept-graph counts and recompute groups for a run on a GPU: the fastest predicted
    placement that fits both tiers, else the closest one (for the refusal to show)."""

    def __init__(self, planner: StreamPlanner, norm_pass: bool):
        p = self.p = planner
        self.norm_pass = norm_pass
        e = self.e = SimpleNamespace(**{**vars(p.e), **NORM_PASS_SETTINGS}) if norm_pass else p.e
        n_units = p.n_units
        self.splits = [(r, t) for r in ([min(e.gpu_resident_units, n_units)] if e.gpu_resident_units >= 0
                                        else range(n_units + 1))
                       for t in ([min(e.gpu_streamed_units, n_units - r)] if e.gpu_streamed_units >= 0
                                 else range(n_units - r + 1))
                       if not p.gpu_updated_only or r + t == n_units]
        self.kept_choices = [e.keep_activation_layers] if e.keep_activation_layers >= 0 else range(p.L + 1)
        if not p.sp.known:  # no speeds to choose by: what the config fixes, else every update on the host
            n_res = min(max(0, e.gpu_resident_units), n_units)
            self.splits = [(n_res, min(p.streamed_default(n_res), n_units - n_res))]
            self.kept_choices = [max(0, e.keep_activation_layers)]
        self.fixed_split = e.gpu_resident_units >= 0 and e.gpu_streamed_units >= 0
        self.fixed_bytes = {n_kept: sum(b for _, b in p.fixed_rows(n_kept)) for n_kept in self.kept_choices}
        # the process, the state and every gradient but the embedding's, the head's and two layers' (those are in
        # the shared accumulators), whichever tier holds them; with sharded state a rank's share of them, at least
        # 1 / state_ranks (the GPU-resident units are on every rank), so that the bound stays a necessary condition.
        # A norm pass holds host-updated units' gradients only, which may be none
        held_grads = 0 if norm_pass else p.fmt.grad_bytes(sum(lay.numel for lay in p.layouts[1:-1])
                                                          - min(2, p.L) * p.s.layer_numel)
        self.held_anyway = p.process_bytes - p.nvme_room + (sum(p.state_bytes) + held_grads) / p.state_ranks

    def hbm_left(self, n_kept: int) -> float:
        """GPU bytes beyond the fixed working set, the layer ring, the shared accumulators and the margin."""
        p = self.p
        return p.gpu_gib * GIB - self.fixed_bytes[n_kept] - p.ring_bytes - p.side_grad_bytes - p.margin_gib * GIB

    def search(self, g: int) -> Tuple[List[Candidate], Placement, List[Candidate]]:
        """(every candidate placement with recompute groups of `g`, the forced placement of the first split, the
        candidates that fit both tiers)."""
        p = self.p
        candidates, fallback = [], None
        for n_kept in self.kept_choices:
            nbytes = {
                "free": self.hbm_left(n_kept),
                "host_free": p.host_gib * GIB - p.fullest_state_bytes - 2 * GIB + p.nvme_room,
                "activation": p.activation_bytes(n_kept, g), "regenerated": p.regenerated_bytes(n_kept, g),
                "regenerated_host": p.regenerated_host_bytes(n_kept, g), "fetched": p.fetched_input_bytes(),
                "grad_host": p.fullest_grad_bytes, "side_grad": p.side_grad_bytes, "cache": p.cache_bytes,
                "ring": p.ring_bytes}
            found, forced = _placements(p.s, self.e, n_kept, g, self.splits, self.fixed_split, nbytes,
                                        p.gpu_grad_bytes, self.norm_pass)
            if not found and self.norm_pass and self.e.activation_tier == "auto":
                # the layer inputs, given HBM first, may leave no split room where on the host they would; the
                # norm pass is the last resort of a plan, so it tries that too
                found, forced = _placements(p.s, SimpleNamespace(**{**vars(self.e), "activation_tier": "host"}),
                                            n_kept, g, self.splits, self.fixed_split, nbytes, p.gpu_grad_bytes, True)
            if fallback is None:
                fallback = forced
            candidates += found
            if not found and self.e.keep_activation_layers < 0:
                break  # more kept graphs fit no better
        candidates = [(p.with_nvme(placement), free) for placement, free in candidates]
        return candidates, p.with_nvme(fallback), [c for c in candidates if not p.rows_for(c[0]).problem()]

    def may_fit(self, g: int) -> bool:
        """A necessary condition for groups of `g` to fit, cheap beside `search`: for some kept-graph count, HBM
        holds the working set and the host holds what of the state, kept inputs and gradients the rest of HBM
        cannot."""
        p = self.p
        for n_kept in self.kept_choices:
            left = self.hbm_left(n_kept) + p.ring_bytes - min(p.ring_bytes, p.cache_bytes)  # cached slots: no ring
            acts = p.activation_bytes(n_kept, g)
            # the activations on the GPU (a group regenerated there), or on the host (its spares there too)
            for gpu_bytes, host_bytes in ((p.regenerated_bytes(n_kept, g), acts),
                                          (p.fetched_input_bytes(), acts + p.regenerated_host_bytes(n_kept, g))):
                spare = left - gpu_bytes
                if spare >= 0 and self.held_anyway + host_bytes - spare <= p.host_gib * GIB:
                    return True
        return False

    def run(self) -> Tuple[Placement, str]:
        """(the chosen placement, a note for a refusal when no recompute group fitted either)."""
        p, e = self.p, self.e
        unfit_note = ""
        candidates, fallback, fitting = self.search(max(1, e.recompute_group))
        if e.recompute_group < 0 and not fitting:  # every input kept does not fit: the smallest group that does
            groups = range(2, p.L - min(self.kept_choices) + 1)
            for g in groups:
                found = self.search(g) if self.may_fit(g) else None
                if found and found[2]:
                    candidates, fallback, fitting = found
                    break
            if not fitting and groups:
                unfit_note = (f"No engine.recompute_group from 2 to {groups[-1]} (recompute groups, one layer input "
                              "kept per group) fits either.")
        chosen = choose_split(p.timer, fitting)
        if chosen is None and candidates:  # nothing fits both tiers: the closest plan, for the refusal to show
            chosen = min(candidates, key=lambda c: p.rows_for(c[0]).overflow_bytes())
        placement, free = chosen if chosen else (fallback, 0.0)
        if self.norm_pass:  # its first backward would consume kept attention outputs: none kept, no gradient held
            return placement, unfit_note
        return p.with_kept_attention(p.fewest_host_grads(placement), free), unfit_note
