"""StreamEngine: the streaming engine's step, the one place that orders work.

One step over M micro-batches:
1. Forward, layer-major. The embedding, then each decoder layer is visited once: its weights arrive in a slot
   (H2D, prefetched `slots - 1` units ahead), all M micro-batches run through it without autograd, and each layer
   input is kept in the activation store (GPU, or pinned host memory via the D2H stream). A unit's compute is
   queued before the engine waits for the host update of the units after it, so compute(k) never waits for
   update(k+1); look-ahead loads of units already updated are queued before compute(k), the others after it.
2. Head. Final norm + LM head + cross-entropy run forward and backward per micro-batch right away (the loss is the
   end of the graph), giving each micro-batch's residual gradient and the head's parameter gradient.
3. Backward, layers L..1. Each layer's weights are found still resident (the last `slots` layers of the forward, or
   every layer when the plan caches weights) or streamed again; each micro-batch's forward is recomputed from its kept
   input with autograd on and back-propagated with `torch.autograd.grad` (`ModelSpec.layer_grads`: a layer's
   recompute stops before the down projection, whose output no gradient needs; a MoE layer's reuses the routing its
   forward kept, `ModelSpec.forward_keeping`). The last `keep_activation_layers` layers
   skip that recompute: their forward ran with autograd on and kept its graph (which reads the weights in the layer's
   own slot), so their backward starts from it. The lean layer's last `kept_attention_layers` recomputed layers keep
   their attention output on the GPU from the forward, and their backward runs no attention forward. With recompute
   groups (`recompute_group` = g > 1, for contexts whose layer inputs do not fit: 7 GiB per layer for qwen7b at 512K
   tokens) only every g-th layer input is kept; when the backward reaches a group, the group's forward runs again
   without autograd from its kept input, layer-major (each layer's weights load once more), and its inputs wait for
   their layers' backward on the GPU, or on the host tier in spare host entries (fetched back one ahead): s - 1 extra layer
   forwards per group of s layers, exact (the same ops on the same weights), where keeping inputs in bf16 instead would
   not be. The layer's gradient accumulates in fp32 on the GPU over micro-batches (bf16 autograd gradients are upcast
   exactly, as autocast's cast-backward does in the reference); the last micro-batch's accumulation also writes each
   tensor's sum of squares into the step's buffer (on the GPU from the fused kernel's registers, so no pass of its own
   reads the gradient again: engine/streaming/gradients.py), and the gradient either stays on the GPU (grads tier gpu)
   or goes to pinned host memory on the D2H stream (fp32, or rounded to bf16: see below). Then the embedding's backward
   (a scatter-add, no weights). The head and the embedding take their sums of squares at their last accumulation too (a
   tied embedding's: the lookup's last micro-batch, after the head's adds).
4. Optimizer. The global norm (`optim.global_norm` of the sums of squares) needs every gradient, so the host reads it
   once, after the backward (the step's single synchronisation). A non-finite norm skips the update. Otherwise each unit
   is updated in the place the plan gave it (engine/placement.py), in forward order: the leading `gpu_resident_units`
   (state in GPU memory) at once on the compute stream; the next `gpu_streamed_units` (state in pinned host memory) on
   the GPU when the next forward loads them, their master, m and v coming in over H2D and going back over D2H, the fresh
   weights cast straight into their slot (engine/streaming/streamed_update.py); the rest by a worker thread running the
   host AdamW unit by unit, fetching GPU-tier gradients through a two-deep pinned staging pair and raising each unit's
   "updated" flag. The next step's forward streams unit u as soon as its flag is up, so the host update of step t
   overlaps the forward of step t+1, with a lead of the GPU-updated units' forward time. Every read of a gradient
   accumulator (D2H, the optimizer's fetch, a GPU update) records an event that the next overwrite of that accumulator
   waits for (engine/streaming/gradients.py).

Norm pass (`placement.norm_pass`, docs/design.md). Steps 2 and 3 run twice. The first time (`first_pass`) each
unit's finished gradient gives its sums of squares and is dropped; kept layer inputs (GPU tier) and a MoE layer's
kept routing stay for the second time, and the last layer's outputs stay for the second head. After the norm is read
the second time runs and hands each finished gradient to its update at once (`_hand_off_grad`): GPU-resident units
on the compute stream, GPU-streamed ones through `StreamedUpdater.update_now` (no slot; the next forward loads them
from home), host-updated ones over D2H as above. No gradient is held, and GPU-updated layers share the ring of two
accumulators. A skipped step runs no second time.

The embedding and head are streamed like layers (their master weights and moments stay on the host, so a 24 GB
GPU can train a 150K-vocabulary model), each into a slot of its own: they differ in size from a layer, and a ring
slot sized for the embedding would waste that difference in every slot. The embedding stays fp32 (it feeds a lookup,
not an autocast matmul). Layers share a ring of `engine.slots` slots, or one slot each when the plan caches
weights from forward to backward. With tied
embeddings the head reads the embedding slot's matrix and both gradients accumulate into the embedding's
accumulator (head first, then the lookup: the same sum as the reference, in a different order of the same terms,
so tied models agree with the reference to fp32 rounding rather than bit for bit).

Low-precision state formats (engine/formats.py) are updated on the GPU only (GPU-resident and GPU-streamed units;
the planner gives none to the host): master and moments live in the formats, in HBM or in pinned host memory
(`optim.FormatAdamW` over `optim.format_state_buffers`), each unit is updated by the fused kernel
(streamtrain_kernels/adamw_update.py, which applies the clip coefficient itself), and slots are filled from the
low-precision master as from an fp32 one. With bf16 gradients the layers accumulate in a shared fp32 pair and each
unit's finished gradient is rounded stochastically into a bf16 copy held until its update (keyed as
engine=reference keys it, so both engines round alike), in GPU memory or, for the last `host_grad_units` streamed
units, in pinned host memory: rounded into its accumulator's wire copy and sent over D2H (`_hold_on_host`), then
fetched beside the unit's state at its update (engine/streaming/streamed_update.py); the norms are of the rounded copies, taken by
`optim.sq_norms` in a pass of their own (2 B/element): the rounding kernel works on the flat buffer without the
layout's tensor boundaries, and the fp32 path is the one whose speed matters. int8 gradients go the same way, in GPU
memory only: the quantizer writes the unit's codes and block scales into its held copy and the dequantized values
back over the accumulator, whose norms are then taken (4 B/element), and the update kernel decodes the codes.

bf16 gradient transfer (`train.grad_transfer_dtype=bf16`; fp32 state, so there are host-updated units). Only the
host-updated units' gradients cross the link, and they may cross it as bf16: each finished fp32 gradient is rounded
stochastically on the GPU (`to_bf16_stochastic`, keyed by run seed, unit and Adam step:
`gradients.transfer_seed`), into a bf16 copy beside its accumulator just before the D2H (grads tier host), or by
the optimizer's fetch into one of two bf16 buffers (grads tier gpu). The host gradients and the pinned staging pair
then hold bf16, 2 B/param instead of 4, and the D2H moves half the bytes; the host AdamW upcasts each unit's gradient
into one fp32 scratch (the size of the largest host-updated unit) just before its update, and the clip coefficient
scales the upcast values. The norms are still taken from the fp32 gradients on the GPU, before the rounding, so the
clip coefficient is the fp32 run's; the rounding is unbiased, so each update is the fp32 one in expectation. Cost:
2 B/param of HBM for the bf16 copies (the accumulators serving host-updated units, or the fetch's pair), and a
rounding pass (read 4, write 2 B/element) per host-updated unit. GPU-updated units are untouched; a placement that
leaves no unit to the host makes the option a no-op, which `notes` says for the run log.

Data parallel (engine/distributed.py). Each finished gradient is summed over ranks on a `comm` stream before its
reader sees it; with sharded state (the default) the sum goes to the unit's owner only, and every load of a unit
whose state another rank holds is a broadcast of that rank's freshly filled slot, on the same stream.

On a CPU-only torch every stream and event is a synchronous stand-in (engine/device.py): same code, no overlap.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from engine import optim
from engine.distributed import SINGLE, DataParallel, state_owners
from engine.device import Device, autocast_ctx
from engine.formats import GRAD_STREAM, StateFormat, update_seed
from streamtrain_kernels.grad_accum import to_bf16_stochastic
from streamtrain_kernels.grad_quant import quantize_grad_int8
from engine.batch import Batch, loss_tokens
from engine.model import ModelSpec, backprop
from engine.model.rope import Positions
from engine.optim import FlatAdamW
from engine.placement import Placement
from engine.streaming.activations import ActivationStore
from engine.streaming.gradients import GradAccumulator, transfer_seed
from engine.streaming.host_store import HostStore, init_master
from engine.streaming.nvme import MomentFile, NvmeError
from engine.streaming.slots import Slot, WeightLoader
from engine.streaming.stall_timer import StallTimer
from engine.streaming.streamed_update import StreamedUpdater


class OptimizerPassError(RuntimeError):
    """A host optimizer pass failed at one unit: the state of the units it had not finished is stale, so the run
    stops before the next update reads it (the NVMe tier's own failures are `NvmeError`s, which name the file)."""

    def __init__(self, unit: int, unit_name: str, step: int, cause: BaseException):
        super().__init__(f"the host AdamW update of unit {unit} ({unit_name}) after step {step} failed: "
                         f"{type(cause).__name__}: {cause}")


def _leaves(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().requires_grad_() for k, v in params.items()}


class StreamEngine:
    name = "stream"

    def __init__(self, spec: ModelSpec, cfg, device: torch.device, compute_dtype: torch.dtype, placement: Placement,
                 dp: DataParallel = SINGLE):
        t = cfg.train
        self.spec, self.t, self.compute_dtype, self.dp = spec, t, compute_dtype, dp
        self.dev = Device(device)
        if placement.n_units != len(spec.units):
            raise ValueError(f"a placement of {placement.n_units} units for a model of {len(spec.units)}")
        self.placement = placement
        # a norm pass (engine.norm_pass): a first backward takes the global norm only, a second updates each unit as
        # its gradient is finished, so no gradient is held (`_gradients`); `first_pass` is true during the first
        self.norm_pass, self.first_pass = placement.norm_pass, False
        if self.norm_pass and dp.active:
            raise ValueError("engine.norm_pass=on runs one process; under torchrun set engine.norm_pass=off")
        self.grads_on_gpu = placement.grads_tier == "gpu"
        self.cache_weights = placement.cache_weights
        activations_on_gpu = placement.activation_tier == "gpu"
        L, M = spec.num_layers, t.grad_accum
        self.shape_BTD = (t.micro_batch_size, t.seq_len, spec.arch.hidden)
        B, T, D = self.shape_BTD
        # recompute groups: of the recomputed layers (all but the last `keep_activation_layers`), only the inputs
        # with index i % recompute_group == 0 are kept; the backward regenerates the others (`_regenerate`)
        self.recompute_group = placement.recompute_group
        self.stored_inputs = list(placement.kept_layer_inputs)
        # on the host tier a group's regenerated inputs go to the host too, into g - 1 spare entries per micro-batch
        self.regenerate_spares = 0 if activations_on_gpu else (self.recompute_group - 1) * M
        activation_numel = 0 if activations_on_gpu else (len(self.stored_inputs) * M + self.regenerate_spares) * B * T * D
        n_units = len(spec.units)
        # the three update places (engine/placement.py), in forward order: GPU-resident, GPU-streamed, host
        n_resident = placement.gpu_resident_units
        self.resident_units = set(placement.resident_units)
        self.streamed_units = list(placement.streamed_units)
        self.host_units = list(placement.host_units)
        self.gpu_updated = set(placement.gpu_updated_units)
        self.seed = cfg.seed
        # bf16 transfer (train.grad_transfer_dtype): the host-updated units' gradients cross the link as bf16
        self.transfer_bf16 = t.grad_transfer_dtype == "bf16" and bool(self.host_units)
        self.notes: List[str] = []  # for the run log
        # called with (phase, layers done) after each layer of the forward and the backward (engine/progress.py)
        self.layer_progress: Optional[Callable[[str, int], None]] = None
        if t.grad_transfer_dtype == "bf16" and not self.host_units:
            self.notes.append(f"train.grad_transfer_dtype=bf16 has no effect: the placement updates all {n_units} "
                              "units on the GPU (engine.gpu_resident_units + engine.gpu_streamed_units), so no "
                              "gradient goes to the host")
        self.fmt = StateFormat.of(t)
        if self.norm_pass and self.fmt.grad != "fp32":
            raise ValueError(f"engine.norm_pass=on holds no gradient, so it has no use for train.grad_dtype="
                             f"{self.fmt.grad} (a held copy's format); use train.grad_dtype=fp32")
        if not self.fmt.exact and self.host_units:
            raise ValueError(f"{self.fmt.overrides()} is updated on the GPU only (the host AdamW runs fp32 state), "
                             f"but the placement leaves units {self.host_units[0]}..{self.host_units[-1]} to it")
        # the NVMe tier: the Adam moments of the last host-updated units live in a file (engine/streaming/nvme.py)
        n_disk = placement.nvme_units
        disk_units = placement.disk_units
        if len(disk_units) < n_disk:
            raise ValueError(f"engine.nvme_units={n_disk}, but only {len(disk_units)} decoder layers are "
                             "host-updated")
        # sharded state (engine/distributed.py): the host-state units' owners; this rank holds and updates its own
        self.owner: Dict[int, int] = {}
        if dp.active and cfg.engine.shard_state:
            self.owner = state_owners(spec, n_resident, dp.world)
        self.my_streamed_units, self.my_host_units, self.disk_units = (
            [u for u in units if self.owns(u)] for units in (self.streamed_units, self.host_units, disk_units))
        # bf16 gradient formats: the GPU-streamed units whose held gradients wait in pinned host memory
        self.host_held = [u for u in placement.host_grad_units_range if self.owns(u)]
        if self.host_held and self.fmt.grad != "bf16":
            raise ValueError(f"engine.host_grad_units={placement.host_grad_units} places held bf16 gradients, and "
                             f"train.grad_dtype={t.grad_dtype} holds none")
        host_grad_units = self.host_held + ([] if self.grads_on_gpu else self.my_host_units)
        self.store = HostStore(spec, pin=self.dev.cuda, grad_units=host_grad_units,
                               grad_staging=2 if self.grads_on_gpu and self.my_host_units else 0,
                               host_activation_numel=activation_numel, seed=cfg.seed,
                               host_units=self.my_streamed_units + self.my_host_units,
                               streamed_units=self.my_streamed_units, fmt=self.fmt, disk_units=self.disk_units,
                               grad_dtype=torch.bfloat16 if self.transfer_bf16 or self.host_held else torch.float32)
        layouts = self.store.layouts
        self.nvme: Optional[MomentFile] = None
        if self.disk_units:
            self.nvme = MomentFile(cfg.hardware.nvme_dir, {u: layouts[u].numel for u in self.disk_units},
                                   cfg.hardware.nvme_direct_io)
            self.notes += [f"removed {p}, the NVMe tier file of a run that is gone" for p in self.nvme.stale_removed]
            self.notes.append(f"NVMe tier: the Adam moments of layers {self.disk_units[0]}..{self.disk_units[-1]} "
                              f"in {self.nvme.path} ({self.nvme.size / 2**30:.2f} GiB)")
        # each unit's state by name ("master", "m", "v"[, "m_scales", "v_scales"]): in the host store, or, for the
        # GPU-resident units, in GPU memory, initialised in fp32 there and rounded to the format
        states = [{name: self.store.state[name][u] for name in self.store.state} for u in range(n_units)]
        for u in sorted(self.resident_units):
            states[u] = optim.format_state_buffers(self.fmt, layouts[u].numel, device)
            init_master(spec, spec.units[u], states[u]["master"], cfg.seed)
        self.master, self.m, self.v = ([st[k] for st in states] for k in ("master", "m", "v"))

        self.h2d, self.d2h, self.opt_d2h = self.dev.new_stream(), self.dev.new_stream(), self.dev.new_stream()
        # data parallel: each finished gradient is summed over ranks on this stream (engine/distributed.py)
        self.comm = self.dev.new_stream() if dp.active else None
        self.timer = StallTimer(self.dev)
        self.streamed = StreamedUpdater(self.dev, self.h2d, self.d2h, layouts, self.my_streamed_units,
                                        {k: [st[k] for st in states] for k in states[0]}, self.timer,
                                        {u: self.store.grads[u] for u in self.host_held})
        # a streamed unit's update runs over its GPU staging views (fp32: the AdamW is built over them; a format:
        # they are passed to each update), the others' over their own buffers
        self.opt, self.format_opt = None, None
        if self.fmt.exact:
            opt_state = {"master": list(self.master), "m": list(self.m), "v": list(self.v)}
            for u in self.my_streamed_units:
                for which, view in self.streamed.state_views(u).items():
                    opt_state[which][u] = view
            for u in self.disk_units:  # rebound to the unit's staging buffer before each of its updates
                opt_state["m"][u], opt_state["v"][u] = self.nvme.staging_views(u)
            self.opt = FlatAdamW(layouts, opt_state["master"], opt_state["m"], opt_state["v"], t,
                                 units=[u for u in range(n_units) if self.owns(u)])
        else:
            self.format_opt = optim.FormatAdamW(layouts, self.fmt, t, cfg.seed, states, device)
        self.loader = WeightLoader(self.dev, self.h2d, self.master, layouts, compute_dtype, self.timer)
        layer_layouts = [u.layout for u in spec.layer_units]
        self.embed_slot = self.loader.new_slot([layouts[0]])
        self.head_slot = self.loader.new_slot([layouts[-1]])
        n_layer_slots = L if self.cache_weights else placement.slots
        self.layer_slots = [self.loader.new_slot(layer_layouts) for _ in range(n_layer_slots)]
        self.device_slots = {} if self.cache_weights else {
            u: self.loader.new_slot([layouts[u]]) for u in sorted(self.resident_units) if 0 < u <= L}
        # the last `keep_activation_layers` layers keep their forward's autograd graph (no recompute); the graph
        # reads the layer's weights in its slot, so each has a slot of its own until its backward
        self.kept_layers = set(range(L - placement.keep_activation_layers + 1, L + 1))
        # the recomputed layers whose forward keeps its attention output on the GPU (the lean layer's KeptAttention)
        self.kept_attention_units = set(placement.kept_attention_units)
        if self.kept_attention_units and not spec.compute.lean:
            raise ValueError(f"engine.kept_attention_layers={placement.kept_attention_layers} needs the lean layer "
                             "(train.lean_layer), whose backward takes a kept attention output")
        # (unit, micro-batch) -> what a recomputed layer's forward kept for its backward (`ModelSpec.forward_keeping`):
        # the lean layer's attention output, a MoE layer's routing
        self.kept_forward: Dict[Tuple[int, int], object] = {}
        self.kept_slots = {} if self.cache_weights else {
            u: self.loader.new_slot([layouts[u]]) for u in sorted(self.kept_layers) if u not in self.device_slots}
        self.graphs: Dict[Tuple[int, int], tuple] = {}  # (layer unit, micro-batch) -> (input leaf, output, params)
        self.slot_version: Dict[int, int] = {}  # id(slot) -> weights version it holds

        fused = cfg.engine.fused_kernels
        # with bf16 transfer, the accumulators whose gradients go to the host D2H carry a bf16 wire copy; with
        # gradients on the GPU, the optimizer's fetch rounds into a pair of bf16 buffers instead (`_optimizer_pass`)
        # (a unit's held bf16 gradient that waits on the host is rounded into its accumulator's wire copy too)
        wired = set(self.host_units if self.transfer_bf16 and not self.grads_on_gpu else ()) | set(self.host_held)
        self.acc: Dict[int, GradAccumulator] = {
            u: GradAccumulator(self.dev, layouts[u], fused, wire=u in wired) for u in (0, L + 1)}
        # bf16 or int8 gradients (a format's train.grad_dtype): every unit's gradient is held as a stochastically
        # rounded copy until its update (in GPU memory, or for bf16 `host_held` units in the host store's gradient
        # buffers); the layers accumulate in fp32 in a shared pair, as with gradients on the host. Only the rank that
        # updates a unit reads its held copy (with sharded state the others' sum ends at the reduce), so each rank
        # holds the copies of its own units
        self.holds_grads = self.fmt.grad != "fp32"
        self.held: Dict[int, GradAccumulator] = {}
        if self.holds_grads:
            held_dtype = torch.bfloat16 if self.fmt.grad == "bf16" else torch.int8
            self.held = {u: GradAccumulator(self.dev, layouts[u], fused, held_dtype,
                                            scale_blocks=self.fmt.n_blocks(layouts[u].numel),
                                            home=self.store.grads[u] if u in self.host_held else None)
                         for u in range(n_units) if self.owns(u)}
        shared_layer_accs = not self.grads_on_gpu or self.holds_grads
        # GPU-updated layers need their own accumulators only when the other layers share a ring and the updates
        # wait for the norm (a norm pass updates each unit before the ring comes round to its accumulator again)
        self.device_accs = {} if self.grads_on_gpu or self.holds_grads or self.norm_pass else {
            u: GradAccumulator(self.dev, layouts[u], fused) for u in sorted(self.gpu_updated) if 0 < u <= L}
        n_layer_accs = min(2, L) if shared_layer_accs else L
        self.layer_accs = [GradAccumulator(self.dev, layer_layouts[0], fused, wire=any(0 < u <= L for u in wired))
                           for _ in range(n_layer_accs)]
        self.wire_pair: List[torch.Tensor] = []
        if self.transfer_bf16 and self.grads_on_gpu:
            largest = max(layouts[u].numel for u in self.host_units)
            self.wire_pair = [torch.empty(largest, dtype=torch.bfloat16, device=device) for _ in range(2)]

        # the step's per-tensor sums of squares in canonical order, and each unit's slice of them
        n_tensors = [len(lay.specs) for lay in layouts]
        self.sq_norms = torch.zeros(sum(n_tensors), dtype=torch.float32, device=device)
        self.sq_slices = self.sq_norms.split(n_tensors)

        self.activations = ActivationStore(self.dev, self.h2d, self.d2h, self.store.activations,
                                           self.stored_inputs, M, self.shape_BTD, self.timer,
                                           spare_entries=self.regenerate_spares)
        # (input index, micro-batch) -> a regenerated layer input on the GPU tier (the host tier's are in the store)
        self.regenerated: Dict[Tuple[int, int], torch.Tensor] = {}
        self.tables = spec.positions(t.seq_len, device)
        self.pos: List[Positions] = []  # the current step's micro-batches' positions
        self.version = 0  # number of optimizer passes submitted: the weights' generation
        self.updated = [threading.Event() for _ in spec.units]
        for ev in self.updated:
            ev.set()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-adamw")
        self.pending: Optional[Future] = None
        self.current_host_unit = 0  # the unit the optimizer thread is updating, named if it fails
        self.skipped_steps = 0
        self.last_optimizer_s = 0.0
        self.last_nvme_io: Dict[str, float] = {}  # MomentFile.take_io_stats of the last optimizer pass
        self.optimizer_wait_s = 0.0

    def owns(self, unit: int) -> bool:
        """Whether this rank holds and updates unit's state (every unit, unless the state is sharded)."""
        return self.owner.get(unit, self.dp.rank) == self.dp.rank

    # ---- weights --------------------------------------------------------------------------------------------
    def _check_optimizer(self, waiting_for: str) -> None:
        """Called while the engine's thread waits on the optimizer thread: raise if that thread has ended."""
        if self.pending is not None and self.pending.done():
            self._collect_pass()  # re-raises the optimizer thread's exception
            raise RuntimeError(f"host optimizer finished without {waiting_for}")

    def _collect_pass(self) -> None:
        """Wait for the last optimizer pass to finish, its disk writes included, and raise its error if it failed.
        Collected once: a failed pass is reported where it is found, not again by `close`."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _wait_updated(self, unit: int) -> None:
        ev = self.updated[unit]
        if ev.is_set():
            return
        start, stall = time.perf_counter(), self.timer.stall_begin()
        while not ev.wait(0.5):
            self._check_optimizer(f"updating unit {unit}")
        self.timer.stall_end(stall, "optimizer")
        self.optimizer_wait_s += time.perf_counter() - start

    def _slot_for(self, unit: int, pinned_units: Sequence[int]) -> Slot:
        if unit == 0:
            return self.embed_slot
        if unit == self.spec.num_layers + 1:
            return self.head_slot
        if self.cache_weights:
            return self.layer_slots[unit - 1]
        if unit in self.device_slots:
            return self.device_slots[unit]
        if unit in self.kept_slots:
            return self.kept_slots[unit]
        for slot in self.layer_slots:
            if slot.unit == unit:
                return slot
        busy = {u for u in pinned_units}
        for slot in self.layer_slots:  # least recently loaded slot whose unit is not needed now
            if slot.unit not in busy:
                self.layer_slots.remove(slot)
                self.layer_slots.append(slot)
                return slot
        raise RuntimeError("no free layer slot: more units requested at once than engine.slots")

    def _ensure_loaded(self, units: Sequence[int], busy: Sequence[int], wait: bool = True) -> None:
        """Make sure each unit's current weights are in (or on their way to) a slot, in order, without evicting a
        unit of `busy`. A unit whose update of the last step is still pending is waited for, or with `wait=False`
        ends the call (loads stay in order, so the ring's least-recently-loaded order stays the use order)."""
        for unit in units:
            slot = self._slot_for(unit, busy)
            if slot.unit == unit and self.slot_version.get(id(slot)) == self.version:
                continue
            if not wait and not self._agreed(self.updated[unit].is_set()):
                return
            owner = self.owner.get(unit)
            if owner is None or owner == self.dp.rank:
                self._wait_updated(unit)
                if unit in self.streamed.pending:
                    self.streamed.update(unit, self._streamed_step, slot)
                else:
                    self.loader.load(unit, slot, after=self.streamed.landed.get(unit))
            if owner is not None:
                self._share_slot(unit, slot, owner)
            self.slot_version[id(slot)] = self.version

    def _agreed(self, ready: bool) -> bool:
        """Whether a look-ahead load goes ahead now: with sharded state, on every rank or none (the loads are
        collectives, issued in the same order everywhere), when the unit's owner has it updated."""
        return self.dp.all_true(ready) if self.owner else ready

    def _share_slot(self, unit: int, slot: Slot, owner: int) -> None:
        """Sharded state: the owner's freshly filled slot to every rank (a broadcast on the comm stream, behind the
        fill on the owner, behind the slot's last use on the others); records `slot.ready` behind it."""
        layout = self.store.layouts[unit]
        with self.dev.on(self.comm):
            self.dev.wait_event(self.comm, slot.ready if owner == self.dp.rank else slot.free)
            for part in (slot.cast[:layout.cast_numel], slot.tail[:layout.numel - layout.cast_numel]):
                if part.numel():
                    self.dp.broadcast_(part, owner)
            slot.ready.record(self.comm)
        slot.unit = unit

    def _load_ahead(self, order: List[int], k: int, wait: bool) -> None:
        """Queue the loads of the units that follow order[k] in the look-ahead window. Called twice around
        order[k]'s compute: first without waiting (units already updated start copying at once), then, once that
        compute is queued, waiting for the host update of order[k + 1] only, the unit the next compute needs: a late
        update never delays a compute queued before it, and units further ahead load as soon as they are updated."""
        window = self._window(order, k)
        if wait:
            self._ensure_loaded(window[1:2], busy=window)
        self._ensure_loaded(window[1:], busy=window, wait=False)

    def _weights(self, unit: int) -> Dict[str, torch.Tensor]:
        """Unit's weights for compute, loaded now where no look-ahead loaded them (a ring of one slot, for a
        one-layer model, looks ahead at nothing: the head after the last layer included)."""
        self._ensure_loaded([unit], busy=[unit])
        slot = self._slot_for(unit, [unit])
        self.timer.wait(slot.ready, "weights")
        return self.loader.bind(unit, slot)

    def _release(self, unit: int) -> None:
        self._slot_for(unit, [unit]).free.record()

    def _window(self, order: List[int], k: int) -> List[int]:
        """order[k] and the units loaded ahead of it: as many as the ring has other slots; with a slot per layer,
        one (a unit's load overlaps the compute before it), or one per rank when the state is sharded (each rank's
        link loads its own units: engine/distributed.py)."""
        depth = (self.dp.world if self.owner else 1) if self.cache_weights else len(self.layer_slots) - 1
        return order[k:k + 1 + depth]

    def _enter(self, order: List[int], k: int) -> Dict[str, torch.Tensor]:
        """Unit order[k]'s weights for compute (bound views of its slot), loading ahead of it what can be."""
        self._ensure_loaded(order[k:k + 1], busy=self._window(order, k))
        self._load_ahead(order, k, wait=False)
        return self._weights(order[k])

    # ---- gradients ------------------------------------------------------------------------------------------
    def _acc_for(self, unit: int) -> GradAccumulator:
        if unit in self.acc:
            return self.acc[unit]
        acc = self.device_accs.get(unit) or self.layer_accs[(unit - 1) % len(self.layer_accs)]
        acc.claim(self.timer, lambda: self._check_optimizer(f"reading the gradient of unit {unit}"))
        self.acc[unit] = acc
        return acc

    def _sq_norms_out(self, unit: int, last: bool) -> Optional[torch.Tensor]:
        """Where an add into unit's accumulator writes its sums of squares: the last add of the step, unless the
        norms are of the held copy or of the gradient summed over ranks (taken in `_finish_grad`), or a norm pass's
        first backward took them already."""
        taken = self.norm_pass and not self.first_pass
        return self.sq_slices[unit] if last and not self.holds_grads and not self.dp.active and not taken else None

    def _finish_grad(self, unit: int, grad_hook) -> None:
        acc = self.acc.pop(unit) if unit not in (0, self.spec.num_layers + 1) else self.acc[unit]
        if not self.dp.active:
            self._hand_off_grad(unit, acc, grad_hook)
            return
        # the sum over ranks and everything that reads the summed gradient, on the comm stream: the compute stream
        # goes on with the next layer's backward meanwhile. A sharded unit's sum goes to its owner only; one rank
        # writes each unit's sums of squares (the owner, or rank 0), which the step then sums over ranks
        ready = self.dev.event()
        ready.record()
        self.dev.wait_event(self.comm, ready)
        owner = self.owner.get(unit)
        with self.dev.on(self.comm):
            if owner is None:
                self.dp.all_reduce_(acc.flat)
                self._hand_off_grad(unit, acc, grad_hook, norms=self.dp.rank == 0)
                return
            self.dp.reduce_(acc.flat, owner)
            if owner == self.dp.rank:
                self._hand_off_grad(unit, acc, grad_hook)
            else:  # nothing reads this rank's copy after the reduce
                acc.hand_off()
                acc.read_queued(self.comm)

    def _hand_off_grad(self, unit: int, acc: GradAccumulator, grad_hook, norms: bool = True) -> None:
        """Unit's finished gradient (summed over ranks) to its reader: the held bf16 copy, the GPU update, or the
        D2H copy to the host, queued on the current stream. `norms`: whether this rank writes the unit's sums of
        squares (data parallel: one rank does)."""
        if grad_hook is not None:
            grad_hook(unit, acc.views)
        if self.first_pass:  # a norm pass's first backward: the sums of squares are all it keeps of the gradient
            if grad_hook is not None:
                self.sq_slices[unit].copy_(optim.sq_norms(list(acc.views.values())))
            return
        if self.norm_pass and unit in self.gpu_updated:  # its second: the update right away, nothing held
            acc.hand_off()
            if unit in self.resident_units:
                self._resident_step(unit, acc)
            else:
                self.streamed.update_now(unit, acc, self._streamed_step)
            return
        if unit in self.host_held:
            self._hold_on_host(unit, acc, norms)
            return
        # round into the unit's held copy, keyed as engine=reference keys it; take its norms; free the accumulator
        if self.holds_grads:
            held = self._claim_held(unit)
            if held.scales is None:
                to_bf16_stochastic(acc.flat, held.flat, self._held_seed(unit))
                held_values = held.views
            else:  # the dequantized values, over the accumulator
                quantize_grad_int8(acc.flat, held.flat, held.scales, self._held_seed(unit), self.fmt.block_size,
                                   dequantized_out=acc.flat)
                held_values = acc.views
            if norms:
                self.sq_slices[unit].copy_(optim.sq_norms(list(held_values.values())))
            acc.hand_off()
            acc.read_queued(None)
            acc = held
        # the norms of the hook's gradient, or of the sum over ranks
        elif (grad_hook is not None or self.dp.active) and norms:
            self.sq_slices[unit].copy_(optim.sq_norms(list(acc.views.values())))
        acc.hand_off()
        if self.grads_on_gpu or unit in self.gpu_updated:
            self.gpu_grads[unit] = acc
            return
        self._grad_to_host(unit, acc, acc.flat if acc.wire is None else acc.to_wire(self._transfer_seed(unit)))

    def _grad_to_host(self, unit: int, acc: GradAccumulator, src: torch.Tensor) -> None:
        """Queue the D2H copy of unit's finished gradient `src` (acc's sum or its wire copy) into its host buffer,
        behind the work queued so far on the current stream; acc is free again once the copy is done."""
        done, landed = self.dev.event(), self.dev.event()
        done.record()
        with self.dev.on(self.d2h), self.timer.busy(self.d2h, "d2h"):
            self.dev.wait_event(self.d2h, done)
            self.store.grads[unit].copy_(src, non_blocking=True)
            landed.record(self.d2h)
        acc.read_queued(self.d2h)
        self.grad_landed[unit] = landed

    def _claim_held(self, unit: int) -> GradAccumulator:
        held = self.held[unit]
        held.claim(self.timer, lambda: self._check_optimizer(f"reading the gradient of unit {unit}"))
        return held

    def _held_seed(self, unit: int) -> int:
        """The key of the rounding of unit's held bf16 gradient: engine=reference's for the same unit and step."""
        opt = self.format_opt
        return update_seed(opt.seed, unit, opt.steps[unit] + 1) ^ GRAD_STREAM

    def _hold_on_host(self, unit: int, acc: GradAccumulator, norms: bool) -> None:
        """A `host_held` unit's finished gradient: rounded into the accumulator's bf16 wire copy (the held copy's
        key), its sums of squares taken there, then copied over D2H into its host buffer, where the unit's update
        fetches it (`StreamedUpdater.update`); the accumulator is free again once that copy is done."""
        held = self._claim_held(unit)
        rounded = to_bf16_stochastic(acc.flat, acc.wire, self._held_seed(unit))
        if norms:
            self.sq_slices[unit].copy_(optim.sq_norms(list(acc.layout.views(rounded).values())))
        acc.hand_off()
        self._grad_to_host(unit, acc, rounded)  # into held.flat, the host store's buffer of the unit
        held.hand_off()
        self.gpu_grads[unit] = held

    def _transfer_seed(self, unit: int) -> int:
        """The key of unit's bf16 transfer rounding: the Adam step its gradient is for (read before the update, or
        from the engine's thread after the last step's update of every unit, which the forward waited for)."""
        return transfer_seed(self.seed, unit, int(self.opt.step_count(unit)) + 1)

    # ---- the step -------------------------------------------------------------------------------------------
    def _forward(self, ids: List[torch.Tensor], keep: bool) -> List[torch.Tensor]:
        spec, L = self.spec, self.spec.num_layers
        order = list(range(L + 2))
        p = self._enter(order, 0)
        with torch.no_grad():
            x = [spec.embed(p, i) for i in ids]
        self._load_ahead(order, 0, wait=True)
        for k in range(1, L + 1):
            p = self._enter(order, k)
            kept = keep and k in self.kept_layers
            if kept:
                p = _leaves(p)
            with torch.set_grad_enabled(kept), autocast_ctx(self.dev.device, self.compute_dtype):
                for m in range(len(x)):
                    if keep and not kept and k - 1 in self.stored_inputs:
                        self.activations.put(k - 1, m, x[m])
                    if kept:
                        x_in = x[m].detach().requires_grad_()
                        y = spec.layer(p, x_in, self.pos[m], k - 1)
                        self.graphs[(k, m)] = (x_in, y, p)
                        x[m] = y.detach()
                    elif keep:
                        x[m], kept_m = spec.forward_keeping(p, x[m], self.pos[m], k - 1,
                                                            attention=k in self.kept_attention_units)
                        if kept_m is not None:
                            self.kept_forward[(k, m)] = kept_m
                    else:
                        x[m] = spec.layer(p, x[m], self.pos[m], k - 1)
            self._release(k)
            self._load_ahead(order, k, wait=True)  # the last layer's window holds the head
            if self.layer_progress is not None and keep:
                self.layer_progress("forward", k)
        return x

    def _head(self, x: List[torch.Tensor], labels: List[torch.Tensor], n_tokens: int, grad_hook):
        spec, head = self.spec, self.spec.num_layers + 1
        p = _leaves(self._weights(head))
        tied = _leaves(self.loader.bind(0, self.embed_slot)) if spec.tied else None
        acc, emb_acc = self.acc[head], self.acc[0]
        for unit, a in ((head, acc), (0, emb_acc)):
            a.claim(self.timer, lambda unit=unit: self._check_optimizer(f"reading the gradient of unit {unit}"))
        dx, loss_total = [], torch.zeros((), device=self.dev.device)
        names = list(p)
        for m, (x_m, lab) in enumerate(zip(x, labels)):
            x_m = x_m.detach().requires_grad_()
            with autocast_ctx(self.dev.device, self.compute_dtype):
                tied_w = tied[spec.tied_weight_name] if tied else None
                loss = spec.loss_sum(p, x_m, lab, tied_w) / n_tokens
            inputs = [x_m] + [p[n] for n in names] + ([tied_w] if tied else [])
            grads = torch.autograd.grad(loss, inputs)
            dx.append(grads[0])
            acc.add(dict(zip(names, grads[1:1 + len(names)])), self._sq_norms_out(head, m == len(x) - 1))
            if tied:
                emb_acc.add({spec.tied_weight_name: grads[-1]})
            loss_total += loss.detach()
        self._release(head)
        self._finish_grad(head, grad_hook)
        return dx, loss_total

    def _backward(self, dx: List[torch.Tensor], grad_hook) -> None:
        spec, L = self.spec, self.spec.num_layers
        order = list(range(L, 0, -1))
        for k, unit in enumerate(order):
            kept = unit in self.kept_layers
            if kept:  # weights still in the layer's own slot, read by the kept graph
                self._load_ahead(order, k, wait=False)
            else:
                if unit - 1 not in self.stored_inputs and not self._regenerated(unit - 1, 0):
                    self._regenerate(unit - 1, len(dx))
                p = _leaves(self._enter(order, k))
            acc = self._acc_for(unit)
            for m in range(len(dx)):  # prefetch the next layer input the backward will recompute from
                if m + 1 < len(dx):
                    if not kept:
                        self._prefetch_input(unit - 1, m + 1)
                elif k + 1 < len(order) and order[k + 1] not in self.kept_layers:
                    self._prefetch_input(unit - 2, 0)
                if kept:
                    x_in, y, p = self.graphs.pop((unit, m))
                    dx[m], layer_grads = backprop(y, x_in, p, dx[m])
                    del y
                else:
                    x_in = self._layer_input(unit - 1, m).requires_grad_()
                    kept_m = self.kept_forward.get((unit, m)) if self.first_pass \
                        else self.kept_forward.pop((unit, m), None)
                    with autocast_ctx(self.dev.device, self.compute_dtype):
                        dx[m], layer_grads = spec.layer_grads(p, x_in, dx[m], self.pos[m], unit - 1, kept=kept_m)
                acc.add(layer_grads, self._sq_norms_out(unit, m == len(dx) - 1))
                del layer_grads, x_in
            self._release(unit)
            self._load_ahead(order, k, wait=True)
            self._finish_grad(unit, grad_hook)
            if self.layer_progress is not None:
                self.layer_progress("norm backward" if self.first_pass else "backward", k + 1)

    def _prefetch_input(self, i: int, m: int) -> None:
        if (i, m) not in self.regenerated and (i in self.stored_inputs or self.activations.holds_spare(i, m)):
            self.activations.prefetch(i, m)

    def _regenerated(self, i: int, m: int) -> bool:
        """Whether layer input (i, m) was regenerated and waits for its layer's backward (GPU or host tier)."""
        return (i, m) in self.regenerated or self.activations.holds_spare(i, m)

    def _layer_input(self, i: int, m: int) -> torch.Tensor:
        x = self.regenerated.pop((i, m), None)
        return x if x is not None else self.activations.get(i, m, keep=self.first_pass)

    def _regenerate(self, i: int, micro_batches: int) -> None:
        """Layer inputs base..i of every micro-batch, base the first input of i's recompute group: the kept input
        of layer base, then the forward (no autograd) of the layers between, layer-major so each one's weights
        load once. Bit-identical to what the forward computed (the same ops on the same weights). On the GPU tier
        they wait on the GPU for their layers' backward; on the host tier they go to the activation store's spare
        entries (the kept input stays in its own), to be fetched back one ahead like kept inputs."""
        spec, base = self.spec, i - i % self.recompute_group
        on_host = not self.activations.on_gpu
        x = [self.activations.get(base, m, keep=self.first_pass) for m in range(micro_batches)]
        if not on_host:
            for m in range(micro_batches):
                self.regenerated[(base, m)] = x[m]
        order = list(range(base + 1, i + 1))  # layer unit u maps input u - 1 to input u
        for k, unit in enumerate(order):
            p = self._enter(order, k)
            with torch.no_grad(), autocast_ctx(self.dev.device, self.compute_dtype):
                for m in range(micro_batches):
                    x[m] = spec.layer(p, x[m], self.pos[m], unit - 1)
                    if on_host:
                        self.activations.put(unit, m, x[m])
                    else:
                        self.regenerated[(unit, m)] = x[m]
            self._release(unit)

    def _embed_backward(self, ids: List[torch.Tensor], dx: List[torch.Tensor], grad_hook) -> None:
        name = self.spec.tied_weight_name
        weight = self.loader.bind(0, self.embed_slot)[name].detach().requires_grad_()
        acc = self.acc[0]
        for m, (ids_m, dx_m) in enumerate(zip(ids, dx)):
            (g,) = torch.autograd.grad(self.spec.embed({name: weight}, ids_m), [weight], grad_outputs=dx_m)
            acc.add({name: g}, self._sq_norms_out(0, m == len(ids) - 1))
        self._release(0)
        self._finish_grad(0, grad_hook)

    def train_step(self, batches: Sequence[Batch], lr: float, grad_hook=None) -> dict:
        t0 = time.perf_counter()
        self.optimizer_wait_s = 0.0
        step_tokens = sum(b.tokens for b in batches) * self.dp.world  # every rank runs the same shapes
        self.spec.begin_step(step_tokens)
        n_tokens = loss_tokens(batches, self.dp)
        ids, labels = self._upload(batches, non_blocking=True)
        self.gpu_grads: Dict[int, GradAccumulator] = {}
        self.grad_landed: Dict[int, object] = {}
        if self.dp.active:  # each rank writes its units' entries; the others must be zero, not the last step's sums
            self.sq_norms.zero_()
        self.timer.reset()
        self.timer.mark("start")
        x = self._forward(ids, keep=True)
        self.timer.mark("forward")
        self.first_pass = self.norm_pass
        loss_total = self._gradients(ids, x, labels, n_tokens, grad_hook)
        if not self.norm_pass:
            del x
            self._clear_kept()

        if self.dp.active:  # the norm reads the sums of squares the comm stream wrote, one rank's each: summed
            reduced = self.dev.event()
            reduced.record(self.comm)
            self.dev.wait_event(None, reduced)
            self.dp.all_reduce_tensors_([self.sq_norms, loss_total])
        total_norm = optim.global_norm(self.sq_norms)
        norm_value = float(total_norm)  # the step's one synchronisation
        skipped = not torch.isfinite(total_norm).item()
        # the last pass must have finished without error before any update reads the state it wrote: its units'
        # flags went up as each was updated, but its last disk writes may still be in flight (or have failed)
        self._collect_pass()
        coef_dev = optim.clip_coefficient(total_norm, self.t.max_grad_norm)
        coef = coef_dev.cpu()
        scale = float(coef) < 1.0
        self.update_args = (coef_dev, scale, lr)
        if self.format_opt is not None:
            self.format_opt.set_lr(lr)
        if self.norm_pass:  # the second backward updates each unit as its gradient is finished
            self.first_pass = False
            if not skipped:
                self.streamed.set_update(coef_dev, scale, lr)
                self._gradients(ids, x, labels, n_tokens, grad_hook)
            del x
            self._clear_kept()
        phases = self.timer.read()
        previous_optimizer_s, previous_nvme_io = self.last_optimizer_s, self.last_nvme_io
        self.skipped_steps += int(skipped)
        self.version += 1
        for unit, ev in enumerate(self.updated):
            if self.owns(unit):  # another rank's units are that rank's to update
                ev.clear()
        if not self.norm_pass:
            self._gpu_updates(skipped)
        for unit in self.resident_units:
            self.updated[unit].set()
        for unit in self.streamed_units:
            self.updated[unit].set()
        self.pending = self.pool.submit(self._optimizer_pass, coef, lr, skipped, dict(self.gpu_grads),
                                        dict(self.grad_landed), self.version)
        record = {"loss": float(loss_total), "grad_norm": norm_value, "skipped": skipped,
                  "skipped_steps": self.skipped_steps, "tokens": step_tokens, "loss_tokens": n_tokens,
                  "step_s": time.perf_counter() - t0, "optimizer_s": previous_optimizer_s,
                  "optimizer_wait_s": self.optimizer_wait_s}
        record.update(previous_nvme_io)  # the previous optimizer pass's disk traffic, like optimizer_s
        record.update(phases)
        if "exposed_s" in phases:
            copy_and_update_s = phases.get("h2d_busy_s", 0.0) + phases.get("d2h_busy_s", 0.0) + previous_optimizer_s
            record["overlap"] = 1.0 - min(1.0, phases["exposed_s"] / copy_and_update_s) if copy_and_update_s else 1.0
        return record

    def _gradients(self, ids: List[torch.Tensor], x: List[torch.Tensor], labels: List[torch.Tensor], n_tokens: int,
                   grad_hook) -> torch.Tensor:
        """The head, the layers' backward and the embedding's, from the last layer's outputs `x`: every unit's
        gradient finished and handed to its reader (or, in a norm pass's first backward, its sums of squares
        taken). Returns the loss."""
        first = "norm_" if self.first_pass else ""
        dx, loss_total = self._head(x, labels, n_tokens, grad_hook)
        self.timer.mark(first + "head")
        self._backward(dx, grad_hook)
        self._embed_backward(ids, dx, grad_hook)
        self.timer.mark(first + "backward")
        return loss_total

    def _clear_kept(self) -> None:
        """Drop what the forward kept for the backward."""
        self.activations.clear()
        self.regenerated.clear()
        self.kept_forward.clear()

    def _resident_step(self, unit: int, acc: GradAccumulator) -> None:
        """A GPU-resident unit's update from its finished gradient, on the compute stream (`update_args`: the step's
        clip coefficient on the GPU, whether it scales, the learning rate)."""
        coef_dev, scale, lr = self.update_args
        if self.format_opt is not None:  # the fused kernel scales by the clip coefficient itself
            self.format_opt.step_unit(unit, acc.flat, coef_dev, grad_scales=acc.scales)
        else:
            if scale:
                acc.flat.mul_(coef_dev)
            self.opt.step_unit(unit, acc.flat, lr)
        acc.read_queued(None)

    def _gpu_updates(self, skipped: bool) -> None:
        """After a step's backward: the GPU-resident units updated right here, in compute-stream order; the
        GPU-streamed ones due when the next forward loads them (streamed_update.py)."""
        for unit in sorted(self.resident_units):
            if skipped:
                self.gpu_grads[unit].release_unread()
            else:
                self._resident_step(unit, self.gpu_grads[unit])
        if skipped:
            self.streamed.skip(self.gpu_grads)
        elif self.my_streamed_units:
            coef_dev, scale, lr = self.update_args
            self.streamed.submit(self.gpu_grads, coef_dev, scale, lr,
                                 {u: self.grad_landed[u] for u in self.host_held})

    def _optimizer_pass(self, coef: torch.Tensor, lr: float, skipped: bool, gpu_grads, grad_landed,
                        step: int) -> None:
        """Step `step`'s host update (on the optimizer thread); any failure but the NVMe tier's own is raised as an
        OptimizerPassError naming the unit it was updating."""
        try:
            self._host_update(coef, lr, skipped, gpu_grads, grad_landed)
        except NvmeError:
            raise
        except Exception as e:
            unit = self.current_host_unit
            raise OptimizerPassError(unit, self.spec.units[unit].name, step, e) from e

    def _host_update(self, coef: torch.Tensor, lr: float, skipped: bool, gpu_grads, grad_landed) -> None:
        start = time.perf_counter()
        units = self.my_host_units
        self.current_host_unit = units[0] if units else 0  # the unit a failure is reported at
        self.last_nvme_io = {}
        if skipped or not units:
            for unit in units:
                if unit in gpu_grads:
                    gpu_grads[unit].release_unread()
            for ev in self.updated:
                ev.set()
            return
        scale = float(coef) < 1.0

        def fetch(k: int):
            acc = gpu_grads[units[k]]
            n = acc.flat.numel()
            buf = self.store.grad_staging[k % 2][:n]
            with self.dev.on(self.opt_d2h):  # the rounding too: the step's norm read already waited for the backward
                src = acc.flat if not self.wire_pair else to_bf16_stochastic(
                    acc.flat, self.wire_pair[k % 2][:n], self._transfer_seed(units[k]))
                buf.copy_(src, non_blocking=True)
                ev = self.dev.event()
                ev.record(self.opt_d2h)
            acc.read_queued(self.opt_d2h)
            return buf, ev

        nxt = fetch(0) if self.grads_on_gpu else None  # the staging pair: fetch unit k+1 while k updates
        disk = self.disk_units
        if disk:
            self.nvme.check()
            self.nvme.prefetch(disk[0])
        for k, unit in enumerate(units):
            self.current_host_unit = unit
            if self.grads_on_gpu:
                grad, ev = nxt
                if k + 1 < len(units):
                    nxt = fetch(k + 1)
            else:
                grad, ev = self.store.grads[unit], grad_landed[unit]
            ev.synchronize()
            if self.transfer_bf16:  # exact: every bf16 value is an fp32 value
                grad = self.store.grad_upcast[:grad.numel()].copy_(grad)
            if scale:
                grad.mul_(coef)
            if disk and disk[0] <= unit <= disk[-1]:  # consecutive layers
                self.opt.bind_moments(unit, *self.nvme.acquire(unit))
                if unit < disk[-1]:
                    self.nvme.prefetch(unit + 1)
                self.opt.step_unit(unit, grad, lr)
                self.nvme.release(unit)
            else:
                self.opt.step_unit(unit, grad, lr)
            self.updated[unit].set()
        if disk:
            self.nvme.drain()
            self.last_nvme_io = self.nvme.take_io_stats()
        self.last_optimizer_s = time.perf_counter() - start

    def _streamed_step(self, unit: int, grad: torch.Tensor, views: Dict[str, torch.Tensor], coef: torch.Tensor,
                       scale: bool, lr: float) -> None:
        """A GPU-streamed unit's update over its staging views, queued on the current stream."""
        if self.format_opt is not None:  # the fused kernel scales by the clip coefficient itself
            held = self.held.get(unit)  # int8 gradients: the codes' scales (in GPU memory, never host-held)
            self.format_opt.step_unit(unit, grad, coef, state=views, grad_scales=held.scales if held else None)
            return
        if scale:
            grad.mul_(coef)
        self.opt.step_unit(unit, grad, lr)  # built over the views

    def wait_for_optimizer(self) -> None:
        """Block until the last step's update has been applied everywhere and all host state is home."""
        self._collect_pass()
        self.streamed.flush(self._streamed_step)

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[Batch]) -> float:
        self.timer.reset()
        self.timer.previous_end = None  # the next step's gap would otherwise count this evaluation
        ids, labels = self._upload(batches)
        x = self._forward(ids, keep=False)
        head = self.spec.num_layers + 1
        p = self._weights(head)
        tied = self.loader.bind(0, self.embed_slot)[self.spec.tied_weight_name] if self.spec.tied else None
        total = torch.zeros((), dtype=torch.float64, device=self.dev.device)
        with autocast_ctx(self.dev.device, self.compute_dtype):
            for x_m, lab in zip(x, labels):
                total += self.spec.loss_sum(p, x_m, lab, tied).double()
        self._release(head)
        self._release(0)
        return float(total) / loss_tokens(batches)

    def _upload(self, batches: Sequence[Batch], non_blocking: bool = False):
        """The micro-batches' ids and labels on the GPU, and their positions in `self.pos`."""
        on_gpu = [b.to(self.dev.device, non_blocking=non_blocking) for b in batches]
        self.pos = [self.tables.of_rows(b.doc_start_BT) for b in on_gpu]
        return [b.ids_BT for b in on_gpu], [b.labels_BT for b in on_gpu]

    def _views(self, which: str, index: int) -> Dict[str, torch.Tensor]:
        return self.store.layouts[index].views(getattr(self, which)[index])

    def _whole_state(self, what: str) -> None:
        if self.owner:
            raise RuntimeError(f"{what}: this rank holds the state of its own units only (engine.shard_state=true); "
                               "read a checkpoint instead, whose unit files every rank wrote")

    def master_weights(self) -> Dict[str, torch.Tensor]:
        self._whole_state("master_weights")
        self.wait_for_optimizer()
        return {u.layout.prefix + name: t.to("cpu", torch.float32, copy=True) for u in self.spec.units
                for name, t in self._views("master", u.index).items()}

    def adam_moments(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        self._whole_state("adam_moments")
        self.wait_for_optimizer()
        if self.format_opt is not None:
            return {k: mv for u in self.spec.units for k, mv in self.format_opt.moments_by_name(u.index).items()}
        out = {}
        for u in self.spec.units:
            m, v = self._moment_views(u.index)
            for name in m:
                out[u.layout.prefix + name] = (m[name].to("cpu", copy=True), v[name].to("cpu", copy=True))
        return out

    def unit_state(self, index: int) -> dict:
        """One unit's training state by name: views into the host store (not copies), after the pending update."""
        if not self.owns(index):
            raise RuntimeError(f"unit {index}'s state lives on rank {self.owner[index]}, not on rank {self.dp.rank} "
                               "(engine.shard_state=true)")
        self.wait_for_optimizer()
        if self.format_opt is not None:
            return self.format_opt.unit_state(index)
        m, v = self._moment_views(index)
        return {"master": self._views("master", index), "exp_avg": m, "exp_avg_sq": v,
                "step": self.opt.step_count(index)}

    def _moment_views(self, index: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """A unit's m and v by tensor name: views into the host store, or copies read from the NVMe tier."""
        if index not in self.disk_units:
            return self._views("m", index), self._views("v", index)
        layout = self.store.layouts[index]
        m, v = self.nvme.read_copy(index)
        return layout.views(m), layout.views(v)

    @torch.no_grad()
    def load_unit_state(self, index: int, master: Dict[str, torch.Tensor], exp_avg=None, exp_avg_sq=None,
                        step: float = 0.0, flat=None) -> None:
        """Copy a unit's state into the host store; moments are optional (HF import leaves them zero). Another
        rank's unit (sharded state) is that rank's to load: only the weights' generation advances, as there."""
        if not self.owns(index):
            self.version += 1
            return
        self.wait_for_optimizer()
        if self.format_opt is not None:
            self.format_opt.load_unit_state(index, master, exp_avg, exp_avg_sq, step, flat)
            self.version += 1
            return
        disk = index in self.disk_units and exp_avg is not None  # moments written through a staging buffer
        m_flat, v_flat = self.nvme.acquire(index) if disk else (self.m[index], self.v[index])
        layout = self.store.layouts[index]
        for flat, values in ((self.master[index], master), (m_flat, exp_avg), (v_flat, exp_avg_sq)):
            if values is not None:
                for name, view in layout.views(flat).items():
                    view.copy_(values[name])
        if disk:
            self.nvme.release(index)
            self.nvme.drain()
        if exp_avg is not None:
            self.opt.set_step_count(index, step)
        self.version += 1  # slots hold stale weights now

    def _state_tensors(self, unit: int) -> List[torch.Tensor]:
        if self.format_opt is not None:
            return list(self.format_opt.states[unit].values())
        return [self.master[unit], self.m[unit], self.v[unit]]

    def memory_bytes(self) -> Dict[str, int]:
        out = {f"host_{k}": b for k, b in self.store.bytes_by_kind.items()}
        gpu = sum(s.cast.numel() * s.cast.element_size() + 4 * s.tail.numel()
                  for s in [self.embed_slot, self.head_slot, *self.layer_slots, *self.device_slots.values(),
                            *self.kept_slots.values()])
        out["device_slots"] = gpu
        accs = list({id(a): a for a in [*self.acc.values(), *self.layer_accs, *self.device_accs.values()]}.values())
        out["device_grad_accumulators"] = sum(4 * a.flat.numel() for a in accs)
        out["device_optimizer_state"] = sum(t.numel() * t.element_size() for u in self.resident_units
                                            for t in self._state_tensors(u))
        out["device_held_grads"] = sum(t.numel() * t.element_size() for u, h in self.held.items()
                                       if u not in self.host_held for t in (h.flat, h.scales) if t is not None)
        out["device_streamed_state_staging"] = self.streamed.bytes
        wires = [*self.wire_pair, *(a.wire for a in accs if a.wire is not None)]
        out["device_grad_transfer"] = sum(2 * w.numel() for w in wires)
        return out

    def close(self) -> None:
        try:
            self.wait_for_optimizer()
        finally:
            self.pool.shutdown(wait=True)
            self.store.close()
            if self.nvme is not None:
                self.nvme.close()
