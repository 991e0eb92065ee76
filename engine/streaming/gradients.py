"""A unit's fp32 gradient accumulator on the GPU, and the event that says when its readers are done with it.

The accumulator holds the gradient in the unit's flat layout (the optimizer state's layout, so it crosses the link as
one copy). `fused` accumulates all of a micro-batch's gradients in one Triton launch, bit-identical to the
per-tensor torch copy_/add_ it replaces (engine/kernels/grad_accum.py).

Norms. The engine's last `add` of a step into an accumulator passes `sq_norms_out`, its slice of the step's
per-tensor sums of squares (the clipping norm's input, `optim.sq_norms`'s definition), so that no pass of its own
reads the finished gradient again. On a GPU the fused kernel computes them from the values in registers: fp32 sums
per block, summed in fp64 per tensor, which differ from the fp64 definition by rounding only. Otherwise, the torch
path or a CPU, `optim.sq_norms` reads the result once more. The CPU is where engine=stream must equal
engine=reference bit for bit, and the kernel there runs under the Triton interpreter, whose in-block sums follow
numpy's order, not torch's: it is not asked for norms there (tests/kernels/ test its norms against the definition).

Lifetime. Once a unit's backward is done the accumulator is handed to one reader: the D2H copy to the host
(grads tier host, queued by the engine's thread), the host optimizer's fetch into pinned staging (grads tier gpu,
queued by the optimizer thread), or the GPU update on the compute stream. The next time the engine overwrites the
accumulator (the next unit sharing it in this backward, or the same unit next step) it must wait for that read.
`hand_off` marks the accumulator as lent, `read_queued(stream)` records the `read_done` event behind the read on its
stream, and `claim` makes the compute stream wait for that event. Because the optimizer thread records its event
from another host thread, `claim` first waits (on the host) until the record has been issued: waiting on a CUDA
event that has not been recorded yet returns at once and would order nothing. In a normal step the record was
issued long before (the next forward cannot start before every unit's update, which follows its fetch), so the host
wait returns immediately; it exists so that this ordering does not rest on that argument.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

import torch

from engine import optim
from engine.device import Device
from engine.kernels.grad_accum import accumulate_layout
from engine.streaming.stall_timer import StallTimer


class GradAccumulator:
    def __init__(self, dev: Device, layout, fused: bool, dtype: torch.dtype = torch.float32):
        """`dtype` bf16: not an accumulator but a held gradient (a stochastically rounded copy of one, written
        by the engine), with the same lending protocol."""
        self.dev, self.layout, self.fused = dev, layout, fused
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=dev.device)
        self.views = layout.views(self.flat)
        self.fresh = True  # next accumulation overwrites instead of adding
        self.read_done = dev.event()
        self._read_queued = threading.Event()
        self._read_queued.set()

    def hand_off(self) -> None:
        """The gradient is final and lent to a reader that will call `read_queued`."""
        self._read_queued.clear()

    def read_queued(self, stream) -> None:
        """The reader's copy (or update) is queued on `stream` (None: the compute stream)."""
        self.read_done.record(stream)
        self._read_queued.set()

    def release_unread(self) -> None:
        """The reader will not read it (a skipped step): nothing to wait for."""
        self._read_queued.set()

    def claim(self, timer: StallTimer, check_reader: Callable[[], None]) -> None:
        """Before overwriting: compute waits until the last reader's copy is done; the next add overwrites.
        `check_reader` is called while the host waits and raises if the reader (the optimizer thread) has died."""
        while not self._read_queued.wait(0.5):
            check_reader()
        timer.wait(self.read_done, "grad_read")
        self.fresh = True

    def add(self, grads: Dict[str, torch.Tensor], sq_norms_out: Optional[torch.Tensor] = None) -> None:
        """Accumulate `grads` (a subset of the layout's names). `sq_norms_out`: fp32 [len(grads)], receives each
        given tensor's sum of squares of the result, in `layout.specs` order."""
        in_kernel = self.fused and self.dev.cuda
        if self.fused:
            accumulate_layout(self.layout, self.flat, grads, first=self.fresh,
                              sq_norms_out=sq_norms_out if in_kernel else None)
        else:
            for name, g in grads.items():
                if self.fresh:
                    self.views[name].copy_(g)
                else:
                    self.views[name].add_(g)
        self.fresh = False
        if sq_norms_out is not None and not in_kernel:
            sq_norms_out.copy_(optim.sq_norms([self.views[s.name] for s in self.layout.specs if s.name in grads]))
