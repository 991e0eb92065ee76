"""Token data: where training sequences come from, behind one `TokenData` interface whose `batch(split, index,
batch_size)` returns an `engine.batch.Batch` and is a pure function of (seed, split, index, batch_size).

- corpus.py: the token streams, cut into windows: stdlib (bytes), memmap (ids written by `python -m engine.data
  prepare`), synthetic (random ids).
- documents.py: text and chat records (json/jsonl/parquet/arrow/csv/txt, or a cached Hugging Face dataset), tokenized
  with the model's tokenizer (chat: its chat template, the loss on the assistant turns), cached, and packed by
  document into seq_len rows with per-token document starts.
"""

from __future__ import annotations

from typing import Optional

from engine.data.corpus import (CORPUS_SOURCES, LOADERS, PREPARE_SUFFIXES, SEPARATOR_NAMES, SPLITS,
                                SYNTHETIC_TRAIN_SEQS, SYNTHETIC_VAL_SEQS, CorpusData, DataError, SyntheticData,
                                TokenData, find_separator, main, prepare, prepare_inputs, sidecar_path, stdlib_files)

DOCUMENT_SOURCES = ("text", "chat")
SOURCES = CORPUS_SOURCES + DOCUMENT_SOURCES

__all__ = ["SOURCES", "CORPUS_SOURCES", "DOCUMENT_SOURCES", "SPLITS", "PREPARE_SUFFIXES", "SEPARATOR_NAMES",
           "SYNTHETIC_TRAIN_SEQS", "SYNTHETIC_VAL_SEQS", "DataError", "TokenData", "CorpusData", "SyntheticData",
           "build_data", "find_separator", "main", "prepare", "prepare_inputs", "sidecar_path", "stdlib_files"]


def build_data(data_cfg, seq_len: int, seed: int, model_vocab_size: int, *,
               tokenizer_dir: Optional[str] = None) -> TokenData:
    """The TokenData described by data_cfg (DataConfig's fields; a plain namespace with the fields a source reads
    does too), cut or packed into seq_len rows. tokenizer_dir: for text/chat, the directory of the model's tokenizer
    (the trainer passes model.init=hf:<dir>'s dir); data.tokenizer wins when set. Raises DataError for anything that
    cannot be served, before reading a corpus where it can."""
    name = getattr(data_cfg, "name", None)
    if name not in SOURCES:
        raise DataError(f"data.name={name!r} is not valid; choose one of {', '.join(SOURCES)}")
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    val_fraction = getattr(data_cfg, "val_fraction", None)
    if val_fraction is None or not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction={val_fraction} must be within (0, 1)")
    if name in DOCUMENT_SOURCES:
        from engine.data import documents  # imports datasets/transformers: only for the sources that need them

        return documents.load_documents(data_cfg, seq_len, seed, model_vocab_size, tokenizer_dir=tokenizer_dir)
    return LOADERS[name](data_cfg, seq_len, seed, model_vocab_size)
