"""Checkpoint benchmark: HF import / export and training-state save / load, timed, with peak host memory per phase.

    python -m bench.bench_checkpoint --model qwen7b --out bench/results/checkpoint.jsonl     # the GPU machine
    python -m bench.bench_checkpoint --model tiny --out /tmp/checkpoint.jsonl                # seconds, any machine

Phases, one JSONL row each:
1. `hf_write`: a random model of the chosen shape is written as an HF checkpoint (bf16, 5 GiB shards) by the
   project's exporter (`engine.checkpoint.export_hf`), its tensors generated one at a time, so no model copy exists.
2. `hf_import`: a StreamEngine is built as the Trainer builds it (`model.init=hf:<dir>`: `open_hf` checks config
   and headers, then `import_hf` copies unit by unit into the host store). The files' pages are dropped from the page
   cache first (posix_fadvise DONTNEED after fsync), so the read comes from the disk.
3. `hf_export`: the engine's master weights are exported again (bf16), as `train.export_hf=true` does.
4. `state_save` / `state_load` (when the disk has room for 12 B/param): a full training checkpoint is saved from
   the engine and loaded back (verified: sizes + sha256 of every file, then copied in), caches dropped in between.

Per row: seconds, bytes moved, GB/s, host RSS before the phase and its peak during the phase (VmHWM, reset with
/proc/self/clear_refs before each phase), and `peak_extra_gib` = peak - before: the memory the phase itself needed
on top of what existed (the host store is part of `rss_before_gib`). Rows carry bench, model, gpu, torch, triton,
git_sha and date like every results file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import checkpoint
from engine.metrics import host_peak_rss_gib, host_rss_gib, run_environment

ROOT = Path(__file__).resolve().parent.parent


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(d: Path):
    return [p for p in sorted(Path(d).rglob("*")) if p.is_file()]


class Phase:
    def __init__(self, name: str, rows: list, common: dict):
        self.name, self.rows, self.common = name, rows, common

    def __enter__(self):
        self.peak_ok = reset_peak()
        self.rss_before = host_rss_gib()
        self.t0 = time.perf_counter()
        self.extra = {}
        return self

    def __exit__(self, exc_type, exc, tb):
        seconds = time.perf_counter() - self.t0
        row = {"bench": "checkpoint", "phase": self.name, **self.common, "seconds": seconds,
               "rss_before_gib": self.rss_before, "peak_rss_gib": host_peak_rss_gib(),
               "peak_is_phase_local": self.peak_ok, **self.extra}
        row["peak_extra_gib"] = row["peak_rss_gib"] - self.rss_before
        if row.get("bytes"):
            row["gb_per_s"] = row["bytes"] / 1e9 / seconds
        if exc is not None:
            row["error"] = repr(exc)
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("gpu", "torch", "triton", "git_sha")}),
              flush=True)
        return False


class RandomSource:
    """Random weights of the model's shape in the export dtype, one tensor at a time (norms 1, biases 0)."""

    def __init__(self, spec, dtype: torch.dtype, seed: int = 0):
        self.spec, self.dtype, self.seed, self.tokenizer_dir = spec, dtype, seed, None

    def unit_master(self, index: int):
        unit = self.spec.units[index]
        shapes = {s.name: (s.shape, s.kind) for s in unit.layout.specs}
        gen = torch.Generator().manual_seed(self.seed * 1000 + index)

        def make(name):
            shape, kind = shapes[name]
            t = torch.empty(shape, dtype=self.dtype)
            if kind == "vector":
                return t.fill_(0.0 if name.endswith(".bias") else 1.0)
            return t.uniform_(-0.03, 0.03, generator=gen)

        return checkpoint.LazyTensors(list(shapes), make)


