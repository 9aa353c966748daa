"""Expert parallelism (EP) for mixture-of-experts models: the pieces above the communication layer.

A mixture-of-experts layer under EP sends each routed row to the rank that holds its
expert and the expert's result back (`dispatch`, `combine`: comm's token dispatch with
the cross-rank agreement in front). The MoE layer, the EP mesh and its parallel style
come later (issue 38); this package is where they go.
"""

from cpcompose.comm import Dispatched
from cpcompose.experts.dispatch import combine, dispatch

__all__ = ["Dispatched", "combine", "dispatch"]
