"""A tiny Hugging Face tokenizer directory, built in-process with no network: for the text/chat data tests, and for
tiny HF model checkpoints (put a config.json and model.safetensors next to it).

`write_tiny_tokenizer(dir)` trains, with the quickstart's `engine.quickstart.write_tokenizer`, a byte-level BPE
tokenizer (the Qwen2/GPT-2 family's scheme, so any text encodes) on a little English and chat text, with the special
tokens `<|endoftext|>` (id 0), `<|im_start|>` (1) and `<|im_end|>` (2), and writes:

- tokenizer.json: the `tokenizers` file;
- tokenizer_config.json: `eos_token` "<|endoftext|>" (as Qwen2.5's base models), `pad_token`, `bos_token` null, and
  `chat_template`: ChatML as in Qwen2.5-Instruct, without its default system prompt and tool calls: each turn is
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and the generation prompt is `<|im_start|>assistant\\n`.
"""

from __future__ import annotations

from pathlib import Path

from engine.quickstart import CHATML_TEMPLATE, EOS, IM_END, IM_START, SPECIAL_TOKENS, write_tokenizer

__all__ = ["CHATML_TEMPLATE", "EOS", "IM_END", "IM_START", "SPECIAL_TOKENS", "TRAINING_TEXT", "write_tiny_tokenizer"]

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Seven wizards quietly pack boxes of liquor while the moon rises.",
    "system user assistant: You are a helpful assistant. What is the capital of France? Paris is the capital.",
    "Hello! How are you today? I am fine, thank you. Tell me a story about a dragon and a knight.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation: ; , . ! ? ( ) [ ] { } \" ' -",
]


def write_tiny_tokenizer(dir: str | Path, vocab_size: int = 384) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `dir` (created if needed); returns `dir` as a Path.
    `vocab_size` (>= 259: the 256 byte symbols and the 3 special tokens) bounds the BPE vocabulary; the merges the
    training text supports stop it earlier, so read the real size from the tokenizer. Deterministic: the same
    arguments write the same files."""
    return write_tokenizer(dir, TRAINING_TEXT * 4, vocab_size)
