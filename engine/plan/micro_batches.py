"""`train.grad_accum=-1`: the micro-batches of a step chosen by the plan, so that the weight stream hides.

Each step the forward streams every streamed unit over the link once, whatever the tokens: the weights, and for the
units updated on the GPU their master and moments too. Its compute grows with the tokens. Below some tokens a step
the forward waits on the link; a sparse model's does at 64K tokens, since every expert streams and few compute.
With `-1` the plan takes the fewest micro-batches, from 1 to `MAX_MICRO_BATCHES`, whose plan fits and whose
forward computes at least as long as it streams (`MemoryPlan.link_bound_ratio` <= 1). Where no count that fits gets
there, it takes the most that fit (the least exposed stream), and its line says by how much the stream stays
exposed. More micro-batches a step is a larger batch: it changes the optimisation, not only the speed, so the choice
is opt-in. The chosen count is written into the config as if it had been set, so the checkpoint fingerprint and the
run records carry it.

Search: the forward's compute grows in proportion to the micro-batches; its stream grows little (only where more held
gradients move to the host). From a count n whose stream is r times its compute, the next count tried is
ceil(n * r): the answer if the stream did not grow, too few by a little if it did (then the step repeats). A count
that does not fit ends the climb with a bisection between the last count that fit and it. That is a handful of
plans, each a fraction of a second, instead of one per count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from engine.plan.memory import MemoryPlan

MAX_MICRO_BATCHES = 64  # the most `train.grad_accum=-1` considers


@dataclass
class MicroBatchChoice:
    """What `choose_micro_batches` took: the count, its plan, and a line for the start banner."""
    grad_accum: int
    plan: MemoryPlan
    line: str


def choose_micro_batches(plan_with: Callable[[int], MemoryPlan],
                         max_micro_batches: int = MAX_MICRO_BATCHES) -> MicroBatchChoice:
    """The fewest micro-batches in 1..`max_micro_batches` whose plan (`plan_with(n)`, unchecked) fits with the
    forward's stream hidden behind its compute; else the most that fit; else 1, whose plan then refuses the run.
    Every plan must carry step times (a GPU plan of engine=stream): the caller refuses the others."""
    plans = {}

    def plan(n: int) -> MemoryPlan:
        if n not in plans:
            plans[n] = plan_with(n)
        return plans[n]

    n = 1
    if plan(1).problem():
        return MicroBatchChoice(1, plan(1), "train.grad_accum=-1: not even 1 micro-batch a step fits; the plan "
                                            "shown is of 1")
    while plan(n).link_bound_ratio() > 1.0 and n < max_micro_batches:
        nxt = min(max_micro_batches, max(n + 1, math.ceil(n * plan(n).link_bound_ratio())))
        if plan(nxt).problem():
            n = _most_that_fit(plan, n, nxt)
            break
        n = nxt
    return MicroBatchChoice(n, plan(n), _choice_line(n, plan(n), max_micro_batches))


def _most_that_fit(plan: Callable[[int], MemoryPlan], fits: int, too_many: int) -> int:
    """Bisection: the largest count in [fits, too_many) whose plan fits (`fits` does, `too_many` does not)."""
    while too_many - fits > 1:
        mid = (fits + too_many) // 2
        if plan(mid).problem():
            too_many = mid
        else:
            fits = mid
    return fits


def _choice_line(n: int, plan: MemoryPlan, max_micro_batches: int) -> str:
    ratio = plan.link_bound_ratio()
    head = f"train.grad_accum=-1: {n} micro-batch{'es' if n > 1 else ''} a step ({plan.times_s['step']:.2f} s planned"
    if ratio <= 1.0:
        return f"{head}; the forward computes {1 / ratio:.2f}x as long as it streams the weights)" if ratio else \
            f"{head}; nothing streams in the forward)"
    why = f"{max_micro_batches}, the most considered" if n == max_micro_batches else f"{n + 1} does not fit"
    return (f"{head}; {why}, and the forward still streams its weights {ratio:.2f}x as long as it computes: the "
            "link sets its pace)")
