"""Training state: save, find, verify and load checkpoints for exact resume; RNG state; the run fingerprint.

The format and the rules (atomic rename of `step_<N>.tmp`, manifest written last, keep-last-K, what resume=auto
picks) are in the package docstring. Costs: a save writes 12 B/param once, hashing while it writes (no copy of
the model, no read-back); a resume reads the checkpoint twice, once to verify every byte before the engine is
touched and once to load it, one tensor at a time.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import os
import random
import re
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from engine.checkpoint.common import CheckpointError, read_json
from engine.checkpoint.hf import head_dim_of, norm_rope_scaling, plain, same_value
from engine.checkpoint.safetensors_io import LazyTensors, Readers, SafetensorsFile, WriteItem, write_safetensors
from engine.config import ConfigError
from engine.distributed import SINGLE
from engine.fileio import fsync_dir, json_bytes, sha256_file, write_durable

FORMAT = "streamtrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"^step_(\d+)$")
VERIFY_THREADS = 8

# ================================================================================================================
# RNG state and run fingerprint


def rng_state() -> dict:
    """torch, numpy, python (and CUDA, once initialised) generator states, JSON-ready (bytes as base64)."""
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    np_state = np.random.get_state()
    py = random.getstate()
    out = {"torch": b64(torch.get_rng_state()),
           "numpy": {"kind": np_state[0], "keys": base64.b64encode(np_state[1].astype("<u4").tobytes()).decode(),
                     "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
           "python": [py[0], list(py[1]), py[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(s: dict) -> None:
    def unb64(x: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(x)), dtype=torch.uint8)

    torch.set_rng_state(unb64(s["torch"]))
    n = s["numpy"]
    np.random.set_state((n["kind"], np.frombuffer(base64.b64decode(n["keys"]), dtype="<u4").astype(np.uint32),
                         n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = s["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([unb64(x) for x in s["cuda"]])


MODEL_FINGERPRINT = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                     "qkv_bias", "qk_norm", "hidden_act")
TRAIN_FINGERPRINT = ("steps", "seq_len", "micro_batch_size", "grad_accum", "lr", "min_lr_ratio", "warmup_steps",
                     "weight_decay", "beta1", "beta2", "eps", "max_grad_norm", "master_dtype", "moments_dtype",
                     "grad_dtype", "moments_block_size")


def run_fingerprint(cfg, data_fingerprint: str) -> dict:
    """What a resumed run must share with the checkpoint: the model architecture, the optimizer recipe and LR
    schedule (train.steps included, it shapes the cosine), the seed and the data. Not part of it: the engine and
    its placement, logging/validation/checkpoint cadence, hardware, compute dtype."""
    m, t = cfg.model, cfg.train
    model = {k: plain(m[k]) for k in MODEL_FINGERPRINT}
    model["head_dim"] = head_dim_of(m)
    model["rope_scaling"] = norm_rope_scaling(m.rope_scaling)
    return {"model": model, "train": {k: plain(t[k]) for k in TRAIN_FINGERPRINT}, "seed": cfg.seed,
            "data": {"name": cfg.data.name, "fingerprint": data_fingerprint, "val_fraction": cfg.data.val_fraction}}


def _current_keys(saved: dict) -> dict:
    """A fingerprint saved before the state formats existed (`train.precision=fp32_master`) in today's keys."""
    train = saved.get("train")
    if not isinstance(train, dict) or train.get("precision") != "fp32_master":
        return saved
    train = {k: v for k, v in train.items() if k != "precision"}
    train.update(master_dtype="fp32", moments_dtype="fp32", grad_dtype="fp32", moments_block_size=256)
    return {**saved, "train": train}


