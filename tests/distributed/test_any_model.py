"""cpcompose.distributed on a model that is not a Llama, and the model registry.

The generic pieces take the modules to act on from the caller, so a toy model of
plain ``nn.Linear`` blocks must work with them as the Llama plan does:
activation checkpointing recomputes each block's forward and leaves names,
types and gradients as they were; FSDP over dp_shard=2 sums the ranks' loss
shares into the single-process gradient. Tolerance: float64 throughout, and the
sharded run only adds two numbers in another order, so a derived bound (a missing
reduction or an average instead of a sum is off by a factor of 2).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpcompose.distributed import ParallelDims, apply_activation_checkpointing, apply_fsdp
from cpcompose.models import Llama, get_model_spec, model_names
from tests.support.tolerance import assert_close


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.proj(x))


class _Toy(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 2) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same weights every time, without touching the caller's RNG
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))
            self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _inputs() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }


def test_activation_checkpointing_recomputes_any_block_and_keeps_names() -> None:
    plain, checkpointed = _Toy().double(), _Toy().double()
    apply_activation_checkpointing(checkpointed.blocks)
    apply_activation_checkpointing(checkpointed.blocks)  # twice is harmless
    for model in (plain, checkpointed):
        model(_inputs()).sum().backward()
    assert [b.calls for b in plain.blocks] == [1, 1]
    assert [b.calls for b in checkpointed.blocks] == [2, 2]  # forward, then the recompute in backward
    assert all(isinstance(b, _Block) for b in checkpointed.blocks)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    for name, grad in _grads(plain).items():
        assert_close(_grads(checkpointed)[name], grad, rtol=0, atol=0)


def _fsdp_grads(_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2)
    mesh = dims.build_mesh("cpu")
    model = _Toy().double()
    apply_fsdp(model, model.blocks, mesh=mesh, parallel_dims=dims)
    rank = torch.distributed.get_rank()
    x = _inputs()[2 * rank : 2 * rank + 2]
    (model(x).sum() / 4).backward()  # this rank's share of the mean over the 4 rows
    return _grads(model)


def test_fsdp_sums_loss_shares_on_any_model(pools) -> None:
    reference = _Toy().double()
    (reference(_inputs()).sum() / 4).backward()
    for got in pools.get(2).run(_fsdp_grads):
        for name, grad in _grads(reference).items():
            assert_close(got[name], grad, terms=4 * 2)  # derived, float64: 4 rows, in 2 shares


def test_registry_builds_llama_and_names_the_key_for_unknown_families() -> None:
    from cpcompose.config import load_config

    assert "llama" in model_names()
    config = load_config(["--model.n_layers=2"])
    with torch.device("meta"):
        model = get_model_spec(config.model.name).build(config.model, max_seq_len=config.max_seq_len())
    assert isinstance(model, Llama) and len(model.layers) == 2
    with pytest.raises(ValueError, match=r"^model.name: 'gpt' is not one of llama"):
        get_model_spec("gpt")
