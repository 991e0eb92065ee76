"""Token data: where training sequences come from.

The token-stream sources (text and chat records are in documents.py), all served through one `TokenData` interface
whose `batch()` returns an `engine.batch.Batch` (here with `doc_start_BT=None`: a window is one causal stream):

- stdlib: every `.py` and `.txt` file of the running Python's standard library (installed packages excluded), in
  sorted path order, joined with newlines and tokenised as raw bytes (vocab 256). It exists on every machine, needs no
  download, and is real text with real structure, so loss curves mean something. About 30 MB for CPython 3.11 (test/
  included); read once into one uint8 array in well under a second. Distributions that strip parts of the stdlib
  produce a different stream, which the fingerprint and the file count in `description` make visible.
- memmap: a flat file of little-endian uint32 ids written by `python -m engine.data prepare` with an HF tokenizer,
  plus a JSON sidecar `<path>.json`. Opened with np.memmap, so a corpus larger than RAM costs only page cache; the
  fingerprint is the one prepare computed (re-hashing gigabytes at every start would cost more than it protects
  against, so loading checks the byte size against the sidecar instead). Every id is checked against the model's
  vocabulary when the file is opened (one max over the file, at memory-bandwidth speed, about 1 s per 4 GB of ids
  from page cache): an id at or past `model.vocab_size` would otherwise crash the embedding lookup mid-run. The
  largest id found is part of the fingerprint, so a checkpoint records which ids its data held.
- synthetic: uniform random ids, generated per sequence from a seeded generator; nothing is held in memory. For
  exercising the engine at a given vocab without a corpus; the loss should sit at ln(vocab).

Splits and sequences (stdlib, memmap). The last `val_fraction` of the stream is validation, the rest training;
the split is contiguous, so no training window ever sees a validation token. Each split is cut into non-overlapping
windows of seq_len+1 tokens at stride seq_len (ids = w[:-1], labels = w[1:]), so every token in a split is a
label exactly once per epoch. A partial window at the end of a split is dropped.

Order. `batch(split, index, batch_size)` is a pure function of (seed, split, index, batch_size): it takes positions
index*B ... index*B+B-1 of an endless sequence made of one permutation of the split's windows per epoch. Training
permutations are seeded from (seed, epoch), so every epoch is reshuffled and no state has to be checkpointed to
resume; validation uses one permutation from a constant seed, identical at every step and for every run seed, so
val losses are comparable across steps and across runs. A permutation costs 4 bytes per window (8 past 2**31
windows) and is cached, so a batch costs one gather of B*(seq_len+1) tokens plus the int64 copy.
"""

from __future__ import annotations

import abc
import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from engine.batch import Batch
from engine.fileio import atomic_write, atomic_write_json, sha256_file

CORPUS_SOURCES = ("stdlib", "memmap", "synthetic")
SPLITS = ("train", "val")
PREPARE_SUFFIXES = (".txt", ".md", ".py")
# Document separators, most specific first; the first one the tokenizer has as a special token is appended to
# every file. Covers Qwen/GPT-2 (<|endoftext|>), Llama 3 (<|end_of_text|>), Llama 2/T5 (</s>), Gemma (<eos>), BERT.
SEPARATOR_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
SYNTHETIC_TRAIN_SEQS = 2**31
SYNTHETIC_VAL_SEQS = 1024
_PREPARE_HINT = "python -m engine.data prepare --tokenizer <tokenizer.json> --out {path} <text files or directories>"


class DataError(ValueError):
    """Input that cannot be served; the message names the bad value and what would be valid."""


