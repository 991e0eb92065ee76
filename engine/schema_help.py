"""`python train.py --help [section]`: every config field with its type, default, allowed values and meaning.

The meaning is the comment the schema itself carries beside or above each field in engine/config.py, read from the
source with `tokenize` (so the help cannot drift from the schema: a field without a comment is a test failure in
tests/test_cli.py). Allowed values are the `one_of` choices; defaults are the dataclass defaults, which the config
groups (conf/<group>/<option>.yaml) then override.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
import typing
from typing import Dict, List, Optional

from engine import config

FIELD_LINE = re.compile(r"^\s+(\w+)\s*:")


def field_docs(cls: type) -> Dict[str, str]:
    """{field: its comment}: the comment lines right above the field plus the one after it on its line."""
    source = inspect.getsource(cls)
    comments: Dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    docs, pending = {}, []
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(comments.get(number, ""))
            continue
        match = FIELD_LINE.match(line)
        if match and match.group(1) in {f.name for f in dataclasses.fields(cls)}:
            docs[match.group(1)] = " ".join(filter(None, [*pending, comments.get(number, "")]))
        pending = []
    return docs


def _all_field_docs(cls: type) -> Dict[str, str]:
    """Docs of `cls`'s fields, inherited ones included (a subclass's own comment wins)."""
    docs: Dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base) and base is not object:
            docs.update({k: v for k, v in field_docs(base).items() if v})
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "set by its config group"
    return "set by its config group" if value == "???" else repr(value)


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in args) + " or null"
    if typing.get_origin(tp) in (list, List):
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def schema_entries(section: type = config.Config, prefix: str = "") -> List[Dict[str, str]]:
    """One entry per leaf field: key, type, default, choices, doc."""
    hints = typing.get_type_hints(section)
    docs = _all_field_docs(section)
    out = []
    for f in dataclasses.fields(section):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += schema_entries(tp, f"{prefix}{f.name}.")
            continue
        choices = f.metadata.get("choices")
        out.append({"key": f"{prefix}{f.name}", "type": _type_name(tp),
                    "default": _default(f), "choices": " | ".join(map(str, choices)) if choices else "",
                    "doc": docs.get(f.name, "")})
    return out


def help_text(section: Optional[str] = None) -> str:
    entries = [e for e in schema_entries() if section is None or e["key"].split(".")[0] == section]
    groups = sorted(p.name for p in config.CONF_DIR.iterdir() if p.is_dir())
    lines = ["usage: python train.py [group=option ...] [key=value ...] [plan=true] [-m for a sweep]",
             "",
             "Config groups (group=option; conf/<group>/<option>.yaml):",
             *(f"  {g}: {', '.join(sorted(p.stem for p in (config.CONF_DIR / g).glob('*.yaml')))}" for g in groups),
             "",
             "Fields (default; allowed values) and what they do:"]
    for e in entries:
        allowed = f"; one of {e['choices']}" if e["choices"] else ""
        lines.append(f"  {e['key']} ({e['type']}, default {e['default']}{allowed})")
        if e["doc"]:
            lines.append(f"      {e['doc']}")
    if section is not None and not entries:
        sections = sorted({e["key"].split(".")[0] for e in schema_entries()})
        lines.append(f"  no section {section!r}; sections: {', '.join(sections)}")
    return "\n".join(lines)
