"""Tiny corpora and configs for the token-store tests (byte-level tokens unless a tokenizer is given)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cpcompose.config import JobConfig, load_config


def write_documents(path: Path, lengths: list[int], *, seed: int = 0) -> Path:
    """A .jsonl file of text documents of the given character lengths (letters; byte-level: one id each)."""
    g = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for n in lengths:
            letters = torch.randint(97, 123, (n,), generator=g).tolist()
            f.write(json.dumps({"text": bytes(letters).decode()}) + "\n")
    return path


def random_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` lengths drawn uniformly from ``[lo, hi)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def store_config(data: Path | None, store: Path, *argv: str, seq_len: int = 32, batch: int = 4) -> JobConfig:
    """data.source = "text" read through token stores kept in ``store``."""
    path = [] if data is None else [f"--data.path={data}"]
    return load_config(["--data.source=text", *path, f"--data.store_dir={store}", f"--training.seq_len={seq_len}",
                        f"--training.batch_size={batch}", *argv])
