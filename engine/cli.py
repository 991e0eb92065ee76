"""The command line: `python train.py ...` and the installed `streamtrain-train` console script run `cli`.

train.py's docstring describes the exit statuses and where each refusal comes from; here the overrides are checked
against the schema before Hydra composes anything, and Hydra's own compose errors become one `error:` line with
status 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from engine.config import CONF_DIR, ConfigError, check_overrides, register


def cli() -> None:
    """`python train.py ...` and the `streamtrain-train` console script (train.py's docstring has the design)."""
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:  # the schema's own field docs (Hydra's help: --hydra-help)
        from engine.schema_help import help_text

        after = argv[argv.index("--help" if "--help" in argv else "-h") + 1:]
        print(help_text(after[0] if after and "=" not in after[0] else None))
        return
    # Fewer, growable segments: the streamed engine's long-lived buffers and per-layer temporaries fragment the
    # default allocator's fixed-size segments (seen as GiBs "reserved but unallocated" at OOM on the H200).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors instead of printing them and exiting 1
    import hydra
    from hydra._internal.utils import get_args_parser
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    register()

    outcomes = []  # each job's result: a summary, or {"refused": why} for a sweep job refused before it started

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def train(cfg: DictConfig) -> None:
        from engine.trainer import main

        outcomes.append(main(cfg))

    args = get_args_parser().parse_args()
    try:
        check_overrides(args.overrides, [CONF_DIR, *[Path(d) for d in (args.config_dir, args.config_path) if d]])
        train()
    except ConfigError as err:
        message = str(err)
    except CompactHydraException as err:
        cause = err.__cause__
        message = f"{err}\n{cause}" if isinstance(cause, OmegaConfBaseException) else str(err)
    else:
        if len(outcomes) > 1 and all("refused" in o for o in outcomes):  # a sweep of which no job ran
            message = (f"every one of the sweep's {len(outcomes)} jobs was refused (each job's refused.json says why); "
                       f"the first: {outcomes[0]['refused']}")
        else:
            return
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
