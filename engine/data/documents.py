"""Text and chat records, tokenized with the model's own tokenizer and packed by document into seq_len rows.

Input (`data.path`, `data.val_path`): one file, a folder of files of one format (walked recursively in sorted path
order, hidden files and folders skipped), or the name of a dataset in the local Hugging Face cache (its "train" split,
or its only one; loaded offline: HF_DATASETS_OFFLINE is set to 1 unless the environment sets it). Formats, by
extension: .json/.jsonl (JSON lines, or one JSON array of records), .parquet, .arrow, .csv, and .txt/.md (plain text:
one document per FILE, so a file is never cut at blank lines or newlines; data=text only). Everything is read with
`datasets.load_dataset`.

Records:
- data=text: a `text` string per record (or a plain text file). The document is the tokenizer's encoding of it (with
  the tokenizer's own special-token template, e.g. a BOS where it has one), followed by the EOS token of
  tokenizer_config.json unless the encoding already ends with it. Every token counts in the loss.
- data=chat: `messages` (a list of {role, content} strings), or `prompt` and `completion` (strings: the prompt is one
  user turn, the completion the assistant's answer; or lists of messages, TRL's conversational form). Rendered with
  the tokenizer's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja) through
  transformers' `apply_chat_template`, then tokenized without adding special tokens (the template writes them).
  data.loss_on=assistant: only the tokens of assistant turns count: from the first token after the template's
  generation prompt to the turn's closing special token (ChatML's <|im_end|>, Llama 3's <|eot_id|>, ...); whitespace
  the template writes after that token does not count. Found by rendering prefixes of the conversation (up to the
  generation prompt of each assistant turn, up to its end) and tokenizing them: each must tokenize to a prefix of the
  whole conversation's tokens, else the record is refused as not prefix-stable. loss_on=all: every token counts.

Labels. A document of tokens t_0..t_{L-1} with counted flags c_i occupies L positions: position i has label t_{i+1}
if c_{i+1}, else IGNORE_INDEX; the last position of a document has IGNORE_INDEX (never predict across documents).

Packing. Documents longer than seq_len are cut into pieces of at most seq_len tokens, each its own document (positions
restart; the label at a piece's end is IGNORE_INDEX); the summary counts the documents cut. Pieces are packed by
best fit (the fullest row that still has room) in a seeded shuffled order into rows of exactly seq_len positions;
`doc_start_BT` holds, per position, the index in the row where its document starts. The space left at a row's end is
padding: ids = the EOS id (0 without one), labels IGNORE_INDEX, one document of its own (doc_start = where the padding
starts). Training rows are packed in an order seeded by the run seed; validation rows in a constant order.

Splits. `data.val_path` (same formats) is validation; without it, a held-out `val_fraction` of the documents (at
least one; chosen by a constant seed, so the validation set does not depend on the run seed) is. No document is in
both splits.

Order. As the token streams: `batch(split, index, batch_size)` takes rows index*B ... index*B+B-1 of an endless
sequence made of one permutation of the split's rows per epoch, seeded from (seed, epoch) for train and constant for
val, so resuming needs no data state.

Cache. Tokenization runs once (datasets.map, data.num_proc processes, 0: min(8, cores)) and its result is stored under
`data.cache_dir` (else $STREAMTRAIN_DATA_CACHE, else ~/.cache/streamtrain/data) in `<key>/`: ids.npy (uint32),
counted.npy (uint8 loss flags), doc_lens.npy (int64), meta.json; written into a temporary folder, each file fsynced,
then renamed into place (engine/fileio.py). The key is a sha256 over: a format version, the source kind (text/chat),
loss_on (chat only), the bytes of tokenizer.json, tokenizer_config.json and chat_template.jinja, and each input
file's relative path and content sha256 (files over HASH_CONTENT_MAX_BYTES: their absolute path, size and mtime
instead, so a multi-GB file is not re-read at every start), or, for a cached Hugging Face dataset, its name and
datasets' fingerprint. seq_len, the seed and val_fraction are not in the key: packing and the document split are
redone at every build (a few seconds per million documents).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from engine.batch import IGNORE_INDEX, Batch
from engine.data.corpus import SEPARATOR_NAMES, DataError, TokenData, _check_split, _check_vocab, _mix
from engine.fileio import fsync_dir, json_bytes, sha256_file, write_durable

CACHE_VERSION = 1
HASH_CONTENT_MAX_BYTES = 256 << 20
# extension -> datasets builder
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
           ".txt": "text", ".md": "text"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAP_BATCH = 256
# How many times tokenization ran in this process (a cache hit leaves it unchanged); for tests and diagnostics.
TOKENIZE_RUNS = 0


def _log(msg: str) -> None:
    print(f"data: {msg}", file=sys.stderr, flush=True)


def _datasets():
    """datasets, offline unless the environment says otherwise (HF_DATASETS_OFFLINE set by the user wins)."""
    user_set = "HF_DATASETS_OFFLINE" in os.environ
    if not user_set:
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    if not user_set:  # imported earlier, before the variable was set
        datasets.config.HF_HUB_OFFLINE = True
        datasets.config.HF_DATASETS_OFFLINE = True
    return datasets


def cache_root(data_cfg) -> Path:
    return Path(getattr(data_cfg, "cache_dir", None) or os.environ.get("STREAMTRAIN_DATA_CACHE")
                or Path.home() / ".cache" / "streamtrain" / "data")


# ----------------------------------------------------------------------------------------------------------------
# the tokenizer


def _token_content(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class DocTokenizer:
    """tokenizer.json + tokenizer_config.json of a directory: ids, EOS, the chat template. Picklable (for
    datasets.map's processes); the transformers tokenizer that renders the template is built lazily."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        path = Path(directory)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise DataError(f"tokenizer directory {str(path)!r}: no tokenizer.json there; set data.tokenizer=<dir "
                            "with tokenizer.json and tokenizer_config.json> or model.init=hf:<checkpoint dir>")
        self.dir = path
        self.tok = Tokenizer.from_file(str(tok_file))
        config_file = path / "tokenizer_config.json"
        try:
            self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except ValueError as e:
            raise DataError(f"{config_file}: not valid JSON ({e})") from e
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.max_id = max(vocab.values())
        self.vocab_size = self.max_id + 1
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.eos_token = _token_content(self.config.get("eos_token"))
        if self.eos_token is None:  # a tokenizer without a config: the usual document separators
            specials = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
            self.eos_token = next((n for n in SEPARATOR_NAMES if n in specials), None)
        self.eos_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        if self.eos_token and self.eos_id is None:
            raise DataError(f"{config_file}: eos_token {self.eos_token!r} is not in {tok_file}'s vocabulary")
        self.chat_template = self._chat_template(path)
        self._hf = None

    def _chat_template(self, path: Path) -> Optional[str]:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{name, template}, ...]: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if not template and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return template if isinstance(template, str) and template else None

    def files(self) -> List[Path]:
        return [self.dir / f for f in TOKENIZER_FILES if (self.dir / f).is_file()]

    def __getstate__(self):
        return dict(self.__dict__, _hf=None)

    def hf(self):
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            specials = {k: _token_content(self.config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                        "pad_token")}
            specials["eos_token"] = self.eos_token
            self._hf = PreTrainedTokenizerFast(tokenizer_object=self.tok,
                                               **{k: v for k, v in specials.items() if v is not None})
            self._hf.chat_template = self.chat_template
        return self._hf

    def render(self, messages: List[dict], add_generation_prompt: bool) -> str:
        return self.hf().apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, texts: List[str], add_special_tokens: bool) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


