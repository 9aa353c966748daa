"""The CP attention strategies by name: one record each (`strategy.Strategy`), one line each.

The order is the candidates' order for `strategy="auto"` (ties go to the earlier).
"""

from __future__ import annotations

from types import MappingProxyType

from cpcompose.attention.strategies.allgather import ALLGATHER
from cpcompose.attention.strategies.alltoall import ALLTOALL
from cpcompose.attention.strategies.alltoall_ring import ALLTOALL_RING
from cpcompose.attention.strategies.ring import RING
from cpcompose.attention.strategies.strategy import Strategy

__all__ = ["STRATEGIES", "STRATEGY_NAMES"]

STRATEGIES: MappingProxyType[str, Strategy] = MappingProxyType({s.name: s for s in (
    RING,
    ALLGATHER,
    ALLTOALL,
    ALLTOALL_RING,
)})
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)
