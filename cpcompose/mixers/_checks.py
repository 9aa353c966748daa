"""The checks every mixer entry point shares, and its cross-rank agreement.

Each entry point validates its arguments on this rank, then agrees once: a bad input
on one rank then raises the same ValueError on every rank before any data moves,
instead of leaving the others blocked in a collective.

Two ways to agree. `agree` is the blocking all-gather of every call's signature
(`agree_across_ranks`). `agreed` is the library's agreement cache
(`cpcompose.agreement.expected`), used by the two calls every hybrid layer makes (the
causal conv and the chunked recurrence): the full agreement runs once per call every
rank expects, later calls gather a flag from every rank instead and read it after the call,
and a rank that deviates replays the expected call's collectives on zeros (its
`CallSpec`) before all ranks agree in full and raise alike. Flags travel only where the
data lives on the host; on a GPU every call agrees in full (a flag read there would be
a device sync per call, as the blocking agreement is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence, TypeVar

import torch
from torch import Tensor

from cpcompose.comm import CPGroup
from cpcompose.layouts import Layout, LayoutSpec, layout_error, resolve_layout
from cpcompose.agreement import CallSpec, Field, agree_across_ranks, agreed_call, dtype_code, shape_fields

__all__ = ["agree", "agreed", "float_tensors_error", "layout_fields", "local_layout", "seq_layout", "shape_of"]

R = TypeVar("R")

_CACHED_CALLS = ("cp_causal_conv1d", "chunked_recurrence")
"""The mixer calls that go through the agreement cache; their index tags the cached signature."""

_MIXER_TAG = -0x6D6978  # "mix": first field of a cached mixer signature, so it never equals an attention call's


def agree(cp: CPGroup, error: str | None, signature: Sequence[Field], *, what: str, device: torch.device) -> None:
    """Raise the same ValueError on every rank if any rank's input is bad or the signatures differ."""
    agree_across_ranks(cp, error, signature, what=what, device=device)


def agreed(
    cp: CPGroup, error: str | None, signature: Sequence[Field], *, what: str, cached_as: str, device: torch.device,
    spec: Callable[[], CallSpec], run: Callable[[], R],
) -> R:
    """`run()` once every rank is known to make this call (`agree`'s guarantee), agreeing in full only when the
    call is not the one every rank expects (see the module).

    Args:
        cached_as: which of `_CACHED_CALLS` this is (tags the signature: a conv never stands for a recurrence).
        spec: what a rank that later deviates from this call replays on zeros: its forward's collectives.
        run: the call itself, after the agreement.
    """
    fields = [("mixer", _MIXER_TAG - _CACHED_CALLS.index(cached_as)), *signature]
    result, _ = agreed_call(cp, error, fields, what=what, device=device, every_call=device.type != "cpu",
                            spec=spec, run=run)
    return result


def local_layout(spec: LayoutSpec, cp: CPGroup, seq_local: int) -> tuple[Layout | None, str | None]:
    """The layout `spec` names over `cp`, and why a shard of `seq_local` tokens does not fit it (or None)."""
    error = layout_error(spec, cp.world)
    if error:
        return None, error
    layout = resolve_layout(spec, cp.world)
    return layout, layout.local_len_error(seq_local)


def seq_layout(spec: LayoutSpec, cp: CPGroup, seq_len: object) -> tuple[Layout | None, str | None]:
    """The layout `spec` names over `cp`, and why it cannot split `seq_len` global tokens (or None)."""
    error = layout_error(spec, cp.world)
    if error:
        return None, error
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        return None, f"seq_len must be an int, got {seq_len!r}"
    layout = resolve_layout(spec, cp.world)
    return layout, layout.split_error(seq_len)


def float_tensors_error(**tensors: object) -> str | None:
    """Why the named arguments are not floating-point tensors of one dtype on one device, or None."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
        if not t.is_floating_point():
            return f"{name} must be floating point, got {t.dtype}"
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        assert isinstance(t, Tensor) and isinstance(first, Tensor)
        if t.dtype != first.dtype or t.device != first.device:
            return (f"{name} is {t.dtype} on {t.device} but {first_name} is {first.dtype} on {first.device}; "
                    "pass one dtype and device")
    return None


def shape_of(t: object) -> tuple[int, ...]:
    """`t`'s shape, or () for a non-tensor (signatures are built even from bad inputs)."""
    return tuple(t.shape) if isinstance(t, Tensor) else ()


def layout_fields(
    layout: Layout | None, dtype: object, grad: bool, *shapes: tuple[str, tuple[int, ...]]
) -> list[Field]:
    """The signature fields every mixer shares: shapes, dtype, the split, and whether a backward will run.

    `grad` is in the signature because a backward runs collectives: one rank that
    needs no gradient while another does would leave the other blocked there.
    """
    fields: list[Field] = []
    for name, shape in shapes:
        fields += shape_fields(name, shape, 8)
    return fields + [
        ("dtype", dtype_code(dtype)), ("layout", -1 if layout is None else layout.identity), ("grad", int(grad)),
    ]
