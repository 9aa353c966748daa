"""`apply_activation_checkpointing(..., offload=...)`: block inputs in host memory on CUDA, nothing moved on the CPU.

Reference: the same chain of blocks without checkpointing. Offloading copies the saved inputs out and back
and checkpointing recomputes the same ops on the same inputs, so outputs and gradients must be bit-identical
(tolerance 0), on the CPU and on CUDA alike.

What is saved, and where, is observed with an outer `saved_tensors_hooks`: non-reentrant checkpointing saves
its inputs through the hooks active outside it. On the CPU the outer hook must see each block's own input
tensor (no copy was made: offload is a no-op there). On CUDA the offload's hooks take them first, so the GPU
memory held between forward and backward drops by the blocks' inputs (measured with `memory_allocated`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cpcompose.distributed import apply_activation_checkpointing
from cpcompose.models import FeedForward

BLOCKS, SEQ, DIM = 4, 64, 16


class _Block(nn.Module):
    """A residual MLP block: what a checkpoint keeps of it is its input."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = FeedForward(dim=DIM, hidden_dim=4 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _chain(device: str, *, ac: bool, offload: bool) -> nn.Sequential:
    torch.manual_seed(0)
    chain = nn.Sequential(*[_Block() for _ in range(BLOCKS)]).to(device)
    if ac:
        apply_activation_checkpointing(chain, offload=offload)
    return chain


def _x(device: str) -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()


def _step(chain: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = chain(x)
    out.square().sum().backward()
    return {"out": out.detach().cpu(), "x": x.grad.cpu(), **{n: p.grad.cpu() for n, p in chain.named_parameters()}}


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, value in want.items():
        assert torch.equal(got[k], value), k


@pytest.mark.parametrize("offload", [False, True])
def test_offload_on_the_cpu_changes_nothing(offload: bool) -> None:
    want = _step(_chain("cpu", ac=False, offload=False), _x("cpu"))
    chain, x = _chain("cpu", ac=True, offload=offload), _x("cpu")
    assert type(chain[0]).__name__ == ("Offloaded" if offload else "") + "Checkpointed_Block"
    saved: list[int] = []  # what the checkpoints save, seen from outside them
    block_inputs: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.data_ptr())
        return t

    for block in chain:
        block.register_forward_pre_hook(lambda _m, args: block_inputs.append(args[0].data_ptr()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chain(x)
    assert saved == block_inputs  # each block's own input, uncopied, and nothing else from inside
    out.square().sum().backward()
    got = {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in chain.named_parameters()}}
    _assert_identical(got, want)


def test_names_are_kept_and_a_second_application_is_harmless() -> None:
    plain, chain = _chain("cpu", ac=False, offload=False), _chain("cpu", ac=True, offload=True)
    assert chain.state_dict().keys() == plain.state_dict().keys()
    assert isinstance(chain[0], _Block)
    apply_activation_checkpointing(chain, offload=False)
    assert type(chain[0]).__name__ == "OffloadedCheckpointed_Block"


# ---------------------------------------------------------------- on CUDA


def _cuda_case(_mesh, _: Any = None) -> dict[str, Any]:
    want = _step(_chain("cuda", ac=False, offload=False), _x("cuda"))
    held, results = {}, {}
    for offload in (False, True):
        chain, x = _chain("cuda", ac=True, offload=offload), _x("cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = chain(x)
        torch.cuda.synchronize()
        held[offload] = torch.cuda.memory_allocated() - before  # what forward leaves for backward
        out.square().sum().backward()
        results[offload] = {"out": out.detach().cpu(), "x": x.grad.cpu(),
                            **{n: p.grad.cpu() for n, p in chain.named_parameters()}}
    return {"want": want, "results": results, "held": held, "input_bytes": x.numel() * x.element_size()}


@pytest.mark.gpu
def test_offload_on_cuda_keeps_block_inputs_on_the_host_and_is_exact(pools) -> None:
    """The GPU holds one block input fewer per block after forward; outputs and gradients are bit-identical."""
    (got,) = pools.get(1, "cuda").run(_cuda_case)
    for offload in (False, True):
        _assert_identical(got["results"][offload], got["want"])
    saved = got["held"][False] - got["held"][True]
    # Blocks 2..BLOCKS save their input (block 1's is x, which the caller holds anyway): all of it leaves the GPU.
    assert saved >= (BLOCKS - 1) * got["input_bytes"], got
