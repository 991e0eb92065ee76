"""data=text and data=chat (engine/data/documents.py): records tokenized with a tiny in-process tokenizer
(tests/tiny_hf.py), labels masked to what is counted, packed by document, split by document, cached by content."""

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.batch import IGNORE_INDEX
from engine.data import DataError, build_data, documents
from tests.tiny_hf import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tokdir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokdir / "tokenizer.json"))


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cfg(path, tmp_path, name="chat", val_path=None, val_fraction=0.1, loss_on="assistant", tokenizer=None, **kw):
    return SimpleNamespace(name=name, path=str(path), val_path=str(val_path) if val_path else None,
                           val_fraction=val_fraction, vocab_size=None, tokenizer=str(tokenizer) if tokenizer else None,
                           loss_on=loss_on, cache_dir=str(tmp_path / "cache"), num_proc=0, **kw)


def encode(tok, pieces):
    """ids and counted flags of a document given as (text, counted) pieces, each tokenized on its own."""
    ids, counted = [], []
    for text, c in pieces:
        piece = tok.encode(text, add_special_tokens=False).ids
        ids += piece
        counted += [c] * len(piece)
    return ids, counted


def next_token_labels(ids, counted):
    return [ids[i + 1] if counted[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)] + [IGNORE_INDEX]


def one_document(tmp_path, tokdir, record, seq_len=128, **kw):
    """The train row of a data set holding exactly `record` (validation: another file), cut to its document."""
    train = write_jsonl(tmp_path / "train.jsonl", [record])
    val = write_jsonl(tmp_path / "val.jsonl", [record])
    data = build_data(cfg(train, tmp_path, val_path=val, tokenizer=tokdir, **kw), seq_len, seed=0,
                      model_vocab_size=1000)
    assert data.num_sequences("train") == 1
    b = data.batch("train", 0, 1)
    ((start, length),) = data.row_pieces("train", 0)
    assert start == 0
    assert b.doc_start_BT[0, :length].eq(0).all() and b.doc_start_BT[0, length:].eq(length).all()
    assert b.labels_BT[0, length:].eq(IGNORE_INDEX).all() and b.ids_BT[0, length:].eq(0).all()  # padding: EOS id 0
    return b.ids_BT[0, :length].tolist(), b.labels_BT[0, :length].tolist(), data


# ------------------------------------------------------------ golden label masks

MESSAGES = {"messages": [{"role": "system", "content": "You are helpful."},
                         {"role": "user", "content": "Hello there!"},
                         {"role": "assistant", "content": "Hi! How are you?"},
                         {"role": "user", "content": "Tell me a story."},
                         {"role": "assistant", "content": "A dragon met a knight."}]}


def test_messages_count_assistant_content_and_its_end_of_turn(tmp_path, tokdir, tok):
    ids, labels, data = one_document(tmp_path, tokdir, MESSAGES)
    expected, counted = encode(tok, [
        ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("Hi! How are you?<|im_end|>", 1),
        ("\n<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n", 0),
        ("A dragon met a knight.<|im_end|>", 1),
        ("\n", 0)])
    assert ids == expected
    assert labels == next_token_labels(expected, counted)
    assert data.vocab_size == tok.get_vocab_size()
    d = data.description
    assert d["source"] == "chat" and d["loss_on"] == "assistant" and d["n_documents"] == 2
    assert d["masked_share"] == pytest.approx(1 - 2 * (sum(counted) - counted[0]) / (2 * len(expected)), abs=1e-6)


