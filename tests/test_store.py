"""The host store holds the state its placement says it holds, and its byte count is what the process really keeps."""

import gc

import pytest
import torch

from engine import optim
from engine.data import build_data
from engine.metrics import host_rss_gib
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.streaming.host_store import HostStore
from engine.trainer import build_engine
from tests.util import SMALL, make_cfg

MID = ["model.hidden_size=512", "model.intermediate_size=1408", "model.num_hidden_layers=4",
       "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.vocab_size=8192",
       "train.seq_len=64", "train.micro_batch_size=2", "train.grad_accum=2"]


@pytest.mark.parametrize("grads_on_host, bytes_per_param", [(False, 12), (True, 16)])
def test_store_bytes_match_design_arithmetic(grads_on_host, bytes_per_param):
    """What the store reports equals the sizes of the tensors it holds, and both equal the design's bytes per
    parameter on the layout's padded element count (the padding stays below 2% of the parameters)."""
    cfg = make_cfg(MID)
    spec = ModelSpec(cfg.model)
    grad_units = range(len(spec.units)) if grads_on_host else ()
    store = HostStore(spec, pin=False, grad_units=grad_units, grad_staging=0, host_activation_numel=0, seed=0)
    held = [*store.master, *store.m, *store.v, *(store.grads or [])]
    held_bytes = sum(t.numel() * t.element_size() for t in held)
    padded_numel = sum(u.layout.numel for u in spec.units)
    assert sum(store.bytes_by_kind.values()) == held_bytes == bytes_per_param * padded_numel
    n = spec.num_params()
    assert n <= padded_numel <= 1.02 * n


def test_store_master_is_the_deterministic_init():
    cfg = make_cfg(MID)
    spec = ModelSpec(cfg.model)
    store = HostStore(spec, pin=False, grad_units=(), grad_staging=0, host_activation_numel=0, seed=3)
    for unit in (spec.units[0], spec.units[2]):
        fresh = {s.name: torch.empty(s.shape) for s in unit.layout.specs}
        spec.init_unit(unit, fresh, 3)
        for name, t in unit.layout.views(store.master[unit.index]).items():
            assert torch.equal(t, fresh[name]), name


def _one_step(overrides):
    cfg = make_cfg(overrides)
    spec = ModelSpec(cfg.model)
    eng = build_engine(spec, cfg, torch.device("cpu"), torch.float32, build_plan(spec, cfg, 0.0, 64.0, False))
    data = build_data(cfg.data, cfg.train.seq_len, 0, cfg.model.vocab_size)
    eng.train_step([data.batch("train", j, 2) for j in range(2)], 1e-3)
    eng.close()


BIG = ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_hidden_layers=6",
       "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.vocab_size=16384",
       "train.seq_len=64", "train.micro_batch_size=2", "train.grad_accum=2"]


def test_host_memory_reported_equals_resident_growth():
    """RSS grows by the bytes the engine reports (store + what would be GPU buffers, here in host memory too;
    m and v pages are first touched by the update), within 10%."""
    # first a small step, so libraries, thread pools and allocator arenas are already resident
    _one_step(["engine=stream", *SMALL, "train.seq_len=32", "train.micro_batch_size=2", "train.grad_accum=2"])
    gc.collect()
    before = host_rss_gib()
    cfg = make_cfg(["engine=stream", *BIG, "engine.fused_kernels=false"])
    spec = ModelSpec(cfg.model)
    plan = build_plan(spec, cfg, 0.0, 64.0, on_gpu=False)
    eng = build_engine(spec, cfg, torch.device("cpu"), torch.float32, plan)
    data = build_data(cfg.data, cfg.train.seq_len, 0, cfg.model.vocab_size)
    try:
        eng.train_step([data.batch("train", j, 2) for j in range(2)], optim.lr_at(0, cfg.train))
        eng.wait_for_optimizer()
        grown = host_rss_gib() - before
        reported_gib = sum(eng.memory_bytes().values()) / 2**30
        assert sum(eng.store.bytes_by_kind.values()) / 2**30 > 1.0
        assert abs(grown - reported_gib) <= 0.1 * reported_gib, (grown, reported_gib)
    finally:
        eng.close()
