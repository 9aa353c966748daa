"""`LargestMade`: the largest tensor any op makes. `LiveWide`: the most bytes of `(rows, width)` tensors alive at once, as a step really holds them.

A `saved_tensors_hooks` count sees what autograd keeps, not the transients around it (a loss's
gradients, a cast's copy), which decide a peak too. This dispatch mode looks at every op's outputs,
follows each `(..., width)` storage by weak reference, and after every op adds up those still alive:
a tensor counts from the op that makes it until autograd, a Function or the caller lets it go.
Temporaries inside one ATen kernel are not seen. The memory tests of the fused loss and of the
Llama's profile use it with `width` = the vocabulary, where the loss's tensors are the only ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LargestMade", "LiveWide"]


class LiveWide(TorchDispatchMode):
    """While active: `peak`, the most bytes of live `(rows, width)` storages after any op.

    Only tensors laid out `width`-wide (unit stride in the last dim) count, so a `(width, dim)` weight's transpose,
    or autocast's bf16 copy of it seen transposed by `F.linear`, does not. `exclude`: tensors whose storages are
    not counted either (the inputs).
    """

    def __init__(self, width: int, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.width = width
        self.excluded = {t.untyped_storage()._cdata for t in exclude}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.width and t.stride(-1) == 1:
                storage = t.untyped_storage()
                if storage._cdata not in self.excluded:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class LargestMade(TorchDispatchMode):
    """While active: `largest`, the most elements any op's output has (what a tiled or chunked path must keep
    below the untiled size)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.largest = max([self.largest, *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
        return out
