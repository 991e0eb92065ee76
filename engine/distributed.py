"""Data parallel over torch.distributed: the host-resident training state sharded over the ranks.

Launch with torchrun (`torchrun --nproc_per_node=2 train.py ...`): it sets RANK / WORLD_SIZE / LOCAL_RANK and the
rendezvous; without it (WORLD_SIZE unset or 1) nothing here communicates. NCCL carries the gradients on GPUs, gloo
on CPUs; a second gloo group carries the host-side control (stop flags, the run dir), so that a control message
never needs a device synchronisation.

Semantics. `train.grad_accum` stays the number of micro-batches per optimizer step over all ranks, so the tokens per
step, the data order and the checkpoints do not depend on the number of ranks: micro-batch j of step s is batch
s * grad_accum + j as on one rank, and rank r runs the contiguous share j in [r * G / W, (r + 1) * G / W). Each
rank's loss is scaled by the step's total tokens, so the sum over ranks of the per-rank gradients is the one-rank
gradient (to fp32 rounding: the terms are added in another order).

Gradients. Each unit's gradient is summed over ranks (all-reduce) as soon as its backward ends, on a stream of its
own (`comm`), so the reduction of layer i overlaps the backward of layer i - 1; what reads the gradient after it (the
sums of squares for the norm, the D2H copy to the host, the bf16 rounding of held gradients) is queued behind the
reduction on the same stream, and the compute stream waits for that stream once, before the global norm. The sums
of squares come from the reduced gradient (the accumulation kernel's in-register norms would be the local ones).

State (engine.shard_state, on by default). The units whose state lives in host RAM (GPU-streamed and host-updated,
engine/placement.py) are dealt out to the ranks whole, `owners` balancing their parameter counts; each rank's host holds
the master and moments of its own units only, so W ranks hold one copy of the model between them. A unit's gradient
is summed onto its owner (a reduce, on the comm stream, as soon as its backward ends); the owner alone takes its norm,
copies it home and updates it. When the next forward (or backward) loads the unit, the owner fills its slot as one
rank would (H2D, or its GPU-streamed update) and broadcasts the slot to the others, on the comm stream: the weights
cross NVLink once per use instead of every rank's PCIe. GPU-resident units (state in HBM) stay replicated: all-reduced
and updated on every rank. The clip norm is one all-reduce of the step's per-tensor sums of squares, each entry
written by one rank (the owner, or rank 0 for a replicated unit), so it is exact. Why whole units rather than 1/W of
every unit (a reduce-scatter and all-gather per layer): the same bytes cross NVLink either way, and a whole unit
keeps everything per-unit as it is on one rank (tensor views for the norm and the per-tensor AdamW, int8 moment
blocks, the NVMe tier's per-layer records, the checkpoint's unit files); the price is that one rank's PCIe carries a
unit at a time, which the look-ahead window (`engine.slots`) spreads over the ranks. Loads must be issued in the
same order on every rank, so a look-ahead load that would wait for a host update is taken or deferred by all ranks
together (`all_true` over the control group, only while a load is pending). With `engine.shard_state=false` every
rank holds and updates every unit (all-reduced gradients, no broadcast), W copies of the state.

The ranks of one host share its RAM and cores, so each rank plans with 1 / LOCAL_WORLD_SIZE of the host budget
(`hardware.host_mem_gib`, or the machine's memory as rank 0 measures it: engine/hardware.py, host_budget) and takes
that share of the cores. Rank 0 writes the run's files
(log, metrics, W&B); the other ranks write their own metrics under `<run dir>/rank<r>/`. A checkpoint is one
directory in rank 0's run dir: each rank writes its own units' files into it, rank 0 the manifest last, so a
checkpoint saved by W ranks resumes on any number of ranks (a rank reads only the unit files it owns).
"""

from __future__ import annotations

import copy
import datetime as dt
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine.config import GRAD_ACCUM_AUTO, ConfigError


