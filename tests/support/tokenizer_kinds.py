"""Small `tokenizers` tokenizers of the kinds real models ship, trained in well under a second, saved as
tokenizer.json files: what the tests of exact piecewise encoding (cpcompose/data/pieces.py) cut texts with.

- ``gpt2``: byte-level BPE, GPT-2's pre-tokenizer regex (ByteLevel with use_regex).
- ``gpt2_prefix``: the same with ``add_prefix_space`` (a space put before the text when it has none).
- ``llama3``: Llama 3 / Qwen style: a Split on Llama 3's regex, then ByteLevel without its own regex.
- ``metaspace``: Llama 2 / Mistral as transformers converts them today: Metaspace "▁" with
  ``prepend_scheme="first"``, BPE with byte fallback (``<0xNN>`` tokens).
- ``metaspace_whole``: the same with ``split=False`` (the whole text one pre-token): trained so, its vocabulary
  has tokens across a space ("x▁"), where a cut gives other ids and must be refused.
- ``prepend``: the older Llama 2 conversion: normalizers Prepend("▁") and Replace(" ", "▁"), no pre-tokenizer;
  the "▁" prepended to every encoded string changes the ids at a cut unless the next piece leaves out the space.
- ``strip``: GPT-2's byte-level BPE behind a Strip normalizer (whitespace dropped at both ends of each encoded
  string): a piece's first space is lost either way, so cuts fail (but before whitespace that ends at an
  added token: the whole text's encode strips that too) and prose is encoded whole.

Each has the specials ``<|endoftext|>`` and ``<s>`` (which its post-processor puts first), and a non-special
added token ``<tool>``.
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("gpt2", "gpt2_prefix", "llama3", "metaspace", "metaspace_whole", "prepend", "strip")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TRAINING_TEXT = (
    "The river runs past the mountain, and the history of science is long. Context parallel attention splits "
    "the sequence across ranks; keys and values travel in a ring. 12345 67890 3.14159 2026-11-26.\n\n"
    "Ünïcödé wörds: café, naïve, Straße, 東京 大阪 こんにちは, emoji 🙂🚀, tabs\tand  double  spaces.\n"
    "    def f(x):\n        return x * 2  # code with indentation\n"
) * 20

SPECIALS = ["<|endoftext|>", "<s>"]


def make_tokenizer_file(kind: str, folder: Path) -> str:
    """Train the tokenizer ``kind`` (one of KINDS) and save it as ``folder/<kind>.json``; returns the path."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    byte_level = kind in ("gpt2", "gpt2_prefix", "llama3", "strip")
    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if kind in ("gpt2", "strip"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if kind == "strip":
            tok.normalizer = normalizers.Strip()
    elif kind == "gpt2_prefix":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif kind in ("metaspace", "metaspace_whole"):
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=kind == "metaspace")
    elif kind == "prepend":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    tok.decoder = decoders.ByteLevel() if byte_level else decoders.Metaspace()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS] if not byte_level else SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    if not byte_level:  # byte fallback: every byte has its <0xNN> token, so no text is ever <unk>
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        spec["model"]["byte_fallback"] = True
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    # A post-processor that adds BOS, as Llama's does: the caller encodes without it, once per document.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path = folder / f"{kind}.json"
    tok.save(str(path))
    Tokenizer.from_file(str(path))  # loads: a spec this code broke fails here, not in the test
    return str(path)
