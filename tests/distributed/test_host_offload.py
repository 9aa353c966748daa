"""`HostOffload`: saved tensors in power-of-two host pieces, a tensor object copied once while unmodified.

On the CPU, with `pin_memory=False`: the same code as on CUDA (pieces, copies, dedupe), ordinary memory and
blocking copies instead of pinned memory and non-blocking ones. The round trip is bitwise (tolerance 0: bytes are
copied, never computed), checked on the bytes, so NaN and -0.0 count. The CUDA path itself (pinned pieces,
non-blocking copies, the pinned-memory cache) needs a GPU: `test_activation_checkpoint.py`'s gpu test runs it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from cpcompose.distributed import apply_activation_checkpointing
from cpcompose.distributed.activation_checkpoint import offloaded_saved_inputs
from cpcompose.distributed.host_offload import MIN_PIECE, HostCopy, HostOffload, host_bytes, piece_sizes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("nbytes", [0, 1, MIN_PIECE - 1, MIN_PIECE, MIN_PIECE + 1, 3 * MIN_PIECE + 5, 2**31 - 1,
                                    5_121_245_184, 4096 * 425_984 * 2 + 12_345])
def test_pieces_are_powers_of_two_of_at_least_the_smallest_holding_the_bytes_with_less_than_one_to_spare(
        nbytes: int) -> None:
    sizes = piece_sizes(nbytes)
    assert all(s >= MIN_PIECE and s & (s - 1) == 0 for s in sizes)
    assert sizes == sorted(set(sizes), reverse=True)  # one piece a binary digit, largest first
    assert nbytes <= sum(sizes) == host_bytes(nbytes) < nbytes + MIN_PIECE


def test_a_4_77_gib_block_input_takes_its_bytes_plus_under_2_mib_not_8_gib() -> None:
    nbytes = 5_121_245_184  # 4.77 GiB: the next power of two is 8 GiB
    assert host_bytes(nbytes) - nbytes < 2**21 and len(piece_sizes(nbytes)) > 1


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    floats = torch.randn(5, 7, 9, generator=g)
    floats[0, 0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return [
        floats,                                                   # contiguous float32
        floats.to(torch.bfloat16).transpose(0, 2),                # non-contiguous bf16
        floats.double()[:, ::2, 1:],                              # strided float64
        torch.randint(-2**40, 2**40, (6, 11), generator=g)[::3],  # int64, rows skipped
        torch.rand(13, 3, generator=g).t() > 0.5,                 # bool, transposed
        floats.half()[1, 2, 3],                                   # 0-dim float16
        torch.empty(0, 4),                                        # no bytes
    ]


@pytest.mark.parametrize("tensor", _cases(), ids=["f32", "bf16-T", "f64-strided", "i64-rows", "bool-T", "f16-0d",
                                                 "empty"])
def test_pack_then_unpack_gives_the_same_bytes_size_and_dtype(tensor: torch.Tensor) -> None:
    host = HostOffload(pin_memory=False, min_piece=16)  # small pieces: several a tensor
    copy = host.pack(tensor)
    assert [p.numel() for p in copy.pieces] == piece_sizes(tensor.numel() * tensor.element_size(), 16)
    got = host.unpack(copy)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and got.device == tensor.device
    assert got.is_contiguous()  # as `save_on_cpu` gives a non-contiguous tensor back
    assert torch.equal(_bytes(got), _bytes(tensor))


def test_a_tensor_object_packed_again_unmodified_is_stored_once() -> None:
    host = HostOffload(pin_memory=False, min_piece=16)
    cos = torch.randn(4, 8)
    first = host.pack(cos)
    assert host.pack(cos) is first
    twin = cos.clone()  # the same shape and values, another object
    assert host.pack(twin) is not first


def test_a_tensor_modified_in_place_after_packing_is_copied_again_and_the_first_copy_keeps_the_old_values() -> None:
    host = HostOffload(pin_memory=False, min_piece=16)
    x = torch.randn(4, 8)
    before = x.clone()
    first = host.pack(x)
    x.mul_(2)  # bumps x._version
    second = host.pack(x)
    assert second is not first
    assert torch.equal(host.unpack(first), before) and torch.equal(host.unpack(second), x)


def test_a_new_tensor_where_a_dead_one_was_packed_is_not_given_its_copy() -> None:
    """The dead tensor's id and address are free for a new tensor of the same shape (CPython and the allocator
    often reuse both at once): the weak reference to the object, not its address, decides."""
    host = HostOffload(pin_memory=False, min_piece=16)
    old = torch.zeros(64)
    copy = host.pack(old)  # kept alive, as a saved tensor would keep it
    del old
    new = torch.ones(64)
    assert host.pack(new) is not copy
    assert torch.equal(host.unpack(host.pack(new)), new)
    assert isinstance(copy, HostCopy)


class _Block(nn.Module):
    """Takes a shared table positionally, like the own Llama's blocks (x, cos, sin)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x) * table


def test_checkpointed_blocks_share_one_offload_that_copies_a_shared_argument_once_and_is_exact(monkeypatch) -> None:
    """Three blocks handed the same table: through the model's `HostOffload` (its CPU form) it is copied once,
    each block's input once a block; outputs and gradients bitwise those of the blocks without checkpointing."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Block() for _ in range(3)])
    blocks = nn.Sequential(*[_Block() for _ in range(3)])
    blocks.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(blocks, offload=True)
    host = blocks[0]._host_offload
    assert all(b._host_offload is host for b in blocks)
    assert isinstance(offloaded_saved_inputs(torch.ones(1), host=host), contextlib.nullcontext)  # CPU: no-op
    host.pin_memory = False
    monkeypatch.setattr("cpcompose.distributed.activation_checkpoint.offloaded_saved_inputs",
                        lambda *args, host: host.hooks())  # the CUDA branch, on the CPU
    copies: list[HostCopy] = []
    copy_out = host._copy_out
    monkeypatch.setattr(host, "_copy_out", lambda t: copies.append(copy_out(t)) or copies[-1])

    def run(model: nn.Module) -> list[torch.Tensor]:
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        table = torch.rand(5, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        h = x
        for block in model:
            h = block(h, table)
        h.square().sum().backward()
        return [h.detach(), x.grad, table.grad, *(p.grad for p in model.parameters())]

    want, got = run(plain), run(blocks)
    assert len(copies) == 3 + 1  # each block's input, and the table once
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(got, want, strict=True))