def _mix(*parts: Any) -> int:
    """A 63-bit generator seed from any tuple of ints and strings, well mixed so nearby inputs give unrelated
    streams (unlike seed + epoch)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TokenData(abc.ABC):
    """A tokenised corpus split into train/val, served as fixed-length sequences."""

    def __init__(self, *, seq_len: int, seed: int, vocab_size: int, fingerprint: str, description: dict):
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.description = description
        self._permutations: Dict[Tuple[str, int], np.ndarray] = {}

    @abc.abstractmethod
    def num_sequences(self, split: str) -> int:
        """Rows in one epoch of the split."""

    @abc.abstractmethod
    def _batch(self, split: str, first: int, count: int) -> Batch:
        """Rows first ... first+count-1 of the split's endless order."""

    def _permutation(self, split: str, epoch: int) -> np.ndarray:
        """The split's rows in the order of `epoch`: reshuffled per epoch (seeded by the run's seed) for training,
        one fixed order for validation, the same for every run seed."""
        key = (split, epoch if split == "train" else 0)
        perm = self._permutations.get(key)
        if perm is None:
            g = torch.Generator()
            g.manual_seed(_mix("train", self.seed, epoch) if split == "train" else _mix("val"))
            n = self.num_sequences(split)
            perm = torch.randperm(n, generator=g, dtype=torch.int32 if n < 2**31 else torch.int64).numpy()
            # Bounded cache: the epochs next to this one, which a batch or a sequential reader can straddle.
            for k in [k for k in list(self._permutations) if k[0] == split and abs(k[1] - key[1]) > 1]:
                self._permutations.pop(k, None)
            self._permutations[key] = perm
        return perm

    def _order(self, split: str, first: int, count: int) -> np.ndarray:
        """Row indices at positions first ... first+count-1 of the split's endless order (epoch after epoch)."""
        n = self.num_sequences(split)
        rows = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, within = divmod(first + done, n)
            take = min(count - done, n - within)
            rows[done:done + take] = self._permutation(split, epoch)[within:within + take]
            done += take
        return rows

    def batch(self, split: str, index: int, batch_size: int) -> Batch:
        """Rows index*B ... index*B+B-1 of the split's order: int64 CPU tensors [batch_size, seq_len] (labels: the
        next tokens, IGNORE_INDEX where nothing is predicted); doc_start_BT for packed documents, else None."""
        _check_split(split)
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be >= 1")
        if index < 0:
            raise DataError(f"batch index={index} must be >= 0")
        return self._batch(split, index * batch_size, batch_size)


class WindowData(TokenData):
    """A source served as windows of seq_len+1 tokens: ids are w[:-1], labels w[1:]."""

    @abc.abstractmethod
    def _windows(self, split: str, first: int, count: int) -> torch.Tensor:
        """Positions first ... first+count-1 of the split's endless order, as int64 [count, seq_len+1]."""

    def _batch(self, split: str, first: int, count: int) -> Batch:
        windows_BW = self._windows(split, first, count)
        return Batch(windows_BW[:, :-1].contiguous(), windows_BW[:, 1:].contiguous())


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"split={split!r} is not valid; choose one of {', '.join(SPLITS)}")


