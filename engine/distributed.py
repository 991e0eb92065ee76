"""Data parallel over torch.distributed (issue 9), first step: every rank holds the whole training state.

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

State. Every rank updates every unit with the same reduced gradient, the same clip coefficient and the same seeds,
so the weights stay identical on all ranks without a broadcast. The ranks of one host share its RAM and cores, so
each rank plans with 1 / LOCAL_WORLD_SIZE of the host budget (`hardware.host_mem_gib`, or the machine's total) and
takes that share of the cores. Rank 0 alone writes the run's files (log, metrics, checkpoints, W&B); the other
ranks write their own metrics under `<run dir>/rank<r>/` and read checkpoints from rank 0's directory, so a
checkpoint saved by W ranks resumes on any number of ranks. Not yet built (issue 9): sharding the host state across
ranks (each rank holds and updates 1/W of it, the fresh weights reach the others); until then W ranks on one host
hold W copies of the state.
"""

from __future__ import annotations

import copy
import datetime as dt
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine.config import ConfigError


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

    def all_reduce_tensors_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each of `tensors` over ranks in place with one collective: flattened into one buffer (a copy of
        their size), reduced, copied back."""
        if not self.active or not tensors:
            return
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat)
        for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(summed)

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


def init(device_name: str, grad_accum: int, timeout_min: float = 30.0) -> DataParallel:
    """Join the torchrun job this process belongs to (a single-process DataParallel without one). Checks that the
    micro-batches split evenly over the ranks before any group is formed; on CUDA each rank takes GPU LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if grad_accum % world:
        raise ConfigError(f"train.grad_accum={grad_accum} micro-batches per step do not split over WORLD_SIZE={world} "
                          f"ranks: use a multiple of {world} (each rank runs grad_accum / WORLD_SIZE of them)")
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
    """The config one rank's engine and planner see: its share of the micro-batches per step."""
    if not dp.active:
        return cfg
    local = copy.deepcopy(cfg)
    local.train.grad_accum = cfg.train.grad_accum // dp.world
    return local

