"""DeepSeek sparse attention's indexer under CP: each query's top-k over the global causal row.

transformers' DSA families (DeepSeek-V3.2, GLM-5 `glm_moe_dsa`, HunYuan V4, Mistral Large
4, dots3, A.X K2) share one indexer: per-token projections give each query a few
heads and each token one indexer key; a query's score row holds its (ReLU'd, weighted)
dot products with every key, masked by the causal mask, and `topk` keeps the best
`index_topk`. The attention then reads only those keys (`indices=` to the attention
interface, where "cpcompose" is neither "eager" nor "sdpa").

Under CP a rank holds only its queries' shard. Inside a CP region the indexer's forward
is called with two stand-ins: a `cache` whose `update_indexer` returns every rank's
indexer keys in global order (gathered: one small head per token), and the mask of the
global row (causal by global position, documents of a pack). So the model's own code
computes each local query's full score row, entry for entry as one process does, and
its `topk` makes the same choice, ties included (a selection is a function of the row's
values and their order only). The indices it returns are global positions, which
`cpcompose.attention.call.selected` reads (and which GLM-5's "shared" layers reuse as they are).
The indexer is not trained through the model's loss in transformers (its forward runs
under no_grad, and no family computes an indexer loss), so there is no gradient to carry.

Refused, on every rank before any key moves: a KV cache, and whatever the region's mask
hook marked (padding the layout cannot express, ...).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.attention.strategies.selection import allowed_keys, global_rows
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.parallel.dispatch import CPAttentionMode, active_cp_region

__all__ = ["INDEXERS", "INDEXED_FAMILIES", "install_indexers", "routed_indexers"]

INDEXERS: tuple[str, ...] = (
    "deepseek_v32.DeepseekV32Indexer",
    "glm_moe_dsa.GlmMoeDsaIndexer",
    "hy_v4.HYV4Indexer",
    "hy_v4_vl.HYV4VLIndexer",
    "mistral_large4.MistralLarge4TextIndexer",
    "dots3_note.Dots3NoteTextIndexer",
    "axk2.AXK2Indexer",
)
"""`<modeling name>.<Class>` of the DSA indexers whose forward runs over the global row inside a CP region."""

INDEXED_FAMILIES = frozenset(path.split(".")[0] for path in INDEXERS)
"""The families whose attention slices the mask for its indexer: inside a region their mask hook returns a marker."""

_ROUTED_ATTR = "__cpcompose_indexer__"
_REFUSAL_ATTR = "_cpcompose_refusal"  # the mask hook's marker attribute (see attention.py)


class _GlobalKeys:
    """The `cache` an indexer is given inside a CP region: `update_indexer` returns every rank's keys, in order."""

    def __init__(self, layout: Layout, cp: CPGroup, meter: CommMeter | None) -> None:
        self.layout, self.cp, self.meter = layout, cp, meter

    def update_indexer(self, keys: Tensor, layer_idx: int) -> Tensor:
        return global_rows(keys, self.layout, self.cp, dim=1, meter=self.meter)


def _mask_refusal(mask: object) -> str | None:
    """The reason the region's mask hook put on the mask (the indexer gets a slice of it: look at its base)."""
    for candidate in (mask, getattr(mask, "_base", None)):
        reason = getattr(candidate, _REFUSAL_ATTR, None)
        if reason:
            return reason
    return None


def _cp_forward(original: Callable[..., Tensor], region: CPAttentionMode, module: nn.Module, *args: Any,
                **kwargs: Any) -> Tensor:
    bound = inspect.signature(original).bind(module, *args, **kwargs)
    hidden = bound.arguments["hidden_states"]
    cp = CPGroup.from_mesh(region.mesh)
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    error = _mask_refusal(bound.arguments.get("attention_mask")) or region.options.error(cp.world)
    if error is None and bound.arguments.get("cache") is not None:
        error = ("a KV cache cannot be split across CP ranks; call the model with use_cache=False and no cache= "
                 "(past_key_values=)")
    layout = None if error else resolve_layout(region.options.layout, cp.world)
    if layout is not None:
        error = layout.local_len_error(hidden.shape[1])
    signature = Signature().shape("hidden_states", hidden.shape, ndim=3).dtype("dtype", hidden.dtype)
    agree_across_ranks(cp, error and f"{where}: {error}", signature.layout(layout).fields, what="DSA indexer",
                       device=hidden.device if hidden.device.type == "cuda" else torch.device("cpu"))
    assert layout is not None
    seq_len = hidden.shape[1] * cp.world
    bound.arguments["attention_mask"] = allowed_keys(layout, cp.rank, seq_len, is_causal=True,
                                                     device=hidden.device).unsqueeze(0)
    bound.arguments["cache"] = _GlobalKeys(layout, cp, region.options.meter)
    return original(*bound.args, **bound.kwargs)


def _routed(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(original)
    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        region = active_cp_region()
        if region is None:
            return original(module, *args, **kwargs)
        return _cp_forward(original, region, module, *args, **kwargs)

    setattr(forward, _ROUTED_ATTR, True)
    return forward


def _indexer_class(path: str) -> type | None:
    name, cls_name = path.split(".")
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:  # a transformers without this family
        return None
    cls = getattr(module, cls_name, None)
    return cls if isinstance(cls, type) else None


def install_indexers() -> None:
    """Route the forward of every class in `INDEXERS` this transformers has (once)."""
    for path in INDEXERS:
        cls = _indexer_class(path)
        if cls is not None and not getattr(cls.forward, _ROUTED_ATTR, False):
            cls.forward = _routed(cls.forward)  # type: ignore[method-assign]


def routed_indexers() -> list[str]:
    """The `INDEXERS` entries now routed (absent: this transformers lacks the family)."""
    return [p for p in INDEXERS if (cls := _indexer_class(p)) is not None and getattr(cls.forward, _ROUTED_ATTR, False)]