def compose(model: str, engine: str, hf_dir: Path | None, extra):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from engine import hardware
    from engine.config import register, validate

    register()
    overrides = [f"model={model}", f"engine={engine}", "logger=none", "data=synthetic", "train.seq_len=512",
                 "train.micro_batch_size=1", "train.grad_accum=1", *extra]
    if hf_dir is not None:
        overrides.append(f"model.init=hf:{hf_dir}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)
    hardware.resolve(cfg)
    validate(cfg)
    return cfg


def build(cfg):
    """The engine exactly as the Trainer builds it."""
    from engine import hardware
    from engine.device import resolve_compute_dtype, resolve_device
    from engine.model import ModelSpec
    from engine.plan import build_plan
    from engine.trainer import build_engine

    spec = ModelSpec(cfg.model)
    device = resolve_device(cfg.hardware.device)
    compute_dtype = resolve_compute_dtype(cfg.train.compute_dtype, device)
    gpu_gib = hardware.apply_gpu_cap(cfg.hardware, device) if device.type == "cuda" else 0.0
    host_gib = hardware.host_budget(cfg)
    plan = build_plan(spec, cfg, gpu_gib, host_gib, device.type == "cuda")
    torch.manual_seed(cfg.seed)
    return spec, build_engine(spec, cfg, device, compute_dtype, plan)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--engine", default="stream", choices=("stream", "reference"))
    p.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir, removed after)")
    p.add_argument("--shard-gib", type=float, default=5.0)
    p.add_argument("--state", choices=("auto", "on", "off"), default="auto",
                   help="training-state save/load: auto = when the disk has room for it")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. hardware=h200")
    args = p.parse_args(argv)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list = []
    common = {"model": args.model, "engine": args.engine, **run_environment(),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    hf_dir, export_dir, state_root = work / "hf_random", work / "hf_export", work / "state"
    engine = None
    try:
        cfg0 = compose(args.model, args.engine, None, args.overrides)
        from engine.model import ModelSpec

        spec0 = ModelSpec(cfg0.model)
        n = spec0.num_params()
        common.update(num_params=n, hardware=cfg0.hardware.name)
        with Phase("hf_write", rows, common) as ph:
            st = checkpoint.export_hf(RandomSource(spec0, torch.bfloat16), hf_dir, torch.bfloat16,
                                      int(args.shard_gib * 2**30))
            ph.extra.update(bytes=st["bytes"], shards=st["shards"], dtype="bf16")
        drop_cache(files_under(hf_dir))

        cfg = compose(args.model, args.engine, hf_dir, args.overrides)
        with Phase("engine_build", rows, common) as ph:
            spec, engine = build(cfg)
            ph.extra.update(memory_bytes=engine.memory_bytes())
        with Phase("hf_import", rows, common) as ph:
            hf = checkpoint.open_hf(spec, hf_dir)
            st = checkpoint.import_hf(engine, hf)
            ph.extra.update(bytes=st["bytes"], shards=st["files"], dtype=hf.dtype, cache="dropped")
        # the imported weights are the written ones (spot check: first and last unit)
        src = RandomSource(spec, torch.bfloat16)
        for idx in (0, len(spec.units) - 1):
            got, want = engine.unit_state(idx)["master"], src.unit_master(idx)
            for name in want:
                assert torch.equal(got[name].cpu(), want[name].float()), f"unit {idx} {name} differs after import"
        with Phase("hf_export", rows, common) as ph:
            st = checkpoint.export_hf(checkpoint.EngineSource(engine), export_dir, torch.bfloat16,
                                      int(args.shard_gib * 2**30))
            ph.extra.update(bytes=st["bytes"], shards=st["shards"], dtype="bf16")
        shutil.rmtree(hf_dir)
        shutil.rmtree(export_dir)

        state_bytes = 12 * n
        free = shutil.disk_usage(work).free
        if args.state == "on" or (args.state == "auto" and state_bytes < 0.9 * free):
            from engine.config import to_plain

            state = {"fingerprint": {}, "config": to_plain(cfg)}
            with Phase("state_save", rows, common) as ph:
                path = checkpoint.save_training_state(engine, state_root, 0, state, keep=1)
                ph.extra.update(bytes=sum(f.stat().st_size for f in files_under(path)))
            drop_cache(files_under(path))
            with Phase("state_load", rows, common) as ph:
                ck = checkpoint.open_training_state(path, spec)
                checkpoint.load_training_state(engine, ck)
                ph.extra.update(bytes=sum(f.stat().st_size for f in files_under(path)),
                                note="verify (sha256 of every file) + load: the bytes are read twice")
        else:
            rows.append({"bench": "checkpoint", "phase": "state_save", **common,
                         "skipped": f"needs {state_bytes / 1e9:.0f} GB on disk, {free / 1e9:.0f} GB free"})
            print(json.dumps(rows[-1]))
    finally:
        if engine is not None:
            engine.close()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
