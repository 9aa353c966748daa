"""Several sources mixed by weight, deterministically: sample ``i`` is a fixed source's sample, computed from
``i`` alone, so the mixture resumes exactly (with any dp size) and hits its weights over every epoch.

A mixture epoch is ``N`` samples, the sources' rows (or windows) summed. Source ``s`` gets ``n_s`` of them, its
weight's share of ``N`` rounded by largest remainder (so the shares are exact to one sample per epoch), spread
evenly through the epoch: its ``k``-th sample sits at the ideal position ``(k + 1/2) N / n_s``. Within a source
its samples run on through its own epochs and shuffles: a source smaller than its share repeats, a larger one
is seen partly in each mixture epoch. The schedule costs each rank a few bytes a row (a uint16 source and the
smallest integer type for ``k``); a single source needs none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from cpcompose.data.batch import Sample

__all__ = ["MixtureSource", "apportion", "schedule"]


class _Sized(Protocol):
    seq_len: int

    def sample(self, index: int) -> Sample: ...


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Integers summing to ``total`` in the proportions of ``weights`` (largest remainder; ties by order)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def schedule(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For one epoch of ``counts.sum()`` positions: the source of each position (int64) and which of that source's
    samples it is (its ``k``), each source's samples spread evenly."""
    total = int(counts.sum())
    source = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    k = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    ideal = (k + 0.5) / np.repeat(counts, counts)  # fraction of the epoch
    order = np.lexsort((source, ideal))
    return source[order], k[order]


def source_seed(seed: int, number: int) -> int:
    """Each source's own shuffle seed, so that two sources of equal size are not shuffled alike."""
    return int.from_bytes(hashlib.blake2b(repr((seed, number)).encode(), digest_size=7).digest(), "little")


class MixtureSource:
    """A weighted mixture of sources (each a map from its own sample index to a sample)."""

    def __init__(self, sources: Sequence[_Sized], sizes: Sequence[int], weights: Sequence[float]) -> None:
        """``sizes``: each source's samples per epoch of its own (rows or windows).

        Raises:
            ValueError: sources of different ``seq_len``, or lengths that differ.
        """
        if not (len(sources) == len(sizes) == len(weights)) or len({s.seq_len for s in sources}) != 1:
            raise ValueError("need one size and weight per source, and sources of one seq_len")
        if len(sources) > 1 << 16:
            raise ValueError(f"at most {1 << 16} sources, got {len(sources)}")
        self.sources, self.sizes, self.seq_len = list(sources), list(sizes), sources[0].seq_len
        self.epoch_length = int(sum(sizes))
        self.counts = apportion(weights, self.epoch_length)
        self.which: np.ndarray | None = None
        self.nth: np.ndarray | None = None
        if len(self.sources) > 1:  # one source is its own stream: no per-row arrays at all
            which, nth = schedule(self.counts)
            self.which, self.nth = which.astype(np.uint16), nth.astype(np.min_scalar_type(int(self.counts.max())))

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index``."""
        if self.which is None or self.nth is None:
            return self.sources[0].sample(index)
        epoch, pos = divmod(index, self.epoch_length)
        s = int(self.which[pos])
        return self.sources[s].sample(epoch * int(self.counts[s]) + int(self.nth[pos]))

    def source_of(self, index: int) -> int:
        """Which source global sample ``index`` comes from."""
        return 0 if self.which is None else int(self.which[index % self.epoch_length])
