"""The GPU-streamed update place (engine/placement.py): a unit whose optimizer state lives in host RAM, updated on
the GPU.

Such a unit's update of step t runs when step t+1's forward loads it, in place of the plain weight load:
1. on the H2D stream, its master, m and v (and int8 moments' scales) come into one of two GPU staging buffers
   (after the D2H that emptied that buffer, and after the D2H that wrote this unit's state home the last time);
2. on the same stream, behind the event recorded when the step's gradient norm and clip coefficient were known, the
   unit is updated over views of the staging buffer by the engine's `step` function: the fused CUDA AdamW the
   reference runs on the clipped gradient (fp32 state, exact), or the fused format kernel, which clips itself
   (streamtrain_kernels/adamw_update.py);
3. still on the H2D stream, the fresh master is cast into the unit's weight slot (bf16 cast segment, fp32 tail):
   no second H2D of the unit's weights;
4. on the D2H stream, the state goes back to its pinned home; that copy frees the staging buffer.
Cost per parameter in fp32 state: 12 B over H2D instead of the 4 B of a plain load, 12 B over D2H, about 28 B of
HBM traffic for the AdamW kernel (milliseconds per layer), no CPU time; a format moves its own bytes per parameter
(bf16 master + int8 moments: 4 B each way). GPU memory: two staging buffers of the largest streamed unit's state,
and the unit's gradient (its fp32 accumulator, or the bf16 copy held for it), from its backward to its next forward.
A bf16 held gradient may instead wait in pinned host memory (`host_grads`, `engine.host_grad_units`): it then comes
in over H2D into the staging buffer behind the unit's state (2 B/param more H2D, and the same again over D2H in the
backward), and the GPU holds none of it between the backward and the update.

The format kernel reads the learning rate from a device scalar that the engine refills at the end of every step on
the compute stream. That refill cannot overtake a queued update's read: every streamed update of step t is queued
during step t+1's forward, whose compute waits on the slot it fills (or, without a slot, `flush` waits for it on
the host), and the next refill follows that forward on the compute stream.

Only events order the work: the host never waits for the device here. The staging buffer a unit uses is fixed by its
rank among the streamed units (rank % 2), so each unit's AdamW (its parameter views and step counters) is built once.
`flush` applies pending updates without a slot to cast into (before a checkpoint, an export or the end of the run);
the next load of such a unit reads its master from home, after the D2H that wrote it. A norm pass (`engine.norm_pass`)
updates every streamed unit that way in its second backward, as soon as the unit's gradient is finished
(`update_now`): the same state traffic, moved from the next forward into the backward, and a plain weight load at the
next forward; the unit's gradient is never held.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from engine.device import Device
from engine.model.layout import UnitLayout
from engine.streaming.gradients import GradAccumulator
from engine.streaming.slots import Slot
from engine.streaming.stall_timer import StallTimer

N_STAGES = 2


ALIGN_BYTES = 256  # each state tensor's view in a staging buffer starts on this boundary


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class StateStage:
    """One GPU staging buffer (raw bytes) for a unit's state tensors, and the event that frees it."""

    def __init__(self, dev: Device, nbytes: int):
        self.raw = dev.empty((nbytes,), torch.uint8)
        self.free = dev.event()

    def views(self, homes: List[torch.Tensor]) -> List[torch.Tensor]:
        """Views of this buffer with the dtypes and sizes of `homes`, one after the other."""
        out, offset = [], 0
        for home in homes:
            nbytes = home.numel() * home.element_size()
            out.append(self.raw[offset:offset + nbytes].view(home.dtype))
            offset += _aligned(nbytes)
        return out


