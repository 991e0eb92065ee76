"""The contract between the planner and the streaming engine: where each unit's state lives and is updated.

The planner (engine/plan/) decides a `Placement` before anything is allocated; the stream engine
(engine/streaming/engine.py) builds itself from it and from nothing else of the plan. Both sides read the unit sets
derived here, so that "which units are GPU-resident, GPU-streamed, host-updated, on disk, which layer inputs are
kept" has one definition. Units are numbered in forward order: 0 the embedding, 1..L the decoder layers, L + 1 the
head. This module imports nothing from the rest of the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Literal

Tier = Literal["gpu", "host"]
TIERS = ("gpu", "host")


def kept_layer_inputs(num_layers: int, keep_activation_layers: int, recompute_group: int) -> range:
    """The 0-based indices of the layer inputs the forward keeps for the backward: of the recomputed layers (all but
    the last `keep_activation_layers`, whose graphs are kept instead), the first of each recompute group."""
    return range(0, num_layers - keep_activation_layers, recompute_group)


def nvme_layers(n_units: int, first_host_unit: int, n: int) -> List[int]:
    """The units whose Adam moments `engine.nvme_units=n` puts on disk: the last n host-updated decoder layers (units
    first_host_unit.. of the embedding, the layers and the head; the head, the largest unit, stays in RAM)."""
    layers = list(range(max(first_host_unit, 1), n_units - 1))
    return layers[len(layers) - n:] if n else []


@dataclass(frozen=True)
class Placement:
    """One streamed run's layout of state and work (the `engine.*` settings of the same names, resolved).

    Units are updated in one of three places, in forward order: the first `gpu_resident_units` keep master and
    moments in GPU memory; the next `gpu_streamed_units` keep them in host RAM and are updated on the GPU as the
    next forward loads them; the rest are updated by the host AdamW, the moments of the last `nvme_units` of those
    layers in a file on disk."""

    n_units: int  # embedding + decoder layers + head
    slots: int = 2  # the ring of layer slots
    keep_activation_layers: int = 0  # the last N layers keep their forward graph instead of recomputing it
    recompute_group: int = 1  # one kept layer input per group of this many recomputed layers
    # the last N recomputed layers (lean layer only) keep their attention output on the GPU for the backward
    kept_attention_layers: int = 0
    activation_tier: Tier = "host"  # where the kept layer inputs live
    grads_tier: Tier = "host"  # where the gradients wait for the global norm
    cache_weights: bool = False  # every layer's weights stay on the GPU from forward to backward
    gpu_resident_units: int = 0
    gpu_streamed_units: int = 0
    nvme_units: int = 0
    # bf16 gradient formats: the held gradients of the last N GPU-streamed units wait for their update in pinned host
    # memory instead of GPU memory (out over D2H in the backward, in beside the unit's state at its update)
    host_grad_units: int = 0
    # clip without holding gradients: a first backward takes the global norm only, a second computes the gradients
    # again and updates each unit as soon as its gradient is finished (GPU-updated units in the backward; host
    # units' gradients go to the host as always). No gradient waits for the norm; one more head and backward a step
    norm_pass: bool = False

    def __post_init__(self):
        for name in ("activation_tier", "grads_tier"):
            if getattr(self, name) not in TIERS:
                raise ValueError(f"Placement.{name}={getattr(self, name)!r}: one of {', '.join(TIERS)}")
        if self.gpu_resident_units + self.gpu_streamed_units > self.n_units or min(
                self.gpu_resident_units, self.gpu_streamed_units, self.nvme_units, self.keep_activation_layers,
                self.kept_attention_layers, self.host_grad_units) < 0 \
                or self.host_grad_units > self.gpu_streamed_units \
                or self.keep_activation_layers + self.kept_attention_layers > self.num_layers \
                or self.recompute_group < 1 or self.slots < 1:
            raise ValueError(f"not a placement of {self.n_units} units: {self}")
        if self.norm_pass and (self.keep_activation_layers or self.kept_attention_layers or self.cache_weights
                               or self.host_grad_units or self.grads_tier != "host"):
            # what the first backward would consume (kept graphs and attention outputs) or what would hold
            # gradients (their GPU tier, host-held bf16 copies) has no place in a step that holds none
            raise ValueError("a norm pass recomputes every layer and holds no gradient: it needs "
                             "keep_activation_layers=0, kept_attention_layers=0, cache_weights=off, "
                             f"host_grad_units=0 and grads_tier=host; got {self}")

    @property
    def num_layers(self) -> int:
        return self.n_units - 2

    @property
    def resident_units(self) -> range:
        return range(0, min(self.n_units, self.gpu_resident_units))

    @property
    def streamed_units(self) -> range:
        first = self.resident_units.stop
        return range(first, min(self.n_units, first + self.gpu_streamed_units))

    @property
    def host_units(self) -> range:
        return range(self.streamed_units.stop, self.n_units)

    @property
    def gpu_updated_units(self) -> range:
        return range(0, self.streamed_units.stop)

    @property
    def host_grad_units_range(self) -> range:
        """The GPU-streamed units whose held bf16 gradients wait in host memory: the last `host_grad_units`."""
        streamed = self.streamed_units
        return range(streamed.stop - self.host_grad_units, streamed.stop)

    @property
    def disk_units(self) -> List[int]:
        return nvme_layers(self.n_units, self.host_units.start, self.nvme_units)

    @property
    def kept_layer_inputs(self) -> range:
        return kept_layer_inputs(self.num_layers, self.keep_activation_layers, self.recompute_group)

    @property
    def kept_attention_units(self) -> range:
        """The decoder-layer units whose forward keeps its attention output for the backward: the last
        `kept_attention_layers` of the recomputed layers (the first the backward reaches)."""
        last = self.num_layers - self.keep_activation_layers
        return range(last - self.kept_attention_layers + 1, last + 1)

    def place_of(self, unit: int) -> str:
        """"resident", "streamed" or "host": where `unit` is updated."""
        if unit in self.resident_units:
            return "resident"
        return "streamed" if unit in self.streamed_units else "host"

    def as_dict(self) -> Dict[str, object]:
        """The `engine.*` settings that reproduce this placement (cache_weights and norm_pass as on/off), for logs and
        records."""
        out = asdict(self)
        del out["n_units"]
        out["cache_weights"] = "on" if self.cache_weights else "off"
        out["norm_pass"] = "on" if self.norm_pass else "off"
        return out
