"""Progress lines for long work: before and between training steps (weight import, state initialisation), and
inside a training step that takes minutes.

A 32B model's weights take minutes to import or initialise, and one 512K-token step of qwen7b takes over ten minutes
on an H100; without a word the run looks hung. `Progress` prints '<what>: k/N <unit> (elapsed, about T left)' at
most every `every_s` seconds, through the run's log, so the lines land in train.log too, without a bar that would
garble the log file. `StepProgress` does the same inside a step, from the streaming engine's layer loops
('step 3: backward, 12 of 28 layers (4m10s into the step)'); the layer a line names has been queued on the GPU,
which runs at most a few layers behind (the engine waits for a slot's previous layer before reusing it).
"""

from __future__ import annotations

import time
from typing import Callable


class Progress:
    def __init__(self, what: str, total: int, log: Callable[[str], None] = print, unit: str = "",
                 every_s: float = 10.0):
        self.what, self.total, self.log, self.unit, self.every_s = what, total, log, unit, every_s
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            elapsed = now - self.t0
            left = elapsed / self.done * (self.total - self.done)
            self.log(f"{self.what}: {self.done}/{self.total}{' ' + self.unit if self.unit else ''} "
                     f"({elapsed:.0f}s, about {left:.0f}s left)")


LONG_STEP_S = 120.0  # a predicted step at least this long gets progress lines inside it
STEP_PROGRESS_EVERY_S = 60.0  # at most one line a minute inside such a step


class StepProgress:
    """The streaming engine's `layer_progress` hook for steps long enough to want it (the trainer installs it when
    the plan predicts a step of `LONG_STEP_S` or more): `begin(step)` before each step, then `(phase, done)` after
    each layer of a phase (forward, backward) logs at most every `every_s` seconds."""

    def __init__(self, num_layers: int, log: Callable[[str], None] = print, every_s: float = STEP_PROGRESS_EVERY_S):
        self.num_layers, self.log, self.every_s = num_layers, log, every_s
        self.begin(0)

    def begin(self, step: int) -> None:
        self.step = step
        self.t0 = self.last = time.monotonic()

    def __call__(self, phase: str, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.log(f"step {self.step}: {phase}, {done} of {self.num_layers} layers ({_minutes(now - self.t0)} into "
                     "the step)")


def _minutes(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"

