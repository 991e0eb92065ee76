"""A failed host-optimizer pass stops the run before the next step's update reads the state it left stale.

The stream engine's host AdamW runs on a worker thread while the next step's forward streams the units it has
finished; its last disk writes (NVMe tier) are drained at the end of the pass. A failure anywhere in the pass, the
drain included, must surface before the next update: as an error naming the file or the unit, a non-zero exit
status and a summary that records it, with no step trained on stale moments. Checkpoints are off here, so that no
save waits for the optimizer and hides a lost error.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from engine.streaming.engine import OptimizerPassError
from engine.streaming.nvme import NvmeError
from engine.trainer import Trainer, main
from tests.test_checkpoint import RECIPE, step_losses
from tests.test_nvme import nvme_overrides
from tests.util import make_cfg


def _recipe(tmp_path, steps=4):
    return [*RECIPE, "engine=stream", f"train.steps={steps}", "train.checkpoint_every=0", "train.log_every=1",
            *nvme_overrides(tmp_path, 2)]


def _fail_writes(monkeypatch, failing):
    """Make os.pwritev raise ENOSPC for the writes whose 1-based number is in `failing` (two disk layers: writes
    2k-1 and 2k belong to the k-th optimizer pass)."""
    real_pwritev, writes = os.pwritev, []

    def pwritev(fd, buffers, offset):
        writes.append(offset)
        if len(writes) in failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


def test_a_transient_write_failure_stops_the_run_before_the_next_update(tmp_path, monkeypatch):
    """The second pass's last write fails once (the drain at the end of the pass, after every unit's flag is up):
    the run stops at the third step's update, names the file and unit, and records the error in summary.json; the
    losses logged are the clean run's, none from a step after the stale state."""
    recipe = _recipe(tmp_path)
    Trainer(make_cfg(recipe), tmp_path / "clean").run()
    _fail_writes(monkeypatch, {4})
    with pytest.raises(NvmeError, match=r"writing the Adam moments of unit \d .*streamtrain-moments-.*No space"):
        Trainer(make_cfg(recipe), tmp_path / "failed").run()
    clean, _ = step_losses(tmp_path / "clean")
    failed, _ = step_losses(tmp_path / "failed")
    assert failed == clean[:len(failed)] and len(failed) == 2, (failed, clean)
    summary = json.loads((tmp_path / "failed" / "summary.json").read_text())
    assert "No space left on device" in summary["error"]


def test_an_update_error_names_the_unit_and_exits_non_zero(tmp_path, monkeypatch):
    """Any exception in a pass (here the host AdamW of one unit) is raised where the engine next waits, as an
    OptimizerPassError naming the unit; `main` prints one `error:` line and exits with the optimizer's status."""
    from engine.optim import FlatAdamW

    real_step = FlatAdamW.step_unit
    calls = []

    def step_unit(self, unit, grad, lr):
        calls.append(unit)
        if len(calls) == 5:
            raise RuntimeError("simulated fault")
        return real_step(self, unit, grad, lr)

    monkeypatch.setattr(FlatAdamW, "step_unit", step_unit)
    cfg = make_cfg([*_recipe(tmp_path), "engine.nvme_units=0", "engine.gpu_resident_units=0",
                    "engine.gpu_streamed_units=0"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(cfg)
    assert stop.value.code == 5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "OptimizerPassError" in summary["error"] and "unit" in summary["error"]


def test_optimizer_pass_error_message():
    err = OptimizerPassError(3, "layer1", 7, RuntimeError("boom"))
    assert str(err) == "the host AdamW update of unit 3 (layer1) after step 7 failed: RuntimeError: boom"