def fingerprint_differences(saved: dict, current: dict, prefix: str = "") -> List[Tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for every leaf that differs, in the current fingerprint's order."""
    out = []
    for key in sorted(set(saved) | set(current), key=lambda k: (list(current).index(k) if k in current else 99)):
        a, b = saved.get(key), current.get(key)
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict) and key != "rope_scaling":
            out += fingerprint_differences(a, b, path + ".")
        elif not same_value(a, b):
            out.append((path, a, b))
    return out


# ================================================================================================================
# finding checkpoints


def unit_file_name(unit) -> str:
    return f"unit_{unit.index:04d}_{unit.name}.safetensors"


def _is_complete(step_dir: Path) -> bool:
    try:
        m = json.loads((step_dir / MANIFEST).read_text())
        return m.get("format") == FORMAT and isinstance(m.get("files"), dict)
    except (OSError, ValueError):
        return False


def step_of(step_dir: Path) -> int:
    return int(STEP_DIR.match(step_dir.name).group(1))


def list_checkpoints(root: Path) -> Tuple[List[Tuple[int, Path]], List[Path]]:
    """(complete checkpoints as (step, dir) oldest first, step dirs without a valid manifest)."""
    complete, incomplete = [], []
    if not root.is_dir():
        return complete, incomplete
    for p in root.iterdir():
        if STEP_DIR.match(p.name) and p.is_dir():
            (complete.append((step_of(p), p)) if _is_complete(p) else incomplete.append(p))
    return sorted(complete), sorted(incomplete, key=step_of)


def incomplete_newer_than(root: Path, step: int) -> List[Path]:
    """Step dirs in `root` without a valid manifest whose step is above `step`: saves that never finished (or
    checkpoints damaged since), which resume=auto and `verify <run dir>` pass over."""
    return [p for p in list_checkpoints(root)[1] if step_of(p) > step]


def resolve_checkpoint_path(path: Path) -> Path:
    """A step dir as is; a run dir or checkpoint root -> its newest complete checkpoint."""
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        return path
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a run dir or a step_<N> checkpoint dir is expected)")
    for root in (path / "checkpoints", path):
        complete, _ = list_checkpoints(root)
        if complete:
            return complete[-1][1]
    raise CheckpointError(f"{path}: no complete checkpoint (step_<N>/ with {MANIFEST}) in it or in its "
                          "checkpoints/ directory")


def find_resume(resume: str, root: Path, log: Callable[[str], None] = print) -> Optional[Path]:
    """The checkpoint a run with train.resume=<resume> continues from, or None to start from step 0."""
    if resume == "none":
        return None
    if resume != "auto":
        return resolve_checkpoint_path(Path(resume).expanduser())
    complete, _ = list_checkpoints(root)
    for p in incomplete_newer_than(root, complete[-1][0] if complete else -1):
        log(f"warning: {p} has no valid {MANIFEST}: an incomplete checkpoint, ignored")
    if not complete:
        log(f"train.resume=auto: no checkpoint in {root}, starting from step 0")
        return None
    return complete[-1][1]


# ================================================================================================================
# saving


def _cleanup(root: Path) -> None:
    """Remove leftovers of interrupted saves and prunes, and step dirs without a valid manifest."""
    _, incomplete = list_checkpoints(root)
    for p in list(root.iterdir()) + incomplete:
        if p.is_dir() and (p.name.endswith(".tmp") or p.name.endswith(".deleting") or p in incomplete):
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    complete, _ = list_checkpoints(root)
    for _, p in complete[:-keep]:
        doomed = p.with_name(p.name + ".deleting")
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    fsync_dir(root)


