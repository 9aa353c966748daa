"""Texts encoded in bounded pieces whose ids, put together, are exactly the whole text's ids.

Why: while the `tokenizers` library encodes a text it holds about 260-290 bytes per token (its ``Encoding``:
ids, token strings, offsets, masks), so encoding a 10 MB document at once costs about 2 GB, and a 64 MiB part of
a ``.txt`` file many GB. Here a text longer than ``PIECE_CHARS`` is cut into pieces of about that size, and the
texts and pieces go to the tokenizer in calls of at most ``CALL_CHARS`` characters (more with more cores, so
every core has a piece), which bounds the tokenizer's memory whatever the documents' lengths.

Exactness. A cut is placed only where a word ends and a space or a line break follows (``word| next``,
``word|\\n``): there BPE's merges never cross, as pre-tokenizers (GPT-2's and Llama 3's regexes, Metaspace) start
a new pre-token at the space, and a piece that starts with a space gets no prefix space (ByteLevel's
``add_prefix_space`` and Metaspace's ``prepend_scheme`` add one only to a text that lacks it); a normalizer that
prepends "▁" to every string (older SentencePiece conversions) is met by leaving the space out of the next
piece, which the normalizer puts back. None of that holds for every tokenizer (one that strips whitespace, a
vocabulary with tokens across a space), so every cut is checked before it is used: the text within
``WINDOW_CHARS`` of the cut is encoded whole and as its two halves (the right one with and without its leading
space), and the cut is kept only where the halves' ids put together are the whole window's. Tokenizers decide
each token from a few characters around it, so a window of hundreds of characters sees everything that decides
the ids at the cut. A cut that fails is moved to the next word boundary (up to ``TRIES``); a text that no cut
passes is encoded whole, and the caller is told (it warns, naming the file), so ids are never silently
different. Specials: the caller encodes without the post-processor's (BOS and
EOS are added once per document by :class:`cpcompose.data.formats.RecordReader`), so none appears per piece.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

from cpcompose.data.tokenizer import Tokenizer

__all__ = ["CALL_CHARS", "PIECE_CHARS", "TRIES", "WINDOW_CHARS", "encode_texts"]

PIECE_CHARS = 256 << 10
"""Texts longer than this (characters) are cut into pieces of about this size (at most 1.5 times, when every
cut passes its check): about 60 MB of the tokenizer's state each for a byte-level BPE of few merges."""
CALL_CHARS = 1 << 20
"""Characters of text (whole texts and pieces) per tokenizer call, or one piece per core if that is more: what
bounds the tokenizer's memory, ~230 MB with a byte-level BPE of few merges (1.3 characters a token), less with a
real vocabulary. Calls of 1 and 4 MiB encode equally fast (measured, 2 cores)."""
WINDOW_CHARS = 512
"""Characters each side of a cut that are encoded to check it."""
TRIES = 4
"""Word boundaries tried for each cut before that cut is given up (its two pieces are then encoded as one)."""

_BOUNDARY = re.compile(r"(?<=\w)(?= \w)|(?<=\w)(?=\n)")
"""Before the space between two word characters, or before a line break that ends a word."""

Uncut = Callable[[int, int], None]
"""Told (text's position in the batch, characters of its longest piece) about a text whose longest piece is
over twice PIECE_CHARS: some cut failed its check everywhere it was tried, or the text has no word boundary."""


def encode_texts(tokenizer: Tokenizer, texts: list[str], *, uncut: Uncut | None = None,
                 piece_chars: int = PIECE_CHARS, call_chars: int = CALL_CHARS) -> list[list[int]]:
    """``tokenizer.encode_batch(texts)``, the same ids, with the tokenizer's memory bounded by ``call_chars``.

    ``piece_chars`` is an argument so that tests can cut short texts many times (the check's window is then
    at most half a piece).
    """
    window_chars = min(WINDOW_CHARS, piece_chars // 2)
    spans: list[tuple[int, int, int]] = []  # (text, start, end), in order
    for i, text in enumerate(texts):
        cuts = verified_cuts(tokenizer, text, piece_chars, window_chars) if len(text) > piece_chars else []
        starts = [0, *(c + skip for c, skip in cuts)]
        ends = [*(c for c, _ in cuts), len(text)]
        longest = max(b - a for a, b in zip(starts, ends))
        if uncut is not None and longest > 2 * piece_chars:
            uncut(i, longest)
        spans += [(i, a, b) for a, b in zip(starts, ends)]
    ids: list[list[int]] = [[] for _ in texts]
    budget = max(call_chars, piece_chars * _cores())
    for call in _calls(spans, budget):
        for (i, _, _), piece_ids in zip(call, tokenizer.encode_batch([texts[i][a:b] for i, a, b in call])):
            ids[i] += piece_ids  # lists of our own, which RecordReader.document may extend in place
    return ids


def verified_cuts(tokenizer: Tokenizer, text: str, piece_chars: int, window_chars: int) -> list[tuple[int, int]]:
    """Where ``text`` is cut, every cut checked: (offset, 0) when the next piece starts at the offset, (offset, 1)
    when it starts after the space there (see below). One cut near each multiple of ``piece_chars``, at the first
    of up to TRIES word boundaries within half a piece after it that passes; sorted.

    The space is left out where a tokenizer makes it again: a normalizer that prepends "▁" to every string (the
    older SentencePiece conversions, Llama 2's among them) turns the piece "next ..." into "▁next", as it turned
    " next" inside the whole text, where " next ..." would become "▁▁next". The same window check decides."""
    candidates: dict[int, Iterator[int]] = {}
    for target in range(piece_chars, len(text), piece_chars):
        end = min(target + piece_chars // 2, len(text) - 1)
        found = (m.start() for m in _BOUNDARY.finditer(text, target, end + 2) if m.start() <= end)
        candidates[target] = iter([c for c, _ in zip(found, range(TRIES))])
    cuts: dict[int, tuple[int, int]] = {}
    for _ in range(TRIES):  # each round checks the next boundary of every cut still open, in one call
        tried = [(target, c) for target, it in candidates.items() if target not in cuts
                 for c in [next(it, None)] if c is not None]
        if not tried:
            break
        windows = []
        for _, c in tried:
            left, right = text[c - window_chars : c], text[c : c + window_chars]
            windows += [left + right, left, right, right[1:] if right.startswith(" ") else right]
        encoded = tokenizer.encode_batch(windows)
        for n, (target, c) in enumerate(tried):
            whole, left, right, after_space = encoded[4 * n : 4 * n + 4]
            if whole == left + right:
                cuts[target] = (c, 0)
            elif text[c] == " " and whole == left + after_space:
                cuts[target] = (c, 1)
    return sorted(cuts.values())


def _calls(spans: list[tuple[int, int, int]], budget: int) -> Iterator[list[tuple[int, int, int]]]:
    """Consecutive spans grouped into calls of at most ``budget`` characters (a longer span alone)."""
    call: list[tuple[int, int, int]] = []
    size = 0
    for span in spans:
        length = span[2] - span[1]
        if call and size + length > budget:
            yield call
            call, size = [], 0
        call.append(span)
        size += length
    if call:
        yield call


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