# ----------------------------------------------------------------------------------------------------------------
# records -> (ids, counted)


def _messages_problem(messages: Any, field: str) -> Optional[str]:
    if not isinstance(messages, list) or not messages:
        return f"'{field}' must be a non-empty list of {{role, content}} messages, got {type(messages).__name__}"
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return (f"'{field}'[{k}] must be a {{role, content}} message with string role and content, got "
                    f"{json.dumps(m, default=str)[:120]}")
    return None


def chat_messages(record: dict) -> Tuple[Optional[List[dict]], Optional[str]]:
    """(messages, None) for a chat record, or (None, why it is not one)."""
    if record.get("messages") is not None:
        problem = _messages_problem(record["messages"], "messages")
        return (None, problem) if problem else ([dict(role=m["role"], content=m["content"])
                                                 for m in record["messages"]], None)
    prompt, completion = record.get("prompt"), record.get("completion")
    if prompt is None and completion is None:
        return None, "a chat record needs 'messages' (a list of {role, content}) or 'prompt' and 'completion'"
    turns = []
    for field, value, role in (("prompt", prompt, "user"), ("completion", completion, "assistant")):
        if isinstance(value, str):
            turns.append(dict(role=role, content=value))
        elif isinstance(value, list):
            problem = _messages_problem(value, field)
            if problem:
                return None, problem
            turns.extend(dict(role=m["role"], content=m["content"]) for m in value)
        else:
            return None, (f"'{field}' must be a string (or a list of {{role, content}} messages), got "
                          f"{type(value).__name__}")
    return turns, None


