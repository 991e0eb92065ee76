"""Weight slots and the copy streams that fill them, and the events that order them.

Three streams: compute (the current stream), H2D (weights and host-tier activations coming in) and D2H
(gradients and activations going out). The only synchronisation is by events (engine/streaming/engine.py orders
the step):
- *param ready*: recorded on H2D after a unit's weights landed in a slot; compute waits on it;
- *buffer free*: recorded on compute after a slot's last use; the next H2D into that slot waits on it;
- *compute done*: recorded on compute after a gradient (or a kept activation) is final; the D2H copy waits on it.
The host thread never blocks on the device inside a step, except on the host optimizer's per-unit "updated" flag
(a weight cannot be streamed before step t's update wrote it) and once per step on the gradient norm.

A slot holds one unit as two buffers: the cast segment of its layout in the compute dtype and the fp32 tail
(norms, biases, embedding). A load copies the unit's master from pinned host memory: a segment whose dtype the slot
shares (the fp32 tail of an fp32 master, the cast segment of a bf16 master) straight into the slot, the other in
chunks through one staging buffer of the master's dtype, each chunk cast on the H2D stream (the cast is a
0.1%-of-the-copy-time kernel, so it does not need a stream of its own). Templates read the slot through views.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from engine.device import Device
from engine.model.layout import UnitLayout
from engine.streaming.stall_timer import StallTimer

STAGING_ELEMS = 64 * 2**20  # elements per H2D chunk of a segment that is cast on arrival (256 MiB in fp32)


class Slot:
    def __init__(self, dev: Device, cast_numel: int, tail_numel: int, dtype: torch.dtype):
        self.cast = dev.empty((cast_numel,), dtype)
        self.tail = dev.empty((tail_numel,), torch.float32)
        self.ready = dev.event()
        self.free = dev.event()
        self.unit: Optional[int] = None  # which unit's weights the slot holds (valid once `ready` completes)

    def fits(self, layout: UnitLayout) -> bool:
        return self.cast.numel() >= layout.cast_numel and self.tail.numel() >= layout.numel - layout.cast_numel

    def fill(self, layout: UnitLayout, master: torch.Tensor) -> None:
        """Copy a unit's fp32 master into this slot in one go (cast segment cast to the slot's dtype), queued on the
        current stream: for a master on the GPU (the staging path of `WeightLoader.load` is for host masters)."""
        self.tail[:layout.numel - layout.cast_numel].copy_(master[layout.cast_numel:], non_blocking=True)
        self.cast[:layout.cast_numel].copy_(master[:layout.cast_numel], non_blocking=True)


class WeightLoader:
    """Brings units' master weights (fp32, or bf16 in a low-precision format) into GPU slots: from pinned host
    memory on the H2D stream, or, for units whose master already lives on the GPU (optimizer state in HBM), by a cast
    on the compute stream, which is where their update ran, so stream order alone makes the cast see the updated
    weights."""

    def __init__(self, dev: Device, h2d_stream, masters: List[torch.Tensor], layouts: List[UnitLayout],
                 compute_dtype: torch.dtype, timer: StallTimer):
        self.dev, self.stream, self.masters, self.layouts, self.timer = dev, h2d_stream, masters, layouts, timer
        self.dtype = compute_dtype
        self.staging = None
        host = [(lay, m) for lay, m in zip(layouts, masters) if not self._on_device(m)]
        if host:
            master_dtype = host[0][1].dtype
            recast = [n for lay, _ in host for n, dtype in self._segments(lay) if dtype != master_dtype]
            if max(recast, default=0):
                self.staging = dev.empty((min(max(recast), STAGING_ELEMS),), master_dtype)

    def _segments(self, layout: UnitLayout):
        """(numel, slot dtype) of the cast segment and the tail."""
        return [(layout.cast_numel, self.dtype), (layout.numel - layout.cast_numel, torch.float32)]

    def _on_device(self, master: torch.Tensor) -> bool:
        return self.dev.cuda and master.is_cuda

    def new_slot(self, layouts: List[UnitLayout]) -> Slot:
        return Slot(self.dev, max(lay.cast_numel for lay in layouts),
                    max(lay.numel - lay.cast_numel for lay in layouts), self.dtype)

    def load(self, unit: int, slot: Slot, after=None) -> None:
        """Queue the copy of `unit` into `slot` behind the slot's last use (and behind event `after`: the D2H that
        wrote a GPU-streamed unit's master home); records `slot.ready`."""
        layout, master = self.layouts[unit], self.masters[unit]
        if not slot.fits(layout):
            raise ValueError(f"slot too small for unit {unit}")
        resident = self._on_device(master)
        stream = None if resident else self.stream
        tail_n = layout.numel - layout.cast_numel
        with self.dev.on(stream), self.timer.busy(stream, "h2d" if stream is not None else "cast"):
            self.dev.wait_event(stream, slot.free)
            if after is not None:
                self.dev.wait_event(stream, after)
            if resident or self.staging is None:
                slot.fill(layout, master)
            else:
                for dst, src in ((slot.cast[:layout.cast_numel], master[:layout.cast_numel]),
                                 (slot.tail[:tail_n], master[layout.cast_numel:])):
                    if dst.dtype == src.dtype:
                        dst.copy_(src, non_blocking=True)
                        continue
                    for start in range(0, src.numel(), self.staging.numel()):
                        n = min(self.staging.numel(), src.numel() - start)
                        chunk = self.staging[:n]
                        chunk.copy_(src[start:start + n], non_blocking=True)
                        dst[start:start + n].copy_(chunk)
            slot.ready.record(stream)
        slot.unit = unit

    def bind(self, unit: int, slot: Slot) -> Dict[str, torch.Tensor]:
        return self.layouts[unit].bind(slot.cast, slot.tail)
