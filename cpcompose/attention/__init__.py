"""Context-parallel attention: kernels, block planning, the strategies (ring, all-gather, all-to-all, 2-D)
and their cost model."""

from cpcompose.attention.api import cp_attention
from cpcompose.attention.op import CPContext
from cpcompose.attention.options import CPOptions
from cpcompose.attention.registry import STRATEGIES

__all__ = ["CPContext", "CPOptions", "STRATEGIES", "cp_attention"]
