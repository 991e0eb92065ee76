"""Progress lines for the long steps before and between training steps (weight import, state initialisation).

A 32B model's weights take minutes to import or initialise; without a word the run looks hung. `Progress` prints
'<what>: k/N <unit> (elapsed, about T left)' at most every `every_s` seconds, through the run's log, so the lines
land in train.log too, without a bar that would garble the log file.
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