def text_of(record: dict) -> Tuple[Optional[str], Optional[str]]:
    text = record.get("text")
    if not isinstance(text, str):
        return None, (f"a text record needs a 'text' string, got {type(text).__name__}" if "text" in record
                      and text is not None else "a text record needs a 'text' string; this one has none")
    return text, None


def tokenize_text(tok: DocTokenizer, text: str) -> Tuple[List[int], List[int]]:
    (ids,) = tok.encode([text], add_special_tokens=True)
    if not ids or ids[-1] != tok.eos_id:
        ids = ids + [tok.eos_id]
    return ids, [1] * len(ids)


def tokenize_chat(tok: DocTokenizer, messages: List[dict], loss_on: str) -> Tuple[List[int], List[int]]:
    """ids and counted flags of one conversation; raises ValueError (with the reason) if the template is not
    prefix-stable."""
    full = tok.render(messages, add_generation_prompt=False)
    if loss_on == "all":
        ids = tok.encode([full], add_special_tokens=False)[0]
        return ids, [1] * len(ids)
    bounds = []  # (start prefix, end prefix) of each assistant turn, as rendered text
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            bounds.append((tok.render(messages[:i], add_generation_prompt=True),
                           tok.render(messages[:i + 1], add_generation_prompt=False), i))
    texts = [full] + [p for b in bounds for p in b[:2]]
    for b in bounds:
        for p in b[:2]:
            if not full.startswith(p):
                raise ValueError(f"the chat template is not prefix-stable: the conversation rendered up to message "
                                 f"{b[2]} is not a prefix of the whole rendering, so the assistant tokens cannot be "
                                 "located; use data.loss_on=all or a template that renders earlier turns the same")
    encoded = tok.encode(texts, add_special_tokens=False)
    ids = encoded[0]
    counted = [0] * len(ids)
    for k, b in enumerate(bounds):
        start_ids, end_ids = encoded[1 + 2 * k], encoded[2 + 2 * k]
        for p in (start_ids, end_ids):
            if ids[:len(p)] != p:
                raise ValueError(f"the chat template and tokenizer are not prefix-stable: the conversation rendered "
                                 f"up to message {b[2]} does not tokenize to a prefix of the whole conversation's "
                                 "tokens, so the assistant tokens cannot be located; use data.loss_on=all")
        start, end = len(start_ids), len(end_ids)
        last_special = max((j for j in range(start, end) if ids[j] in tok.special_ids), default=None)
        if last_special is not None and tok.tok.decode(ids[last_special + 1:end], skip_special_tokens=False).strip() \
                == "":
            end = last_special + 1  # the newline after the closing token is the template's, not the answer's
        for j in range(start, end):
            counted[j] = 1
    return ids, counted


class _Tokenize:
    """datasets.map function (batched): records -> ids, counted, error (empty when the record is fine)."""

    def __init__(self, tok: DocTokenizer, kind: str, loss_on: str):
        self.tok, self.kind, self.loss_on = tok, kind, loss_on

    def __call__(self, batch: Dict[str, list]) -> Dict[str, list]:
        n = len(next(iter(batch.values())))
        out = dict(ids=[], counted=[], error=[])
        for r in range(n):
            record = {k: v[r] for k, v in batch.items()}
            try:
                if self.kind == "text":
                    text, problem = text_of(record)
                    if problem:
                        raise ValueError(problem)
                    ids, counted = tokenize_text(self.tok, text)
                else:
                    messages, problem = chat_messages(record)
                    if problem:
                        raise ValueError(problem)
                    ids, counted = tokenize_chat(self.tok, messages, self.loss_on)
                error = ""
            except Exception as e:  # reported with the file and line by the caller
                ids, counted, error = [], [], f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            out["ids"].append(ids)
            out["counted"].append(counted)
            out["error"].append(error)
        return out


# ----------------------------------------------------------------------------------------------------------------
# inputs


