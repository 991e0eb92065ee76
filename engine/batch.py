"""The micro-batch every data source hands the engines, and what the engines read from it.

`Batch` is the one contract between `engine/data` (which produces it) and the two engines and the model templates
(which consume it):

- `ids_BT` (int64 [B, T]): the input tokens.
- `labels_BT` (int64 [B, T]): the token each position predicts, or `IGNORE_INDEX` where no loss is counted (the
  prompt of a chat record, the last token of a packed document, padding). The loss of a step is the sum over counted
  positions divided by their number (over every micro-batch of the step and every data-parallel rank).
- `doc_start_BT` (int32 [B, T] or None): for packed rows, the index within the row where each token's document
  begins. A token attends to the keys of its own document only (`doc_start[i] <= j <= i`), and its rotary position
  restarts at 0 with each document (`i - doc_start[i]`). None: one document per row, causal over the whole row,
  positions 0..T-1. Documents are contiguous runs, so `doc_start` never decreases along a row.

With this, a row packed from several documents computes exactly what each document computes on its own: that is what
lets packing waste no tokens on padding without changing what the model learns (tests/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

IGNORE_INDEX = -100  # the label of a position whose prediction is not part of the loss (torch's cross_entropy default)


@dataclass(frozen=True)
class Batch:
    ids_BT: torch.Tensor
    labels_BT: torch.Tensor
    doc_start_BT: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.ids_BT.shape != self.labels_BT.shape or self.ids_BT.dim() != 2:
            raise ValueError(f"Batch: ids {tuple(self.ids_BT.shape)} and labels {tuple(self.labels_BT.shape)} must "
                             "be the same [B, T] shape")
        if self.doc_start_BT is not None and self.doc_start_BT.shape != self.ids_BT.shape:
            raise ValueError(f"Batch: doc_start {tuple(self.doc_start_BT.shape)} must match ids "
                             f"{tuple(self.ids_BT.shape)}")

    @property
    def tokens(self) -> int:
        return self.ids_BT.numel()

    def loss_tokens(self) -> int:
        """Positions whose prediction counts in the loss."""
        return int((self.labels_BT != IGNORE_INDEX).sum())

    def to(self, device, non_blocking: bool = False) -> "Batch":
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return Batch(move(self.ids_BT), move(self.labels_BT), move(self.doc_start_BT))


def loss_tokens(batches: Sequence[Batch], dp=None) -> int:
    """The positions counted in the loss over a step's micro-batches, summed over the data-parallel ranks of `dp`
    (engine/distributed.py) when given: the divisor that makes a step's loss the mean over counted tokens. Raises
    ValueError when none counts (a step of prompts only would otherwise divide by zero)."""
    n = sum(b.loss_tokens() for b in batches)
    if dp is not None:
        n = dp.sum_over_ranks(n)
    if n == 0:
        raise ValueError(f"none of the {sum(b.tokens for b in batches)} tokens of these micro-batches is counted in "
                         "the loss (every label is -100): with data=chat, check that the records have assistant "
                         "turns, or use data.loss_on=all")
    return n
