"""The default tiny job's loss curve, pinned: a change that moves the loss shows here even when both engines move
together (the equivalence tests compare the engines with each other, not with a fixed curve).

The curve is the first GOLDEN_STEPS steps of `python train.py` (the default recipe, CPU, seed 0), for both engines
(they are bit-identical on the CPU). Pinned to a relative 1e-5: different CPUs' BLAS kernels may round differently,
which moves a loss by ~1e-7, while any change to data order, initialisation, the model, the recipe or the optimizer
moves it by far more. A deliberate change regenerates the file with
`STREAMTRAIN_UPDATE_GOLDEN=1 TRITON_INTERPRET=1 python -m pytest tests/test_golden_loss.py` and says why in its commit.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from engine.trainer import Trainer
from tests.util import make_cfg

GOLDEN = Path(__file__).parent / "golden" / "tiny_default_loss.json"
GOLDEN_STEPS = 6


@pytest.mark.parametrize("engine", ["reference", "stream"])
def test_default_job_reproduces_the_pinned_loss_curve(engine, tmp_path):
    cfg = make_cfg([f"engine={engine}", f"train.steps={GOLDEN_STEPS}", "train.val_every=0", "train.val_batches=1"])
    Trainer(cfg, tmp_path).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    if os.environ.get("STREAMTRAIN_UPDATE_GOLDEN") and engine == "reference":
        GOLDEN.write_text(json.dumps({"torch": torch.__version__, "steps": GOLDEN_STEPS, "losses": losses},
                                     indent=1) + "\n")
    pinned = json.loads(GOLDEN.read_text())
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(pinned["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
