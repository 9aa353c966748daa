"""Planning CP attention: a cost model of each strategy, its machine constants, and `choose_strategy`.

Pure functions of the call, the topology and the constants: no process group, no
communication, the same answer on every rank.
"""

from cpcompose.attention.cost.calibration import (
    CPU_DEFAULT,
    H100_CLUSTER,
    INTER,
    INTRA,
    Calibration,
    Link,
    Topology,
    default_calibration,
)
from cpcompose.attention.cost.call import AttentionCall
from cpcompose.attention.cost.choose import CANDIDATE_STRATEGIES, Choice, candidates, choose_strategy
from cpcompose.attention.cost.model import StrategyCost, predict
from cpcompose.attention.cost.traffic import Transfer, bytes_sent, transfers

__all__ = [
    "CANDIDATE_STRATEGIES", "CPU_DEFAULT", "H100_CLUSTER", "INTER", "INTRA", "AttentionCall", "Calibration", "Choice",
    "Link", "StrategyCost", "Topology", "Transfer", "bytes_sent", "candidates", "choose_strategy",
    "default_calibration", "predict", "transfers",
]