def test_prompt_completion_counts_the_completion(tmp_path, tokdir, tok):
    ids, labels, _ = one_document(tmp_path, tokdir, {"prompt": "What is 2+2?", "completion": "4"})
    expected, counted = encode(tok, [("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
                                     ("4<|im_end|>", 1), ("\n", 0)])
    assert ids == expected
    assert labels == next_token_labels(expected, counted)
    assert sum(lbl != IGNORE_INDEX for lbl in labels) == 2  # "4" and <|im_end|>


def test_loss_on_all_counts_every_token_but_the_last(tmp_path, tokdir, tok):
    ids, labels, data = one_document(tmp_path, tokdir, MESSAGES, loss_on="all")
    assert labels == ids[1:] + [IGNORE_INDEX]
    assert data.description["loss_on"] == "all"


def test_text_records_end_with_eos(tmp_path, tokdir, tok):
    ids, labels, data = one_document(tmp_path, tokdir, {"text": "The quick brown fox."}, name="text")
    eos = tok.token_to_id("<|endoftext|>")
    assert ids == tok.encode("The quick brown fox.", add_special_tokens=False).ids + [eos]
    assert labels == ids[1:] + [IGNORE_INDEX]
    assert data.description["source"] == "text" and data.description["loss_on"] is None


# ------------------------------------------------------------ packing, splits, order

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards pack boxes of liquor".split()


def text_records(n, seed=0, long_every=7):
    rng = np.random.default_rng(seed)
    return [{"text": f"doc {k}: " + " ".join(rng.choice(WORDS, size=60 if long_every and k % long_every == 3 else
                                                          int(rng.integers(1, 12))))} for k in range(n)]


def segments(b, row):
    """The (doc_start, tokens, labels) runs of one row, by doc_start."""
    ds, ids, labels = b.doc_start_BT[row].tolist(), b.ids_BT[row].tolist(), b.labels_BT[row].tolist()
    out, i = [], 0
    while i < len(ds):
        j = i
        while j < len(ds) and ds[j] == ds[i]:
            j += 1
        assert ds[i] == i  # a document starts where its doc_start says
        out.append((ids[i:j], labels[i:j]))
        i = j
    return out


def test_packing_rows_hold_every_document_once_per_epoch(tmp_path, tokdir, tok):
    seq_len = 24
    records = text_records(40)
    path = write_jsonl(tmp_path / "t.jsonl", records)
    data = build_data(cfg(path, tmp_path, name="text", tokenizer=tokdir, val_fraction=0.25), seq_len, seed=5,
                      model_vocab_size=1000)
    eos = tok.token_to_id("<|endoftext|>")
    docs = [tok.encode(r["text"], add_special_tokens=False).ids + [eos] for r in records]
    n_cut = sum(len(d) > seq_len for d in docs)
    assert n_cut >= 3 and data.description["n_documents_cut"] == n_cut
    expected = Counter()
    for d in docs:
        for k in range(0, len(d), seq_len):
            expected[tuple(d[k:k + seq_len])] += 1

    seen = Counter()
    for split in ("train", "val"):
        n = data.num_sequences(split)
        b = data.batch(split, 0, n)
        assert b.ids_BT.shape == (n, seq_len) and b.ids_BT.dtype == torch.int64
        assert b.doc_start_BT.dtype == torch.int32
        assert sorted(data.row_indices(split, 0, n).tolist()) == list(range(n))  # one epoch: every row once
        for row in range(n):
            pieces = segments(b, row)
            n_real = len(data.row_pieces(split, int(data.row_indices(split, 0, n)[row])))
            for ids, labels in pieces[:n_real]:
                assert labels == ids[1:] + [IGNORE_INDEX]  # text: all counted; never across documents or pieces
                seen[tuple(ids)] += 1
            for ids, labels in pieces[n_real:]:  # padding
                assert set(ids) == {eos} and set(labels) == {IGNORE_INDEX}
    assert seen == expected
    d = data.description
    assert d["n_documents"] == 40 and d["n_tokens"] == sum(map(len, docs))
    assert d["padding_share"] == pytest.approx(1 - d["n_tokens"] / (seq_len * (d["n_train_seqs"] + d["n_val_seqs"])),
                                               abs=1e-6)
    json.dumps(d)


def test_val_split_by_document_order_and_seeds(tmp_path, tokdir):
    path = write_jsonl(tmp_path / "t.jsonl", text_records(30, long_every=0))
    build = lambda seed: build_data(cfg(path, tmp_path, name="text", tokenizer=tokdir, val_fraction=0.2), 128,
                                    seed=seed, model_vocab_size=1000)
    data, again, other = build(0), build(0), build(1)
    assert data.description["n_documents_cut"] == 0
    starts = {s: {st for r in range(data.num_sequences(s)) for st, _ in data.row_pieces(s, r)}
              for s in ("train", "val")}
    assert not starts["train"] & starts["val"] and len(starts["train"]) + len(starts["val"]) == 30
    assert data.description["splits"]["val"]["documents"] == 6
    # batch() is a pure function of (seed, split, index, batch_size); val is the same for every run seed
    for a, b in ((data, again), (data, other)):
        for i in range(3):
            x, y = a.batch("val", i, 2), b.batch("val", i, 2)
            assert torch.equal(x.ids_BT, y.ids_BT) and torch.equal(x.doc_start_BT, y.doc_start_BT)
    x, y = data.batch("train", 1, 2), again.batch("train", 1, 2)
    assert torch.equal(x.ids_BT, y.ids_BT) and torch.equal(x.labels_BT, y.labels_BT)
    assert data.fingerprint == again.fingerprint == other.fingerprint
    n = data.num_sequences("train")
    assert not np.array_equal(data.row_indices("train", 0, n), other.row_indices("train", 0, n))
    # epochs are reshuffled permutations of the rows
    assert not np.array_equal(data.row_indices("train", 0, n), data.row_indices("train", 1, n))
    assert sorted(data.row_indices("train", 1, n).tolist()) == list(range(n))

    val = write_jsonl(tmp_path / "v.jsonl", [{"text": "seven wizards"}, {"text": "a lazy dog"}])
    with_val = build_data(cfg(path, tmp_path, name="text", tokenizer=tokdir, val_path=val), 128, seed=0,
                          model_vocab_size=1000)
    assert with_val.description["splits"]["train"]["documents"] == 30
    assert with_val.description["splits"]["val"]["documents"] == 2
    assert with_val.fingerprint != data.fingerprint

    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "alone"}])
    with pytest.raises(DataError, match="1 document.*val_fraction"):
        build_data(cfg(one, tmp_path, name="text", tokenizer=tokdir), 128, seed=0, model_vocab_size=1000)