def _unwritable(value: Any, where: str) -> Optional[str]:
    """Where in `value` strict JSON fails (NaN, infinity, a type JSON has no form for), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is {value!r}"
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _unwritable(v, f"{where}[{k!r}]"))), None)
    if isinstance(value, (list, tuple)):
        return next((p for i, v in enumerate(value) if (p := _unwritable(v, f"{where}[{i}]"))), None)
    return f"{where} is a {type(value).__name__}"


def _state_json(path: Path, state: dict) -> bytes:
    try:
        return json_bytes(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be written, strict JSON has no value for it: "
                              f"{_unwritable(state, 'state') or e}") from None


def save_training_state(engine, root: Path, step: int, state: dict, keep: int = 3, dp=SINGLE) -> Path:
    """Atomically write the engine's full training state plus `state` (trainer_state.json) as root/step_<step>.

    Data parallel (`dp`, called on every rank): rank 0 prepares `step_<step>.tmp`, each rank writes the unit files
    of the units whose state it holds (engine.owner; rank 0 those held everywhere), rank 0 writes the trainer state
    and the manifest last and renames; a failure on any rank fails the save on every rank.

    An error during the save removes `step_<step>.tmp` and re-raises: the newest complete checkpoint stays what
    it was. A state that strict JSON cannot hold (NaN, infinity, an object) is refused before any unit is
    written. KeyboardInterrupt and SystemExit (a second signal: abort now) leave the partial directory, like a
    kill; the next save removes it."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    head = {"format": FORMAT, "version": VERSION, **state, "step": step}
    _state_json(final / TRAINER_STATE, head)
    rank0 = dp.rank == 0
    if _on_ranks(dp, tmp, _prepare_save if rank0 else None, root, final, tmp)[0]:
        return final
    owner = getattr(engine, "owner", {})
    mine = [unit for unit in engine.spec.units if owner.get(unit.index, 0) == dp.rank]
    written = _on_ranks(dp, tmp, _write_units, engine, mine, tmp)
    files = {name: meta for files, _ in written for name, meta in files.items()}
    units = sorted((u for _, units in written for u in units), key=lambda u: u["index"])
    _on_ranks(dp, tmp, _finish_save if rank0 else None, root, final, tmp, head, files, units, keep)
    return final


def _prepare_save(root: Path, final: Path, tmp: Path) -> bool:
    """Rank 0: True if step_<N> is complete already, else an empty step_<N>.tmp ready for the unit files."""
    root.mkdir(parents=True, exist_ok=True)
    if _is_complete(final):
        return True
    _cleanup(root)
    if final.exists():
        shutil.rmtree(final)
    tmp.mkdir()
    return False


def _write_units(engine, units, tmp: Path) -> Tuple[Dict[str, dict], List[dict]]:
    """One unit file per unit of `units`: (manifest entries, trainer-state entries)."""
    files: Dict[str, dict] = {}
    entries = []
    for unit in units:
        st = engine.unit_state(unit.index)
        items: List[WriteItem] = []
        for kind in STATE_KINDS:
            tensors = st[kind]
            if not tensors:  # the reference engine's moments before its first update
                continue
            for s in unit.layout.specs:
                t = tensors[s.name]
                items.append((f"{kind}.{unit.layout.prefix}{s.name}", t.dtype, tuple(s.shape), t))
        flat = st.get("flat") or {}  # int8 moments: flat buffers and their block scales
        items += [(f"flat.{key}", t.dtype, tuple(t.shape), t) for key, t in sorted(flat.items())]
        fname = unit_file_name(unit)
        nbytes, sha = write_safetensors(tmp / fname, items, {"format": "pt", "unit": str(unit.index),
                                                             "adam_step": repr(float(st["step"]))})
        files[fname] = {"bytes": nbytes, "sha256": sha}
        entries.append({"index": unit.index, "name": unit.name, "file": fname, "adam_step": float(st["step"]),
                        "moments": bool(st["exp_avg"]) or bool(flat), "flat": sorted(flat)})
    return files, entries


def _finish_save(root: Path, final: Path, tmp: Path, head: dict, files: Dict[str, dict], units: List[dict],
                 keep: int) -> None:
    """Rank 0, every unit file written: the trainer state, the manifest last, the rename, the pruning."""
    nbytes, sha = write_durable(tmp / TRAINER_STATE, _state_json(final / TRAINER_STATE, {**head, "units": units}))
    files[TRAINER_STATE] = {"bytes": nbytes, "sha256": sha}
    write_durable(tmp / MANIFEST, json_bytes({
        "format": FORMAT, "version": VERSION, "step": head["step"], "files": files,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}))
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    _prune(root, keep)


