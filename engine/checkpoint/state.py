"""Training state: save, find, verify and load checkpoints for exact resume; RNG state; the run fingerprint.

The format and the rules (atomic rename of `step_<N>.tmp`, manifest written last, the replacing swap, the
`.streamtrain` marker that makes a directory ours to delete, keep-last-K, what resume=auto picks or refuses) are in
the package docstring. Costs: a save writes 12 B/param once, hashing while it writes (no copy of
the model, no read-back); a resume reads the checkpoint twice, once to verify every byte before the engine is
touched and once to load it, one tensor at a time.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import math
import os
import random
import re
import shutil
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from engine.checkpoint.common import CheckpointError, read_json
from engine.checkpoint.hf import head_dim_of, norm_rope_scaling, plain, same_value, tokenizer_dir_of
from engine.checkpoint.safetensors_io import LazyTensors, Readers, SafetensorsFile, WriteItem, write_safetensors
from engine.config import ConfigError
from engine.distributed import SINGLE
from engine.fileio import free_gib, fsync_dir, json_bytes, sha256_file, write_durable

FORMAT = "streamtrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
MARKER = ".streamtrain"  # written first into every step directory: what cleanup may delete
REPLACED = ".replaced"  # suffix of a step directory moved aside while its replacement is renamed in
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


def _manifest_problem(step_dir: Path) -> Optional[str]:
    """Why `step_dir` has no valid manifest (the message names the file), or None when it has one."""
    try:
        m = read_json(step_dir / MANIFEST, "")
    except CheckpointError as e:
        return str(e)
    if m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        return f"{step_dir / MANIFEST}: not a {FORMAT} manifest"
    return None


def _is_complete(step_dir: Path) -> bool:
    return _manifest_problem(step_dir) is None


def write_marker(directory: Path) -> Tuple[int, str]:
    """The marker that makes `directory` ours to delete, written first into every directory a save creates; returns
    (size, sha256) for the manifest."""
    return write_durable(directory / MARKER, json_bytes({
        "written_by": "streamtrain", "format": FORMAT, "pid": os.getpid(), "host": socket.gethostname(),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}))


def is_ours(directory: Path) -> bool:
    """True if `directory` carries the marker a save writes first: only such directories are ever deleted. The
    file's presence is the proof (a save killed while writing it leaves it empty); its JSON says who wrote it."""
    return (directory / MARKER).is_file()


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
    """Step dirs in `root` without a valid manifest whose step is above `step`: damaged checkpoints (a save names a
    step dir only after its manifest is complete), which resume=auto refuses and `verify <run dir>` warns about."""
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
    if root.is_dir():
        _recover_swaps(root, log)
    complete, damaged = list_checkpoints(root)
    newer = incomplete_newer_than(root, complete[-1][0] if complete else -1)
    if newer:
        raise CheckpointError(_damage_message(newer[-1], complete[-1][1] if complete else None))
    for p in damaged:
        log(f"warning: {_manifest_problem(p)}: a damaged checkpoint, older than the newest complete one; left in place")
    if not complete:
        log(f"train.resume=auto: no checkpoint in {root}, starting from step 0")
        return None
    return complete[-1][1]


def _damage_message(step_dir: Path, previous: Optional[Path]) -> str:
    """The refusal of a step dir without a valid manifest, with the way to resume from the previous checkpoint."""
    way = (f"resume from the previous complete checkpoint with train.resume={previous}" if previous is not None else
           "there is no earlier complete checkpoint: start over with train.resume=none")
    return (f"{_manifest_problem(step_dir)}; a save names a step_<N> directory only after its {MANIFEST} is written, "
            f"so {step_dir} is damaged (or not a streamtrain checkpoint). Move it away, or {way} (its save of that "
            "step replaces a damaged checkpoint that streamtrain wrote)")


# ================================================================================================================
# saving


def check_writable(root: Path, field: str) -> bool:
    """Create `root` if missing, write and remove a probe file in it: a checkpoint root that cannot be written is
    refused at start (ConfigError naming `field`), not at the first save after the training time is spent. True if
    this call created it."""
    created = not root.exists()
    probe = root / f".streamtrain-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_durable(probe, b"probe\n")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{field}={root}: cannot be written ({e.strerror or e}: {e.filename or root}); it must be "
                          "a directory this user can create and write files in") from None
    return created


