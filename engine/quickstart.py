"""The fine-tune quickstart's inputs, made offline in seconds: `python -m engine.quickstart --out demo`.

A fine-tune needs a pretrained Hugging Face checkpoint (config.json, safetensors weights, a tokenizer with a chat
template) and chat records. Real ones are gigabytes behind a network; this module makes small stand-ins of the same
formats on any machine, so that the whole path (model.init=hf: import, data=chat tokenization with the checkpoint's
chat template and loss on the assistant turns, training, train.export_hf, transformers loading the export) runs on a
CPU in minutes:

- `OUT/tiny-chat/`: an HF-format Qwen2 checkpoint of model=tiny_chat (conf/model/tiny_chat.yaml): config.json
  (`hf_config_dict`), model.safetensors (bf16 weights initialised as a model=tiny_chat run initialises them, from
  `--seed`: there is nothing pretrained in it), tokenizer.json (a byte-level BPE, the Qwen2/GPT-2 scheme, so any text
  encodes, trained on the records below to exactly the model's vocabulary) and tokenizer_config.json (EOS
  `<|endoftext|>`, ChatML chat template as Qwen2.5-Instruct's, without its default system prompt and tools);
- `OUT/chat.jsonl`: question/answer records from a corpus every machine has, the docstrings of the running Python's
  standard library (its .py files parsed with `ast`, nothing imported): "What does `json.dumps` do?" answered by the
  first paragraph of `json.dumps`'s docstring. Most records are `messages`, one in eight is `prompt`/`completion`
  (data=chat reads both). Which documented names are chosen, in what order and with which question wording follows
  `--seed` alone: the same Python and arguments write the same files.

Then `TRAIN_COMMAND` (printed) fine-tunes it. Its learning rate is not the finetune recipe's 1e-5, which suits
pretrained 7B+ models: a randomly initialised 4M-parameter model needs 1e-3 to learn visibly in 60 steps.

`write_tokenizer` is also what the tests' tiny tokenizers (tests/tiny_hf.py) are written with.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shlex
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)  # ids 0, 1, 2

# ChatML as Qwen2.5-Instruct's template renders it, without the default system prompt and tool calls: each turn is
# `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt is `<|im_start|>assistant\n`.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL = "tiny_chat"  # conf/model/tiny_chat.yaml
CHECKPOINT_DIR = "tiny-chat"
RECORDS_FILE = "chat.jsonl"
DEFAULT_OUT = "demo"
DEFAULT_RECORDS = 3000
DEFAULT_SEED = 0
PROMPT_COMPLETION_EVERY = 8  # every 8th record is written as prompt/completion, the others as messages
MIN_ANSWER_CHARS = 40
MAX_ANSWER_CHARS = 600

# The fine-tune of the quickstart, as the README shows it (for --out demo). train=finetune is the fine-tune recipe;
# the overrides after it size the run for a CPU (a few minutes on 2 cores) and raise the learning rate from the
# recipe's 1e-5 (for pretrained 7B+ models) to 1e-3, which a randomly initialised tiny model needs to learn visibly in
# 60 steps. The recipe ends by exporting <run dir>/hf (train.export_hf), which transformers loads, tokenizer included.
TRAIN_OVERRIDES = ("train=finetune", "train.lr=1e-3", "train.warmup_steps=6", "train.steps=60", "train.seq_len=256",
                   "train.micro_batch_size=8", "train.grad_accum=1", "train.val_every=20", "train.val_batches=4")


def train_command(out: str | os.PathLike = DEFAULT_OUT) -> str:
    """The command that fine-tunes what `python -m engine.quickstart --out <out>` wrote (run from the repository
    root: paths relative to it stay relative)."""
    out = str(out).rstrip("/") or "/"
    return " ".join(["python", "train.py", f"model={MODEL}",
                     shlex.quote(f"model.init=hf:{out}/{CHECKPOINT_DIR}"), "data=chat",
                     shlex.quote(f"data.path={out}/{RECORDS_FILE}"), *TRAIN_OVERRIDES])


TRAIN_COMMAND = train_command(DEFAULT_OUT)


# ---------------------------------------------------------------------------------------------------------------
# the tokenizer


def write_tokenizer(dir: str | os.PathLike, texts: Iterable[str], vocab_size: int) -> Path:
    """Train a byte-level BPE with the special tokens `<|endoftext|>` (id 0), `<|im_start|>` (1), `<|im_end|>` (2)
    on `texts` and write `dir`/tokenizer.json and `dir`/tokenizer_config.json (ChatML template, EOS and pad
    `<|endoftext|>`, no BOS); returns `dir` as a Path. `vocab_size` (>= 259: the 256 byte symbols and the 3 special
    tokens) is the vocabulary's size when the texts support that many merges, else it stops earlier: read the real
    size from the tokenizer. Deterministic: the same arguments write the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} must be >= {256 + len(SPECIAL_TOKENS)}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", eos_token=EOS, pad_token=EOS, bos_token=None,
                  unk_token=None, model_max_length=32768, chat_template=CHATML_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------------------
