"""Saved tensors kept in (pinned) host memory in power-of-two pieces, each tensor object copied once.

Why not `torch.autograd.graph.save_on_cpu(pin_memory=True)`: torch's pinned-memory cache (CUDA's caching host
allocator) rounds every pinned allocation up to the next power of two and keeps it once freed, so a Llama-3-8B
block input of 4.77 GiB takes 8 GiB (+68% over 32 blocks). Here a tensor's bytes go into pieces whose sizes are
the binary digits of its byte count, rounded up to a multiple of the smallest piece (`MIN_PIECE`): each piece is a
power of two, which the cache keeps as it is, and a tensor wastes less than one smallest piece. The same sizes come
back every step, so the cache serves them again.

And why a cache of copies: non-reentrant checkpointing saves every positional tensor argument of each block, so the
own Llama's rotary cos and sin (the same tensor objects for every block of a forward) would be copied once per
block. A tensor packed again while its object is alive and unmodified (`_version` unchanged) shares the first
copy. The cache holds weak references alone: to the tensor object (never only its address, which a later tensor
may reuse once the first is freed) and to the host copy, which lives as long as some saved tensor holds it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["MIN_PIECE", "HostCopy", "HostOffload", "host_bytes", "piece_sizes"]

MIN_PIECE = 2 * 2**20
"""The smallest piece, bytes: a tensor's pieces exceed its bytes by less than this."""


def piece_sizes(nbytes: int, min_piece: int = MIN_PIECE) -> list[int]:
    """The power-of-two piece sizes, largest first, that hold `nbytes`: the binary digits of `nbytes` rounded up
    to a multiple of `min_piece` (a power of two), so every piece is at least `min_piece`."""
    rounded = -(-nbytes // min_piece) * min_piece
    return [1 << bit for bit in reversed(range(rounded.bit_length())) if rounded >> bit & 1]


def host_bytes(nbytes: int, min_piece: int = MIN_PIECE) -> int:
    """What one tensor of `nbytes` takes in host memory: its pieces' total (the memory plan's figure)."""
    return sum(piece_sizes(nbytes, min_piece))


@dataclass(eq=False)
class HostCopy:
    """One tensor's bytes in host memory, and what unpacking needs to make it again."""

    pieces: list[torch.Tensor]
    """uint8 host tensors of `piece_sizes(nbytes)`; the last one's tail is unused."""
    nbytes: int
    size: torch.Size
    dtype: torch.dtype
    device: torch.device


class HostOffload:
    """Saved-tensor hooks (`hooks()`) that keep saved tensors in host memory; one object a model, its blocks share it.

    Unpacking gives a new contiguous tensor of the saved one's size, dtype and device, bitwise equal to it (a
    non-contiguous one comes back contiguous, as `save_on_cpu` gives it).

    Args:
        pin_memory: page-locked pieces and non-blocking copies (CUDA); False copies into ordinary memory
            through the same code (the CPU tests).
        min_piece: the smallest piece, bytes; a power of two.
    """

    def __init__(self, *, pin_memory: bool = True, min_piece: int = MIN_PIECE) -> None:
        if min_piece <= 0 or min_piece & (min_piece - 1):
            raise ValueError(f"min_piece must be a power of two, got {min_piece}")
        self.pin_memory = pin_memory
        self.min_piece = min_piece
        # id(tensor) -> (weak tensor, what must be unchanged to share its copy, weak copy)
        self._copies: dict[int, tuple[weakref.ref, tuple, weakref.ref]] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that routes saved tensors through `pack` and `unpack`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> HostCopy:
        """Copy `tensor` to host memory, or return the copy made of this very tensor object, still unmodified."""
        key = id(tensor)
        # data_ptr, size, stride and dtype too: `.data = ...` swaps them without a version bump
        state = (tensor._version, tensor.data_ptr(), tensor.size(), tensor.stride(), tensor.dtype)
        if key in self._copies:
            tensor_ref, known, copy_ref = self._copies[key]
            copy = copy_ref()
            if tensor_ref() is tensor and known == state and copy is not None:
                return copy
        copy = self._copy_out(tensor)
        entries = self._copies
        # dropped as the tensor object dies, before its id can name another object
        dead = weakref.ref(tensor, lambda ref: entries.pop(key) if entries.get(key, (None,))[0] is ref else None)
        entries[key] = (dead, state, weakref.ref(copy))
        return copy

    def unpack(self, copy: HostCopy) -> torch.Tensor:
        """A new tensor on the saved one's device, its bytes copied back from the pieces."""
        flat = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
        offset = 0
        for piece in copy.pieces:
            n = min(piece.numel(), copy.nbytes - offset)
            flat[offset:offset + n].copy_(piece[:n], non_blocking=self.pin_memory)
            offset += n
        return flat.view(copy.dtype).view(copy.size)

    def _copy_out(self, tensor: torch.Tensor) -> HostCopy:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes, pieces, offset = flat.numel(), [], 0
        for size in piece_sizes(nbytes, self.min_piece):
            piece = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            n = min(size, nbytes - offset)
            piece[:n].copy_(flat[offset:offset + n], non_blocking=self.pin_memory)
            pieces.append(piece)
            offset += n
        return HostCopy(pieces, nbytes, tensor.size(), tensor.dtype, tensor.device)