def _on_ranks(dp, tmp: Path, fn: Optional[Callable], *args) -> list:
    """`fn(*args)` on every rank that passes one (None: nothing to do there); every rank's result in rank order, or
    a CheckpointError on every rank naming the ranks that failed, after rank 0 removed step_<N>.tmp. One process
    re-raises the error itself."""
    result = error = None
    if fn is not None:
        try:
            result = fn(*args)
        except Exception as e:
            if not dp.active:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            error = f"{type(e).__name__}: {e}"
    gathered = dp.gather((result, error))
    failed = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err is not None]
    if failed:
        if dp.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("saving the checkpoint failed: " + "; ".join(failed))
    return [res for res, _ in gathered]


# ================================================================================================================
# verifying and loading


@dataclass
class TrainingCheckpoint:
    path: Path
    manifest: dict
    state: dict
    spec: Any
    unit_files: List[Path]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _check_listed(ckpt_dir: Path, name: str, meta: dict) -> Path:
    """The manifest's cheap checks of one file: present, and of the listed size."""
    path = ckpt_dir / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (listed in {ckpt_dir / MANIFEST})")
    size = path.stat().st_size
    if size != meta.get("bytes"):
        raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, {MANIFEST} says {meta.get('bytes')}")
    return path


def _verify_file(ckpt_dir: Path, name: str, meta: dict) -> None:
    path = _check_listed(ckpt_dir, name, meta)
    if sha256_file(path) != meta.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from {MANIFEST}): the file is corrupt")


