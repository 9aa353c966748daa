"""Context-parallel attention: kernels, block planning, and the three strategies."""

from cpcompose.attention.api import STRATEGIES, cp_attention

__all__ = ["STRATEGIES", "cp_attention"]
