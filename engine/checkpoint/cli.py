"""`python -m engine.checkpoint export|verify`: a training checkpoint to an HF directory, or a full verification.

Every refusal is one line on stderr, `error: <path>: <what>`, and exit status 2: a CheckpointError or ConfigError
from the checkpoint code, or an OSError from the file system (the path that failed and the reason). Nothing is
written before the source checkpoint has been found and the output path checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

import engine.checkpoint
from engine.checkpoint.common import CheckpointError
from engine.checkpoint.hf import export_hf
from engine.checkpoint.state import (MANIFEST, CheckpointSource, incomplete_newer_than, open_training_state,
                                     resolve_checkpoint_path)
from engine.config import ConfigError


def _export(src_path: str, out: str, dtype: str, shard_gib: float) -> None:
    src = CheckpointSource(src_path)
    try:
        print(f"exporting {src.ckpt.path} (step {src.ckpt.step})")
        export_hf(src, out, torch.bfloat16 if dtype == "bf16" else torch.float32, int(shard_gib * 2**30))
    finally:
        src.close()


def _verify(src: str) -> None:
    given = Path(src)
    ck = open_training_state(resolve_checkpoint_path(given))
    print(f"{ck.path}: complete, step {ck.step}, {len(ck.manifest['files'])} files verified")
    if ck.path != given:  # chosen as the newest complete one: say what was passed over
        for p in incomplete_newer_than(ck.path.parent, ck.step):
            print(f"warning: {p} is newer but incomplete (no valid {MANIFEST}: a save was interrupted or files were "
                  f"removed); verified {ck.path} instead", file=sys.stderr)


def _os_error(e: OSError) -> str:
    where = e.filename if e.filename is not None else ""
    return f"{where}: {e.strerror}" if where and e.strerror else str(e)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.checkpoint",
                                description=engine.checkpoint.__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="training checkpoint -> HF safetensors directory")
    ex.add_argument("src", help="a run dir (its newest complete checkpoint) or a checkpoints/step_<N> dir")
    ex.add_argument("out", help="output directory (created; an existing one gets its model files replaced)")
    ex.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ex.add_argument("--shard-gib", type=float, default=5.0)
    ve = sub.add_parser("verify", help="check a training checkpoint's files against its manifest")
    ve.add_argument("src", help="a run dir or a step dir")
    args = p.parse_args(argv)
    try:
        if args.cmd == "export":
            _export(args.src, args.out, args.dtype, args.shard_gib)
        else:
            _verify(args.src)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 2
    return 0
