"""Per-sample random generators, derived from integers and never from the global RNG."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["seeded_generator"]


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded by a hash of ``parts`` (e.g. seed, sample index).

    Hashing (rather than ``seed + index``) keeps nearby tuples uncorrelated, and a fresh generator per
    sample makes the data independent of what else consumed random numbers, of the order samples are
    drawn in, and of how they are split across ranks.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