# the records: the standard library's docstrings


SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_modules(root: Optional[str] = None) -> List[Tuple[str, Path]]:
    """(dotted module name, file) of the public .py modules of the standard library, in name order: installed
    packages, test suites and private modules (a `_` name part) left out."""
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root_path):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith((".", "_"))
                       and d.isidentifier()]
        rel = Path(dirpath).relative_to(root_path).parts
        if rel and not (Path(dirpath) / "__init__.py").is_file():
            continue  # not a package (e.g. a data folder)
        for f in filenames:
            if not f.endswith(".py") or f == "__main__.py" or (f.startswith("_") and f != "__init__.py"):
                continue
            stem = f[:-3]
            if not stem.isidentifier():
                continue
            parts = rel if f == "__init__.py" else (*rel, stem)
            if parts:
                found.append((".".join(parts), Path(dirpath) / f))
    return sorted(found)


def first_paragraph(doc: Optional[str]) -> Optional[str]:
    """A docstring's first paragraph on one line, if it reads as prose of a useful length, else None."""
    if not doc:
        return None
    para = textwrap.dedent(doc).strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in para.splitlines()).strip()
    if not (MIN_ANSWER_CHARS <= len(text) <= MAX_ANSWER_CHARS) or not re.match(r"[A-Z`\"']", text):
        return None
    if text.endswith(":") or ">>>" in text or "\t" in text:  # introduces a list or an example that was cut off
        return None
    return text


QUESTIONS = {
    "module": ("What is the `{name}` module for?", "What does the Python module `{name}` provide?",
               "Describe the `{name}` module."),
    "function": ("What does `{name}` do?", "Explain `{name}` in the Python standard library.",
                 "What is `{name}` used for?"),
    "class": ("What is `{name}`?", "Describe the class `{name}`.", "What does the `{name}` class represent?"),
}


def _documented(tree: ast.Module, module: str) -> Iterator[Tuple[str, str, str]]:
    """(kind, dotted name, docstring) of the module, its public functions and classes and their public methods."""
    yield "module", module, ast.get_docstring(tree, clean=False) or ""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            name = f"{module}.{node.name}"
            if isinstance(node, ast.ClassDef):
                yield "class", name, ast.get_docstring(node, clean=False) or ""
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        yield "function", f"{name}.{sub.name}", ast.get_docstring(sub, clean=False) or ""
            else:
                yield "function", name, ast.get_docstring(node, clean=False) or ""


def docstring_entries(root: Optional[str] = None) -> List[Tuple[str, str, str]]:
    """(kind, dotted name, answer) of every usable docstring of the standard library, in module then source order;
    an answer text seen before (a docstring copied onto an override, say) is kept once."""
    entries, seen = [], set()
    for module, path in stdlib_modules(root):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # e.g. a file of another Python's grammar (lib2to3 test data) or unreadable
        for kind, name, doc in _documented(tree, module):
            answer = first_paragraph(doc)
            if answer and answer not in seen:
                seen.add(answer)
                entries.append((kind, name, answer))
    return entries


def make_records(n: int = DEFAULT_RECORDS, seed: int = DEFAULT_SEED, root: Optional[str] = None) -> List[dict]:
    """`n` chat records (fewer if the standard library has fewer usable docstrings), chosen and worded from `seed`."""
    entries = docstring_entries(root)
    if not entries:
        raise RuntimeError(f"no usable docstrings under {root or sysconfig.get_paths()['stdlib']}")
    rng = random.Random(seed)
    chosen = rng.sample(entries, min(n, len(entries)))
    records = []
    for i, (kind, name, answer) in enumerate(chosen):
        question = rng.choice(QUESTIONS[kind]).format(name=name)
        if i % PROMPT_COMPLETION_EVERY == PROMPT_COMPLETION_EVERY - 1:
            records.append({"prompt": question, "completion": answer})
        else:
            records.append({"messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": answer}]})
    return records


def record_turns(record: dict) -> List[Tuple[str, str]]:
    """(role, content) of a record written by make_records, either form."""
    if "messages" in record:
        return [(m["role"], m["content"]) for m in record["messages"]]
    return [("user", record["prompt"]), ("assistant", record["completion"])]


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint


