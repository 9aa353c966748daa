"""A loss-curve PNG drawn with Pillow (already installed with tensorboard).

So a user can look at the run without starting TensorBoard, and without adding
matplotlib as a dependency for one picture.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw

__all__ = ["plot_loss"]

_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 800, 480, 70, 20, 40, 50


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo or 1.0
    step = 10 ** math.floor(math.log10(span / count))
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= count:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def plot_loss(steps: Sequence[int], losses: Sequence[float], path: str | Path, *, title: str) -> None:
    """Write a line plot of `losses` against `steps` to `path` (PNG)."""
    img = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(img)
    x0, x1, y0, y1 = _LEFT, _W - _RIGHT, _H - _BOTTOM, _TOP
    finite = [(s, l) for s, l in zip(steps, losses) if math.isfinite(l)]
    draw.text((_LEFT, 12), title, fill="black")
    draw.rectangle((x0, y1, x1, y0), outline="black")
    if finite:
        smin, smax = finite[0][0], max(finite[-1][0], finite[0][0] + 1)
        lmin, lmax = min(l for _, l in finite), max(l for _, l in finite)
        lmin, lmax = (lmin, lmax) if lmax > lmin else (lmin - 1, lmax + 1)

        def xy(s: float, l: float) -> tuple[float, float]:
            return x0 + (s - smin) / (smax - smin) * (x1 - x0), y0 - (l - lmin) / (lmax - lmin) * (y0 - y1)

        for tick in _nice_ticks(lmin, lmax):
            _, y = xy(smin, tick)
            draw.line((x0, y, x1, y), fill=(230, 230, 230))
            draw.text((8, y - 6), f"{tick:.3g}", fill="black")
        for tick in _nice_ticks(smin, smax):
            x, _ = xy(tick, lmin)
            draw.text((x - 10, y0 + 8), f"{int(tick)}", fill="black")
        draw.line([xy(s, l) for s, l in finite], fill=(31, 119, 180), width=2)
    draw.text(((x0 + x1) // 2 - 10, _H - 22), "step", fill="black")
    draw.text((8, _TOP - 28), "loss", fill="black")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
