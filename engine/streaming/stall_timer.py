"""Phase times, compute-stream stalls and copy-stream busy time of one streamed step, measured with CUDA events."""

from __future__ import annotations

import time
from typing import Dict, List

from engine.device import Device


class StallTimer:
    """Phase times, compute-stream stalls and copy-stream busy time of one step.

    On CUDA everything is measured with events, never by synchronising:
    - `mark(name)` records a phase boundary on the compute stream;
    - a *stall* is the gap between an event recorded on the compute stream just before it is made to wait (on a
      copy's event, or while the host thread blocks on the host optimizer) and one recorded just after: the second
      completes only when compute may go on, so the difference is how long compute sat idle for that reason;
    - `busy(stream)` brackets a copy on its stream; the sum is the time that stream spent copying.
    The gap between the previous step's last mark and this step's first is the `between_steps` stall (the norm
    synchronisation, the optimizer hand-off, Python).

    `read` runs after the step's synchronisation point, which covers the compute stream only: a copy stream may
    still be busy (with grads on the host, the embedding's gradient D2H is queued after the last compute). Each
    copy's end event is therefore synchronised before it is read; an event still pending cannot be timed (CUDA
    answers "not ready"). The wait is at most that last copy, which the host optimizer must wait for anyway before
    it can update the embedding, the first unit the next forward needs. A norm pass's second backward runs after
    that point, so the phase marks are synchronised too (the host waits for the step's last compute, which only the
    launch of the next step's first kernels could have overlapped). On CPU, copies are synchronous: stalls and
    busy times are not measured, phases are wall-clock.
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
            if self.dev.cuda:
                b.synchronize()
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
            b.synchronize()
            out[f"{kind}_busy_s"] = out.get(f"{kind}_busy_s", 0.0) + a.elapsed_time(b) / 1e3
        out["exposed_s"] = sum(v for k, v in out.items() if k.endswith("_stall_s"))
        return out
