"""`parallelism.tp` > 1 for a Hugging Face model: its decoder layers split as the family's plan says.

The plan and its checks are the integration's (`cpcompose.integrations.transformers.tensor_parallel`): the
attention's q/k/v projections column-wise (each tp rank its share of the heads and kv heads), o_proj row-wise,
the feed-forward's gate/up column-wise and down row-wise, per-head q/k norms replicated with their gradient
summed. Applied before FSDP2, which then shards each split parameter over dp_shard x cp on top of its tp split
(a 2-D mesh: dp_shard_cp x tp), so the weights load and export as one DTensor per tensor whatever the layout.

CP composes unchanged: the CP region intercepts attention calls, whose q, k and v are plain tensors with this tp
rank's heads; the exchange runs over the cp mesh, with the same heads on every cp rank of a tp coordinate.

The input embedding, the final norm and the output layer stay replicated over tp (the family's plan would split
`lm_head` by vocabulary and gather the logits, `colwise_gather_output`): the fused loss
(`cp_linear_cross_entropy`) takes the whole output weight and makes each token's log-sum-exp over the whole
vocabulary a chunk of tokens at a time, so a vocabulary split would need a loss with a cross-rank log-sum-exp;
replicated, every tp rank computes the same loss over the same tokens (as the trainer's own Llama does), and
FSDP still shards that weight over dp_shard x cp, so its memory is not the tp degree's to save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.config import ConfigError, JobConfig

if TYPE_CHECKING:  # the integration imports transformers: only once model.name = "hf" has checked it is there
    from cpcompose.integrations.transformers.tensor_parallel import TensorParallelPlan

__all__ = ["apply_hf_tensor_parallel", "check_hf_tensor_parallel"]


def check_hf_tensor_parallel(model: nn.Module, layers: Sequence[nn.Module], config: JobConfig) -> TensorParallelPlan:
    """The plan `parallelism.tp` splits `model`'s `layers` by, checked (no ranks needed).

    Raises:
        ConfigError: `parallelism.tp`, naming every count or part that cannot be split.
    """
    from cpcompose.integrations.transformers.tensor_parallel import tensor_parallel_plan

    tp = config.parallelism.tp
    prefix = f"{getattr(model, 'base_model_prefix', 'model')}.layers"
    try:
        return tensor_parallel_plan(model, layers, tp, prefix=prefix)
    except ValueError as e:
        raise ConfigError(f"parallelism.tp: {tp}: {type(model).__name__} ({config.model.path}) cannot be split "
                          f"exactly: {e}; set parallelism.tp = 1 (parallelism.cp and dp_shard split it instead)") \
            from None


def apply_hf_tensor_parallel(model: nn.Module, layers: Sequence[nn.Module], config: JobConfig,
                             mesh: DeviceMesh) -> None:
    """Split `layers` over the root `mesh`'s tp axis, in place (before FSDP)."""
    from cpcompose.integrations.transformers.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(layers, check_hf_tensor_parallel(model, layers, config), mesh["tp"])