def open_training_state(path: Path, spec=None, fingerprint: Optional[dict] = None, verify: bool = True,
                        threads: int = VERIFY_THREADS,
                        verify_unit: Optional[Callable[[int], bool]] = None) -> TrainingCheckpoint:
    """Check a checkpoint completely without touching any engine: manifest, sizes, checksums (`verify`), the run
    fingerprint against `fingerprint` (ConfigError naming the field), every unit file's tensor names and shapes.
    `verify_unit(index)`: which unit files to checksum (default all; a rank of a sharded run reads its own only)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    manifest = read_json(path / MANIFEST, "without a manifest the checkpoint is incomplete (a save was interrupted "
                                          "or files were removed); use an older step_<N> directory")
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path / MANIFEST}: not a {FORMAT} manifest")
    files = manifest["files"]
    if TRAINER_STATE not in files:
        raise CheckpointError(f"{path / MANIFEST}: does not list {TRAINER_STATE}")
    for name, meta in files.items():  # cheap checks first: missing and truncated files
        _check_listed(path, name, meta)
    state = read_json(path / TRAINER_STATE, "")
    if fingerprint is not None:
        diffs = fingerprint_differences(_current_keys(state.get("fingerprint", {})), fingerprint)
        if diffs:
            key, saved, now = diffs[0]
            more = "; also differ: " + ", ".join(d[0] for d in diffs[1:]) if len(diffs) > 1 else ""
            raise ConfigError(f"train.resume: checkpoint {path} was made with {key}={saved!r} but this run has "
                              f"{key}={now!r}{more}. Resume with the checkpoint's settings, or start a new run "
                              "(train.resume=none, or another run dir)")
    if verify:
        skipped = set()
        if verify_unit is not None:
            skipped = {u["file"] for u in state.get("units") or [] if not verify_unit(u["index"])}
        names = sorted(set(files) - skipped, key=lambda n: -files[n]["bytes"])  # largest first: they end together
        with ThreadPoolExecutor(max_workers=max(1, min(threads, os.cpu_count() or 1, len(names)))) as pool:
            for f in [pool.submit(_verify_file, path, n, files[n]) for n in names]:
                f.result()
    if spec is None:
        from omegaconf import OmegaConf

        from engine.model import ModelSpec

        try:
            spec = ModelSpec(OmegaConf.create(state["config"]["model"]))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path / TRAINER_STATE}: lacks the model config ({e})") from None
    units = state.get("units") or []
    if len(units) != len(spec.units):
        raise CheckpointError(f"{path / TRAINER_STATE}: has {len(units)} units, model={spec.cfg.name} has "
                              f"{len(spec.units)}")
    unit_files = []
    for unit, u in zip(spec.units, units):
        p = path / u["file"]
        if u["file"] not in files:
            raise CheckpointError(f"{p}: not listed in {path / MANIFEST}")
        with SafetensorsFile(p) as st:
            kinds = STATE_KINDS if u.get("moments", True) and not u.get("flat") else STATE_KINDS[:1]
            for key in u.get("flat") or []:
                if f"flat.{key}" not in st.entries:
                    raise CheckpointError(f"{p}: tensor flat.{key} is missing")
            for kind in kinds:
                for s in unit.layout.specs:
                    name = f"{kind}.{unit.layout.prefix}{s.name}"
                    info = st.entries.get(name)
                    if info is None:
                        raise CheckpointError(f"{p}: tensor {name} is missing")
                    if tuple(info.shape) != tuple(s.shape):
                        raise CheckpointError(f"{p}: tensor {name} has shape {list(info.shape)}, the model "
                                              f"expects {list(s.shape)}")
        unit_files.append(p)
    return TrainingCheckpoint(path, manifest, state, spec, unit_files)


def load_training_state(engine, ckpt: TrainingCheckpoint) -> dict:
    """Copy a checkpoint opened (and verified) by `open_training_state` into the engine; returns trainer_state."""
    for unit, u, p in zip(engine.spec.units, ckpt.state["units"], ckpt.unit_files):
        with SafetensorsFile(p) as st:
            prefix = unit.layout.prefix

            def lazy(kind: str, st=st, prefix=prefix, unit=unit) -> LazyTensors:
                return LazyTensors(unit.layout.names, lambda n: st.get(f"{kind}.{prefix}{n}"))

            if u.get("flat"):
                engine.load_unit_state(unit.index, lazy("master"), step=float(u["adam_step"]),
                                       flat={key: st.get(f"flat.{key}") for key in u["flat"]})
            elif u.get("moments", True):
                engine.load_unit_state(unit.index, lazy("master"), lazy("exp_avg"), lazy("exp_avg_sq"),
                                       float(u["adam_step"]))
            else:
                engine.load_unit_state(unit.index, lazy("master"))
    return ckpt.state


class CheckpointSource:
    """Master weights of a training checkpoint (a run dir -> its newest complete checkpoint, or a step dir), as an
    export source. Each unit file is verified against the manifest when first read, not all up front."""

    def __init__(self, path: str | Path):
        self.ckpt = open_training_state(resolve_checkpoint_path(Path(path)), verify=False)
        _verify_file(self.ckpt.path, TRAINER_STATE, self.ckpt.manifest["files"][TRAINER_STATE])
        self.spec = self.ckpt.spec
        self.init = self.ckpt.state.get("config", {}).get("model", {}).get("init", "random")
        self._verified = set()
        self._readers = Readers()

    def unit_master(self, index: int) -> Mapping:
        path = self.ckpt.unit_files[index]
        if path not in self._verified:
            _verify_file(self.ckpt.path, path.name, self.ckpt.manifest["files"][path.name])
            self._verified.add(path)
        unit = self.spec.units[index]
        reader = self._readers(path)
        return LazyTensors(unit.layout.names, lambda n: reader.get(f"master.{unit.layout.prefix}{n}"))

    def close(self) -> None:
        self._readers.close()
