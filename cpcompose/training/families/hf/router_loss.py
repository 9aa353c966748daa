"""Which transformers MoE families train a router loss with `output_router_logits = true`, and where their config
keeps its numbers: an explicit table keyed by `model_type`.

The trainer reproduces one router loss, transformers' `load_balancing_loss_func` (the Switch-Transformer loss, the
same body copied into each modeling file), over the whole micro-batch of the dp x cp mesh
(`cpcompose.parallel.cp_load_balancing_loss`). A table rather than recognising the function in the loaded code:
what the trainer computes must not change silently when a transformers release edits one copy or renames a key;
`tests/training/families/hf/test_router_loss_table.py` checks every entry against the installed transformers (the
function's body is Qwen3-MoE's, the causal LM's forward calls it with the keys listed, no router z-loss) and that no
causal LM calling it is missing. A `model_type` not in the table is refused by name with `output_router_logits =
true`: the DeepSeek-V3 line, LFM2-MoE, Llama 4 and others only record the logits (DeepSeek-V3 balances by updating
`e_score_correction_bias`, which transformers never does); doge computes another loss. No causal LM in
transformers 5.24 has a router z-loss (switch_transformers' and nllb_moe's are encoder-decoders).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from cpcompose.config import ConfigError
from cpcompose.training.families.record import RouterLoss

__all__ = ["LOAD_BALANCING", "LoadBalancingKeys", "router_loss_of"]


@dataclass(frozen=True)
class LoadBalancingKeys:
    """Where a family's config keeps the numbers its causal LM passes to `load_balancing_loss_func` (dotted: a
    key of a nested config)."""

    num_experts: str
    """Routed experts per MoE layer."""
    top_k: str = "num_experts_per_tok"
    """Experts chosen per token."""
    coefficient: str = "router_aux_loss_coef"
    """The loss's weight in the causal LM's total."""


_QWEN = LoadBalancingKeys("num_experts")
_MIXTRAL = LoadBalancingKeys("num_local_experts")

LOAD_BALANCING: dict[str, LoadBalancingKeys] = {
    **dict.fromkeys(("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp",
                     "qwen4_exp_text", "olmoe", "flex_olmo", "flint", "ernie4_5_moe", "jamba", "laguna", "lara_mini",
                     "mellum"), _QWEN),
    **dict.fromkeys(("mixtral", "minimax", "minimax_m2", "minimax_m3_vl_text", "phimoe", "gpt_oss", "granitemoe",
                     "granitemoe_swa", "granitemoehybrid", "granitemoeshared"), _MIXTRAL),
    "dbrx": LoadBalancingKeys("ffn_config.moe_num_experts", "ffn_config.moe_top_k", "ffn_config.moe_loss_weight"),
}
"""The causal LMs (by `model_type`) whose forward adds `coefficient x load_balancing_loss_func(router_logits,
num_experts, top_k, attention_mask)` to the loss in transformers 5.24."""


def _read(config: object, key: str) -> object:
    return functools.reduce(lambda c, k: getattr(c, k, None), key.split("."), config)


def router_loss_of(model: nn.Module, *, where: str = "config.json") -> RouterLoss | None:
    """The router loss a transformers causal LM trains with `output_router_logits = true`, which the trainer
    reproduces over the whole micro-batch; None when `output_router_logits` is false.

    Raises:
        ConfigError: `output_router_logits` is true for a `model_type` not in `LOAD_BALANCING` (its causal LM computes
            no router loss, or one the trainer does not reproduce), or its numbers are not numbers.
    """
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    model_type = getattr(config, "model_type", None)
    cls = next(c for c in type(model).__mro__ if not c.__module__.startswith("cpcompose."))  # not the trainer's
    keys = LOAD_BALANCING.get(model_type)
    if keys is None:
        forward = getattr(cls, "forward", None)
        while hasattr(forward, "__wrapped__"):
            forward = forward.__wrapped__
        calls = "load_balancing_loss_func" in getattr(getattr(forward, "__code__", None), "co_names", ())
        what = ("computes a router loss not in the trainer's table of transformers' load-balancing losses "
                "(cpcompose.training.families.hf.router_loss.LOAD_BALANCING)" if calls else "computes no router loss")
        raise ConfigError(f"model.path: {where} sets output_router_logits = true, but {cls.__name__} (model_type "
                          f"{model_type!r}) {what}, which the trainer does not reproduce; set output_router_logits = "
                          "false in config.json")
    numbers = [_read(config, key) for key in (keys.num_experts, keys.top_k, keys.coefficient)]
    if not (isinstance(numbers[0], int) and isinstance(numbers[1], int) and isinstance(numbers[2], (int, float))
            and 0 < numbers[1] <= numbers[0]):
        raise ConfigError(f"model.path: {where} sets output_router_logits = true, but its {keys.num_experts}, "
                          f"{keys.top_k}, {keys.coefficient} are {numbers}, not the experts, the experts per token and "
                          "the loss's coefficient")
    return RouterLoss(num_experts=numbers[0], top_k=numbers[1], coefficient=float(numbers[2]))
