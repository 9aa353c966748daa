"""Qwen4-Exp's per-layer embeddings (PLE) under CP: its hashed n-gram ids and its dilated short conv.

A PLE layer mixes tokens twice, both in transformers' own code:

* `Qwen4ExpTextNGramEmbedding.forward` hashes each token with the `ngram_size - 1` tokens
  before it (an EOS token starts a new segment; before the sequence, EOS). On a shard each
  run's first tokens would read nothing before them, so each run gets the ids before it in
  its document from their owners (EOS before the document's start, as when the document
  runs alone), and transformers' own forward hashes the run, handed those ids as its
  cached context (the path it takes when generating with a cache);
* `Qwen4ExpTextPLELayer._short_conv` is a causal depthwise conv with dilation `ngram_size`
  and a silu: the same conv, undilated with zeros between its taps (exact: products by
  zero add nothing), through `cpcompose.mixers.cp_causal_conv1d`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpcompose.agreement import agree_across_ranks
from cpcompose.comm import CPGroup, fetch_positions
from cpcompose.mixers.api_checks import tensor_fields
from cpcompose.mixers.conv import cp_causal_conv1d, halo_positions
from cpcompose.mixers.region import Region

__all__ = ["cp_ngram_embedding", "cp_ple_short_conv"]

_NO_CACHE = "got a cache (a generation cache): under CP call the model with use_cache=False and no cache"


class _Context:
    """The one cache call the n-gram embedding makes, answered with a run's preceding ids (and no update)."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.ids

    def update_conv_state(self, *args: Any, **kwargs: Any) -> None:
        return None


def cp_ngram_embedding(
    original: Callable[..., Tensor], region: Region, self: nn.Module, input_ids: Tensor,
    cache: Any = None,
) -> Tensor:
    """`Qwen4ExpTextNGramEmbedding.forward(input_ids (batch, seq_local), cache)` under CP.

    Returns:
        `(batch, seq_local, embedding)`, each run hashed with its document's preceding ids.
    """
    cp, layout, context = CPGroup.from_mesh(region.mesh), region.layout(), int(self.context_len)
    seq_local = input_ids.shape[-1]
    error = f"{type(self).__name__} {_NO_CACHE}" if cache is not None else None
    if error is None and input_ids.ndim != 2:
        error = f"{type(self).__name__}: input_ids must be (batch, seq), got {tuple(input_ids.shape)}"
    error = error or region.options.error(cp.world) or (layout.local_len_error(seq_local) if layout else None)
    signature = [*tensor_fields("input_ids", input_ids), ("layout", -1 if layout is None else layout.identity),
                 ("context", context)]
    agree_across_ranks(cp, error, signature, what=type(self).__name__, device=input_ids.device)
    assert layout is not None
    seq_len = seq_local * cp.world
    wanted = halo_positions(layout, seq_len, context)
    ids = input_ids.long()
    fetched = fetch_positions(ids, [sum(w, []) for w in wanted], cp=cp, layout=layout, seq_len=seq_len,
                              meter=region.options.meter)
    outputs, at = [], 0
    for run, before in zip(layout.runs(cp.rank, seq_len), wanted[cp.rank]):
        eos = ids.new_full((ids.shape[0], context - len(before)), self.eos_token_id)  # before the document
        history = torch.cat([eos, fetched[:, at:at + len(before)]], dim=1)
        outputs.append(original(self, ids[:, run.row:run.row + run.length], _Context(history)))
        at += len(before)
    return torch.cat(outputs, dim=1)


def cp_ple_short_conv(
    original: Callable[..., Tensor], region: Region, self: nn.Module, hidden_states: Tensor,
    cache: Any = None,
) -> Tensor:
    """`Qwen4ExpTextPLELayer._short_conv(hidden_states (batch, seq_local, channels), cache)` under CP:
    `silu(conv1d(...))` over each run's document, the dilated taps spread over one undilated kernel."""
    conv = self.conv1d
    error = f"{type(self).__name__} {_NO_CACHE}" if cache is not None else None
    dilation, width = conv.dilation[0], conv.kernel_size[0]
    if error is None and (conv.groups != conv.in_channels or conv.out_channels != conv.in_channels
                          or conv.stride != (1,) or conv.padding != (0,)):
        error = f"{type(self).__name__}.conv1d ({conv}) is not a depthwise, unpadded, stride-1 conv"
    weight = conv.weight.reshape(conv.weight.shape[0], -1)  # what the agreement sees when refusing
    if error is None:  # the taps `dilation` apart in one undilated kernel, differentiable w.r.t. the conv's weight
        taps = torch.arange(width, device=weight.device) * dilation
        weight = weight.new_zeros(conv.out_channels, (width - 1) * dilation + 1).index_copy(1, taps, weight)
    out = cp_causal_conv1d(hidden_states, weight, conv.bias, mesh=region.mesh, layout=region.options.layout,
                           meter=region.options.meter, caller_error=error)
    return F.silu(out)
