"""What a run's data is, for the banner: a line per source and a PNG of its document lengths.

Plain data in, plain text and a picture out, so the banner and the dry run can show it without knowing stores.
The PNG is drawn with Pillow (installed with tensorboard), like the loss plot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from cpcompose.data.store.tokens import TokenStore

__all__ = ["counted", "length_histogram", "save_length_histogram", "summary_lines"]

_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
_W, _H, _LEFT, _BOTTOM, _TOP = 800, 420, 70, 60, 40


def counted(number: int | float | str, noun: str) -> str:
    """``number`` and ``noun``, singular for exactly one: "1 document", "2 documents", "0.5 epochs".

    Integers get thousands separators; a string is a number already formatted ("1.00" stays plural, as one
    writes it)."""
    text = f"{number:,}" if isinstance(number, int) else str(number)
    return f"{text} {noun}" if text == "1" else f"{text} {noun}s"


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per source of :meth:`StoreMixture.summary`'s rows."""
    lines = []
    for row in rows:
        epochs = row.get("epochs")
        run = "" if epochs is None else f", {counted(format(epochs, '.3g'), 'epoch')} of it in this run"
        lines.append(f"data {row['path']}: {counted(row['documents'], 'document')}, "
                     f"{counted(row['tokens'], 'token')}, {counted(row['samples_per_epoch'], 'sample')} an epoch, "
                     f"{100 * row['share']:.1f}% of the mixture{run} (store {row['store']})")
    return lines


def length_histogram(store: TokenStore, edges: np.ndarray) -> np.ndarray:
    """Tokens in documents of each length bin (``edges`` in tokens), as a fraction of the store's tokens."""
    lengths = store.lengths()
    weights, _ = np.histogram(lengths, bins=edges, weights=lengths.astype(np.float64))
    return weights / max(float(lengths.sum()), 1.0)


def save_length_histogram(stores: Sequence[TokenStore], names: Sequence[str], path: str | Path) -> None:
    """A PNG of where each source's tokens are by document length (power-of-two bins), one bar colour each."""
    longest = max((int(s.lengths().max()) for s in stores if s.num_docs), default=1)
    edges = 2.0 ** np.arange(0, math.ceil(math.log2(max(longest, 2))) + 2)
    bars = [length_histogram(s, edges) for s in stores]
    height = _H + 14 * len(bars)  # a legend line per source under the axis
    img = Image.new("RGB", (_W, height), "white")
    draw = ImageDraw.Draw(img)
    x0, x1, y0, y1 = _LEFT, _W - 20, _H - _BOTTOM, _TOP
    draw.rectangle((x0, y1, x1, y0), outline="black")
    draw.text((x0, 12), "share of each source's tokens by document length (tokens)", fill="black")
    top = max((float(b.max()) for b in bars if b.size), default=1.0) or 1.0
    slot = (x1 - x0) / (len(edges) - 1)
    width = slot / (len(bars) + 1)
    for b, share in enumerate(bars):
        color = _COLORS[b % len(_COLORS)]
        for i, value in enumerate(share.tolist()):
            left = x0 + i * slot + (b + 0.5) * width
            draw.rectangle((left, y0 - value / top * (y0 - y1), left + width, y0), fill=color)
        draw.text((x0, y0 + 28 + 14 * b), f"== {names[b]}", fill=color)
    for i, edge in enumerate(edges[:-1]):
        if i % 2 == 0:
            draw.text((x0 + i * slot, y0 + 8), f"{int(edge):,}", fill="black")
    draw.text((8, y1 - 4), f"{top:.0%}", fill="black")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
