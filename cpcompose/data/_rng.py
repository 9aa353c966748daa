"""Per-sample random generators, derived from integers and never from the global RNG."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["EpochShuffle", "seeded_generator"]


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded by a hash of ``parts`` (e.g. seed, sample index).

    Hashing (rather than ``seed + index``) keeps nearby tuples uncorrelated, and a fresh generator per
    sample makes the data independent of what else consumed random numbers, of the order samples are
    drawn in, and of how they are split across ranks.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class EpochShuffle:
    """Global sample position -> item, a fresh permutation of ``size`` items per epoch from ``(seed, epoch)``.

    One permutation is cached: ranks read positions in increasing order, so it is rebuilt once an epoch.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def __call__(self, index: int) -> int:
        epoch, pos = divmod(index, self.size)
        if epoch != self._epoch:
            self._perm = torch.randperm(self.size, generator=seeded_generator(self.seed, epoch))
            self._epoch = epoch
        return int(self._perm[pos])
