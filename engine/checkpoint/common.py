"""What every part of engine.checkpoint shares: the error type and the reader of a checkpoint's JSON files."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; a missing file (`what` says why it is needed), bytes that are not JSON or JSON
    that is not an object raise CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {what}" if what else f"{path}: missing") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt: expected a JSON object")
    return data