def save_failure(root: Path, step: int, err: BaseException) -> str:
    """What a failed save of step `step` says: the step directory, the error, the free space, what is left."""
    try:
        free = f"{free_gib(root):.2f} GiB free on {root}"
    except OSError as e:
        free = f"free space on {root} unknown ({e.strerror})"
    complete, _ = list_checkpoints(root)
    left = f"the newest complete checkpoint is {complete[-1][1]}" if complete else "there is no complete checkpoint"
    return (f"the checkpoint of step {step} could not be written to {root / f'step_{step}'}: {err} ({free}); its "
            f"partial files were removed and {left}")


def _remove(path: Path, why: str, log: Callable[[str], None]) -> None:
    shutil.rmtree(path)
    log(f"removed {path} ({why})")


def _recover_swaps(root: Path, log: Callable[[str], None]) -> None:
    """Finish or undo a replacing swap that a crash interrupted (`_swap_in`): a `step_<N>.replaced` whose `step_<N>`
    is missing is renamed back (the new one never arrived); one whose `step_<N>` is complete is removed."""
    for old in sorted(root.glob(f"step_*{REPLACED}")):
        final = old.with_name(old.name[:-len(REPLACED)])
        if not (STEP_DIR.match(final.name) and old.is_dir() and is_ours(old)):
            continue
        if not final.exists():
            os.rename(old, final)
            fsync_dir(root)
            log(f"restored {final} from {old}: a save replacing it was interrupted before the new one was in place")
        elif _is_complete(final):
            _remove(old, "the checkpoint it replaced; a save was interrupted before removing it", log)


def _cleanup(root: Path, log: Callable[[str], None]) -> None:
    """Remove what interrupted saves (`*.tmp`) and prunes (`*.deleting`) left, if a save of ours made it (the
    marker). Step dirs without a valid manifest are damage, never removed here (resume refuses them)."""
    _recover_swaps(root, log)
    for p in sorted(root.iterdir()):
        if p.name.endswith((".tmp", ".deleting")) and p.is_dir() and is_ours(p):
            _remove(p, "left by an interrupted save" if p.name.endswith(".tmp") else "left by an interrupted "
                    "removal of an old checkpoint", log)


def _prune(root: Path, keep: int, log: Callable[[str], None]) -> None:
    """Keep the newest `keep` complete checkpoints of ours (0: all); older ones are renamed to `*.deleting` first, so
    a crash mid-removal never leaves something that looks complete."""
    if keep <= 0:
        return
    complete = [p for _, p in list_checkpoints(root)[0] if is_ours(p)]
    for p in complete[:-keep]:
        doomed = p.with_name(p.name + ".deleting")
        os.rename(p, doomed)
        _remove(doomed, f"train.keep_checkpoints={keep}", log)
    fsync_dir(root)


def _swap_in(root: Path, final: Path, tmp: Path) -> None:
    """Rename the complete `tmp` to `final`. An existing `final` (ours: `_prepare_save` checked) is renamed aside to
    `<final>.replaced` first and removed once the new one is in place; a crash between the two renames leaves
    `.replaced` without `final`, which `_recover_swaps` renames back, so a complete step_<N> survives every point."""
    old = final.with_name(final.name + REPLACED)
    replacing = final.exists()
    if replacing:
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except Exception:
        if replacing:
            os.rename(old, final)
        raise
    fsync_dir(root)
    if replacing:
        shutil.rmtree(old)


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


