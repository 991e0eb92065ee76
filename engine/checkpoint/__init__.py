"""Checkpoints: HF safetensors import and export, training-state save and exact resume, crash safety.

Modules: `safetensors_io` (reading through the `safetensors` library, an own streaming writer that hashes while it
writes; format: an 8-byte header length, a JSON header, then the raw tensors), `hf` (config.json comparison, import,
export), `state` (training-state save / verify / load, run fingerprint, RNG state, listing and pruning), `lock` (one run
at a time per run dir and checkpoint root), `cli` (`python -m engine.checkpoint export|verify`), `common`
(CheckpointError, the JSON reader). Every name other modules use is re-exported here; file writing goes through
engine/fileio.py (fsync, sha256, strict JSON).

1. HF import (`model.init=hf:<dir>`). `open_hf` reads `<dir>/config.json` (old and new spellings: `torch_dtype` /
   `dtype`, top-level `rope_theta`/`rope_scaling` / v5 `rope_parameters`), compares every architecture field with
   the chosen model config and raises ConfigError naming the first differing field with both values (the others
   that differ are listed after it). Then it opens every shard named by `model.safetensors.index.json` (or the
   single `model.safetensors`): the library validates each header against its file (a truncated shard is caught
   from its header, before any weight is read), and `open_hf` checks that every tensor of our layout is present,
   in a float dtype (F32/F16/BF16/F64), with its shape, and that there is nothing unexpected (old
   `rotary_emb.inv_freq` buffers and a tied model's redundant `lm_head.weight` are ignored).
   `max_position_embeddings` is not compared: it only bounds train.seq_len, no weight depends on it (llama3
   RoPE's `original_max_position_embeddings` is). Only then does the Trainer build the engine, and `import_hf`
   copies the weights in unit by unit through `engine.load_unit_state`: each tensor is read with pread(2) (the
   library's pread backend; no mmap, so no page-cache pages are charged to the process) into a buffer of the
   file's dtype when the engine asks for it, and the engine casts it into its fp32 master while copying. Extra
   host memory is one tensor in the file's dtype (the largest is the embedding: 1.1 GB bf16 for Qwen2.5-7B),
   never a second copy of the model. Adam moments start at zero. Mixture-of-experts checkpoints map several
   on-disk tensors to one of ours: Qwen3-MoE's per-expert matrices are stacked, and gpt-oss's MXFP4 expert blocks
   and scales (uint8) are decoded (engine/checkpoint/mxfp4.py); each stacked or decoded tensor is built one at a
   time, which bounds the extra memory then.

2. HF export. `export_hf(source, out_dir)` writes `model-0000k-of-0000n.safetensors` shards (default 5 GiB, keys in
   unit order so each layer's tensors are contiguous, metadata `{"format": "pt"}`, `lm_head.weight` omitted when
   tied), `model.safetensors.index.json` (`total_size` = sum of tensor bytes), `config.json` (architectures,
   model_type, every architecture field, `torch_dtype` and `dtype`, old-style `rope_theta`/`rope_scaling`, which
   every transformers version reads) and `generation_config.json` when bos/eos are known; tokenizer files of the
   `hf:` directory the run started from are copied along. A source is an engine (`EngineSource`, used by
   `train.export_hf=true` at the end of training into `<run dir>/hf`) or a training checkpoint (`CheckpointSource`:
   `python -m engine.checkpoint export <run dir | step dir> <out dir> [--dtype bf16|fp32] [--shard-gib 5]`, and
   `train.export_hf=true` when the state is sharded over data-parallel ranks), which reads the master weights
   only. Tensors are converted one at a time while the shard is written: peak extra memory is one tensor. Files
   are written under temporary names in `<out dir>.tmp/` and moved into place at the end, the index and config
   last; an `<out dir>` that exists as a file is refused before anything is written.

3. Training state. `save_training_state` writes

       <checkpoint root>/step_<N>/              (root: train.checkpoint_dir, default <run dir>/checkpoints)
           unit_0000_embed.safetensors          one file per unit, tensors "master.<hf name>", "exp_avg.<hf name>",
           unit_0001_layer0.safetensors         "exp_avg_sq.<hf name>" (fp32; the moments are absent before the
           ...                                  first update of the reference engine); metadata: unit, adam_step
           unit_<L+1>_head.safetensors
           .streamtrain                         the marker, written first: {written_by, format, pid, host, created}
           trainer_state.json                   step, data position, LR-schedule inputs, torch/numpy/python (and
                                                CUDA) RNG states (base64), Adam step per unit, skipped-step
                                                counters, tokens seen, validation losses, run fingerprint, config
           manifest.json                        written last: every file with its size and sha256

   Units are serialised one at a time straight from `engine.unit_state` (views into the host store for the stream
   engine), with the sha256 computed on the bytes as they are written: no copy of the model is made. Unit files
   are written through this package's `write_safetensors`, looked up at each save, so that replacing that one
   name (tests/test_faults.py slows it down) affects every save. Atomicity: everything goes into
   `step_<N>.tmp/`, the marker first, each file is fsynced, then the directory, then it is renamed to `step_<N>`
   and the parent is fsynced. A `step_<N>` directory therefore either has a manifest describing complete files or
   was damaged afterwards. A trainer state that strict JSON cannot hold (NaN, infinity) is refused before any unit
   is written, and an error during the save removes `step_<N>.tmp/`, so the previous checkpoint stays the newest.

   Replace. A save of a step that has a `step_<N>` already (a run resumed from an older step after that one was
   found corrupt; another run that used the same checkpoint root before) replaces it: the old one is renamed to
   `step_<N>.replaced`, the new one renamed in, the parent fsynced, the old one removed. A crash between the two
   renames leaves `.replaced` without `step_<N>`; the next save, and resume=auto, rename it back (a crash after
   them: they remove it), so a complete `step_<N>` survives every point of the swap. A `step_<N>` without the
   marker is not replaced: the save is refused naming it.

   Marker. Only directories carrying `.streamtrain` (written first into every directory a save creates) are ever
   deleted, and each deletion is logged: leftovers of a killed or signal-aborted save (`*.tmp`), of an
   interrupted prune (`*.deleting`) and of an interrupted swap, removed at the next save; and the checkpoints
   pruned after a save, which keeps the newest `train.keep_checkpoints` complete checkpoints of ours (0 keeps
   all; older ones are renamed to `*.deleting` before removal, so a kill mid-removal never leaves something that
   looks complete). Anything else in the checkpoint root is left alone.

   Lock. A training run holds `fcntl.flock` locks on `<run dir>/.streamtrain.lock` and
   `<checkpoint root>/.streamtrain.lock` (JSON: pid, host, started) from before it reads the checkpoint root to
   its end (`lock.DirLock`); a second run on either is refused (exit status 2) naming the holder's pid and host.
   The kernel drops the lock of a process that dies, so a lock left by a killed run is taken over, with a log
   line naming it. The checkpoint root is created and probed with a file write at start: one that cannot be
   written is refused then (exit status 2), not at the first save; a save that fails (a full disk) names the step
   directory and the free space there, and the Trainer exits with status 4.

   Damage. A save names a `step_<N>` only after its manifest is written, so a `step_<N>` whose manifest is
   missing or unreadable is damaged (only `*.tmp` directories are interrupted saves): `train.resume=auto`
   refuses the newest such one with a CheckpointError naming the file and saying how to resume from the previous
   complete checkpoint (`train.resume=<its path>`); nothing deletes it (a save of that step replaces it, if it
   carries the marker). Older damaged ones are named in a warning.

   `train.resume=auto` takes the newest complete `step_<N>` (none at all starts from step 0), `train.resume=<dir>`
   a step directory or a run directory. `open_training_state` verifies everything before the engine is touched: the
   manifest, every file's size (truncation) and sha256 (flipped bytes, hashed in parallel threads), trainer_state.json,
   the run fingerprint (model architecture, optimizer recipe, steps, seed, data identity; a difference is a
   ConfigError naming the field and both values, except a larger train.steps: training longer) and every unit file's tensor names and shapes. A damaged newest
   checkpoint is refused naming the file, never silently replaced by an older one: pass the older step directory
   explicitly to fall back. Loading then streams one tensor at a time into `engine.load_unit_state`. Cost: a resume
   reads the checkpoint twice (verify, then load); a save writes 12 B/param.

   `python -m engine.checkpoint verify <run dir>` verifies the newest complete checkpoint, prints which one, and
   warns (exit status still 0) about newer step directories without a manifest; `verify <step dir>` of an
   incomplete checkpoint fails.

Errors: CheckpointError (a ValueError) names the file; the Trainer turns it, like ConfigError, into exit status 2,
and so does the CLI, which also reports an OSError (a path that is a file, no permission) as one `error:` line.
"""

from engine.checkpoint.common import CheckpointError
from engine.checkpoint.hf import (EngineSource, check_hf_config, export_hf, hf_config_dict, hf_dir_of, import_hf,
                                  open_hf, tokenizer_dir_of)
from engine.checkpoint.lock import DirLock, LockHeld
from engine.checkpoint.safetensors_io import LazyTensors, SafetensorsFile, write_safetensors
from engine.checkpoint.state import (CheckpointSource, check_writable, find_resume, list_checkpoints,
                                     load_training_state, open_training_state, rng_state, run_fingerprint,
                                     save_failure, save_training_state, set_rng_state)
from engine.fileio import sha256_file

__all__ = ["CheckpointError", "CheckpointSource", "DirLock", "EngineSource", "LazyTensors", "LockHeld",
           "SafetensorsFile", "check_hf_config", "check_writable", "export_hf", "find_resume", "hf_config_dict",
           "hf_dir_of", "import_hf", "list_checkpoints", "load_training_state", "open_hf", "open_training_state",
           "rng_state", "run_fingerprint", "save_failure", "save_training_state", "set_rng_state", "sha256_file",
           "tokenizer_dir_of", "write_safetensors"]