class StreamedUpdater:
    def __init__(self, dev: Device, h2d_stream, d2h_stream, layouts: List[UnitLayout], units: Sequence[int],
                 homes: Dict[str, List[torch.Tensor]], timer: StallTimer,
                 host_grads: Optional[Dict[int, torch.Tensor]] = None):
        """`homes`: state name ("master" first, then "m", "v", ...) -> per-unit pinned host buffers (the streamed
        units' entries are used). `host_grads`: the units whose held gradient waits in this pinned host buffer; it
        comes into the staging buffer beside the state."""
        self.dev, self.h2d, self.d2h, self.layouts, self.timer = dev, h2d_stream, d2h_stream, layouts, timer
        self.units = list(units)
        self.homes = homes
        self.host_grads = host_grads or {}
        nbytes = max((sum(_aligned(t.numel() * t.element_size()) for t in self._staged(u)) for u in self.units),
                     default=0)
        self.stages = [StateStage(dev, nbytes) for _ in range(min(N_STAGES, len(self.units)))]
        self.stage_of = {u: self.stages[rank % len(self.stages)] for rank, u in enumerate(self.units)}
        self.landed: Dict[int, object] = {}  # unit -> event: its state is back home
        self.pending: Dict[int, GradAccumulator] = {}  # units whose update of the last step has not run yet
        self.grad_landed: Dict[int, object] = {}  # host_grads unit -> event: its gradient is in its host buffer
        self.coef: Optional[torch.Tensor] = None
        self.scale = False
        self.lr = 0.0
        self.grads_final = None

    def _staged(self, unit: int) -> List[torch.Tensor]:
        """The host buffers whose copies share unit's staging buffer: its state, then its gradient if on the host."""
        return [self.homes[k][unit] for k in self.homes] + ([self.host_grads[unit]] if unit in self.host_grads else [])

    def state_views(self, unit: int) -> Dict[str, torch.Tensor]:
        """The unit's state by name as GPU views of its staging buffer (what its update runs over)."""
        return dict(zip(self.homes, self.stage_of[unit].views(self._staged(unit))))

    @property
    def bytes(self) -> int:
        return sum(s.raw.numel() for s in self.stages)

    def submit(self, grads: Dict[int, GradAccumulator], coef: torch.Tensor, scale: bool, lr: float,
               grad_landed: Optional[Dict[int, object]] = None) -> None:
        """After the backward of a step that is not skipped: the streamed units' updates are due. Records the event
        the updates wait for (the gradients and `coef` are final on the compute stream); `grad_landed`: per
        `host_grads` unit, the event after its gradient's D2H copy."""
        if self.pending:
            raise RuntimeError(f"streamed updates of units {sorted(self.pending)} were never applied")
        self.set_update(coef, scale, lr)
        self.grads_final = self.dev.event()
        self.grads_final.record()
        self.pending = {u: grads[u] for u in self.units}
        self.grad_landed = dict(grad_landed or {})

    def set_update(self, coef: torch.Tensor, scale: bool, lr: float) -> None:
        """The step's clip coefficient (on the GPU, final on the compute stream), whether it scales, and the
        learning rate, for the updates queued from now on."""
        self.dev.record_stream(coef, self.h2d)
        self.coef, self.scale, self.lr = coef, scale, lr

    def update_now(self, unit: int, grad: GradAccumulator, step) -> None:
        """A norm pass's second backward: queue unit's update at once, behind its gradient's last add on the current
        stream, after `set_update`; no slot to cast into (the next forward loads the unit's weights from home, after
        the D2H that writes them there)."""
        self.grads_final = self.dev.event()
        self.grads_final.record()
        self.pending[unit] = grad
        self.update(unit, step, None)

    def update(self, unit: int, step, slot: Optional[Slot]) -> None:
        """Queue unit's update (and, with a slot, the cast of its fresh weights into it); see the module doc.
        `step(unit, grad, views, coef, scale, lr)` queues the update itself, on the current stream, over `views`
        (`state_views(unit)`)."""
        acc = self.pending.pop(unit)
        layout, stage = self.layouts[unit], self.stage_of[unit]
        staged = stage.views(self._staged(unit))  # the state's views, then the host-held gradient's if any
        views = dict(zip(self.homes, staged))
        parts = list(views.values())
        homes = [self.homes[k][unit] for k in views]
        with self.dev.on(self.h2d), self.timer.busy(self.h2d, "h2d"):
            self.dev.wait_event(self.h2d, stage.free)
            if unit in self.landed:
                self.dev.wait_event(self.h2d, self.landed[unit])
            for part, home in zip(parts, homes):
                part.copy_(home, non_blocking=True)
            grad = acc.flat
            if unit in self.host_grads:
                self.dev.wait_event(self.h2d, self.grad_landed.pop(unit))
                grad = staged[-1]
                grad.copy_(acc.flat, non_blocking=True)
            self.dev.wait_event(self.h2d, self.grads_final)
            step(unit, grad, views, self.coef, self.scale, self.lr)
            acc.read_queued(self.h2d)
            if slot is not None:
                self.dev.wait_event(self.h2d, slot.free)
                slot.fill(layout, views["master"])
                slot.ready.record(self.h2d)
            updated = self.dev.event()
            updated.record(self.h2d)
        with self.dev.on(self.d2h), self.timer.busy(self.d2h, "d2h"):
            self.dev.wait_event(self.d2h, updated)
            for part, home in zip(parts, homes):
                home.copy_(part, non_blocking=True)
            stage.free.record(self.d2h)
            landed = self.dev.event()
            landed.record(self.d2h)
        self.landed[unit] = landed
        if slot is not None:
            slot.unit = unit

    def skip(self, grads: Dict[int, GradAccumulator]) -> None:
        """A skipped step: the gradients will not be read."""
        for u in self.units:
            grads[u].release_unread()

    def flush(self, step) -> None:
        """Apply every pending update now (no cast) and wait until all state is home."""
        for unit in sorted(self.pending):
            self.update(unit, step, None)
        for ev in self.landed.values():
            ev.synchronize()