def test_text_files_are_one_document_each(tmp_path, tokdir, tok):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick fox\n\nover the dog\n")
    (folder / "b.txt").write_text("seven wizards\n")
    (folder / "c.txt").write_text("pack boxes\n")
    data = build_data(cfg(folder, tmp_path, name="text", tokenizer=tokdir, val_fraction=0.3), 64, seed=0,
                      model_vocab_size=1000)
    assert data.description["n_documents"] == 3
    assert data.description["n_tokens"] == sum(len(tok.encode(p.read_text(), add_special_tokens=False).ids) + 1
                                               for p in folder.iterdir())
    (folder / "d.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="mixes formats"):
        build_data(cfg(folder, tmp_path, name="text", tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)


# ------------------------------------------------------------ refusals


def test_bad_records_are_refused_naming_file_and_line(tmp_path, tokdir):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + '{"messages": [\n'
                        + json.dumps(good) + "\n")
    with pytest.raises(DataError, match="not valid JSON") as e:
        build_data(cfg(bad_json, tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)
    assert f"{bad_json}:3" in str(e.value)

    missing = write_jsonl(tmp_path / "missing.jsonl", [{"text": "a b"}, {"title": "no text"}, {"text": "c"}])
    with pytest.raises(DataError, match="'text'") as e:
        build_data(cfg(missing, tmp_path, name="text", tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)
    assert f"{missing}:2" in str(e.value)

    wrong = write_jsonl(tmp_path / "wrong.jsonl", [good, good, good, {"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match="role, content") as e:
        build_data(cfg(wrong, tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)
    assert f"{wrong}:4" in str(e.value)

    mixed = write_jsonl(tmp_path / "mixed.jsonl", [good, {"messages": "not a list"}])
    with pytest.raises(DataError, match="messages") as e:
        build_data(cfg(mixed, tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)
    assert f"{mixed}:2" in str(e.value)

    none = write_jsonl(tmp_path / "none.jsonl", [{"title": "x"}, {"title": "y"}])
    with pytest.raises(DataError, match="needs records with a 'messages' field.*title"):
        build_data(cfg(none, tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)

    unknown = tmp_path / "records.xml"
    unknown.write_text("<x/>")
    with pytest.raises(DataError, match="unknown extension '.xml'.*\\.jsonl") as e:
        build_data(cfg(unknown, tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)
    assert str(unknown) in str(e.value)

    with pytest.raises(DataError, match="no such file"):
        build_data(cfg(tmp_path / "absent.jsonl", tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=1000)
    with pytest.raises(DataError, match="model.vocab_size=100"):
        build_data(cfg(wrong, tmp_path, tokenizer=tokdir), 64, seed=0, model_vocab_size=100)
    with pytest.raises(DataError, match="model.init=hf"):
        build_data(cfg(wrong, tmp_path), 64, seed=0, model_vocab_size=1000)
    with pytest.raises(DataError, match="no tokenizer.json"):
        build_data(cfg(wrong, tmp_path), 64, seed=0, model_vocab_size=1000, tokenizer_dir=str(tmp_path))


# ------------------------------------------------------------ cache


def test_cache_hit_and_content_key(tmp_path, tokdir, capfd):
    path = write_jsonl(tmp_path / "t.jsonl", text_records(12))
    c = cfg(path, tmp_path, name="text", val_fraction=0.2)
    runs = documents.TOKENIZE_RUNS
    first = build_data(c, 32, seed=0, model_vocab_size=1000, tokenizer_dir=str(tokdir))  # the model's dir
    assert documents.TOKENIZE_RUNS == runs + 1
    capfd.readouterr()
    second = build_data(c, 16, seed=3, model_vocab_size=1000, tokenizer_dir=str(tokdir))
    assert documents.TOKENIZE_RUNS == runs + 1  # no tokenization: another seq_len and seed reuse the entry
    assert "from the cache" in capfd.readouterr().err
    assert first.description["cache_keys"] == second.description["cache_keys"]
    entry = Path(c.cache_dir) / first.description["cache_keys"]["train"]
    assert (entry / "meta.json").is_file() and not list(Path(c.cache_dir).glob("*.tmp*"))
    assert not list(Path(c.cache_dir).glob("tmp-datasets-*"))

    write_jsonl(path, text_records(12, seed=1))
    third = build_data(c, 32, seed=0, model_vocab_size=1000, tokenizer_dir=str(tokdir))
    assert documents.TOKENIZE_RUNS == runs + 2
    assert third.description["cache_keys"] != first.description["cache_keys"]
    assert third.fingerprint != first.fingerprint

    chat = write_jsonl(tmp_path / "c.jsonl", [MESSAGES] * 4)
    a = build_data(cfg(chat, tmp_path, tokenizer=tokdir, val_fraction=0.3), 64, seed=0, model_vocab_size=1000)
    b = build_data(cfg(chat, tmp_path, tokenizer=tokdir, val_fraction=0.3, loss_on="all"), 64, seed=0,
                   model_vocab_size=1000)
    assert a.description["cache_keys"] != b.description["cache_keys"]  # loss_on is part of the key


def test_a_template_that_is_not_prefix_stable_is_refused_for_assistant_loss(tmp_path, tokdir):
    """A template that renders a turn differently once later turns follow cannot locate the assistant tokens by
    prefixes: refused naming the record, and usable with loss_on=all."""
    import shutil

    odd = tmp_path / "odd_tok"
    shutil.copytree(tokdir, odd)
    config = json.loads((odd / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("message['content']",
                                                              "message['content'] + ('.' if loop.last else '')")
    (odd / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "c.jsonl", [MESSAGES] * 3)
    with pytest.raises(DataError, match="not prefix-stable.*loss_on=all") as e:
        build_data(cfg(path, tmp_path, tokenizer=odd), 128, seed=0, model_vocab_size=1000)
    assert f"{path}:1" in str(e.value)
    data = build_data(cfg(path, tmp_path, tokenizer=odd, loss_on="all"), 128, seed=0, model_vocab_size=1000)
    assert data.description["n_documents"] == 3
