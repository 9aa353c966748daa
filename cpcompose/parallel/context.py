"""`context_parallel`: PyTorch's experimental CP context manager, on every device.

Code written for `torch.distributed.tensor.experimental.context_parallel` works by
changing the import: the buffers are sharded in place along their sequence dims
(zigzag by default, the same default as `cp_shard` and `cp_attention`; causal and
bidirectional attention are both exact under it), SDPA inside the block is
context-parallel, and the buffers are restored on exit unless listed in
`no_restore_buffers`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.attention.call.options import CPOptions
from cpcompose.comm import CPGroup
from cpcompose.layouts import LayoutSpec, layout_error, resolve_layout
from cpcompose.parallel.dispatch import CPAttentionMode
from cpcompose.sharding.tensors import cp_unshard, dim_error
from cpcompose.agreement import agree_across_ranks, shape_fields

__all__ = ["context_parallel", "context_parallel_unshard"]


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[Tensor] | None = None,
    options: CPOptions | None = None,
    **overrides: Any,
) -> Iterator[None]:
    """Shard `buffers` in place and make SDPA context-parallel inside the block.

    Run the backward inside the block too: restoring a buffer on exit changes it in
    place, and autograd refuses tensors (token ids, positions) changed after saving.

    Args:
        mesh: the 1-D CP mesh.
        buffers: full-sequence tensors (inputs, labels, position ids, RoPE tables),
            identical on every rank; replaced in place by this rank's shard.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers to leave sharded on exit.
        options: the `CPOptions`; `**overrides` sets any of its fields by name
            (`strategy=`, `layout=` (a `PackedLayout`: buffers are the padded pack), ...).

    Raises:
        ValueError: on every rank, before any buffer changes: buffers and dims differ
            in number, a dim is out of range, or a buffer's sequence cannot be split.
            On exit, if a module ran inside but no attention call went through CP (the
            model's attention would have run on this rank's tokens only). A region that
            only shards and restores buffers, running no module, is fine (PyTorch's
            `context_parallel` allows it too).
    """
    opts = (options or CPOptions()).replace(**overrides)
    cp = CPGroup.from_mesh(mesh)
    buffers, dims = list(buffers or []), list(buffer_seq_dims or [])
    error = layout_error(opts.layout, cp.world)
    if len(buffers) != len(dims):
        error = f"got {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one dim per buffer"
    seq_layout = resolve_layout(opts.layout, cp.world) if error is None else None
    for i, (buf, dim) in enumerate(zip(buffers, dims)):
        if error is None and seq_layout is not None:
            error = dim_error(dim, buf.ndim) or seq_layout.split_error(
                buf.shape[dim], what=f"buffers[{i}] sequence length (dim {dim})"
            )
    signature = [("buffers", len(buffers)), ("layout", -1 if seq_layout is None else seq_layout.identity),
                 ("verify", int(opts.verify is True))]
    signature += [f for b in buffers for f in shape_fields("buffer shape", b.shape, 6)]
    device = buffers[0].device if buffers else torch.device("cpu")
    agree_across_ranks(cp, error, signature, what="context_parallel", device=device)
    assert seq_layout is not None
    keep = {id(b) for b in (no_restore_buffers or ())}
    full = [b.clone() for b in buffers]
    originals = [None if id(b) in keep else f for b, f in zip(buffers, full)]
    shards = [seq_layout.shard(b, dim, cp.rank) for b, dim in zip(buffers, dims)]
    with torch.no_grad():
        for buf, shard in zip(buffers, shards):
            buf.resize_(shard.shape).copy_(shard)
    mode = CPAttentionMode(mesh, opts, full_buffers={id(b): (f, d) for b, f, d in zip(buffers, full, dims)},
                           count_in_op=True)
    modules = [0]  # module calls inside the region: did a model run?
    _install_module_counter()
    _COUNTERS.stack.append(modules)
    try:
        try:
            with mode:
                yield
        finally:
            _COUNTERS.stack.pop()
        if modules[0] or mode.local_only:
            mode.check_routed("context_parallel")
    finally:
        with torch.no_grad():
            for buf, original in zip(buffers, originals):
                if original is not None:
                    buf.resize_(original.shape).copy_(original)


class _Counters(threading.local):
    """This thread's open regions' module counters, innermost last (a region is a mode: per thread)."""

    def __init__(self) -> None:
        self.stack: list[list[int]] = []


_COUNTERS = _Counters()
_COUNTER_HOOK: list[Any] = []  # the one global hook's handle, once installed


def _count_module(module: torch.nn.Module, args: Any) -> None:
    # A module compiled inside a region traces this hook: compiling is read first, so the traced hook reads
    # nothing dynamo would guard on (the modules outside the compiled blocks still count, eagerly).
    if not torch.compiler.is_compiling() and _COUNTERS.stack:
        _COUNTERS.stack[-1][0] += 1


def _install_module_counter() -> None:
    """Register `_count_module` as a global forward pre-hook, once per process.

    Once, not per region: dynamo guards on the keys of the global hook dict, so a hook added and removed by
    each region would recompile every compiled module at every region. Outside a region it returns at once.
    """
    if not _COUNTER_HOOK:
        _COUNTER_HOOK.append(torch.nn.modules.module.register_module_forward_pre_hook(_count_module))


def context_parallel_unshard(
    mesh: DeviceMesh, buffers: Sequence[Tensor], seq_dims: Sequence[int], *, layout: LayoutSpec = None
) -> list[Tensor]:
    """All-gather sharded `buffers` back to full sequences in global order (differentiable)."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"got {len(buffers)} buffers but {len(seq_dims)} seq_dims; give one dim per buffer")
    return [cp_unshard(b, mesh, seq_dim=d, layout=layout) for b, d in zip(buffers, seq_dims)]