class Source:
    """One input: its files and datasets builder, or a dataset name in the HF cache."""

    def __init__(self, path: str, kind: str, setting: str):
        self.path, self.kind, self.setting = path, kind, setting
        self.files: List[str] = []
        self.builder: Optional[str] = None
        self.hub_name: Optional[str] = None
        accepted = ", ".join(sorted(FORMATS))
        if os.path.isdir(path):
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                found.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith("."))
            found.sort()
            if not found:
                raise DataError(f"{setting}={path!r}: the folder holds no files; it needs {accepted} files")
            for f in found:
                if Path(f).suffix.lower() not in FORMATS:
                    raise DataError(f"{f}: unknown extension {Path(f).suffix!r}; {setting} files must be one of "
                                    f"{accepted}")
            builders = {FORMATS[Path(f).suffix.lower()] for f in found}
            if len(builders) > 1:
                raise DataError(f"{setting}={path!r}: the folder mixes formats ({', '.join(sorted(builders))}); "
                                "put one format per folder")
            self.files, self.builder = found, builders.pop()
        elif os.path.isfile(path):
            suffix = Path(path).suffix.lower()
            if suffix not in FORMATS:
                raise DataError(f"{path}: unknown extension {suffix!r}; {setting} files must be one of {accepted}")
            self.files, self.builder = [path], FORMATS[suffix]
        elif path.startswith((".", "/", "~")) or path.count("/") > 1 or Path(path).suffix.lower() in FORMATS:
            raise DataError(f"{setting}={path!r}: no such file or folder")
        else:
            self.hub_name = path
        if self.builder == "text" and kind == "chat":
            raise DataError(f"{setting}={path!r}: plain text files hold no chat records; data=chat needs "
                            "json/jsonl/parquet/arrow/csv records with 'messages' or 'prompt'/'completion'")

    def load(self, tmp_cache: Path):
        datasets = _datasets()
        if self.hub_name is not None:
            try:
                ds = datasets.load_dataset(self.hub_name)
            except Exception as e:
                raise DataError(f"{self.setting}={self.path!r}: not a file or folder, and not a dataset in the local "
                                f"Hugging Face cache (read offline; {type(e).__name__}: {str(e)[:300]}); pass a "
                                "json/jsonl/parquet/arrow/csv/txt file or folder, or download the dataset first") \
                    from e
            if isinstance(ds, datasets.DatasetDict):
                split = "train" if "train" in ds else next(iter(ds)) if len(ds) == 1 else None
                if split is None:
                    raise DataError(f"{self.setting}={self.path!r}: the dataset has splits {', '.join(ds)} and no "
                                    "'train'")
                ds = ds[split]
            return ds
        kwargs = dict(sample_by="document") if self.builder == "text" else {}
        try:
            return datasets.load_dataset(self.builder, data_files=self.files, split="train",
                                         cache_dir=str(tmp_cache), **kwargs)
        except Exception as e:
            if self.builder == "json":
                locate_json_problem(self.files, self.kind)
            raise DataError(f"{self.setting}={self.path!r}: cannot read {', '.join(self.files[:3])}"
                            f"{' ...' if len(self.files) > 3 else ''} as {self.builder} "
                            f"({type(e).__name__}: {str(e)[:400]})") from e

    def key_parts(self) -> List[Any]:
        if self.hub_name is not None:
            return ["hub", self.hub_name]
        parts: List[Any] = [self.builder]
        base = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        for f in self.files:
            st = os.stat(f)
            if st.st_size > HASH_CONTENT_MAX_BYTES:
                parts.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
            else:
                parts.append([os.path.relpath(f, base), sha256_file(f)])
        return parts

    def locate(self, row: int) -> str:
        """'<file>:<line>' (JSON lines) or '<file>, record <n>' of the dataset's row-th record (0-based)."""
        if self.hub_name is not None:
            return f"{self.path} (cached dataset), record {row + 1}"
        if self.builder == "text":
            return f"{self.files[row]}"
        remaining = row
        for f in self.files:
            n, lines = _count_records(f, self.builder)
            if remaining < n:
                if lines is not None:
                    return f"{f}:{lines[remaining]}"
                return f"{f}, record {remaining + 1}" + (f" (line {remaining + 2} counting the header)"
                                                         if self.builder == "csv" else "")
            remaining -= n
        return f"{self.path}, record {row + 1}"


