"""The one place an SDPA call becomes context-parallel: a TorchFunctionMode.

While a `CPAttentionMode` is active (entered by the `ContextParallel` style around
a module's forward, or by the `context_parallel` context manager), every
`F.scaled_dot_product_attention` call is routed to CP attention with the mode's
mesh and `CPOptions`. The configuration lives in the mode object on the
(thread-local) mode stack, not in a global, so two models with different CP
settings in one process never see each other's.

`F.multi_head_attention_forward` (PyTorch's `nn.MultiheadAttention`,
`TransformerEncoderLayer`) is computed with its attention routed the same way
(`mha.py`). `flex_attention` cannot be routed: the mode records it (the call sits
inside flex's own dynamo trace, where an exception would come out mangled) and
`check_routed` raises at the end of the forward or region. The mode also counts
what it routed, so a region in which no attention went through CP raises too.

Arguments may be plain tensors (this rank's sequence shard) or DTensors placed
`Shard(2)` on the CP mesh dimension whose split is the region's (see
`cpcompose.sharding.dtensor`); other mesh dims (e.g. TP's head sharding) are kept as
they are, and the result has the same form. Every refusal (masks, dropout, GQA
flags, placements) joins the cross-rank agreement, so all ranks raise it or none.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from cpcompose import _compat
from cpcompose.attention.call.api import attend
from cpcompose.attention.call.op import CPContext, compiled_attention
from cpcompose.attention.call.options import CPOptions
from cpcompose.comm import CPGroup
from cpcompose.sharding.dtensor import cp_dim_name, split_mismatch
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.parallel.key_masks import real_keys
from cpcompose.parallel.mha import multi_head_attention_forward

__all__ = ["NO_ATTENTION_ROUTED", "CPAttentionMode", "active_cp_region"]

NO_ATTENTION_ROUTED = (
    "no attention call went through context parallelism: the attention in this CP region ran on this rank's "
    "tokens only. Likely causes: the model computes attention with flex_attention or an explicit softmax "
    "(eager attention) instead of F.scaled_dot_product_attention; the ContextParallel plan key matched a "
    "module that does not call attention; or attention runs outside the region"
)
"""The message of every check that a CP region routed at least one attention call."""


class CPAttentionMode(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to CP attention on `mesh` under `options`.

    `routed` counts the calls it routed, so a region can tell whether any attention ran through CP.
    Under `torch.compile` the calls go through the `cpcompose::attention` custom op with
    `context` (see `cpcompose.attention.call.op`); a mode entered inside compiled code (by a
    style's hook) must be given its owner's context, since dynamo cannot create one.
    """

    def __init__(self, mesh: DeviceMesh, options: CPOptions, context: CPContext | None = None,
                 full_buffers: dict[int, tuple[Tensor, int]] | None = None, count_in_op: bool = False) -> None:
        super().__init__()
        self.mesh, self.options = mesh, options
        self._full_buffers = full_buffers or {}  # id(buffer) -> (full-sequence contents, seq dim): context_parallel's
        self.context = context if context is not None else CPContext(mesh, options)
        self.world = self.context.world
        self.routed = 0
        # A region entered outside compiled code (context_parallel) lives across compiled calls: a count kept on
        # it would be a value dynamo guards on, recompiling at every call. Its compiled calls are counted by the
        # custom op instead, on the region's own CPContext, at run time.
        self._count_in_op = count_in_op
        self._op_calls_before = self.context.calls if count_in_op else 0
        self.local_only = 0  # flex_attention calls, which ran on this rank's tokens only

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            return multi_head_attention_forward(self.attend, *args, **kwargs)
        if getattr(func, "__name__", "") == "flex_attention":
            self.local_only += 1
        return func(*args, **kwargs)

    def check_routed(self, where: str) -> None:
        """Raise unless every attention call in this region went through CP (and there was one).

        Every rank runs the same model code, so every rank raises here alike.
        """
        if self.local_only:
            raise ValueError(
                f"{where}: flex_attention is not context-parallel in cpcompose: inside a CP region it attended "
                "this rank's tokens only. Use F.scaled_dot_product_attention (is_causal=True, or a PackedLayout "
                "for document masks) or cpcompose.cp_attention"
            )
        routed = self.routed + (self.context.calls - self._op_calls_before if self._count_in_op else 0)
        if routed == 0:
            raise ValueError(f"{where}: {NO_ATTENTION_ROUTED}")

    def full_buffer(self, shard: object) -> Tensor | None:
        """The full-sequence contents of a buffer this region sharded (the same on every rank), or None.

        What a rank's shard cannot tell (where a padding mask's zeros lie in the global
        sequence) its full copy can, with no communication. `shard` is the buffer itself or
        a copy of its values (transformers casts a mask before reading it): a copy is
        matched by content, and only when every buffer it matches holds the same contents.
        """
        if id(shard) in self._full_buffers:
            return self._full_buffers[id(shard)][0]
        layout = self.layout()
        if not isinstance(shard, Tensor) or layout is None:
            return None
        rank = CPGroup.from_mesh(self.mesh).rank
        found = [full for full, dim in self._full_buffers.values()
                 if full.shape[:dim] + full.shape[dim + 1:] == shard.shape[:dim] + shard.shape[dim + 1:]
                 and full.ndim == shard.ndim and full.shape[dim] == shard.shape[dim] * layout.world
                 and torch.equal(layout.shard(full, dim, rank), shard.to(full.dtype))]
        return found[0] if found and all(torch.equal(f, found[0]) for f in found) else None

    def layout(self) -> Layout | None:
        """The region's split, or None if the options name none (the attention then reports why)."""
        return None if self.options.error(self.world) else resolve_layout(self.options.layout, self.world)

    def sdpa(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """`F.scaled_dot_product_attention`'s signature, computed context-parallel.

        A mask of the key alone, `(batch or 1, 1, 1, keys)` (bool, or 0/-inf), built from a
        padding buffer's shard, is this rank's keys' mask: it becomes CP attention's
        `key_padding`, which travels with K/V.

        Raises:
            ValueError: on every rank: any other mask tensor, dropout, GQA without `enable_gqa`,
                a mix of DTensors and plain tensors, or DTensors not in the region's split.
        """
        tensors = (query, key, value)
        key_padding, mask_error = _sdpa_key_padding(attn_mask, query, key, is_causal)
        error = (mask_error or _refusal(tensors, None if key_padding is not None else attn_mask, dropout_p, enable_gqa)
                 or self._dtensor_error(tensors))
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        out = self.attend(*local, is_causal=is_causal, scale=scale, caller_error=error, key_padding=key_padding)
        if isinstance(query, DTensor):
            return DTensor.from_local(out, query.device_mesh, query.placements, run_check=False)
        return out

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float | None = None,
        softcap: float | None = None, caller_error: str | None = None, sinks: Tensor | None = None,
        key_padding: Tensor | None = None, position_ids: Tensor | None = None, **overrides: Any,
    ) -> Tensor:
        """CP attention of local shards under this region's options (with per-call `overrides`,
        e.g. a layer's `window_size`); counts the call for `check_routed`.

        The one way attention code other than SDPA (nn.MultiheadAttention, a Hugging Face
        attention function) enters the region. `caller_error` joins the cross-rank agreement;
        `key_padding` is `cp_attention`'s per-row key mask of this rank's keys. `position_ids` (compiled calls
        only; eager callers check them themselves): this rank's positions, checked against the region's split
        inside the custom op (`cpcompose.layouts.position_ids_error`), their complaint joining the agreement.
        """
        compiling = torch.compiler.is_compiling()
        if not (compiling and self._count_in_op):
            self.routed += 1
        if compiling:  # dynamo cannot trace the agreement: hide it in the op
            window = overrides.pop("window_size", self.options.window_size)  # a layer's window: an op argument
            changed = sorted(k for k, value in overrides.items() if getattr(self.options, k) != value)
            if changed and caller_error is None:
                caller_error = (
                    f"per-call CP options {changed} (beyond a layer's window_size) are not supported "
                    "under torch.compile yet; run this model eagerly"
                )
            if sinks is not None and caller_error is None:
                caller_error = "attention sinks are not supported under torch.compile yet; run this model eagerly"
            if key_padding is not None and caller_error is None:
                caller_error = ("a padding mask that needs keys masked per row (left padding, or padding in a "
                                "bidirectional model) is not supported under torch.compile yet; run this model "
                                "eagerly, or build the batch with pack_batch")
            out = compiled_attention(q, k, v, context=self.context, is_causal=is_causal, scale=scale,
                                     softcap=softcap, caller_error=caller_error, position_ids=position_ids,
                                     window_size=window)
        else:
            out = attend(q, k, v, mesh=self.mesh, is_causal=is_causal, scale=scale, softcap=softcap,
                         options=self.options.replace(**overrides), caller_error=caller_error, sinks=sinks,
                         key_padding=key_padding)
        assert isinstance(out, Tensor)
        return out

    def _dtensor_error(self, tensors: tuple[Tensor, ...]) -> str | None:
        layout = self.layout()
        if layout is None or not isinstance(tensors[0], DTensor):
            return None
        cp_name = cp_dim_name(self.mesh)
        for name, t in zip(("query", "key", "value"), tensors):
            assert isinstance(t, DTensor)
            names = [n.split("@", 1)[0] for n in (t.device_mesh.mesh_dim_names or ())]
            placement = t.placements[names.index(cp_name)] if cp_name in names else None
            if not (isinstance(placement, Shard) and placement.dim % t.ndim == 2):
                return (
                    f"SDPA {name} is a DTensor with placements {t.placements} on mesh dims {tuple(names)}; "
                    f"context parallelism needs Shard(2) (the sequence) on mesh dim {cp_name!r}"
                )
            error = split_mismatch(t, layout, what=f"SDPA {name}", cp_name=cp_name)
            if error:
                return error
        return None


