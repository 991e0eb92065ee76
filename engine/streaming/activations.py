"""Layer-input activations kept from the forward for the backward's recompute, on the GPU or in pinned host memory."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set

import torch

from engine.device import Device
from engine.streaming.stall_timer import StallTimer


class ActivationStore:
    """The inputs of the decoder layers named by `layer_inputs`, for every micro-batch, kept from the forward so the
    backward can recompute from them (activation checkpointing at layer granularity, or at the granularity of a
    recompute group: engine/streaming/engine.py), on the GPU or in pinned host memory.

    Entry (i, m) is the input of decoder layer i (0-based) for micro-batch m; the head's input never leaves the GPU.
    Host-tier entries are copied out on the D2H stream once compute has produced them (record_stream keeps the GPU
    tensor alive for that copy) and fetched back on the H2D stream for the backward, one micro-batch ahead. A kept
    input may be fetched more than once (a recompute group reads it, then its layer's backward). `spare_entries`
    more host entries hold the inputs a recompute group regenerates, each from its `put` to its `get`.
    """

    def __init__(self, dev: Device, h2d_stream, d2h_stream, host_buffer: Optional[torch.Tensor],
                 layer_inputs: Sequence[int], micro_batches: int, shape_BTD: tuple, timer: StallTimer,
                 spare_entries: int = 0):
        self.dev, self.h2d, self.d2h, self.timer = dev, h2d_stream, d2h_stream, timer
        self.shape = shape_BTD
        self.numel = shape_BTD[0] * shape_BTD[1] * shape_BTD[2]
        self.on_gpu = host_buffer is None
        self.gpu: Dict[tuple, torch.Tensor] = {}
        self.host: Dict[tuple, torch.Tensor] = {}
        self.pending: Dict[tuple, tuple] = {}
        self.spares: List[torch.Tensor] = []  # host entries free for other keys (a recompute group's inputs)
        self.spare_keys: Set[tuple] = set()  # keys that hold a spare entry until their `get`
        if host_buffer is not None:
            fixed = len(layer_inputs) * micro_batches
            need = (fixed + spare_entries) * self.numel
            if host_buffer.numel() < need:
                raise ValueError(f"host activation buffer holds {host_buffer.numel()} elements, needs {need}")
            for n, i in enumerate(layer_inputs):
                for m in range(micro_batches):
                    k = (n * micro_batches + m) * self.numel
                    self.host[(i, m)] = host_buffer[k:k + self.numel].view(shape_BTD)
            self.spares = [host_buffer[k * self.numel:(k + 1) * self.numel].view(shape_BTD)
                           for k in range(fixed, fixed + spare_entries)]

    def put(self, i: int, m: int, x: torch.Tensor) -> None:
        """Keep x as entry (i, m): a layer input of `layer_inputs`, or on the host any other key, which takes a spare
        entry until its `get` (a spare is reused only after the compute stream has waited for its last read)."""
        if self.on_gpu:
            self.gpu[(i, m)] = x
            return
        if (i, m) not in self.host:
            if not self.spares:
                raise RuntimeError(f"activation store: no spare host entry for layer input {i}, micro-batch {m}")
            self.host[(i, m)] = self.spares.pop()
            self.spare_keys.add((i, m))
        done = self.dev.event()
        done.record()
        with self.dev.on(self.d2h), self.timer.busy(self.d2h, "d2h"):
            self.dev.wait_event(self.d2h, done)
            self.host[(i, m)].copy_(x, non_blocking=True)
            self.dev.record_stream(x, self.d2h)

    def prefetch(self, i: int, m: int) -> None:
        if self.on_gpu or (i, m) in self.pending:
            return
        with self.dev.on(self.h2d), self.timer.busy(self.h2d, "h2d"):
            x = torch.empty(self.shape, dtype=torch.float32, device=self.dev.device)
            # the D2H that wrote this entry must be complete: order the streams through an event
            written = self.dev.event()
            written.record(self.d2h)
            self.dev.wait_event(self.h2d, written)
            x.copy_(self.host[(i, m)], non_blocking=True)
            ready = self.dev.event()
            ready.record(self.h2d)
        self.pending[(i, m)] = (x, ready)

    def get(self, i: int, m: int, keep: bool = False) -> torch.Tensor:
        """Entry (i, m) for compute. A GPU-tier entry is dropped from the store unless `keep` (a norm pass reads
        every input twice); a host-tier one stays in its host entry (a spare goes back to the pool)."""
        if self.on_gpu:
            return self.gpu[(i, m)] if keep else self.gpu.pop((i, m))
        self.prefetch(i, m)
        x, ready = self.pending.pop((i, m))
        self.timer.wait(ready, "activation")
        self.dev.record_stream(x, self.dev.current_stream())
        if (i, m) in self.spare_keys:
            self.spare_keys.discard((i, m))
            self.spares.append(self.host.pop((i, m)))
        return x

    def holds_spare(self, i: int, m: int) -> bool:
        """Whether entry (i, m) sits in a spare host entry (put, not yet fetched by `get`)."""
        return (i, m) in self.spare_keys

    def clear(self) -> None:
        self.gpu.clear()
        self.pending.clear()
        for key in self.spare_keys:
            self.spares.append(self.host.pop(key))
        self.spare_keys.clear()
