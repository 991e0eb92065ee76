"""The GPU side of the streaming engine: weight slots, the copy streams and the events that order them.

Three streams: compute (the current stream), H2D (weights and host-tier checkpoints coming in) and D2H
(gradients and checkpoints going out). The only synchronisation is by events, as DESIGN.md §3 names them:
- *param ready*: recorded on H2D after a unit's weights landed in a slot; compute waits on it;
- *buffer free*: recorded on compute after a slot's last use; the next H2D into that slot waits on it;
- *compute done*: recorded on compute after a gradient (or checkpoint) is final; the D2H copy waits on it.
The host thread never blocks on the device inside a step, except on the host optimizer's per-unit "updated" flag
(a weight cannot be streamed before step t's update wrote it) and once per step on the gradient norm.

A slot holds one unit as two buffers: the cast segment of its layout in the compute dtype and the fp32 tail
(norms, biases, embedding). A load copies the unit's fp32 master from pinned host memory: the tail straight into the
slot, the cast segment in chunks through one fp32 staging buffer, each chunk cast on the H2D stream (the cast is a
0.1%-of-the-copy-time kernel, so it does not need a stream of its own). Templates read the slot through views.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from engine.device import Device
from engine.model.layout import UnitLayout

STAGING_ELEMS = 64 * 2**20  # fp32 elements per H2D chunk of a cast segment (256 MiB)


class Slot:
    def __init__(self, dev: Device, cast_numel: int, tail_numel: int, dtype: torch.dtype):
        self.cast = dev.empty((cast_numel,), dtype)
        self.tail = dev.empty((tail_numel,), torch.float32)
        self.ready = dev.event()
        self.free = dev.event()
        self.unit: Optional[int] = None  # which unit's weights the slot holds (valid once `ready` completes)

    def fits(self, layout: UnitLayout) -> bool:
        return self.cast.numel() >= layout.cast_numel and self.tail.numel() >= layout.numel - layout.cast_numel


class WeightLoader:
    """Brings units' fp32 master weights into GPU slots: from pinned host memory on the H2D stream, or, for units
    whose master already lives on the GPU (optimizer state in HBM), by a cast on the compute stream, which is where
    their update ran, so stream order alone makes the cast see the updated weights."""

    def __init__(self, dev: Device, h2d_stream, masters: List[torch.Tensor], layouts: List[UnitLayout],
                 compute_dtype: torch.dtype, timer: "StallTimer"):
        self.dev, self.stream, self.masters, self.layouts, self.timer = dev, h2d_stream, masters, layouts, timer
        self.dtype = compute_dtype
        streamed_cast = [lay.cast_numel for lay, m in zip(layouts, masters) if not self._on_device(m)]
        biggest_cast = max(streamed_cast, default=0)
        self.staging = dev.empty((min(biggest_cast, STAGING_ELEMS),), torch.float32) if biggest_cast else None

    def _on_device(self, master: torch.Tensor) -> bool:
        return self.dev.cuda and master.is_cuda

    def new_slot(self, layouts: List[UnitLayout]) -> Slot:
        return Slot(self.dev, max(lay.cast_numel for lay in layouts),
                    max(lay.numel - lay.cast_numel for lay in layouts), self.dtype)

    def load(self, unit: int, slot: Slot) -> None:
        """Queue the copy of `unit` into `slot` behind the slot's last use; records `slot.ready`."""
        layout, master = self.layouts[unit], self.masters[unit]
        if not slot.fits(layout):
            raise ValueError(f"slot too small for unit {unit}")
        resident = self._on_device(master)
        stream = None if resident else self.stream
        tail_n = layout.numel - layout.cast_numel
        with self.dev.on(stream), self.timer.busy(stream, "h2d" if stream is not None else "cast"):
            self.dev.wait_event(stream, slot.free)
            slot.tail[:tail_n].copy_(master[layout.cast_numel:], non_blocking=True)
            if resident or self.staging is None:
                slot.cast[:layout.cast_numel].copy_(master[:layout.cast_numel])
            else:
                for start in range(0, layout.cast_numel, self.staging.numel()):
                    n = min(self.staging.numel(), layout.cast_numel - start)
                    chunk = self.staging[:n]
                    chunk.copy_(master[start:start + n], non_blocking=True)
                    slot.cast[start:start + n].copy_(chunk)
            slot.ready.record(stream)
        slot.unit = unit

    def bind(self, unit: int, slot: Slot) -> Dict[str, torch.Tensor]:
        return self.layouts[unit].bind(slot.cast, slot.tail)