@dataclass
class DataParallel:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1  # ranks on this host: they share its RAM
    control: Any = field(default=None, repr=False)  # gloo group for host-side messages

    @property
    def active(self) -> bool:
        return self.world > 1

    def micro_batches(self, grad_accum: int) -> range:
        """The indices (within a step) of the micro-batches this rank runs."""
        share = grad_accum // self.world
        return range(self.rank * share, (self.rank + 1) * share)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks in place (on the current stream: NCCL orders itself after it and the stream's
        later work after the reduction, without blocking the host)."""
        if self.active:
            dist.all_reduce(tensor)
        return tensor

    def sum_over_ranks(self, value: int) -> int:
        """An integer summed over ranks, on the host (through the gloo control group)."""
        if not self.active:
            return value
        total = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(total, group=self.control)
        return int(total)

    def all_reduce_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each of `tensors` over ranks in place with one collective: flattened into one buffer (a copy of
        their size), reduced, copied back."""
        if not self.active or not tensors:
            return
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat)
        for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(summed)

    def reduce_(self, tensor: torch.Tensor, dst: int) -> torch.Tensor:
        """Sum `tensor` over ranks into rank `dst`'s copy (the others' copies are scratch afterwards)."""
        if self.active:
            dist.reduce(tensor, dst)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `tensor` into every rank's, in place."""
        if self.active:
            dist.broadcast(tensor, src)
        return tensor

    def all_true(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on all (host-side, over the control group)."""
        return not self.any(not flag)

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any (host-side, over the control group)."""
        if not self.active:
            return flag
        t = torch.tensor([int(bool(flag))], dtype=torch.int32)
        dist.all_reduce(t, group=self.control)
        return bool(t.item())

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.control)

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = DataParallel()


def owners(numels: Dict[int, int], world: int) -> Dict[int, int]:
    """Unit -> the rank that holds and updates its state: the largest units first, each to the rank with the fewest
    parameters so far (the lowest rank on a tie), so every rank's share is within one unit of 1 / world."""
    load = [0] * world
    out = {}
    for unit in sorted(numels, key=lambda u: (-numels[u], u)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[unit] = rank
        load[rank] += numels[unit]
    return out


def state_owners(spec, n_resident: int, world: int) -> Dict[int, int]:
    """The owners (`owners`) of the units whose state lives in host RAM: all but the `n_resident` leading
    GPU-resident ones."""
    return owners({u.index: u.layout.numel for u in spec.units[n_resident:]}, world)


def check_split(grad_accum: int, world: int, ranks: str, hint: str = "") -> None:
    """Refuse micro-batches per step that do not split evenly over `world` ranks (`ranks` names where the count
    comes from; `hint`, another way out)."""
    if grad_accum == GRAD_ACCUM_AUTO:
        raise ConfigError(f"train.grad_accum={GRAD_ACCUM_AUTO} (auto) is planned for one process; with "
                          f"{ranks} set the micro-batches per step, a multiple of {world}{hint}")
    if grad_accum % world:
        raise ConfigError(f"train.grad_accum={grad_accum} micro-batches per step do not split over {ranks} "
                          f"ranks: use a multiple of {world} (each rank runs grad_accum / {world} of them){hint}")


def planned_ranks(world: int) -> DataParallel:
    """What `plan=true` plans for a profile of `world` cards of one host: rank 0 of a torchrun job of `world` ranks
    on that host (every rank plans alike), with nothing to communicate."""
    return DataParallel(world=world, local_world=world)


def init(device_name: str, grad_accum: int, timeout_min: float = 30.0) -> DataParallel:
    """Join the torchrun job this process belongs to (a single-process DataParallel without one). Checks that the
    micro-batches split evenly over the ranks before any group is formed; on CUDA each rank takes GPU LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    check_split(grad_accum, world, f"WORLD_SIZE={world}")
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} GPUs: "
                              "torchrun --nproc_per_node must not exceed the GPU count")
        torch.cuda.set_device(local_rank)
    timeout = dt.timedelta(minutes=timeout_min)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    # torchrun starts several ranks with OMP_NUM_THREADS=1 (one core for each host AdamW) and torch alone would give
    # each rank every core (oversubscribed): each rank of this host takes its share of the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return DataParallel(rank=rank, world=world, local_rank=local_rank, local_world=local_world, control=control)


def local_config(cfg, dp: DataParallel):
    """The config one rank's engine and planner see: its share of the micro-batches per step and of the host's NVMe
    tier space (of its RAM too, which the trainer divides), and, with sharded state, a ring of at least world + 1
    layer slots: a unit is loaded over its owner's PCIe link only, so the look-ahead window must hold one unit per
    rank for every rank's link to carry a load at once (with the default 2 slots one load is in flight at a time and
    the H2D time would not shrink with the ranks). The norm pass runs in one process: `auto` is off here, `on`
    refused."""
    if not dp.active:
        return cfg
    if cfg.engine.norm_pass == "on":
        raise ConfigError(f"engine.norm_pass=on runs in one process, and this run has {dp.world} data-parallel ranks; "
                          "set engine.norm_pass=auto or off, or run one process (hardware.gpus=1 for a plan)")
    local = copy.deepcopy(cfg)
    local.engine.norm_pass = "off"
    local.train.grad_accum = cfg.train.grad_accum // dp.world
    local.hardware.nvme_gib = cfg.hardware.nvme_gib / dp.local_world  # the ranks of a host share its disk
    if cfg.engine.name == "stream" and cfg.engine.shard_state:
        local.engine.slots = max(cfg.engine.slots, dp.world + 1)
    return local

