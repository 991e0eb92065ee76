"""Host-resident training state: per-unit flat master weights and Adam moments in the state format, host-tier buffers.

Everything lives in one host arena allocated once, carved into aligned per-unit views. Only the parts that cross
the PCIe link asynchronously (master weights streamed H2D, gradients and kept activations landing D2H) need page-locked
memory; they are allocated as plain memory and pinned with cudaHostRegister, one registration per region. Two
reasons not to use `torch.empty(pin_memory=True)`: the caching host allocator rounds every request up to a power of
two (a 91 GB request would take 128 GB), and the m/v of host-updated units are only touched by the CPU optimizer, so
pinning them would cost registration time for nothing (those of GPU-streamed units cross the link: pinned). On a
CPU-only torch nothing is pinned and the layout is the same.

Bytes: the state format's bytes per parameter (engine/formats.py; fp32 master + m + v: 12) of the units whose state
lives on the host (updated by the host AdamW or streamed to the GPU for their update), plus 4 per parameter for the
gradients of host-updated units when the plan keeps them on the host, plus host-tier layer-input activations, plus a
small pinned staging ring for the host-updated units' gradients kept on the GPU. With bf16 gradient transfer
(`train.grad_transfer_dtype=bf16`) the host gradients and the staging ring hold bf16 (2 per parameter), and one
unpinned fp32 scratch the size of the largest host-updated unit takes each unit's gradient upcast just before its
AdamW. `bytes_by_kind` reports exactly what was allocated; the layout padding (tensors aligned to 64 elements) is
included.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

import torch

from engine.device import pin_host, unpin_host
from engine.formats import StateFormat
from engine.model import ModelSpec
from engine.optim import state_shapes

KIND_OF_STATE = {"master": "master", "m": "adam_m", "v": "adam_v", "m_scales": "adam_scales",
                 "v_scales": "adam_scales"}


INIT_THREADS = 8
LOW_PRECISION_INIT_SCRATCH_BYTES = 8 * 2**30  # fp32 copies of units being drawn at once, when the master is not fp32


def init_copies(master_dtype: str, numels: Sequence[int]) -> int:
    """How many units `HostStore` initialises at once when each holds an fp32 copy of its unit (a low-precision
    master is drawn in fp32, then rounded): up to 4, as many as fit in 8 GiB of copies, at least one. 0 for an fp32
    master (drawn in place). The planner counts the copies at start-up (engine/plan/stream.py). Without the cap, four
    gpt-oss-120b layers in flight would hold 51 GB of fp32 beside their bf16 masters."""
    if master_dtype == "fp32" or not numels:
        return 0
    per_copy = 4 * max(numels)
    return max(1, min(4, len(numels), LOW_PRECISION_INIT_SCRATCH_BYTES // max(per_copy, 1)))


def init_master(spec: ModelSpec, unit, flat: torch.Tensor, seed: int) -> None:
    """A unit's initial weights into its flat master (host or GPU): drawn in fp32, rounded to nearest into a bf16
    master; the alignment padding between tensors zero."""
    init = flat if flat.dtype == torch.float32 else torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    init.zero_()
    spec.init_unit(unit, unit.layout.views(init), seed)
    if init is not flat:
        flat.copy_(init)


class HostStore:
    def __init__(self, spec: ModelSpec, pin: bool, grad_units: Sequence[int], grad_staging: int,
                 host_activation_numel: int, seed: int, host_units: Optional[Sequence[int]] = None,
                 streamed_units: Sequence[int] = (), fmt: Optional[StateFormat] = None,
                 disk_units: Sequence[int] = (), grad_dtype: torch.dtype = torch.float32):
        """`host_units`: the units whose state lives here (default all); the others get empty placeholders (their
        state lives in GPU memory, owned by the engine). `grad_units`: the units whose gradients wait here for the
        global norm (streamed units among them: their held bf16 gradients, until their update on the GPU). `streamed_units`: units updated on the GPU from this state, whose moments (and int8 scales)
        cross the link too and are therefore pinned like the master. `fmt`: the state format (default fp32); a
        bf16 master is initialised in fp32 and rounded to nearest, as `optim.FormatAdamW.from_masters` does.
        `disk_units`: host units whose m and v live in the NVMe tier's file (engine/streaming/nvme.py): they get
        empty placeholders here. `grad_dtype`: the dtype the host-updated units' gradients arrive in (host gradients
        and staging); bf16 adds `grad_upcast`, the fp32 scratch their AdamW reads."""
        self.spec = spec
        self.layouts = [u.layout for u in spec.units]
        self.host_units = set(range(len(spec.units)) if host_units is None else host_units)
        numels = [lay.numel if u.index in self.host_units else 0 for u, lay in zip(spec.units, self.layouts)]
        self.total_numel = sum(numels)
        self.pin = pin
        self.bytes_by_kind: Dict[str, int] = {}
        self.pinned: List[torch.Tensor] = []

        self.fmt = fmt or StateFormat("fp32", "fp32", "fp32")
        self.state: Dict[str, List[torch.Tensor]] = {}  # "master", "m", "v"[, "m_scales", "v_scales"] -> per unit
        shapes = [state_shapes(self.fmt, n) for n in numels]
        on_disk = set(disk_units)
        for name, (_, dtype) in shapes[0].items() if shapes else ():
            unit_numels = [0 if u in on_disk and name != "master" else sh[name][0] for u, sh in enumerate(shapes)]
            arena = self._alloc(KIND_OF_STATE[name], sum(unit_numels), zero=name != "master", dtype=dtype)
            self.state[name] = self._split(arena, unit_numels)
        self.master, self.m, self.v = self.state["master"], self.state["m"], self.state["v"]
        to_pin: List[torch.Tensor] = []
        self.grads = None
        if grad_units:
            grad_numels = [n if i in set(grad_units) else 0 for i, n in enumerate(numels)]
            self.grads = self._split(self._alloc("grads", sum(grad_numels), dtype=grad_dtype), grad_numels)
            to_pin += self.grads  # one registration per unit: every copy stays inside one registered region
        to_pin += [self.state[name][u] for u in streamed_units for name in self.state if name != "master"]
        host_updated = [n for u, n in enumerate(numels) if u not in set(streamed_units)]
        self.grad_staging = [self._alloc("grad_staging", max(host_updated), dtype=grad_dtype)
                             for _ in range(grad_staging)]
        to_pin += self.grad_staging
        self.grad_upcast = None
        host_updated_grads = set(grad_units) - set(streamed_units)  # the others' held bf16 copies go to the GPU
        if grad_dtype != torch.float32 and (host_updated_grads or grad_staging):
            self.grad_upcast = self._alloc("grad_upcast", max(host_updated))
        self.activations = None
        if host_activation_numel:
            self.activations = self._alloc("activations", host_activation_numel)
            to_pin.append(self.activations)

        def init_unit(unit) -> None:
            init_master(spec, unit, self.master[unit.index], seed)
            self._pin(self.master[unit.index])

        def touch_and_pin(t: torch.Tensor) -> None:
            t.zero_()
            self._pin(t)

        to_init = [u for u in spec.units if u.index in self.host_units]
        # with a low-precision master each thread holds an fp32 copy of the unit it initialises
        init_threads = init_copies(self.fmt.master, [u.layout.numel for u in to_init]) or INIT_THREADS
        with ThreadPoolExecutor(max_workers=init_threads) as pool:
            list(pool.map(init_unit, to_init))
            list(pool.map(touch_and_pin, to_pin))

    def _alloc(self, kind: str, numel: int, zero: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.zeros(numel, dtype=dtype) if zero else torch.empty(numel, dtype=dtype)
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + t.numel() * t.element_size()
        return t

    @staticmethod
    def _split(arena: torch.Tensor, numels: List[int]) -> List[torch.Tensor]:
        return list(torch.split(arena, numels))

    def _pin(self, t: torch.Tensor) -> None:
        if not self.pin or t.numel() == 0:  # the empty placeholders of GPU-resident units
            return
        pin_host(t)
        self.pinned.append(t)

    def close(self) -> None:
        """Unpin everything. Copies into or out of this memory may still be queued on any stream (a gradient D2H,
        a prefetch), and unregistering under a running DMA is undefined, so the device is drained first; this runs
        once, at the end of a run, never on the step path."""
        if not self.pinned:
            return
        torch.cuda.synchronize()
        failed = []
        for t in self.pinned:
            err = unpin_host(t)
            if err != 0:
                failed.append(f"{t.numel() * t.element_size() / 2**30:.2f} GiB at {t.data_ptr():#x}: CUDA error {err}")
        self.pinned = []
        if failed:
            raise RuntimeError("cudaHostUnregister failed for " + "; ".join(failed))
