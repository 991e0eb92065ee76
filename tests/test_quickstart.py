"""The README's fine-tune quickstart, run as a user runs it (CPU, offline): `python -m engine.quickstart --out DIR`
writes an HF checkpoint of model=tiny_chat with its tokenizer and chat records from the standard library's
docstrings; the train command it prints (engine.quickstart.TRAIN_COMMAND, with the test's paths and fewer steps)
fine-tunes it with the validation loss clearly falling and exports it; transformers loads the export, and its logits
equal our model's on the same exported weights."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import quickstart
from engine.checkpoint import open_hf
from engine.checkpoint.hf import import_hf
from engine.data.documents import TOKENIZER_FILES, chat_messages
from engine.model import ModelSpec, dense
from tests.util import user_env

ROOT = Path(__file__).resolve().parent.parent
RECORDS = 1000  # fewer than the default 3000: tokenizing them is a third of the time
STEPS = 20


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(out dir, stdout) of `python -m engine.quickstart --out <out> --records 1000`."""
    out = tmp_path_factory.mktemp("quickstart") / "demo"
    proc = subprocess.run([sys.executable, "-m", "engine.quickstart", "--out", str(out), "--records", str(RECORDS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=user_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def run_dir(made, tmp_path_factory):
    """The run dir of the printed train command, shortened to 20 steps (validation at step 0 and the end)."""
    out, stdout = made
    command = quickstart.train_command(out)
    assert f"  {command}\n" in stdout  # printed as it is run here
    run = tmp_path_factory.mktemp("run")
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"]
    argv = [sys.executable, *argv[1:], f"train.steps={STEPS}", "train.val_every=0", "logger=none",
            f"data.cache_dir={run / 'data-cache'}", f"hydra.run.dir={run}"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**user_env(), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_the_readme_command_is_the_demo_one_with_the_finetune_recipe():
    assert quickstart.TRAIN_COMMAND == quickstart.train_command("demo")
    assert quickstart.TRAIN_COMMAND.startswith(
        "python train.py model=tiny_chat model.init=hf:demo/tiny-chat data=chat data.path=demo/chat.jsonl "
        "train=finetune train.lr=1e-3 ")
    for group, name in (("model", "tiny_chat"), ("train", "finetune"), ("data", "chat")):
        assert (ROOT / "conf" / group / f"{name}.yaml").is_file()


def test_quickstart_writes_a_checkpoint_its_tokenizer_and_records(made):
    from tokenizers import Tokenizer

    out, stdout = made
    ckpt = out / "tiny-chat"
    assert {p.name for p in ckpt.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json"}
    m = quickstart.model_config()
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert tok.get_vocab_size() == m.vocab_size == 512  # the ids fit the model's embedding exactly
    assert tok.token_to_id("<|endoftext|>") == m.eos_token_id == 0
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "<|im_start|>" in config["chat_template"]
    open_hf(ModelSpec(m), ckpt)  # config.json matches model=tiny_chat; every tensor present with its shape

    records = [json.loads(line) for line in (out / "chat.jsonl").read_text().splitlines()]
    assert len(records) == RECORDS
    forms = {"messages" in r for r in records}
    assert forms == {True, False}  # both chat forms data=chat reads
    for r in records:
        messages, problem = chat_messages(r)
        assert problem is None and [x["role"] for x in messages] == ["user", "assistant"]
        assert "`" in messages[0]["content"] and len(messages[1]["content"]) >= quickstart.MIN_ANSWER_CHARS
    # deterministic from the seed: the same records in another process
    assert records == quickstart.make_records(RECORDS, quickstart.DEFAULT_SEED)
    assert f"{RECORDS} chat records" in stdout


def test_the_printed_command_fine_tunes_with_the_validation_loss_falling(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["error"] is None
    assert summary["config"]["model"]["init"].startswith("hf:")
    assert summary["initial_val_loss"] > 5.5  # about ln(512) = 6.24: a random model
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.8


class _Collector:
    """The engine interface import_hf writes into: each unit's tensors, as our model names them."""

    def __init__(self, spec):
        self.spec, self.units = spec, {}

    def load_unit_state(self, index, master):
        self.units[index] = {name: master[name].float() for name in master}


def test_the_export_loads_in_transformers_with_our_logits(made, run_dir):
    transformers = pytest.importorskip("transformers")
    out, _ = made
    export = run_dir / "hf"
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the checkpoint's tokenizer, byte for byte
        assert (export / f).read_bytes() == (out / "tiny-chat" / f).read_bytes()
    assert set(TOKENIZER_FILES) & {p.name for p in export.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}

    hf_tok = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    messages = [{"role": "user", "content": "What does `json.dumps` do?"}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat does `json.dumps` do?<|im_end|>\n<|im_start|>assistant\n"
    ids = hf_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 5 and hf_tok.eos_token_id == 0

    model = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    assert torch.isfinite(theirs).all()

    # ours: the same export read back through the engine's import path, the model's own templates in fp32
    spec = ModelSpec(quickstart.model_config())
    engine = _Collector(spec)
    import_hf(engine, open_hf(spec, export), log=lambda _: None)
    with torch.no_grad():
        x = spec.embed(engine.units[0], ids)
        rope = spec.positions(ids.shape[1], "cpu")
        for u in spec.layer_units:
            x = spec.layer(engine.units[u.index], x, rope, u.layer)
        ours = dense.logits(engine.units[spec.units[-1].index], x, spec.arch)
    # both compute in fp32 from the same bf16-rounded weights: equal up to fp32 rounding
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