class CorpusData(WindowData):
    """A token stream held as a 1-D numpy array (in RAM or memory-mapped), cut into train/val windows."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int, val_fraction: float, vocab_size: int,
                 fingerprint: str, description: dict):
        n_tokens = len(tokens)
        val_start = n_tokens - int(n_tokens * val_fraction)
        self.tokens = tokens
        self._regions = {"train": (0, val_start), "val": (val_start, n_tokens)}
        self._n_seqs = {}
        for split, (lo, hi) in self._regions.items():
            if hi - lo < seq_len + 1:
                enough = math.ceil((seq_len + 1) / n_tokens * 1e4) / 1e4  # rounded up: it does hold a window
                hint = f"raise data.val_fraction to at least {enough:.4f}, " if split == "val" \
                    and seq_len + 1 < n_tokens - seq_len - 1 else ""
                raise DataError(f"data={description['source']}: the {split} split has {hi - lo} tokens, fewer than "
                                f"one window of seq_len+1={seq_len + 1} (n_tokens={n_tokens}, "
                                f"val_fraction={val_fraction}); {hint}lower train.seq_len or use a larger corpus")
            self._n_seqs[split] = (hi - lo - 1) // seq_len
        description = dict(description, n_tokens=n_tokens, n_train_tokens=val_start,
                           n_val_tokens=n_tokens - val_start, n_train_seqs=self._n_seqs["train"],
                           n_val_seqs=self._n_seqs["val"], seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                           val_fraction=val_fraction, fingerprint=fingerprint)
        super().__init__(seq_len=seq_len, seed=seed, vocab_size=vocab_size, fingerprint=fingerprint,
                         description=description)

    def num_sequences(self, split: str) -> int:
        _check_split(split)
        return self._n_seqs[split]

    def window_starts(self, split: str, index: int, batch_size: int) -> np.ndarray:
        """Stream offsets of the first token of each row of batch(split, index, batch_size), int64 [batch_size].
        For audits (leakage, coverage) and tests; batch() reads tokens[start : start + seq_len + 1]."""
        _check_split(split)
        return self._starts(split, index * batch_size, batch_size)

    def _starts(self, split: str, first: int, count: int) -> np.ndarray:
        return self._regions[split][0] + self._order(split, first, count) * self.seq_len

    def _windows(self, split: str, first: int, count: int) -> torch.Tensor:
        starts = self._starts(split, first, count)
        offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.tokens[starts[:, None] + offsets], dtype=np.int64))


class SyntheticData(WindowData):
    """Uniform random ids; sequence k of a split is drawn from a generator seeded with (seed, split, k)."""

    def __init__(self, *, seq_len: int, seed: int, vocab_size: int):
        fingerprint = hashlib.sha256(f"synthetic:{vocab_size}:{seed}".encode()).hexdigest()[:16]
        description = dict(source="synthetic", vocab_size=vocab_size, seed=seed, seq_len=seq_len,
                           n_train_seqs=SYNTHETIC_TRAIN_SEQS, n_val_seqs=SYNTHETIC_VAL_SEQS, fingerprint=fingerprint)
        super().__init__(seq_len=seq_len, seed=seed, vocab_size=vocab_size, fingerprint=fingerprint,
                         description=description)

    def num_sequences(self, split: str) -> int:
        _check_split(split)
        return SYNTHETIC_TRAIN_SEQS if split == "train" else SYNTHETIC_VAL_SEQS

    def _windows(self, split: str, first: int, count: int) -> torch.Tensor:
        n = self.num_sequences(split)
        g = torch.Generator()
        rows = []
        for k in range(first, first + count):
            g.manual_seed(_mix(split, self.seed, k % n))
            rows.append(torch.randint(self.vocab_size, (self.seq_len + 1,), generator=g, dtype=torch.int64))
        return torch.stack(rows)


# ----------------------------------------------------------------------------------------------------------------
# sources


def _check_vocab(source: str, vocab_size: int, model_vocab_size: int, requested: Optional[int]) -> None:
    if requested is not None and requested != vocab_size:
        raise DataError(f"data.vocab_size={requested} does not match data={source}, whose tokens span "
                        f"vocab_size={vocab_size}; set data.vocab_size={vocab_size} or null")
    if vocab_size > model_vocab_size:
        raise DataError(f"data={source} produces token ids up to vocab_size={vocab_size}, more than "
                        f"model.vocab_size={model_vocab_size}; use a model with vocab_size >= {vocab_size}")


def stdlib_files(root: str) -> List[str]:
    """The stdlib corpus' files in stream order: .py and .txt under root, installed packages left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith((".py", ".txt")))
    return sorted(found)


def _load_stdlib(data_cfg, seq_len: int, seed: int, model_vocab_size: int) -> CorpusData:
    _check_vocab("stdlib", 256, model_vocab_size, getattr(data_cfg, "vocab_size", None))
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    if not files:
        raise DataError(f"data=stdlib: no .py or .txt files under {root}; use data=memmap or data=synthetic")
    blob = b"\n".join(_read_bytes(f) for f in files)
    description = dict(source="stdlib", path=root, n_files=len(files), n_bytes=len(blob),
                       python=sys.version.split()[0])
    return CorpusData(np.frombuffer(blob, dtype=np.uint8), seq_len=seq_len, seed=seed,
                      val_fraction=data_cfg.val_fraction, vocab_size=256,
                      fingerprint=hashlib.sha256(blob).hexdigest()[:16], description=description)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sidecar_path(bin_path: str) -> str:
    return bin_path + ".json"


