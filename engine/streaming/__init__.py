"""The streaming engine: host RAM holds the training state, the GPU computes one unit at a time.

One file per piece:
- `engine.py`      StreamEngine, the step: forward, head, backward, optimizer hand-off; the one place that orders work
- `slots.py`       GPU weight slots and the H2D loader that fills them (chunked cast through a staging buffer)
- `activations.py` ActivationStore: the layer inputs kept for the backward's recompute, on the GPU or host
- `gradients.py`   GradAccumulator: a unit's fp32 gradient on the GPU and the events that order its readers
- `host_store.py`  HostStore: the pinned host arena of master weights, Adam moments, gradients, activations
- `stall_timer.py` StallTimer: phase times, compute stalls and copy busy time, from CUDA events
"""

from engine.streaming.engine import StreamEngine

__all__ = ["StreamEngine"]
