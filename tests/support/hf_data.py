"""Data files and the tiny model tokenizer the data and trainer tests share.

The tokenizer is the one `cpcompose/integrations/transformers/tiny_model.py` writes (byte-level BPE, BOS/EOS/pad, a chat template
with `{% generation %}` markers), loaded from that script so the tests use what a newcomer gets.
"""

from __future__ import annotations

import importlib

import functools
import json
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch




@functools.cache
def tiny_model_script() -> ModuleType:
    """`cpcompose.integrations.transformers.tiny_model`."""
    return importlib.import_module("cpcompose.integrations.transformers.tiny_model")


@functools.cache
def tiny_tokenizer_folder() -> str:
    """A folder holding the tiny tokenizer (written once per process; its vocabulary is `VOCAB` = 320 ids)."""
    folder = Path(tempfile.mkdtemp(prefix="cpcompose-tiny-tokenizer-"))
    tiny_model_script().make_tokenizer(folder)
    return str(folder)


@functools.cache
def tiny_model_folder() -> str:
    """A whole tiny Llama folder (config.json, weights, the tokenizer), as model.name = "hf" reads it."""
    return str(tiny_model_script().make_tiny_model(Path(tempfile.mkdtemp(prefix="cpcompose-tiny-llama-"))))


def tokenizer_variant(folder: Path, **changes: Any) -> str:
    """The tiny tokenizer saved into ``folder`` with attributes changed (e.g. ``chat_template=...``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_folder(), local_files_only=True)
    for name, value in changes.items():
        setattr(tok, name, value)
    tok.save_pretrained(folder)
    return str(folder)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """One JSON value a line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


WORDS = ("context", "parallel", "ranks", "attention", "keys", "values", "the", "fox", "jumps", "over", "dog")


def sentence(g: torch.Generator, lo: int, hi: int) -> str:
    """Between ``lo`` and ``hi`` (exclusive) random words."""
    n = int(torch.randint(lo, hi, (), generator=g))
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def chat_records(n: int, seed: int = 0, *, turns: int = 2) -> list[dict]:
    """``n`` conversations of a user question and an assistant answer per turn (a system prompt on every third)."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(turns):
            messages += [{"role": "user", "content": sentence(g, 1, 6)},
                         {"role": "assistant", "content": sentence(g, 1, 8)}]
        records.append({"messages": messages})
    return records


def text_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` {"text": ...} documents of 1 to 40 words."""
    g = torch.Generator().manual_seed(seed)
    return [{"text": sentence(g, 1, 40)} for _ in range(n)]