def _json_lines(f: str) -> Optional[List[Tuple[int, str]]]:
    """(line number, text) of each non-blank line if the file is JSON lines (not one JSON document), else None."""
    with open(f, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return None
    return [(k + 1, line) for k, line in enumerate(text.splitlines()) if line.strip()]


def _count_records(f: str, builder: str) -> Tuple[int, Optional[List[int]]]:
    """Records in one file, and for JSON lines the line number of each."""
    if builder == "json":
        lines = _json_lines(f)
        if lines is not None:
            return len(lines), [k for k, _ in lines]
        with open(f) as fh:
            return len(json.load(fh)), None
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(f).metadata.num_rows, None
    ds = _datasets().load_dataset(builder, data_files=[f], split="train")
    return ds.num_rows, None


def locate_json_problem(files: Sequence[str], kind: str) -> None:
    """After datasets failed to read JSON files: the first line that is not valid JSON, or whose record is not a
    valid `kind` record, as a DataError naming the file and line. Returns if none is found."""
    for f in files:
        lines = _json_lines(f)
        if lines is None:
            try:
                with open(f) as fh:
                    records = json.load(fh)
            except ValueError as e:
                raise DataError(f"{f}:{getattr(e, 'lineno', '?')}: not valid JSON ({e})") from e
            located = [(f"{f}, record {k + 1}", r) for k, r in enumerate(records if isinstance(records, list)
                                                                          else [records])]
        else:
            located = []
            for k, line in lines:
                try:
                    located.append((f"{f}:{k}", json.loads(line)))
                except ValueError as e:
                    raise DataError(f"{f}:{k}: not valid JSON ({e})") from e
        for where, record in located:
            problem = _record_problem(record, kind)
            if problem:
                raise DataError(f"{where}: {problem}")


def _record_problem(record: Any, kind: str) -> Optional[str]:
    if not isinstance(record, dict):
        return f"a record must be a JSON object, got {type(record).__name__}"
    return text_of(record)[1] if kind == "text" else chat_messages(record)[1]


# ----------------------------------------------------------------------------------------------------------------
# tokenize + cache


def _num_proc(data_cfg, n_records: int) -> int:
    n = int(getattr(data_cfg, "num_proc", 0) or 0) or min(8, os.cpu_count() or 1)
    return max(1, min(n, n_records // 1000 or 1))  # a process per thousand records at least: small inputs run inline


def tokenize_source(source: Source, tok: DocTokenizer, kind: str, loss_on: str, data_cfg) -> Tuple[Dict, str]:
    """The cached tokenization of one input: dict(ids, counted, doc_lens, meta), and its key."""
    global TOKENIZE_RUNS
    parts = [CACHE_VERSION, kind, loss_on if kind == "chat" else None,
             [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in tok.files()], source.key_parts()]
    root = cache_root(data_cfg)
    tmp_cache = root / f"tmp-datasets-{os.getpid()}-{time.monotonic_ns()}"
    ds = None
    if source.hub_name is not None:  # its fingerprint is known only once loaded
        ds = source.load(tmp_cache)
        parts.append(ds._fingerprint)
    key = hashlib.sha256(repr(parts).encode()).hexdigest()
    entry = root / key
    if (entry / "meta.json").is_file():
        try:
            loaded = dict(meta=json.loads((entry / "meta.json").read_text()),
                          **{n: np.load(entry / f"{n}.npy", mmap_mode="r") for n in ("ids", "counted", "doc_lens")})
            _log(f"{source.setting}={source.path}: tokenized data from the cache ({entry})")
            return loaded, key
        except (OSError, ValueError) as e:
            _log(f"{entry}: unreadable cache entry ({e}); tokenizing again")
    try:
        if ds is None:
            ds = source.load(tmp_cache)
        ds = _tokenized(ds, source, tok, kind, loss_on, data_cfg, tmp_cache)
        TOKENIZE_RUNS += 1
        result = _flatten(ds, source)
    finally:
        shutil.rmtree(tmp_cache, ignore_errors=True)
    result["meta"] = dict(version=CACHE_VERSION, kind=kind, loss_on=loss_on if kind == "chat" else None,
                          path=os.path.abspath(source.path) if source.hub_name is None else source.path,
                          files=len(source.files), tokenizer=str(tok.dir.resolve()),
                          n_documents=int(len(result["doc_lens"])), n_tokens=int(len(result["ids"])),
                          n_counted=int(result["counted"].sum(dtype=np.int64)))
    _store(entry, result)
    return result, key


def _tokenized(ds, source: Source, tok: DocTokenizer, kind: str, loss_on: str, data_cfg, tmp_cache: Path):
    datasets = _datasets()
    if kind == "text" and "text" not in ds.column_names or kind == "chat" and "messages" not in ds.column_names \
            and not {"prompt", "completion"} <= set(ds.column_names):
        need = "a 'text' field" if kind == "text" else "a 'messages' field, or 'prompt' and 'completion'"
        raise DataError(f"{source.setting}={source.path!r}: data={kind} needs records with {need}; the records have "
                        f"{', '.join(ds.column_names) or 'no fields'}")
    if ds.num_rows == 0:
        raise DataError(f"{source.setting}={source.path!r}: holds no records")
    features = datasets.Features(ids=datasets.List(datasets.Value("uint32")),
                                 counted=datasets.List(datasets.Value("uint8")), error=datasets.Value("string"))
    num_proc = _num_proc(data_cfg, ds.num_rows)
    extra = {}
    if source.hub_name is not None:  # not next to the dataset in the HF cache: in the build's scratch folder
        tmp_cache.mkdir(parents=True, exist_ok=True)
        extra = dict(cache_file_name=str(tmp_cache / "tokenized.arrow"))
    _log(f"{source.setting}={source.path}: tokenizing {ds.num_rows:,} records ({kind}, {num_proc} process"
         f"{'es' if num_proc > 1 else ''})")
    return ds.map(_Tokenize(tok, kind, loss_on), batched=True, batch_size=MAP_BATCH, remove_columns=ds.column_names,
                  features=features, num_proc=num_proc if num_proc > 1 else None, load_from_cache_file=False,
                  desc=f"tokenizing {kind}", **extra)


def _flatten(ds, source: Source) -> Dict[str, np.ndarray]:
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    errors = table.column("error")
    bad = pc.not_equal(errors, "")
    if pc.any(bad).as_py():
        row = int(pc.index(bad, True).as_py())
        raise DataError(f"{source.locate(row)}: {errors[row].as_py()}")
    ids_col, counted_col = table.column("ids"), table.column("counted")
    doc_lens = np.asarray(pc.list_value_length(ids_col).to_numpy(zero_copy_only=False), dtype=np.int64)
    ids = np.concatenate([c.flatten().to_numpy(zero_copy_only=False) for c in ids_col.chunks]).astype(np.uint32)
    counted = np.concatenate([c.flatten().to_numpy(zero_copy_only=False)
                              for c in counted_col.chunks]).astype(np.uint8)
    if len(ids) != doc_lens.sum() or len(counted) != len(ids):
        raise DataError(f"{source.path}: internal error, tokenized columns disagree in length")
    return dict(ids=ids, counted=counted, doc_lens=doc_lens)


def _store(entry: Path, result: Dict) -> None:
    """Into `<entry>.tmp-<pid>/`, every file fsynced, then renamed to `entry` (a concurrent writer of the same key
    loses the race harmlessly: the content is the same)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in ("ids", "counted", "doc_lens"):
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, result[name])
                f.flush()
                os.fsync(f.fileno())
        write_durable(tmp / "meta.json", json_bytes(result["meta"]))
        fsync_dir(tmp)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process stored the same entry first
            if not (entry / "meta.json").is_file():
                raise
        fsync_dir(entry.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# packing + serving


def _pieces(doc_starts: np.ndarray, doc_lens: np.ndarray, seq_len: int) -> Tuple[np.ndarray, np.ndarray, int]:
    """(start, length) of every piece of at most seq_len tokens, and how many documents were cut."""
    n_pieces = np.maximum(1, -(-doc_lens // seq_len))
    piece_doc = np.repeat(np.arange(len(doc_lens)), n_pieces)
    first_piece = np.cumsum(n_pieces) - n_pieces
    within = np.arange(len(piece_doc)) - first_piece[piece_doc]
    starts = doc_starts[piece_doc] + within * seq_len
    lens = np.minimum(seq_len, doc_lens[piece_doc] - within * seq_len)
    return starts.astype(np.int64), lens.astype(np.int64), int((n_pieces > 1).sum())


def pack(lens: np.ndarray, seq_len: int, order_seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Best-fit packing of pieces (each <= seq_len) in a seeded shuffled order: (piece indices grouped by row,
    row pointers [n_rows + 1]). Deterministic in (lens, seq_len, order_seed)."""
    g = np.random.default_rng(order_seed)
    order = g.permutation(len(lens))
    free_caps: List[int] = []  # sorted distinct remaining capacities that some row has
    rows_with: Dict[int, List[int]] = {}
    row_items: List[List[int]] = []
    for p in order.tolist():
        length = int(lens[p])
        k = bisect.bisect_left(free_caps, length)
        if k < len(free_caps):
            cap = free_caps[k]
            row = rows_with[cap].pop()
            if not rows_with[cap]:
                del rows_with[cap]
                free_caps.pop(k)
        else:
            cap, row = seq_len, len(row_items)
            row_items.append([])
        row_items[row].append(p)
        left = cap - length
        if left > 0:
            if left not in rows_with:
                rows_with[left] = []
                bisect.insort(free_caps, left)
            rows_with[left].append(row)
    ptr = np.zeros(len(row_items) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in row_items])
    flat = np.fromiter((p for r in row_items for p in r), dtype=np.int64, count=int(ptr[-1]))
    return flat, ptr


class _Split:
    def __init__(self, ids, counted, starts: np.ndarray, lens: np.ndarray, seq_len: int, order_seed: int):
        self.ids, self.counted = ids, counted
        self.piece_starts, self.piece_lens = starts, lens
        self.rows, self.ptr = pack(lens, seq_len, order_seed)
        self.n_rows = len(self.ptr) - 1
        self.n_tokens = int(lens.sum())


class DocumentData(TokenData):
    """Packed text/chat documents; batch() returns Batch(ids, labels, doc_start)."""

    def __init__(self, splits: Dict[str, _Split], *, seq_len: int, seed: int, vocab_size: int, pad_id: int,
                 fingerprint: str, description: dict):
        self._splits = splits
        self.pad_id = pad_id
        super().__init__(seq_len=seq_len, seed=seed, vocab_size=vocab_size, fingerprint=fingerprint,
                         description=description)

    def num_sequences(self, split: str) -> int:
        _check_split(split)
        return self._splits[split].n_rows

    def row_indices(self, split: str, index: int, batch_size: int) -> np.ndarray:
        """Which packed rows batch(split, index, batch_size) holds, in order (for audits and tests)."""
        _check_split(split)
        return self._order(split, index * batch_size, batch_size)

    def row_pieces(self, split: str, row: int) -> List[Tuple[int, int]]:
        """(start in the split's token array, length) of each document piece of a packed row, in row order."""
        s = self._splits[split]
        return [(int(s.piece_starts[p]), int(s.piece_lens[p])) for p in s.rows[s.ptr[row]:s.ptr[row + 1]]]

    def _batch(self, split: str, first: int, count: int) -> Batch:
        s = self._splits[split]
        T = self.seq_len
        ids = np.full((count, T), self.pad_id, dtype=np.int64)
        labels = np.full((count, T), IGNORE_INDEX, dtype=np.int64)
        doc_start = np.zeros((count, T), dtype=np.int32)
        for b, row in enumerate(self._order(split, first, count).tolist()):
            at = 0
            for start, length in self.row_pieces(split, row):
                tok = np.asarray(s.ids[start:start + length], dtype=np.int64)
                ids[b, at:at + length] = tok
                nxt = np.asarray(s.counted[start + 1:start + length], dtype=bool)
                labels[b, at:at + length - 1] = np.where(nxt, tok[1:], IGNORE_INDEX)
                doc_start[b, at:at + length] = at
                at += length
            doc_start[b, at:] = at  # padding: one document of its own
        return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(doc_start))


def _resolve_tokenizer(data_cfg, tokenizer_dir: Optional[str], kind: str) -> DocTokenizer:
    directory = getattr(data_cfg, "tokenizer", None) or tokenizer_dir
    if not directory:
        raise DataError(f"data={kind} tokenizes with the model's tokenizer: set data.tokenizer=<dir with "
                        "tokenizer.json> or model.init=hf:<checkpoint dir>")
    return DocTokenizer(directory)


def load_documents(data_cfg, seq_len: int, seed: int, model_vocab_size: int, *,
                   tokenizer_dir: Optional[str] = None) -> DocumentData:
    kind = data_cfg.name
    loss_on = getattr(data_cfg, "loss_on", None) or "assistant"
    if loss_on not in ("assistant", "all"):
        raise DataError(f"data.loss_on={loss_on!r} is not valid; choose one of assistant, all")
    path = getattr(data_cfg, "path", None)
    if not path:
        raise DataError(f"data={kind} needs data.path=<a json/jsonl/parquet/arrow/csv/txt file, a folder of them, or "
                        "a dataset name in the local Hugging Face cache>")
    tok = _resolve_tokenizer(data_cfg, tokenizer_dir, kind)
    _check_vocab(kind, tok.vocab_size, model_vocab_size, getattr(data_cfg, "vocab_size", None))
    if kind == "text" and tok.eos_id is None:
        raise DataError(f"{tok.dir}: the tokenizer has no EOS token (tokenizer_config.json's eos_token), which "
                        "data=text ends every document with")
    if kind == "chat" and tok.chat_template is None:
        raise DataError(f"{tok.dir}: no chat template (tokenizer_config.json's chat_template or chat_template.jinja);"
                        " data=chat renders records with it")
    val_path = getattr(data_cfg, "val_path", None)
    sources = {"train": Source(path, kind, "data.path")}
    if val_path:
        sources["val"] = Source(val_path, kind, "data.val_path")
    t0 = time.monotonic()
    tokenized, keys = {}, {}
    for split, source in sources.items():
        tokenized[split], keys[split] = tokenize_source(source, tok, kind, loss_on, data_cfg)

    def doc_starts(lens):
        return np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if len(lens) else lens

    splits_docs: Dict[str, Tuple[Dict, np.ndarray]] = {}
    train = tokenized["train"]
    all_lens = np.asarray(train["doc_lens"], dtype=np.int64)
    if val_path:
        splits_docs["train"] = (train, np.arange(len(all_lens)))
        splits_docs["val"] = (tokenized["val"], np.arange(len(tokenized["val"]["doc_lens"])))
    else:
        n_docs = len(all_lens)
        n_val = max(1, int(round(n_docs * data_cfg.val_fraction)))
        if n_docs - n_val < 1:
            raise DataError(f"data.path={path!r} holds {n_docs} document{'s' if n_docs != 1 else ''}: too few to hold "
                            f"out val_fraction={data_cfg.val_fraction} of them (at least one) and train on the rest; "
                            "add documents or set data.val_path")
        perm = np.random.default_rng(_mix("val-documents")).permutation(n_docs)
        splits_docs["val"] = (train, np.sort(perm[:n_val]))
        splits_docs["train"] = (train, np.sort(perm[n_val:]))

    splits, stats = {}, {}
    for split in ("train", "val"):
        data, docs = splits_docs[split]
        lens = np.asarray(data["doc_lens"], dtype=np.int64)
        starts, piece_lens, n_cut = _pieces(doc_starts(lens)[docs], lens[docs], seq_len)
        order_seed = _mix("pack", seed) if split == "train" else _mix("pack-val")
        splits[split] = _Split(data["ids"], data["counted"], starts, piece_lens, seq_len, order_seed)
        n_tokens = int(lens[docs].sum())
        # a position is masked unless its next token counts: documents' last tokens and uncounted tokens
        n_labels = _count_labels(data["counted"], doc_starts(lens), lens, docs, starts)
        stats[split] = dict(documents=int(len(docs)), tokens=n_tokens, labels=n_labels, documents_cut=n_cut,
                            rows=splits[split].n_rows, padding=splits[split].n_rows * seq_len - n_tokens)
    if val_path:
        fingerprint_parts = [keys["train"], keys["val"]]
    else:
        fingerprint_parts = [keys["train"], float(data_cfg.val_fraction)]
    fingerprint = hashlib.sha256(repr(fingerprint_parts).encode()).hexdigest()[:16]
    total_tokens = sum(s["tokens"] for s in stats.values())
    total_labels = sum(s["labels"] for s in stats.values())
    total_slots = sum(s["rows"] for s in stats.values()) * seq_len
    description = dict(source=kind, path=path, val_path=val_path, tokenizer=str(tok.dir), loss_on=loss_on
                       if kind == "chat" else None, cache_keys=keys, seq_len=seq_len, seed=seed,
                       vocab_size=tok.vocab_size, eos_id=tok.eos_id, val_fraction=None if val_path else
                       data_cfg.val_fraction, n_documents=sum(s["documents"] for s in stats.values()),
                       n_tokens=total_tokens, masked_share=round(1 - total_labels / max(total_tokens, 1), 6),
                       n_documents_cut=sum(s["documents_cut"] for s in stats.values()),
                       padding_share=round(1 - total_tokens / max(total_slots, 1), 6),
                       n_train_seqs=stats["train"]["rows"], n_val_seqs=stats["val"]["rows"],
                       splits=stats, fingerprint=fingerprint)
    for split in ("train", "val"):
        s = stats[split]
        _log(f"data={kind} {split}: {s['documents']:,} documents, {s['tokens']:,} tokens, "
             f"{1 - s['labels'] / max(s['tokens'], 1):.1%} of positions masked, {s['documents_cut']:,} documents "
             f"cut at seq_len={seq_len}, {s['rows']:,} rows, {s['padding'] / max(s['rows'] * seq_len, 1):.1%} "
             "padding")
    _log(f"data={kind}: ready in {time.monotonic() - t0:.1f}s (fingerprint {fingerprint})")
    return DocumentData(splits, seq_len=seq_len, seed=seed, vocab_size=tok.vocab_size,
                        pad_id=tok.eos_id if tok.eos_id is not None else 0, fingerprint=fingerprint,
                        description=description)


def _count_labels(counted, doc_starts: np.ndarray, doc_lens: np.ndarray, docs: np.ndarray,
                  piece_starts: np.ndarray) -> int:
    """Positions with a label: the counted tokens of the documents `docs` (indices into doc_starts/doc_lens, which
    tile the token array), less each piece's first token (nothing in its piece predicts it)."""
    if not len(docs):
        return 0
    counted = np.asarray(counted, dtype=np.uint8)
    per_doc = np.add.reduceat(counted, doc_starts, dtype=np.int64) if len(counted) else np.zeros(len(doc_starts))
    per_doc[doc_lens == 0] = 0
    return int(per_doc[docs].sum()) - int(np.asarray(counted[piece_starts], dtype=np.int64).sum())