class StallTimer:
    """Phase times, compute-stream stalls and copy-stream busy time of one step.

    On CUDA everything is measured with events, never by synchronising:
    - `mark(name)` records a phase boundary on the compute stream;
    - a *stall* is the gap between an event recorded on the compute stream just before it is made to wait (on a
      copy's event, or while the host thread blocks on the host optimizer) and one recorded just after: the second
      completes only when compute may go on, so the difference is how long compute sat idle for that reason;
    - `busy(stream)` brackets a copy on its stream; the sum is the time that stream spent copying.
    The gap between the previous step's last mark and this step's first is the `between_steps` stall (the norm
    synchronisation, the optimizer hand-off, Python). Read after the step's synchronisation point. On CPU, copies
    are synchronous: stalls and busy times are not measured, phases are wall-clock.
    """

    def __init__(self, dev: Device):
        self.dev = dev
        self.marks: List[tuple] = []
        self.stalls: List[tuple] = []
        self.copies: List[tuple] = []
        self.previous_end = None

    def reset(self) -> None:
        if self.marks and self.dev.cuda:
            self.previous_end = self.marks[-1][1]
        self.marks, self.stalls, self.copies = [], [], []

    def mark(self, name: str) -> None:
        if self.dev.cuda:
            ev = self.dev.event(timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def wait(self, event, kind: str) -> None:
        """Make compute wait for `event`, timing the stall."""
        if not self.dev.cuda:
            return
        before = self.stall_begin()
        self.dev.wait_event(None, event)
        self.stall_end(before, kind)

    def stall_begin(self):
        if not self.dev.cuda:
            return None
        before = self.dev.event(timing=True)
        before.record()
        return before

    def stall_end(self, before, kind: str) -> None:
        if before is None:
            return
        after = self.dev.event(timing=True)
        after.record()
        self.stalls.append((kind, before, after))

    def busy(self, stream, kind: str):
        """Context manager bracketing work queued on `stream` (a copy stream)."""
        timer = self

        class _Busy:
            def __enter__(self):
                if timer.dev.cuda:
                    self.start = timer.dev.event(timing=True)
                    self.start.record(stream)

            def __exit__(self, *exc):
                if timer.dev.cuda:
                    end = timer.dev.event(timing=True)
                    end.record(stream)
                    timer.copies.append((kind, self.start, end))

        return _Busy()

    def read(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            seconds = a.elapsed_time(b) / 1e3 if self.dev.cuda else b - a
            out[f"{name}_s"] = out.get(f"{name}_s", 0.0) + seconds
        if not self.dev.cuda:
            return out
        stalls = list(self.stalls)
        if self.previous_end is not None and self.marks:
            stalls.append(("between_steps", self.previous_end, self.marks[0][1]))
        for kind, a, b in stalls:
            out[f"{kind}_stall_s"] = out.get(f"{kind}_stall_s", 0.0) + a.elapsed_time(b) / 1e3
        for kind, a, b in self.copies:
            out[f"{kind}_busy_s"] = out.get(f"{kind}_busy_s", 0.0) + a.elapsed_time(b) / 1e3
        out["exposed_s"] = sum(v for k, v in out.items() if k.endswith("_stall_s"))
        return out


class CheckpointStore:
    """Layer-input checkpoints of every micro-batch, on the GPU or in pinned host memory.

    Entry (i, m) is the input of decoder layer i (0-based) for micro-batch m; the head's input never leaves the GPU.
    Host-tier entries are copied out on the D2H stream once compute has produced them (record_stream keeps the GPU
    tensor alive for that copy) and fetched back on the H2D stream for the backward, one micro-batch ahead.
    """

    def __init__(self, dev: Device, h2d_stream, d2h_stream, host_buffer: Optional[torch.Tensor],
                 num_layers: int, micro_batches: int, shape_BTD: tuple, timer: StallTimer):
        self.dev, self.h2d, self.d2h, self.timer = dev, h2d_stream, d2h_stream, timer
        self.shape = shape_BTD
        self.numel = shape_BTD[0] * shape_BTD[1] * shape_BTD[2]
        self.on_gpu = host_buffer is None
        self.gpu: Dict[tuple, torch.Tensor] = {}
        self.host: Dict[tuple, torch.Tensor] = {}
        self.pending: Dict[tuple, tuple] = {}
        if host_buffer is not None:
            need = num_layers * micro_batches * self.numel
            if host_buffer.numel() < need:
                raise ValueError(f"host checkpoint buffer holds {host_buffer.numel()} elements, needs {need}")
            for i in range(num_layers):
                for m in range(micro_batches):
                    k = (i * micro_batches + m) * self.numel
                    self.host[(i, m)] = host_buffer[k:k + self.numel].view(shape_BTD)

    def put(self, i: int, m: int, x: torch.Tensor) -> None:
        if self.on_gpu:
            self.gpu[(i, m)] = x
            return
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

    def get(self, i: int, m: int, timer: StallTimer) -> torch.Tensor:
        if self.on_gpu:
            return self.gpu.pop((i, m))
        self.prefetch(i, m)
        x, ready = self.pending.pop((i, m))
        timer.wait(ready, "checkpoint")
        self.dev.record_stream(x, self.dev.current_stream())
        return x

    def clear(self) -> None:
        self.gpu.clear()
        self.pending.clear()
