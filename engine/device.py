"""The device layer: streams, events, pinned memory and autocast, with CPU stand-ins.

On CUDA these are torch.cuda streams and events. On a CPU-only torch (CI), a stream is a no-op context, an event
records nothing and waiting on it returns at once, and "copies" are synchronous, because every op already runs in
program order on one device. The schedule is written once against this interface, so CI runs exactly the code path
that the GPU runs, minus the concurrency.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("hardware.device=cuda but torch sees no CUDA device "
                               f"(torch {torch.__version__}); use hardware.device=cpu or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


CUBLAS_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")  # the two settings under which cuBLAS is reproducible


def set_deterministic(enabled: bool) -> None:
    """Switch torch's deterministic-algorithms mode for this process (`train.deterministic`). On: every op must use
    a reproducible algorithm or raise (strict, never a warning: a silently nondeterministic op would defeat the
    point), inductor picks reduction configs that do not depend on timing, the Triton attention kernel skips its
    autotuning (streamtrain_kernels/attention.py), and cuBLAS gets a fixed workspace. CUBLAS_WORKSPACE_CONFIG takes
    effect only if it is set before the process's first cuBLAS call, so call this before any CUDA work."""
    if enabled:
        # another value already set is refused by engine/config.py `validate`
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACES[0])
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def pin_host(t: torch.Tensor, hint: str = "") -> None:
    """Page-lock an existing host tensor's memory with cudaHostRegister (no power-of-two rounding, unlike
    `pin_memory=True`). Raises with the size and CUDA error; `hint` is appended to the message."""
    nbytes = t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with CUDA error {err}; the host may "
                           f"not allow that much locked memory (ulimit -l){hint}")


def unpin_host(t: torch.Tensor) -> int:
    """Undo `pin_host`; returns the CUDA error code (0: done). The caller drains the device first."""
    return int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


def autocast_dtype(device_type: str, fallback: torch.dtype) -> torch.dtype:
    """The dtype autocast computes in on `device_type` where it is on, else `fallback` (the tensors' own)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else fallback


def autocast_ctx(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class _NullEvent:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class Device:
    """Streams and events for one device; `cuda` false gives the synchronous CPU stand-ins."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def new_stream(self) -> Optional[torch.cuda.Stream]:
        return torch.cuda.Stream(device=self.device) if self.cuda else None

    def current_stream(self) -> Optional[torch.cuda.Stream]:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else _NullEvent()

    def wait_event(self, stream, event) -> None:
        """Make `stream` (None: the current one) wait for `event` on the device; the host does not block."""
        if self.cuda:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if self.cuda:
            tensor.record_stream(stream)

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)
