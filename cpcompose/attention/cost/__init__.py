"""The cost model of CP attention: each strategy's bytes, time and memory for one call, from its machine constants.

Pure functions of the call, the topology and the constants: no process group, no
communication, the same answer on every rank. A strategy's record names its family's
model (`model.RING_FAMILY`, `model.GATHER`); `cpcompose.attention.call.choose` weighs the
registry's strategies with it, and `strategy="auto"` (`cpcompose.attention.call.auto`) runs the choice.
The constants are measured by `calibrate` (`python -m cpcompose.attention.cost.calibrate`, the
`cpcompose-calibrate` command), the one module here that runs processes; nothing imports it.
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
from cpcompose.attention.cost.model import StrategyCost, bytes_sent, predict
from cpcompose.attention.cost.traffic import Transfer

__all__ = [
    "CPU_DEFAULT", "H100_CLUSTER", "INTER", "INTRA", "AttentionCall", "Calibration", "Link", "StrategyCost",
    "Topology", "Transfer", "bytes_sent", "default_calibration", "predict",
]