def _load_memmap(data_cfg, seq_len: int, seed: int, model_vocab_size: int) -> CorpusData:
    path = getattr(data_cfg, "path", None)
    if not path:
        raise DataError("data=memmap needs data.path=<tokens .bin>; create one with "
                        + _PREPARE_HINT.format(path="<tokens.bin>"))
    if not os.path.isfile(path):
        raise DataError(f"data.path={path!r}: no such file; create it with " + _PREPARE_HINT.format(path=path))
    side = sidecar_path(path)
    if not os.path.isfile(side):
        raise DataError(f"{side}: sidecar of {path} is missing; rewrite both with " + _PREPARE_HINT.format(path=path))
    try:
        with open(side) as f:
            meta = json.load(f)
        vocab_size, n_tokens, fingerprint = int(meta["vocab_size"]), int(meta["n_tokens"]), str(meta["fingerprint"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{side}: corrupt sidecar ({type(e).__name__}: {e}); it needs JSON with vocab_size, "
                        f"n_tokens and fingerprint; rewrite it with " + _PREPARE_HINT.format(path=path)) from e
    _check_vocab("memmap", vocab_size, model_vocab_size, getattr(data_cfg, "vocab_size", None))
    n_bytes = os.path.getsize(path)
    if n_bytes % 4:
        raise DataError(f"{path}: {n_bytes} bytes is not a whole number of uint32 tokens; the file is truncated "
                        "or not written by prepare")
    if n_bytes // 4 != n_tokens:
        raise DataError(f"{path}: holds {n_bytes // 4} tokens but its sidecar {side} says n_tokens={n_tokens}; "
                        "the pair is inconsistent (truncated or overwritten), rewrite it with prepare")
    if n_tokens == 0:
        raise DataError(f"{path}: holds no tokens; prepare it from non-empty text")
    tokens = np.memmap(path, dtype="<u4", mode="r")
    limit = min(model_vocab_size, vocab_size)
    max_id, first_bad = _scan_token_ids(tokens, path, limit)
    if first_bad is not None:
        raise DataError(f"{path}: token id {max_id} (first bad one at token {first_bad:,}) is out of range: the "
                        f"sidecar says vocab_size={vocab_size} and model.vocab_size={model_vocab_size}, so ids must be "
                        f"below {limit}; the file was not written by this tokenizer, or is corrupt; rewrite it with "
                        + _PREPARE_HINT.format(path=path))
    description = dict(source="memmap", path=os.path.abspath(path), sidecar=os.path.abspath(side),
                       tokenizer=meta.get("tokenizer"), tokenizer_sha256=meta.get("tokenizer_sha256"),
                       separator=meta.get("separator"), sources=meta.get("sources"), max_token_id=max_id)
    return CorpusData(tokens, seq_len=seq_len, seed=seed, val_fraction=data_cfg.val_fraction, vocab_size=vocab_size,
                      fingerprint=f"{fingerprint}-max{max_id}", description=description)


def _scan_token_ids(tokens: np.ndarray, path: str, limit: int, chunk_tokens: int = 256 << 20,
                    progress_every_s: float = 5.0) -> Tuple[int, Optional[int]]:
    """(largest id, position of the first id >= limit or None) of a token file, in one pass over chunks (bounded
    memory), with progress lines on a long scan."""
    max_id, first_bad, t0, last_report = 0, None, time.monotonic(), time.monotonic()
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start:start + chunk_tokens]
        chunk_max = int(chunk.max())
        if first_bad is None and chunk_max >= limit:
            first_bad = start + int(np.argmax(chunk >= limit))
        max_id = max(max_id, chunk_max)
        if time.monotonic() - last_report >= progress_every_s:
            print(f"{path}: checking token ids, {start + chunk_tokens:,}/{len(tokens):,} "
                  f"({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
            last_report = time.monotonic()
    return max_id, first_bad


def _load_synthetic(data_cfg, seq_len: int, seed: int, model_vocab_size: int) -> SyntheticData:
    vocab_size = getattr(data_cfg, "vocab_size", None) or model_vocab_size
    if vocab_size < 1:
        raise DataError(f"data=synthetic: vocab_size={vocab_size} must be >= 1")
    _check_vocab("synthetic", vocab_size, model_vocab_size, None)
    return SyntheticData(seq_len=seq_len, seed=seed, vocab_size=vocab_size)


LOADERS = {"stdlib": _load_stdlib, "memmap": _load_memmap, "synthetic": _load_synthetic}


# ----------------------------------------------------------------------------------------------------------------
# prepare: text files -> <out> (uint32 ids) + <out>.json


def prepare_inputs(inputs: Iterable[str]) -> List[str]:
    """Files in stream order: each argument in the order given; a directory contributes its *.txt, *.md and *.py
    files in sorted path order, hidden files and directories skipped."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = []
            for dirpath, dirnames, filenames in os.walk(item):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found.extend(os.path.join(dirpath, f) for f in filenames
                             if f.endswith(PREPARE_SUFFIXES) and not f.startswith("."))
            files.extend(sorted(found))
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(f"{item}: no such file or directory")
    return files


def find_separator(tokenizer) -> Optional[Tuple[str, int]]:
    """(token, id) of the document separator appended after each file, or None if the tokenizer has none."""
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for name in SEPARATOR_NAMES:
        if name in specials:
            return name, specials[name]
    return None


def prepare(tokenizer_path: str, out_path: str, inputs: List[str], batch_bytes: int = 16 << 20,
            progress_every_s: float = 3.0) -> dict:
    """Tokenise inputs into out_path and write its sidecar; returns the sidecar dict. Each file is one document:
    its ids (without the tokenizer's own BOS/EOS template) followed by the separator token, if there is one."""
    from tokenizers import Tokenizer

    if not os.path.isfile(tokenizer_path):
        raise DataError(f"--tokenizer {tokenizer_path}: no such file; pass an HF tokenizer.json")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size > 2**32:
        raise DataError(f"{tokenizer_path}: vocab_size={vocab_size} does not fit uint32 ids")
    files = prepare_inputs(inputs)
    if not files:
        raise DataError(f"no {'/'.join(PREPARE_SUFFIXES)} files found in {' '.join(inputs)}")
    separator = find_separator(tokenizer)
    sep_ids = np.array([separator[1]] if separator else [], dtype="<u4")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)

    digest = hashlib.sha256()
    stats = dict(files=0, bytes=0, tokens=0, undecodable=0)
    t0 = last_report = time.monotonic()

    def report(final: bool = False) -> None:
        dt = time.monotonic() - t0
        print(f"prepare: {stats['files']}/{len(files)} files, {stats['bytes'] / 1e6:.1f} MB, "
              f"{stats['tokens']:,} tokens, {stats['bytes'] / 1e6 / max(dt, 1e-9):.1f} MB/s"
              + (f", done in {dt:.1f}s" if final else ""), file=sys.stderr, flush=True)

    def encode_all(f) -> None:
        nonlocal last_report
        pending: List[str] = []
        pending_bytes = 0
        for i, path in enumerate(files):
            with open(path, "rb") as fh:
                raw = fh.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="replace")
                stats["undecodable"] += 1
            pending.append(text)
            pending_bytes += len(raw)
            if pending_bytes < batch_bytes and i + 1 < len(files):
                continue
            # encode_batch_fast: same ids as encode_batch, without computing character offsets we don't use.
            encodings = tokenizer.encode_batch_fast(pending, add_special_tokens=False)
            parts = []
            for enc in encodings:
                parts.append(np.asarray(enc.ids, dtype="<u4"))
                parts.append(sep_ids)
            chunk = np.concatenate(parts).tobytes()
            f.write(chunk)
            digest.update(chunk)
            stats["files"] += len(pending)
            stats["bytes"] += pending_bytes
            stats["tokens"] += len(chunk) // 4
            pending, pending_bytes = [], 0
            if time.monotonic() - last_report >= progress_every_s:
                report()
                last_report = time.monotonic()

    side = sidecar_path(out_path)
    # A sidecar from an earlier run must not sit next to the new bin even for a moment.
    if os.path.exists(side):
        os.remove(side)
    atomic_write(out_path, encode_all)
    meta = dict(vocab_size=vocab_size, n_tokens=stats["tokens"], dtype="uint32-le",
                tokenizer=os.path.abspath(tokenizer_path), tokenizer_sha256=sha256_file(tokenizer_path),
                separator=dict(token=separator[0], id=separator[1]) if separator else None,
                sources=[os.path.abspath(p) for p in inputs], n_files=len(files), n_text_bytes=stats["bytes"],
                n_files_with_invalid_utf8=stats["undecodable"], fingerprint=digest.hexdigest()[:16])
    atomic_write_json(side, meta, indent=2)
    report(final=True)
    return meta


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenise text files into a uint32 .bin + .json sidecar for data=memmap")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer.json")
    p.add_argument("--out", required=True, help="output .bin; the sidecar goes to <out>.json")
    p.add_argument("inputs", nargs="+", help="text files, or directories walked for *.txt, *.md, *.py")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.tokenizer, args.out, args.inputs)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {meta['n_tokens']:,} tokens, vocab_size={meta['vocab_size']}, "
          f"fingerprint={meta['fingerprint']}")
    return 0
