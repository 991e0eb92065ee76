"""The order in which the streaming engine queues work, and the hand-off of gradient accumulators between threads.

On the CPU every copy is synchronous, but the host optimizer still runs on its own thread, so the engine's thread
really does wait for it; these tests slow that thread down and record what the engine's thread did meanwhile.
"""

import threading
import time

import pytest
import torch

from engine import optim
from engine.data import build_data
from engine.device import Device
from engine.model import ModelSpec
from engine.plan import build_plan
from engine.streaming.gradients import GradAccumulator
from engine.streaming.stall_timer import StallTimer
from engine.trainer import build_engine
from tests.util import SMALL, make_cfg

RECIPE = ["engine=stream", *SMALL, "train.seq_len=16", "train.micro_batch_size=2", "train.grad_accum=2"]


def _engine(overrides=()):
    cfg = make_cfg([*RECIPE, *overrides])
    spec = ModelSpec(cfg.model)
    eng = build_engine(spec, cfg, torch.device("cpu"), torch.float32, build_plan(spec, cfg, 0.0, 64.0, False))
    data = build_data(cfg.data, cfg.train.seq_len, cfg.seed, cfg.model.vocab_size)
    return cfg, spec, eng, data


@pytest.mark.parametrize("slots", [2, 3])
def test_compute_of_a_layer_is_queued_before_waiting_for_the_next_layers_update(slots):
    """compute(k) must not wait for update(k+1): every wait of the forward on the host optimizer for unit u comes
    after the compute of unit u - 1 was queued."""
    cfg, spec, eng, data = _engine([f"engine.slots={slots}", "engine.gpu_resident_units=0"])
    events = []
    step_unit, wait_updated, weights = eng.opt.step_unit, eng._wait_updated, eng._weights

    def slow_step_unit(unit, grad, lr):
        time.sleep(0.02)
        step_unit(unit, grad, lr)

    def logged_wait(unit):
        if not eng.updated[unit].is_set():
            events.append(("wait", unit))
        wait_updated(unit)

    def logged_weights(unit):  # called just before the unit's compute is queued
        events.append(("compute", unit))
        return weights(unit)

    try:
        batches = [data.batch("train", j, 2) for j in range(2)]
        eng.train_step(batches, 1e-3)
        eng.opt.step_unit, eng._wait_updated, eng._weights = slow_step_unit, logged_wait, logged_weights
        eng.train_step(batches, 1e-3)  # ends by handing the (now slowed) host update to the optimizer thread
        events.clear()
        eng.train_step(batches, 1e-3)  # its forward waits for that update
    finally:
        eng.close()
    forward = events[:events.index(("compute", spec.num_layers)) + 1]
    waits = [u for kind, u in forward if kind == "wait"]
    assert len(waits) >= 2, f"the slowed host optimizer did not make the forward wait: {forward}"
    for u in waits:
        if u >= 1:
            assert forward.index(("compute", u - 1)) < forward.index(("wait", u)), forward


def test_claim_waits_until_the_reader_has_queued_its_read():
    dev = Device(torch.device("cpu"))
    spec = ModelSpec(make_cfg(RECIPE).model)
    acc = GradAccumulator(dev, spec.units[1].layout, fused=False)
    acc.hand_off()
    claimed = threading.Event()
    worker = threading.Thread(target=lambda: (acc.claim(StallTimer(dev), lambda: None), claimed.set()))
    worker.start()
    assert not claimed.wait(0.2), "claim returned while the reader had not read yet"
    acc.read_queued(None)
    worker.join(5)
    assert claimed.is_set() and acc.fresh


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fused", [True, False])
def test_an_add_writes_the_sums_of_squares_of_the_accumulated_result(device, fused):
    """What the last add of a step writes to `sq_norms_out`: `optim.sq_norms` of the accumulated result, in layout
    order, for all of a unit's tensors or a subset (a tied embedding's lookup). Bit for bit on the CPU; on a GPU
    the fused kernel's in-register sums, equal to rounding."""
    dev = Device(torch.device(device))
    layout = ModelSpec(make_cfg(RECIPE).model).units[1].layout
    acc = GradAccumulator(dev, layout, fused=fused)
    gen = torch.Generator().manual_seed(0)
    grads = [{s.name: torch.randn(s.shape, generator=gen).to(device, torch.bfloat16 if s.kind == "matmul" else
                                                             torch.float32) for s in layout.specs} for _ in range(3)]
    tol = {"rtol": 1e-6 if dev.cuda and fused else 0.0, "atol": 0.0}
    sq = torch.full((len(layout.specs),), -1.0, device=device)
    for m, g in enumerate(grads):
        acc.add(g, sq if m == len(grads) - 1 else None)
    torch.testing.assert_close(sq, optim.sq_norms(list(acc.views.values())), **tol)
    subset = [s.name for s in layout.specs[::2]]
    sq = torch.full((len(subset),), -1.0, device=device)
    acc.add({name: grads[0][name] for name in reversed(subset)}, sq)
    torch.testing.assert_close(sq, optim.sq_norms([acc.views[name] for name in subset]), **tol)


def test_claim_raises_when_the_reader_died():
    dev = Device(torch.device("cpu"))
    spec = ModelSpec(make_cfg(RECIPE).model)
    acc = GradAccumulator(dev, spec.units[1].layout, fused=False)
    acc.hand_off()

    def reader_died():
        raise RuntimeError("optimizer thread failed")

    with pytest.raises(RuntimeError, match="optimizer thread failed"):
        acc.claim(StallTimer(dev), reader_died)


def test_a_skipped_step_releases_every_accumulator():
    """A non-finite gradient skips the update; the accumulators lent to the optimizer must come back all the same,
    or the next backward would wait for them forever."""
    cfg, spec, eng, data = _engine(["engine.grads_tier=gpu", "engine.gpu_resident_units=1"])
    try:
        batches = [data.batch("train", j, 2) for j in range(2)]
        eng.train_step(batches, optim.lr_at(0, cfg.train), grad_hook=lambda unit, views: [
            v.fill_(float("nan")) for v in views.values()] if unit == 2 else None)
        record = eng.train_step(batches, optim.lr_at(1, cfg.train))
        assert not record["skipped"]
    finally:
        eng.close()
