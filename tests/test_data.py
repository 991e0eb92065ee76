import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.data import DataError, build_data

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 4096  # long windows keep the stdlib split small enough to walk a whole epoch quickly


def cfg(name="stdlib", path=None, val_fraction=0.02, vocab_size=None):
    return SimpleNamespace(name=name, path=path, val_fraction=val_fraction, vocab_size=vocab_size)


@pytest.fixture(scope="module")
def stdlib():
    return build_data(cfg(), SEQ_LEN, seed=0, model_vocab_size=32000)


# ------------------------------------------------------------ stdlib


def test_stdlib_shapes_and_labels_follow_stream(stdlib):
    assert stdlib.vocab_size == 256
    for split in ("train", "val"):
        b = stdlib.batch(split, 3, 5)
        ids, labels = b.ids_BT, b.labels_BT
        assert b.doc_start_BT is None
        assert ids.shape == labels.shape == (5, SEQ_LEN)
        assert ids.dtype == labels.dtype == torch.int64 and ids.device.type == "cpu"
        for row, start in enumerate(stdlib.window_starts(split, 3, 5)):
            window = torch.from_numpy(stdlib.tokens[start:start + SEQ_LEN + 1].astype(np.int64))
            assert torch.equal(ids[row], window[:-1]) and torch.equal(labels[row], window[1:])


def test_stdlib_deterministic_and_seeded(stdlib):
    again = build_data(cfg(), SEQ_LEN, seed=0, model_vocab_size=32000)
    other = build_data(cfg(), SEQ_LEN, seed=1, model_vocab_size=32000)
    assert again.fingerprint == stdlib.fingerprint == other.fingerprint
    assert len(stdlib.fingerprint) == 16 and int(stdlib.fingerprint, 16) >= 0
    assert again.description == stdlib.description
    json.dumps(stdlib.description)
    for index in (0, 7):
        a, b = stdlib.batch("train", index, 4), again.batch("train", index, 4)
        assert torch.equal(a.ids_BT, b.ids_BT) and torch.equal(a.labels_BT, b.labels_BT)
    assert not np.array_equal(stdlib.window_starts("train", 0, 16), other.window_starts("train", 0, 16))
    # Validation does not depend on the run seed, so val losses compare across runs.
    assert np.array_equal(stdlib.window_starts("val", 0, 16), other.window_starts("val", 0, 16))


def test_stdlib_splits_disjoint(stdlib):
    ends = {}
    for split in ("train", "val"):
        n = stdlib.num_sequences(split)
        starts = np.sort(stdlib.window_starts(split, 0, n))
        assert np.all(np.diff(starts) == SEQ_LEN)  # one epoch: every window exactly once
        ends[split] = (starts[0], starts[-1] + SEQ_LEN + 1)
    assert ends["train"][1] <= ends["val"][0]
    assert ends["val"][1] <= len(stdlib.tokens)
    d = stdlib.description
    assert d["n_train_seqs"] == stdlib.num_sequences("train") and d["n_val_seqs"] == stdlib.num_sequences("val")
    assert d["n_tokens"] == len(stdlib.tokens) and d["n_files"] > 100


