"""Context-parallel attention, in five rooms, bottom to top: `local/` (kernels, block planning, the
softmax merge), `cost/` (the cost model), `strategies/` (ring, all-gather, all-to-all, 2-D), `call/`
(options, checks and agreement, the automatic choice, the entry points) and `sparse/` (indexer-selected
attention: each query reads only the keys it selected)."""

from cpcompose.attention.call.api import cp_attention
from cpcompose.attention.call.op import CPContext
from cpcompose.attention.call.options import CPOptions
from cpcompose.attention.strategies.registry import STRATEGIES

__all__ = ["CPContext", "CPOptions", "STRATEGIES", "cp_attention"]
