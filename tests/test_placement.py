"""The planner -> engine contract (engine/placement.py) and the import layering it allows: the stream engine and the
Triton kernels stand without the planner, the kernels without the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.placement import Placement
from tests.util import ROOT


def test_the_unit_sets_partition_the_units_in_forward_order():
    p = Placement(n_units=9, gpu_resident_units=2, gpu_streamed_units=3, nvme_units=2, keep_activation_layers=2,
                  recompute_group=2, kept_attention_layers=3)
    assert (list(p.resident_units), list(p.streamed_units), list(p.host_units)) == ([0, 1], [2, 3, 4], [5, 6, 7, 8])
    assert list(p.gpu_updated_units) == [0, 1, 2, 3, 4]
    assert p.disk_units == [6, 7]  # the last host-updated decoder layers; the head (8) stays in RAM
    assert list(p.kept_layer_inputs) == [0, 2, 4]  # 7 layers, the last 2 keep graphs, one input per group of 2
    assert [p.place_of(u) for u in (1, 2, 5)] == ["resident", "streamed", "host"]
    assert list(p.kept_attention_units) == [3, 4, 5]  # the last 3 recomputed layers (6 and 7 keep graphs)
    assert p.as_dict() == {"slots": 2, "keep_activation_layers": 2, "recompute_group": 2, "kept_attention_layers": 3,
                           "activation_tier": "host",
                           "grads_tier": "host", "cache_weights": "off", "gpu_resident_units": 2,
                           "gpu_streamed_units": 3, "nvme_units": 2, "host_grad_units": 0, "norm_pass": "off"}


@pytest.mark.parametrize("fields", [{"gpu_resident_units": 6, "gpu_streamed_units": 4}, {"recompute_group": 0},
                                    {"grads_tier": "nvme"}, {"nvme_units": -1},
                                    {"keep_activation_layers": 5, "kept_attention_layers": 3}])
def test_an_impossible_placement_is_refused(fields):
    with pytest.raises(ValueError):
        Placement(n_units=9, **fields)


@pytest.mark.parametrize("statement", [
    "import engine.streaming, sys; assert 'engine.plan' not in sys.modules, sorted(sys.modules)",
    "import streamtrain_kernels.adamw_update, streamtrain_kernels.attention, streamtrain_kernels.cross_entropy, "
    "streamtrain_kernels.grad_accum, sys; assert not [m for m in sys.modules if m.split('.')[0] == 'engine']",
])
def test_layering(statement):
    out = subprocess.run([sys.executable, "-c", statement], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
