"""Composable CP: the SDPA dispatch, the ParallelStyle, the context manager, the losses (the language model's, a MoE router's), the exactness probe."""

from cpcompose.parallel.context import context_parallel, context_parallel_unshard
from cpcompose.parallel.dispatch import CPAttentionMode, active_cp_region
from cpcompose.parallel.gradients import allreduce_gradients
from cpcompose.parallel.loss import (
    LossKernel,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    global_token_count,
)
from cpcompose.parallel.parallelize import parallelize_module
from cpcompose.parallel.recompute import recompute_context
from cpcompose.parallel.router_loss import cp_load_balancing_loss
from cpcompose.parallel.style import ContextParallel
from cpcompose.parallel.verify import verify

__all__ = [
    "CPAttentionMode",
    "ContextParallel",
    "LossKernel",
    "active_cp_region",
    "allreduce_gradients",
    "context_parallel",
    "context_parallel_unshard",
    "cp_cross_entropy",
    "cp_load_balancing_loss",
    "cp_linear_cross_entropy",
    "global_token_count",
    "parallelize_module",
    "recompute_context",
    "verify",
]