def active_cp_region() -> CPAttentionMode | None:
    """The innermost active CP region (a `CPAttentionMode` on this thread's mode stack), or None.

    For attention code that is not an SDPA call (e.g. a Hugging Face attention
    function) but must use the region's mesh and options.
    """
    regions = [m for m in _compat.function_mode_stack() if isinstance(m, CPAttentionMode)]
    return regions[-1] if regions else None


def _sdpa_key_padding(attn_mask: object, query: object, key: object,
                      is_causal: bool) -> tuple[Tensor | None, str | None]:
    """SDPA's `attn_mask` as CP's key mask where it depends on the key alone (`(B or 1, 1, 1, keys)`), or why not.

    Any other mask (None included) gives `(None, None)`: `_refusal` names it.
    """
    if not isinstance(attn_mask, Tensor) or any(isinstance(t, DTensor) for t in (attn_mask, query, key)):
        return None, None
    if not isinstance(key, Tensor) or attn_mask.ndim != 4 or tuple(attn_mask.shape[1:3]) != (1, 1) \
            or attn_mask.shape[3] != key.shape[-2]:
        return None, None
    if is_causal:  # as plain SDPA: one or the other
        return None, "SDPA got both attn_mask and is_causal=True; plain SDPA takes one or the other"
    return real_keys(attn_mask[:, 0, 0, :], key.shape[0], true_means_real=True, what="SDPA attn_mask")


def _refusal(tensors: tuple[Tensor, ...], attn_mask: object, dropout_p: float, enable_gqa: bool) -> str | None:
    """What this SDPA call asks that CP attention cannot honour, or None."""
    if attn_mask is not None:
        return (
            "context-parallel SDPA cannot honour an explicit attn_mask tensor (its rows and columns "
            "index the global sequence, which no rank holds); use is_causal=True, a mask of the key alone "
            "(batch, 1, 1, keys) for padding, or a PackedLayout for document masks"
        )
    if dropout_p:
        return f"context-parallel SDPA does not support dropout (dropout_p={dropout_p}); set it to 0"
    is_dtensor = [isinstance(t, DTensor) for t in tensors]
    if any(is_dtensor) and not all(is_dtensor):
        return (
            "SDPA got a mix of DTensor and plain tensor arguments; under context parallelism pass "
            "q, k, v all as plain local shards or all as DTensors sharded Shard(2) on the CP mesh"
        )
    query, key = tensors[0], tensors[1]
    if query.ndim == key.ndim == 4 and query.shape[1] != key.shape[1] and not enable_gqa:
        return f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True, as plain SDPA requires"
    return None
