"""A unit's fp32 gradient accumulator on the GPU, and the event that says when its readers are done with it.

The accumulator holds the gradient in the unit's flat layout (the optimizer state's layout, so it crosses the link as
one copy). `fused` accumulates all of a micro-batch's gradients in one Triton launch, bit-identical to the
per-tensor torch copy_/add_ it replaces (streamtrain_kernels/grad_accum.py).

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

bf16 transfer (`train.grad_transfer_dtype=bf16`). A host-updated unit's gradient may cross the link as bf16: the
accumulator rounds its finished fp32 sum stochastically into a bf16 `wire` copy on the GPU (`to_wire`, the
`to_bf16_stochastic` kernel: 6 B/element of HBM traffic, to save 2 B/element of the ~50x slower PCIe), and the D2H
copy reads the wire instead of the sum. The wire is lent with the accumulator: the next `claim` waits for the copy
that read it, and the wire is rewritten only after that claim. Its key, `transfer_seed`, is a function of (run seed,
unit, Adam step) like the key of the held bf16 gradients, xor-ed with a stream constant of its own so that the two
never share a key for the same unit and step.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

import torch

from engine import optim
from engine.device import Device
from engine.formats import update_seed
from streamtrain_kernels.grad_accum import accumulate_layout, to_bf16_stochastic
from engine.streaming.stall_timer import StallTimer

# xor-ed into an update's seed to key the rounding of its gradient's D2H copy (formats.GRAD_STREAM: the held copy's)
TRANSFER_STREAM = 0x7866657200000000


def transfer_seed(run_seed: int, unit: int, step: int) -> int:
    """The key of the bf16 rounding of unit's gradient on its way to the host at Adam step `step` (1-based)."""
    return update_seed(run_seed, unit, step) ^ TRANSFER_STREAM


class GradAccumulator:
    def __init__(self, dev: Device, layout, fused: bool, dtype: torch.dtype = torch.float32, wire: bool = False,
                 home: Optional[torch.Tensor] = None, scale_blocks: int = 0):
        """`dtype` bf16 or int8: not an accumulator but a held gradient (a stochastically rounded copy of one,
        written by the engine), with the same lending protocol; int8 codes come with `scales`, `scale_blocks` fp32
        ones (one per block of the format's elements: streamtrain_kernels/grad_quant.py), and have no per-tensor
        `views`. `home`: a bf16 held gradient in this (pinned host) buffer instead of device memory, written over
        D2H. `wire`: the gradient goes to the host as bf16 (a copy of 2 B/element beside the accumulator, written by
        `to_wire`)."""
        self.dev, self.layout, self.fused = dev, layout, fused
        self.flat = home if home is not None else torch.zeros(layout.numel, dtype=dtype, device=dev.device)
        self.scales = torch.zeros(scale_blocks, dtype=torch.float32, device=dev.device) \
            if dtype == torch.int8 else None
        self.views = layout.views(self.flat) if self.scales is None else {}
        self.wire = torch.empty(layout.numel, dtype=torch.bfloat16, device=dev.device) if wire else None
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

    def to_wire(self, seed: int) -> torch.Tensor:
        """The finished gradient rounded stochastically into the bf16 wire copy (on the current stream), for the
        D2H copy to read; `seed`: `transfer_seed` of the unit and step."""
        return to_bf16_stochastic(self.flat, self.wire, seed)

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