def test_stdlib_wraps_into_reshuffled_epoch(stdlib):
    n = stdlib.num_sequences("train")
    batch_size = 1000
    assert n % batch_size
    epochs = np.concatenate([stdlib.window_starts("train", i, batch_size) for i in range(2 * n // batch_size + 1)])
    first, second = epochs[:n], epochs[n:2 * n]
    assert np.array_equal(np.sort(first), np.sort(second))
    assert not np.array_equal(first, second)
    # The batch straddling the boundary holds the tail of epoch 0 and the head of epoch 1.
    boundary = n // batch_size
    ids = stdlib.batch("train", boundary, batch_size).ids_BT
    tail = n - boundary * batch_size
    start = second[0]
    assert torch.equal(ids[tail], torch.from_numpy(stdlib.tokens[start:start + SEQ_LEN].astype(np.int64)))
    # Validation repeats the same order every pass.
    n_val = stdlib.num_sequences("val")
    assert np.array_equal(stdlib.window_starts("val", 1, n_val), stdlib.window_starts("val", 0, n_val))


# ------------------------------------------------------------ memmap

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor".split()


def _train_tokenizer(path: Path, specials):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainers.WordLevelTrainer(special_tokens=["[UNK]", *specials]))
    tok.save(str(path))
    return tok


def _prepare(tokenizer: Path, out: Path, *inputs: Path):
    return subprocess.run([sys.executable, "-m", "engine.data", "prepare", "--tokenizer", str(tokenizer),
                           "--out", str(out), *map(str, inputs)], cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("memmap")
    text_dir = root / "text"
    (text_dir / "sub").mkdir(parents=True)
    (text_dir / ".hidden").mkdir()
    rng = np.random.default_rng(0)
    for name in ("b.txt", "a.md", "sub/c.py", "sub/ünknown word.txt"):
        (text_dir / name).write_text(" ".join(rng.choice(WORDS + ["zebra"], size=300)) + "\n")
    (text_dir / "skipped.json").write_text("quick quick quick")
    (text_dir / ".hidden" / "x.txt").write_text("quick quick quick")
    tok_path = root / "tokenizer.json"
    tok = _train_tokenizer(tok_path, ["<|endoftext|>"])
    out = root / "tokens.bin"
    result = _prepare(tok_path, out, text_dir)
    assert result.returncode == 0, result.stderr
    files = sorted(str(p) for p in text_dir.rglob("*")
                   if p.suffix in (".txt", ".md", ".py") and ".hidden" not in p.parts)
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for f in files for i in tok.encode(Path(f).read_text(), add_special_tokens=False).ids + [eos]]
    return SimpleNamespace(root=root, out=out, tok=tok, tok_path=tok_path, text_dir=text_dir, expected=expected,
                           n_files=len(files), stderr=result.stderr)


def test_memmap_tokens_match_tokenizer(corpus):
    assert np.array_equal(np.fromfile(corpus.out, dtype="<u4"), corpus.expected)
    meta = json.loads(Path(str(corpus.out) + ".json").read_text())
    assert meta["n_tokens"] == len(corpus.expected) and meta["n_files"] == corpus.n_files == 4
    assert meta["vocab_size"] == corpus.tok.get_vocab_size()
    assert meta["separator"] == {"token": "<|endoftext|>", "id": corpus.tok.token_to_id("<|endoftext|>")}
    assert "prepare:" in corpus.stderr
    assert not Path(str(corpus.out) + ".tmp").exists()

    data = build_data(cfg("memmap", str(corpus.out), val_fraction=0.25), 8, seed=0, model_vocab_size=1000)
    assert isinstance(data.tokens, np.memmap)
    assert data.vocab_size == meta["vocab_size"] and data.fingerprint.startswith(meta["fingerprint"] + "-max")
    assert data.description["n_tokens"] == len(corpus.expected)
    b = data.batch("train", 2, 3)
    ids, labels = b.ids_BT, b.labels_BT
    assert ids.shape == (3, 8) and ids.dtype == torch.int64
    for row, start in enumerate(data.window_starts("train", 2, 3)):
        assert ids[row].tolist() == corpus.expected[start:start + 8]
        assert labels[row].tolist() == corpus.expected[start + 1:start + 9]
    assert data.window_starts("val", 0, data.num_sequences("val")).min() >= len(corpus.expected) * 0.75 - 1

    with pytest.raises(DataError, match="model.vocab_size=5"):
        build_data(cfg("memmap", str(corpus.out)), 8, seed=0, model_vocab_size=5)


def test_memmap_without_separator(tmp_path, corpus):
    tok_path = tmp_path / "plain.json"
    tok = _train_tokenizer(tok_path, [])
    text = corpus.text_dir / "b.txt"
    result = _prepare(tok_path, tmp_path / "t.bin", text, text)
    assert result.returncode == 0, result.stderr
    ids = tok.encode(text.read_text(), add_special_tokens=False).ids
    assert np.fromfile(tmp_path / "t.bin", dtype="<u4").tolist() == ids + ids


def _copy(corpus, tmp_path):
    bin_path = tmp_path / "tokens.bin"
    shutil.copy(corpus.out, bin_path)
    shutil.copy(str(corpus.out) + ".json", str(bin_path) + ".json")
    return bin_path


def test_memmap_errors_name_the_file(tmp_path, corpus):
    def load(p):
        return build_data(cfg("memmap", str(p), val_fraction=0.25), 8, seed=0, model_vocab_size=1000)

    with pytest.raises(DataError, match="prepare"):
        load(tmp_path / "absent.bin")
    with pytest.raises(DataError, match="data.path"):
        load(None)

    bin_path = _copy(corpus, tmp_path)
    side = Path(str(bin_path) + ".json")
    side.write_text('{"vocab_size": 20, "n_tok')
    with pytest.raises(DataError, match="corrupt sidecar") as e:
        load(bin_path)
    assert str(side) in str(e.value)
    side.unlink()
    with pytest.raises(DataError, match="missing") as e:
        load(bin_path)
    assert str(side) in str(e.value)

    bin_path = _copy(corpus, tmp_path)
    size = os.path.getsize(bin_path)
    os.truncate(bin_path, size - 4)
    with pytest.raises(DataError, match="n_tokens") as e:
        load(bin_path)
    assert str(bin_path) in str(e.value)
    os.truncate(bin_path, size - 6)
    with pytest.raises(DataError, match="uint32") as e:
        load(bin_path)
    assert str(bin_path) in str(e.value)

    result = _prepare(corpus.tok_path, tmp_path / "x.bin", tmp_path / "nothing-here")
    assert result.returncode == 2 and "nothing-here" in result.stderr


def test_memmap_ids_beyond_the_vocabulary_are_refused_when_opened(tmp_path, corpus):
    """A token file whose ids reach the vocabulary (not written by this tokenizer, or corrupt) is refused when the
    data is opened, naming the id, where it is and the limit, instead of crashing the embedding mid-run."""
    bin_path = _copy(corpus, tmp_path)
    meta = json.loads(Path(str(bin_path) + ".json").read_text())
    ids = np.fromfile(bin_path, dtype="<u4")
    good = build_data(cfg("memmap", str(bin_path), val_fraction=0.25), 8, seed=0, model_vocab_size=meta["vocab_size"])
    assert good.description["max_token_id"] == int(ids.max())
    assert good.fingerprint.endswith(f"-max{int(ids.max())}")
    ids[17] = meta["vocab_size"]
    ids.tofile(bin_path)
    with pytest.raises(DataError, match=rf"token id {meta['vocab_size']} \(first bad one at token 17\)") as e:
        build_data(cfg("memmap", str(bin_path), val_fraction=0.25), 8, seed=0, model_vocab_size=meta["vocab_size"])
    assert str(bin_path) in str(e.value)


# ------------------------------------------------------------ synthetic


def test_synthetic():
    data = build_data(cfg("synthetic", vocab_size=50), 16, seed=3, model_vocab_size=64)
    again = build_data(cfg("synthetic", vocab_size=50), 16, seed=3, model_vocab_size=64)
    other = build_data(cfg("synthetic", vocab_size=50), 16, seed=4, model_vocab_size=64)
    b = data.batch("train", 5, 4)
    ids, labels = b.ids_BT, b.labels_BT
    assert b.doc_start_BT is None
    assert ids.shape == (4, 16) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < 50 and int(labels.max()) < 50
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    assert torch.equal(ids, again.batch("train", 5, 4).ids_BT)
    assert not torch.equal(ids, other.batch("train", 5, 4).ids_BT)
    assert not torch.equal(ids, data.batch("val", 5, 4).ids_BT)
    assert not torch.equal(ids, data.batch("train", 6, 4).ids_BT)
    assert data.fingerprint == again.fingerprint != other.fingerprint
    assert data.num_sequences("train") == 2**31 and data.num_sequences("val") == 1024
    json.dumps(data.description)
    # The model's vocab is the default.
    assert build_data(cfg("synthetic"), 16, seed=0, model_vocab_size=64).vocab_size == 64


# ------------------------------------------------------------ errors


def test_errors():
    with pytest.raises(DataError, match="'wikitext'.*stdlib, memmap, synthetic"):
        build_data(cfg("wikitext"), 16, seed=0, model_vocab_size=1000)
    with pytest.raises(DataError, match="seq_len=0"):
        build_data(cfg(), 0, seed=0, model_vocab_size=1000)
    with pytest.raises(DataError, match="vocab_size=256.*model.vocab_size=100"):
        build_data(cfg(), 16, seed=0, model_vocab_size=100)
    with pytest.raises(DataError, match="vocab_size=70.*model.vocab_size=64"):
        build_data(cfg("synthetic", vocab_size=70), 16, seed=0, model_vocab_size=64)
    with pytest.raises(DataError, match="data.vocab_size=1000"):
        build_data(cfg(vocab_size=1000), 16, seed=0, model_vocab_size=32000)
    with pytest.raises(DataError, match="val_fraction"):
        build_data(cfg(val_fraction=1.5), 16, seed=0, model_vocab_size=1000)
    with pytest.raises(DataError, match="val split has .* seq_len\\+1"):
        build_data(cfg(val_fraction=1e-6), 1024, seed=0, model_vocab_size=1000)
    data = build_data(cfg("synthetic"), 4, seed=0, model_vocab_size=8)
    with pytest.raises(DataError, match="split='test'"):
        data.batch("test", 0, 1)
    with pytest.raises(DataError, match="batch_size=0"):
        data.batch("train", 0, 0)


def test_a_val_split_shorter_than_one_window_names_the_fraction_that_would_hold_one():
    with pytest.raises(DataError, match="the val split has") as e:
        build_data(cfg("stdlib", None, val_fraction=0.001), 65536, seed=0, model_vocab_size=256)
    n_tokens = int(re.search(r"n_tokens=(\d+)", str(e.value)).group(1))
    enough = re.search(r"raise data.val_fraction to at least (0\.\d{4})", str(e.value)).group(1)
    assert float(enough) - 1e-4 < 65537 / n_tokens <= float(enough)
    build_data(cfg("stdlib", None, val_fraction=float(enough)), 65536, seed=0, model_vocab_size=256)  # holds one
