"""Entry point: `python train.py model=qwen7b engine=stream ...` (installed: `streamtrain-train ...`, the same
function, `engine.cli.cli`). Hydra composes `conf/` and hands the config to the Trainer (engine/trainer.py), which
holds all training logic.

Exit status: a config that cannot work exits 2 with one `error: <message>` paragraph on stderr and no traceback, the
message naming the key and what would be valid; genuine crashes of training keep Python's traceback and status 1
(the trainer's own statuses are in engine/trainer.py). Refusals come from three places:
- Before Hydra runs, `check_overrides` parses the command-line overrides with Hydra's own override parser and checks
  each key against the schema dataclasses: a key the schema does not know is refused whatever its syntax (`key=`,
  `+key=`, `++key=`), naming it and listing the valid keys of its section, and so is a renamed key; every value
  (each value of a sweep, so a multirun refuses a bad value before its first job) must convert to the field's type,
  as omegaconf converts it when composing. Config group choices (`model=...`, `experiment=...`) and `hydra.*`
  keys are Hydra's to check.
- Anything Hydra itself refuses while composing (an unknown group option, with the options listed; a broken yaml
  file): HYDRA_FULL_ERROR=1 makes Hydra raise its errors instead of printing them and exiting 1, and the
  user-facing ones (hydra.errors.CompactHydraException, which Hydra prints without a traceback too) are reported
  with Hydra's message and status 2. Every other exception propagates with its traceback.
- Inside the job, `validate` and the trainer refuse values, files, combinations and plans (ConfigError and
  friends; engine/trainer.py `main`). In a multirun such a job is recorded as refused (`refused.json` in its run
  dir) and the sweep goes on, since one point of a sweep may not fit while the others do.
"""

from engine.cli import cli

if __name__ == "__main__":
    cli()