def save_training_state(engine, root: Path, step: int, state: dict, keep: int = 3, dp=SINGLE,
                        log: Callable[[str], None] = print) -> Path:
    """Atomically write the engine's full training state plus `state` (trainer_state.json) as root/step_<step>.

    Data parallel (`dp`, called on every rank): rank 0 prepares `step_<step>.tmp`, each rank writes the unit files
    of the units whose state it holds (engine.owner; rank 0 those held everywhere), rank 0 writes the trainer state
    and the manifest last and renames; a failure on any rank fails the save on every rank.

    An existing `step_<step>` of ours is replaced (`_swap_in`); one without the marker is refused. An error during
    the save removes `step_<step>.tmp` and re-raises: the newest complete checkpoint stays what it was. A state
    that strict JSON cannot hold (NaN, infinity, an object) is refused before any unit is written.
    KeyboardInterrupt and SystemExit (a second signal: abort now) leave the partial directory, like a
    kill; the next save removes it. `log` gets a line for each directory removed."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    head = {"format": FORMAT, "version": VERSION, **state, "step": step}
    _state_json(final / TRAINER_STATE, head)
    rank0 = dp.rank == 0
    _on_ranks(dp, tmp, _prepare_save if rank0 else None, root, final, tmp, log)
    owner = getattr(engine, "owner", {})
    mine = [unit for unit in engine.spec.units if owner.get(unit.index, 0) == dp.rank]
    written = _on_ranks(dp, tmp, _write_units, engine, mine, tmp)
    files = {name: meta for files, _ in written for name, meta in files.items()}
    units = sorted((u for _, units in written for u in units), key=lambda u: u["index"])
    _on_ranks(dp, tmp, _finish_save if rank0 else None, root, final, tmp, head, files, units, keep, log)
    return final


def _prepare_save(root: Path, final: Path, tmp: Path, log: Callable[[str], None]) -> None:
    """Rank 0: the leftovers of interrupted saves removed, a new step_<N>.tmp holding only the marker."""
    root.mkdir(parents=True, exist_ok=True)
    _cleanup(root, log)
    if tmp.is_dir() and not is_ours(tmp):
        with contextlib.suppress(OSError):
            tmp.rmdir()  # empty: a save killed between creating it and its marker; anything else stays
    for p in (final, tmp):
        if p.exists() and not is_ours(p):
            raise CheckpointError(f"{p}: exists and was not written by streamtrain (no {MARKER} marker in it), so the "
                                  f"save of step {step_of(final)} will not replace it; move it away, or choose another "
                                  "train.checkpoint_dir")
    tmp.mkdir()
    write_marker(tmp)


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
                 keep: int, log: Callable[[str], None]) -> None:
    """Rank 0, every unit file written: the trainer state, the manifest last, the swap, the pruning."""
    nbytes, sha = write_durable(tmp / TRAINER_STATE, _state_json(final / TRAINER_STATE, {**head, "units": units}))
    files[TRAINER_STATE] = {"bytes": nbytes, "sha256": sha}
    files[MARKER] = {"bytes": (tmp / MARKER).stat().st_size, "sha256": sha256_file(tmp / MARKER)}
    write_durable(tmp / MANIFEST, json_bytes({
        "format": FORMAT, "version": VERSION, "step": head["step"], "files": files,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}))
    fsync_dir(tmp)
    _swap_in(root, final, tmp)
    _prune(root, keep, log)


def _remove_partial(tmp: Path) -> None:
    """A failed save's step_<N>.tmp, if this save made it (a foreign one of that name stays)."""
    if is_ours(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            tmp.rmdir()  # empty: the save failed before its marker was written


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
                _remove_partial(tmp)
                raise
            error = f"{type(e).__name__}: {e}"
    gathered = dp.gather((result, error))
    failed = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err is not None]
    if failed:
        if dp.rank == 0:
            _remove_partial(tmp)
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
    saved_steps: Optional[int] = None  # the checkpoint's train.steps where this run extends it, else None

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
    fingerprint against `fingerprint` (ConfigError naming the field; a larger train.steps is allowed: training
    longer), every unit file's tensor names and shapes.
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
    saved_steps = None
    if fingerprint is not None:
        diffs = fingerprint_differences(_current_keys(state.get("fingerprint", {})), fingerprint)
        extended = [d for d in diffs if d[0] == "train.steps" and isinstance(d[1], int) and d[2] > d[1]]
        if extended:  # training longer: the schedule is re-derived for the new length (the trainer says how)
            diffs.remove(extended[0])
            saved_steps = extended[0][1]
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
    return TrainingCheckpoint(path, manifest, state, spec, unit_files, saved_steps)


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
        config = self.ckpt.state.get("config", {})
        self.tokenizer_dir = tokenizer_dir_of(config.get("model", {}).get("init", "random"),
                                              config.get("data", {}).get("tokenizer"))
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
