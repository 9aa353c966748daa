"""Shared fixtures: the multi-process rank pools."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.rank_pool import PoolCache


@pytest.fixture(scope="session")
def pools() -> Iterator[PoolCache]:
    """Forked gloo worker pools, one per group size, shared by the whole session."""
    cache = PoolCache()
    yield cache
    cache.close()