def model_config(name: str = MODEL):
    """conf/model/<name>.yaml over the ModelConfig schema (no Hydra composition needed)."""
    from omegaconf import OmegaConf

    from engine.config import CONF_DIR, ModelConfig

    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))


def write_checkpoint(dir: str | os.PathLike, model_cfg, seed: int, dtype=None) -> Path:
    """config.json and model.safetensors of `model_cfg` with the weights a run of that model initialises from
    `seed` (ModelSpec.init_unit, fp32), stored in `dtype` (bf16 by default) under the HF names."""
    import torch

    from engine.checkpoint import write_safetensors
    from engine.checkpoint.hf import hf_config_dict
    from engine.fileio import json_bytes, write_durable
    from engine.model import ModelSpec

    dtype = dtype or torch.bfloat16
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(model_cfg)
    items = []
    for unit in spec.units:
        params = {s.name: torch.empty(s.shape, dtype=torch.float32) for s in unit.layout.specs}
        spec.init_unit(unit, params, seed)
        items.extend((unit.layout.prefix + s.name, dtype, s.shape, params[s.name].to(dtype))
                     for s in unit.layout.specs)
    write_safetensors(out / "model.safetensors", items, {"format": "pt"})
    write_durable(out / "config.json", json_bytes(hf_config_dict(model_cfg, dtype)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the command


def write_quickstart(out: str | os.PathLike, records: int = DEFAULT_RECORDS, seed: int = DEFAULT_SEED,
                     log=print, model: str = MODEL) -> dict:
    """Write OUT/tiny-chat (checkpoint + tokenizer) and OUT/chat.jsonl; returns their paths and figures. Another
    `model` (conf/model/<model>.yaml, e.g. qwen7b for a GPU run) gets the same small tokenizer, whose ids all fall
    within its vocabulary, in OUT/<model>."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m = model_config(model)
    recs = make_records(records, seed)
    records_path = out / RECORDS_FILE
    tmp = records_path.with_name(records_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    os.replace(tmp, records_path)
    ckpt = out / (CHECKPOINT_DIR if model == MODEL else model)
    texts = [f"{role}\n{content}" for r in recs for role, content in record_turns(r)]
    tiny = model_config()
    write_tokenizer(ckpt, texts, tiny.vocab_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    if tok.get_vocab_size() > m.vocab_size or (model == MODEL and tok.token_to_id(EOS) != m.eos_token_id):
        raise RuntimeError(f"the tokenizer ({tok.get_vocab_size()} ids, EOS id {tok.token_to_id(EOS)}) does not fit "
                           f"model={model} (vocab_size {m.vocab_size}, eos_token_id {m.eos_token_id})")
    write_checkpoint(ckpt, m, seed)
    from engine.model import ModelSpec

    n_params = ModelSpec(m).num_params()
    n_chat = sum("messages" in r for r in recs)
    log(f"wrote {ckpt}/: model={model} ({n_params:,} parameters, random init, seed {seed}) as an HF checkpoint: "
        f"config.json, model.safetensors, tokenizer.json ({tok.get_vocab_size()} ids, byte-level BPE), "
        "tokenizer_config.json (ChatML, EOS <|endoftext|>)")
    log(f"wrote {records_path}: {len(recs)} chat records from the docstrings of Python {sys.version.split()[0]}'s "
        f"standard library ({n_chat} messages, {len(recs) - n_chat} prompt/completion)")
    return dict(checkpoint=str(ckpt), records=str(records_path), n_records=len(recs), n_params=n_params,
                vocab=tok.get_vocab_size(), command=train_command(out))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.quickstart", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--records", type=int, default=DEFAULT_RECORDS, help=f"chat records (default {DEFAULT_RECORDS})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="record choice and wording, weight init")
    p.add_argument("--model", default=MODEL, help=f"conf/model/<name> of the checkpoint (default {MODEL}; a larger "
                                                   "one, e.g. qwen7b, for a GPU fine-tuning run)")
    args = p.parse_args(argv)
    if args.records < 1:
        p.error("--records must be >= 1")
    if args.model != MODEL:
        write_quickstart(args.out, args.records, args.seed, model=args.model)
        return 0
    info = write_quickstart(args.out, args.records, args.seed)
    print("\nNext, fine-tune it, from this directory (a few minutes on a CPU; the learning rate is raised from the "
          "finetune recipe's 1e-5, which suits pretrained 7B+ models, to 1e-3, which a randomly initialised tiny model "
          "needs):\n")
    print(f"  {info['command']}\n")
    print("The validation loss falls from about ln(512) = 6.2; the run ends by exporting an HF checkpoint with the "
          "tokenizer to <run dir>/hf, which transformers' AutoTokenizer and AutoModelForCausalLM load.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
