"""Context-parallel attention: kernels, block planning, and the strategies (ring, all-gather, all-to-all, 2-D)."""

from cpcompose.attention.api import STRATEGIES, cp_attention
from cpcompose.attention.op import CPContext
from cpcompose.attention.options import CPOptions

__all__ = ["CPContext", "CPOptions", "STRATEGIES", "cp_attention"]
