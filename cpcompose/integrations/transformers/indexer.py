"""DeepSeek sparse attention's indexer under CP: each query's top-k over its document's global causal row.

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
computes each local query's full score row, entry for entry as one process does.

Its one `topk` call is then taken per document (`selection.topk_per_document`, through a
function mode around the forward): a packed row's queries choose among their own
document's keys, on a row as long as that document, so each document gets the selection
it gets run alone, ties included. transformers' own packed row does not (its `topk` over
the whole row breaks ties otherwise: see selection.py), and neither did this before. The
same holds on one process for a model built with attn_implementation="cpcompose" on a
packed row (positions restarting at each document, as transformers detects packing).
The indices are global positions (a document shorter than `index_topk` fills its lists
with a position outside it, which the attention ignores), which
`cpcompose.attention.sparse.call` reads (and which GLM-5's "shared" layers reuse as they are).
The indexer is not trained through the model's loss in transformers (its forward runs
under no_grad, and no family computes an indexer loss), so there is no gradient to carry.

Refused, on every rank before any key moves: a model whose attention is not "cpcompose"
(transformers' eager and sdpa paths scatter the indices into a mask of this rank's
shard), a KV cache, and whatever the region's mask hook marked (padding the layout
cannot express, ...).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.attention.sparse.selection import (
    DocumentRows,
    allowed_keys,
    document_rows,
    global_rows,
    topk_per_document,
)
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.integrations.transformers.batch import cu_seqlens_from_position_ids
from cpcompose.integrations.transformers.implementation import ATTN_IMPLEMENTATION
from cpcompose.layouts import Layout, PackedLayout, resolve_layout
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


def _implementation(module: nn.Module) -> str | None:
    """The attention implementation the indexer's model was built with (its config's)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def _implementation_refusal(module: nn.Module) -> str | None:
    """Why this model's attention cannot read the indexer's global top-k under CP, or None."""
    implementation = _implementation(module)
    if implementation == ATTN_IMPLEMENTATION:
        return None
    return (f"DeepSeek sparse attention under CP needs the model built with attn_implementation="
            f"\"{ATTN_IMPLEMENTATION}\" (this one has {implementation!r}, whose attention would scatter the "
            "indexer's top-k over the whole sequence into a mask of this rank's shard)")


def _cp_forward(original: Callable[..., Tensor], region: CPAttentionMode, module: nn.Module, *args: Any,
                **kwargs: Any) -> Tensor:
    bound = inspect.signature(original).bind(module, *args, **kwargs)
    hidden = bound.arguments["hidden_states"]
    cp = CPGroup.from_mesh(region.mesh)
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    error = (_implementation_refusal(module) or _mask_refusal(bound.arguments.get("attention_mask"))
             or region.options.error(cp.world))
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
    return _per_document(original, bound, [document_rows(layout, cp.rank, seq_len)], seq_len, where)


def _one_process_forward(original: Callable[..., Tensor], module: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    """Outside a CP region: a "cpcompose" model's packed rows take each document's top-k; anything else is
    transformers' indexer as it is."""
    bound = inspect.signature(original).bind(module, *args, **kwargs)
    documents = _packed_documents(module, bound.arguments)
    if documents is None:
        return original(*bound.args, **bound.kwargs)
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    return _per_document(original, bound, documents, bound.arguments["hidden_states"].shape[1], where)


def _packed_documents(module: nn.Module, arguments: dict[str, Any]) -> list[list[DocumentRows]] | None:
    """The documents of each row of a "cpcompose" model's packed batch on one process, or None.

    A row is packed as transformers reads it: positions restart at each document (its
    `find_packed_sequence_indices` rule) and the mask it built keeps the documents apart
    (with an explicit attention_mask transformers does not separate them, and neither does this).
    """
    from transformers.utils.import_utils import is_tracing  # values cannot be read while tracing (fake, compile)

    hidden, mask, positions = (arguments.get(name) for name in ("hidden_states", "attention_mask", "position_ids"))
    if _implementation(module) != ATTN_IMPLEMENTATION:
        return None
    if arguments.get("cache") is not None or not isinstance(positions, Tensor) or not isinstance(mask, Tensor):
        return None
    length = hidden.shape[1]
    rows = positions.reshape(-1, positions.shape[-1])  # (1 or batch, length); 3-D mRoPE positions do not fit
    if is_tracing(positions) or rows.shape[1] != length or rows.shape[0] not in (1, hidden.shape[0]) \
            or mask.ndim != 3 or mask.shape[-2:] != (length, length):
        return None
    documents = []
    for b, row in enumerate(rows):
        cu = cu_seqlens_from_position_ids(row)
        starts = torch.tensor(cu[1:-1], dtype=torch.long, device=mask.device)
        to_previous = mask[b if mask.shape[0] > 1 else 0][starts, starts - 1]  # each start's entry for the key before
        apart = ~to_previous if mask.dtype == torch.bool else to_previous != 0  # bool: True keeps; else additive
        if not bool(apart.all()):  # one sequence to the mask: the indexer's row is the whole row
            return None
        documents.append(document_rows(PackedLayout.build(cu, 1), 0, length))
    return documents


def _per_document(original: Callable[..., Tensor], bound: inspect.BoundArguments,
                  documents: list[list[DocumentRows]], columns: int, where: str) -> Tensor:
    """The indexer's forward with its `topk` taken per document (one document filling the row: as it is)."""
    if all(len(row) == 1 and row[0].start == 0 and row[0].length == columns for row in documents):
        return original(*bound.args, **bound.kwargs)
    mode = _TopkPerDocument(documents)
    with mode:
        indices = original(*bound.args, **bound.kwargs)
    if mode.calls != 1:  # a transformers whose indexer selects otherwise: its packed rows would cross documents
        raise RuntimeError(f"{where}: cpcompose takes each document's top-k where the indexer calls torch.topk, and "
                           f"this indexer's forward called it {mode.calls} times: update cpcompose's indexer.py")
    return indices


class _TopkPerDocument(TorchFunctionMode):
    """Around one indexer forward: its `topk` over the score rows taken per document; every other call as is."""

    def __init__(self, documents: list[list[DocumentRows]]) -> None:
        super().__init__()
        self.documents, self.calls = documents, 0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is not torch.topk and func is not Tensor.topk:
            return func(*args, **(kwargs or {}))
        self.calls += 1
        return self._topk(*args, **(kwargs or {}))

    def _topk(self, scores: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        if scores.ndim != 3 or dim not in (-1, 2):
            raise RuntimeError(f"an indexer's topk over dim {dim} of a {scores.ndim}-D tensor: cpcompose takes "
                               "it per document over the last dim of (batch, queries, keys) scores only")
        values, indices = topk_per_document(scores, k, self.documents, largest=largest, sorted=sorted)
        return torch.return_types.topk((values, indices))


def _routed(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(original)
    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        region = active_cp_region()
        if region is None:
            return _one_process_forward(original, module, *args, **kwargs)
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
