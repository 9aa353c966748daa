"""`choose_strategy`: the strategy of one call, the same on every rank, with no communication.

Pure and deterministic: the candidates come in a fixed order (the registry's, each
strategy's `candidate_sizes` in increasing order: `ring`, `allgather`, `alltoall`, then
`alltoall_ring` by increasing all-to-all size), every rank evaluates
the same float arithmetic on the same agreed call, and predicted times are compared
rounded to 9 significant digits with ties going to the earlier candidate, so no
last-bit difference can split the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpcompose.attention.cost.calibration import Calibration, Topology
from cpcompose.attention.cost.call import AttentionCall
from cpcompose.attention.cost.model import StrategyCost, predict
from cpcompose.attention.strategies.registry import STRATEGIES, STRATEGY_NAMES

__all__ = ["CANDIDATE_STRATEGIES", "Choice", "candidates", "choose_strategy"]

CANDIDATE_STRATEGIES: tuple[str, ...] = STRATEGY_NAMES


def candidates(world: int, strategies: Sequence[str] = CANDIDATE_STRATEGIES) -> list[tuple[str, int | None]]:
    """(strategy, alltoall_size) pairs in the fixed order (2-D: each a with 1 < a < P dividing P)."""
    return [(name, a) for name in STRATEGY_NAMES if name in strategies for a in STRATEGIES[name].candidate_sizes(world)]


@dataclass(frozen=True)
class Choice:
    """The chosen strategy and every candidate's prediction.

    Attributes:
        strategy: the name to run (`CPOptions.strategy`).
        alltoall_size: the all-to-all block size for `alltoall_ring`, else None.
        costs: each candidate's `StrategyCost`, in the fixed candidate order.
        calibration: the fingerprint of the constants it was made from.
    """

    strategy: str
    alltoall_size: int | None
    costs: tuple[StrategyCost, ...]
    calibration: str

    @property
    def costs_label(self) -> str:
        """The chosen candidate's label (as in `log_line` and `scalars`)."""
        mine = (self.strategy, self.alltoall_size)
        return next(c.label for c in self.costs if (c.strategy, c.alltoall_size) == mine)

    @property
    def predicted_s(self) -> float:
        mine = (self.strategy, self.alltoall_size)
        return next(c.time_s for c in self.costs if (c.strategy, c.alltoall_size) == mine)

    def options(self) -> dict[str, object]:
        """The `CPOptions` fields to set (`alltoall_size` only for the 2-D strategy)."""
        return {"strategy": self.strategy, **({"alltoall_size": self.alltoall_size} if self.alltoall_size else {})}

    def log_line(self) -> str:
        """One line for the first call of a signature: the choice, then every candidate's time."""
        chosen = f"{self.strategy}" + (f"(a={self.alltoall_size})" if self.alltoall_size else "")
        rest = ", ".join(f"{c.label} {c.time_s * 1e3:.3g} ms" for c in self.costs)
        return (f"cp strategy auto -> {chosen} (predicted {self.predicted_s * 1e3:.3g} ms; {rest}; "
                f"calibration {self.calibration})")

    def scalars(self) -> dict[str, float]:
        """Predicted seconds per candidate, keyed for TensorBoard (`cp/predicted_s/<label>`)."""
        return {f"cp/predicted_s/{c.label}": c.time_s for c in self.costs}


def choose_strategy(call: AttentionCall, topology: Topology, calibration: Calibration, world: int,
                    strategies: Sequence[str] = CANDIDATE_STRATEGIES, *, backward: bool = True) -> Choice:
    """The fastest predicted strategy for `call` on a CP group of `world` ranks.

    Args:
        call: the agreed call (its layout's world must be `world`).
        topology: which ranks share a node.
        calibration: the machine constants (every rank must use the same: compare fingerprints).
        strategies: the strategies that may be chosen (default all; leave out
            `alltoall_ring` where it does not exist).
        backward: rank by forward+backward time (training); False: the forward alone (inference).

    Raises:
        ValueError: `world` differs from the layout's, or no candidate is left.
    """
    if call.world != world:
        raise ValueError(f"the call's layout is for {call.world} ranks, the CP group has {world}")
    pairs = candidates(world, strategies)
    if not pairs:
        raise ValueError(f"no candidate strategy among {tuple(strategies)}")
    costs = tuple(predict(call, STRATEGIES[s], topology, calibration, a, backward=backward) for s, a in pairs)
    best = min(range(len(costs)), key=lambda i: (float(f"{costs[i].time_s:.9g}"), i))
    return Choice(costs[best].strategy, costs[best].alltoall_size, costs, calibration.fingerprint())
