"""A Hugging Face causal LM as body + head, for a loss that never builds the logits.

`cp_linear_cross_entropy` takes the final hidden states and the output weight and computes the
loss a chunk of tokens at a time. To use it on a transformers model, the model must be cut where
its `ForCausalLM.forward` calls `self.lm_head(hidden_states)`, and whatever the family does to the
logits after that must come along: Gemma 2/3 softcap them (`final_logit_softcapping`), Cohere
multiplies them by `logit_scale`, Granite divides them by `logits_scaling`. No attribute says what
a family does there (it is code in its forward), so `causal_lm_head` knows the families listed in
`HEADS`, each checked against the model's own logits in float64
(tests/integrations/test_transformers_head.py), and refuses any other by name.

    head = cphf.causal_lm_head(model)
    hidden = head.body(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    loss = head.loss(hidden, labels, mesh=mesh)   # = cp_cross_entropy(model(...).logits, labels, mesh=mesh)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.parallel.loss import cp_linear_cross_entropy

__all__ = ["HEADS", "CausalLMHead", "causal_lm_head"]

_Head = Callable[[Any], tuple[float | None, float | None]]  # the model -> (softcap, scale)


def _plain(model: Any) -> tuple[float | None, float | None]:
    return None, None


def _softcapped(model: Any) -> tuple[float | None, float | None]:
    return model.config.final_logit_softcapping, None


def _logit_scale(model: Any) -> tuple[float | None, float | None]:
    return None, float(model.config.logit_scale)


def _logits_scaling(model: Any) -> tuple[float | None, float | None]:
    return None, 1.0 / float(model.config.logits_scaling)


def _lm_head_multiplier(model: Any) -> tuple[float | None, float | None]:
    return None, float(model.config.lm_head_multiplier)


def _logits_soft_cap(model: Any) -> tuple[float | None, float | None]:
    return float(model.config.logits_soft_cap), None


def _output_logit_soft_cap(model: Any) -> tuple[float | None, float | None]:
    cap = model.config.output_logit_soft_cap
    return (None if cap is None else float(cap)), None


def _plain_without_z_loss(model: Any) -> tuple[float | None, float | None]:
    """Bamba: plain logits, but its own loss adds `z_loss_coefficient * logsumexp^2` when set, which the fused
    (language-model) loss would leave out."""
    coefficient = float(getattr(model.config, "z_loss_coefficient", 0.0) or 0.0)
    if coefficient > 0:
        raise ValueError(f"{type(model).__name__}: config.z_loss_coefficient = {coefficient} adds a z-loss to the "
                         "model's loss, which the language-model loss leaves out; set it to 0 in config.json")
    return None, None


HEADS: Mapping[str, _Head] = MappingProxyType({
    **dict.fromkeys(
        ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "gemma",
         "deepseek_v3", "lfm2", "phi3", "olmo2",
         # hybrids: `lm_head(hidden)` and nothing after it (Mamba's, Mamba2's, Nemotron-H's `.float()` is a cast)
         "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "nemotron_h", "lfm2_moe", "lfm3", "gpt_oss",
         "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "lara_mini", "bailing_hybrid",
         "qwen4_exp_text", "minimax", "rwkv",
         # indexer-selected (DSA) attention: plain logits
         "deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text"),
        _plain,
    ),
    "bamba": _plain_without_z_loss,
    "falcon_h1": _lm_head_multiplier,  # logits * lm_head_multiplier (muP)
    "granitemoehybrid": _logits_scaling,
    "recurrent_gemma": _logits_soft_cap,  # logits = cap * tanh(logits / cap), always
    "xlstm": _output_logit_soft_cap,  # the same in training (inference chunks it, same values)
    "gemma2": _softcapped,  # logits = cap * tanh(logits / cap) when final_logit_softcapping is set
    "gemma3_text": _softcapped,
    "cohere": _logit_scale,  # logits * logit_scale
    "cohere2": _logit_scale,
    "granite": _logits_scaling,  # logits / logits_scaling
    "granitemoe": _logits_scaling,
})
"""`config.model_type` -> what its `ForCausalLM.forward` does to `lm_head`'s output: (softcap, scale)."""


@dataclass(frozen=True)
class CausalLMHead:
    """A causal LM cut at its output layer: logits = softcap(scale * (hidden @ weight.T + bias))."""

    body: nn.Module
    """The decoder (`model.model`): `body(input_ids=..., position_ids=..., use_cache=False).last_hidden_state`
    is what the model's own forward feeds its `lm_head`."""
    weight: Tensor
    """`(vocab, hidden)`, the output layer's weight (read when `causal_lm_head` was called: call it inside the
    forward where FSDP has gathered it)."""
    bias: Tensor | None
    """`(vocab,)` or None."""
    softcap: float | None
    """Final-logit softcapping (Gemma 2/3): `softcap * tanh(logits / softcap)`, or None."""
    scale: float | None
    """A factor on the logits (Cohere's `logit_scale`, Granite's `1 / logits_scaling`), or None."""

    def linear_inputs(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """`(hidden, weight, bias)` with `scale` folded in, so that `F.linear` of them is the scaled logits.

        The factor goes on the hidden states and the bias, not on the weight: a scaled copy of the
        `vocab x hidden` weight would cost as much as the weight.
        """
        if self.scale is None:
            return hidden, self.weight, self.bias
        bias = None if self.bias is None else self.bias * self.scale
        return hidden * self.scale, self.weight, bias

    def logits(self, hidden: Tensor) -> Tensor:
        """The model's logits from `hidden`, whole (for a check, or the unfused loss)."""
        x, weight, bias = self.linear_inputs(hidden)
        z = F.linear(x, weight, bias)
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def loss(self, hidden: Tensor, labels: Tensor, *, mesh: DeviceMesh, **kwargs: Any) -> Tensor:
        """This rank's share of the global mean cross-entropy, the logits never whole (`cp_linear_cross_entropy`).

        Args:
            hidden: `(..., hidden)` the body's last hidden states of this rank's tokens.
            labels: `(...)` targets (already shifted, `-100` = no loss).
            mesh: the mesh the valid tokens are counted over (dp x cp in training).
            **kwargs: `cp_linear_cross_entropy`'s other options (`num_tokens`, `chunk_tokens`, `ignore_index`,
                `kernel`).
        """
        x, weight, bias = self.linear_inputs(hidden)
        return cp_linear_cross_entropy(x, weight, labels, mesh=mesh, bias=bias, softcap=self.softcap, **kwargs)


def causal_lm_head(model: nn.Module) -> CausalLMHead:
    """`model` (a transformers `...ForCausalLM`) as body + output layer + what its forward does to the logits.

    Raises:
        ValueError: the family is not in `HEADS` (its forward may change the logits in a way this does not
            know), or the model has no `lm_head` / base model to cut at.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    known = HEADS.get(model_type) if isinstance(model_type, str) else None
    if known is None:
        raise ValueError(
            f"{type(model).__name__} (model_type {model_type!r}): cpcompose does not know what its forward does to "
            f"the logits after lm_head (softcapping, scaling, ...), so it cannot fuse its loss; families it knows: "
            f"{', '.join(sorted(HEADS))}. Compute the loss from the model's own logits instead"
        )
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # RWKV: `head`
    prefix = getattr(model, "base_model_prefix", None)
    body = getattr(model, prefix, None) if isinstance(prefix, str) else None
    if not isinstance(lm_head, nn.Linear) or not isinstance(body, nn.Module) or body is model:
        raise ValueError(f"{type(model).__name__}: expected an nn.Linear lm_head and a base model "
                         f"(model.{prefix}) to cut at, got {type(lm_head).__name__} and {type(body).__name__}")
    softcap, scale = known(model)
    return CausalLMHead(body=body, weight=lm_head.weight, bias=lm_head.bias,
                        softcap=None if softcap is None else float(softcap), scale=scale)
