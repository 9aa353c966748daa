"""A model nobody wrote for cpcompose, trained under CP through each entry point.

`PlainLM` (tests/support/plain_model.py) is ordinary PyTorch: embeddings, a few
attention blocks that call `F.scaled_dot_product_attention`, a head. It is driven
through `ContextParallel` (via `parallelize_module`), through `context_parallel(...)`,
and through DTensor inputs; loss and every parameter gradient must equal a
single-process run on the full sequence. Everything runs in float64 so the
comparison is tight (derived: float64 eps x the longest sum): only summation order differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from cpcompose import (
    cp_from_local,
    ContextParallel,
    PackedLayout,
    context_parallel,
    context_parallel_unshard,
    cp_cross_entropy,
    cp_position_ids,
    cp_shard,
    pad_pack,
)
from tests.support.plain_model import SEQ, TOL, PlainLM, finish, make_batch, make_model, reference
from tests.support.tolerance import assert_close


def train_step_style(mesh, strategy: str, causal: bool, alltoall_size: int | None = None) -> dict:
    model = make_model(causal)
    layout = "zigzag"
    style = ContextParallel(strategy=strategy, layout=layout, alltoall_size=alltoall_size)
    parallelize_module(model, mesh, {"blocks.*": style})
    tokens, labels = (cp_shard(t, mesh, seq_dim=1, layout=layout) for t in make_batch())
    positions = cp_position_ids(SEQ, mesh, layout=layout)
    loss = cp_cross_entropy(model(tokens, positions), labels, mesh=mesh)
    loss.backward()
    return finish(model, loss, mesh)


def train_step_context(mesh, strategy: str, causal: bool, alltoall_size: int | None = None) -> dict:
    model = make_model(causal)
    tokens, labels = make_batch()
    positions = torch.arange(SEQ)
    with context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0], strategy=strategy,
                          alltoall_size=alltoall_size):
        assert tokens.shape[1] == SEQ // mesh.size()
        loss = cp_cross_entropy(model(tokens, positions), labels, mesh=mesh)
        loss.backward()
    assert tokens.shape[1] == SEQ  # restored on exit
    return finish(model, loss, mesh)


class DTensorIn(nn.Module):
    """Wraps the model so the blocks receive DTensor hidden states (Shard(1) on the CP mesh)."""

    def __init__(self, model: PlainLM, mesh) -> None:
        super().__init__()
        self.model, self.mesh = model, mesh

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.tok(tokens) + m.pos(positions)
        for block in m.blocks:
            h = cp_from_local(torch.tanh(x), self.mesh, seq_dim=1, layout="zigzag")
            y = block(h)
            assert isinstance(y, DTensor) and y.placements == (Shard(1),)
            assert y.device_mesh.mesh_dim_names == h.device_mesh.mesh_dim_names
            x = x + y.to_local()
        return m.head(x)


def train_step_dtensor(mesh, strategy: str, causal: bool, alltoall_size: int | None = None) -> dict:
    model = make_model(causal)
    style = ContextParallel(strategy=strategy, use_local_output=False, alltoall_size=alltoall_size)
    parallelize_module(model, mesh, {"blocks.*": style})
    tokens, labels = (cp_shard(t, mesh, seq_dim=1, layout="zigzag") for t in make_batch())
    logits = DTensorIn(model, mesh)(tokens, cp_position_ids(SEQ, mesh, layout="zigzag"))
    loss = cp_cross_entropy(logits, labels, mesh=mesh)
    loss.backward()
    return finish(model, loss, mesh)


ENTRY_POINTS = {"style": train_step_style, "context": train_step_context, "dtensor": train_step_dtensor}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_plain_model_trains_exactly(pools, entry: str, strategy: str, causal: bool, world: int) -> None:
    want = reference(causal)
    for rank, got in enumerate(pools.get(world).run(ENTRY_POINTS[entry], strategy, causal)):
        assert_close(got["loss"], want["loss"], **TOL)
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_plain_model_trains_exactly_twod(pools, entry: str, causal: bool) -> None:
    """2-D ("alltoall_ring", 2 x 2 at P=4) through every entry point: the same loss and gradients."""
    want = reference(causal)
    for rank, got in enumerate(pools.get(4).run(ENTRY_POINTS[entry], "alltoall_ring", causal, 2)):
        assert_close(got["loss"], want["loss"], **TOL)
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def test_gradients_need_reduction_over_cp(pools) -> None:
    """Each CP rank's gradient covers only its tokens: skipping the CP reduction is wrong.

    (One of the seed documents claims no all-reduce over the CP dimension is needed.)
    """
    want = reference(True)
    results = pools.get(2).run(train_step_style, "ring", True)
    for name, grad in want["grads"].items():
        partial = [r["unreduced"][name] for r in results]
        assert not torch.allclose(partial[0], grad, atol=1e-6), name
        assert_close(partial[0] + partial[1], grad, **TOL)


def sdpa_on_dtensors(mesh) -> dict:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    local = [cp_shard(t, mesh, seq_dim=2, layout="zigzag").detach().requires_grad_() for t in (q, k, v)]
    dq, dk, dv = (cp_from_local(t, mesh, seq_dim=2, layout="zigzag") for t in local)
    with context_parallel(mesh):
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        assert isinstance(out, DTensor) and out.placements == (Shard(2),)
        (full,) = context_parallel_unshard(mesh, [out.to_local()], [2])
        full.sum().backward()
    return {"out": full.detach(), "grads": [t.grad for t in local], "qkv": (q, k, v)}


def test_sdpa_on_dtensors(pools) -> None:
    for result in pools.get(2).run(sdpa_on_dtensors):
        q, k, v = (t.requires_grad_() for t in result["qkv"])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_close(result["out"], out.detach(), **TOL)


def bad_sdpa(mesh, case: str) -> str:
    q = torch.randn(1, 4, 8, 8)
    try:
        if case == "unsplittable_buffer":
            with context_parallel(mesh, buffers=[torch.zeros(2, 6)], buffer_seq_dims=[1]):
                pass
        with context_parallel(mesh):
            if case == "mixed":
                dq = DTensor.from_local(q, mesh, [Shard(2)], run_check=False)
                F.scaled_dot_product_attention(dq, q, q)
            elif case == "mask":
                F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
            elif case == "replicated_dtensor":
                from torch.distributed.tensor import Replicate

                dq = DTensor.from_local(q, mesh, [Replicate()], run_check=False)
                F.scaled_dot_product_attention(dq, dq, dq)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,message",
    [
        ("mixed", "mix of DTensor and plain tensor"),
        ("mask", "cannot honour an explicit attn_mask"),
        ("replicated_dtensor", "needs Shard(2)"),
        ("unsplittable_buffer", "not divisible by 4"),
    ],
)
def test_bad_sdpa_input(pools, case: str, message: str) -> None:
    for got in pools.get(2).run(bad_sdpa, case):
        assert message in got


DOCS = (5, 17, 1, 3, 12, 9)  # 47 tokens: padded to the group size


def packed_reference() -> dict:
    """Each document through the model on its own, positions restarting; one mean loss."""
    model = make_model(True)
    tokens, labels = make_batch()
    tokens, labels = tokens[0, : sum(DOCS)], labels[0, : sum(DOCS)]
    total, count, start = 0.0, (labels != -100).sum(), 0
    for n in DOCS:
        logits = model(tokens[None, start : start + n], torch.arange(n))
        total = total + F.cross_entropy(logits[0], labels[start : start + n], ignore_index=-100, reduction="sum")
        start += n
    loss = total / count
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def train_step_packed(mesh, strategy: str, entry: str, alltoall_size: int | None = None) -> dict:
    model = make_model(True)
    cu = torch.tensor([0, *DOCS]).cumsum(0).tolist()
    layout = PackedLayout.build(cu, mesh.size())
    tokens, labels = make_batch()
    tokens = pad_pack(tokens[:1, : sum(DOCS)], layout, dim=1)
    labels = pad_pack(labels[:1, : sum(DOCS)], layout, dim=1, value=-100)  # padding carries no loss
    positions = pad_pack(torch.cat([torch.arange(n) for n in DOCS]), layout, dim=0)
    if entry == "style":
        style = ContextParallel(strategy=strategy, alltoall_size=alltoall_size)
        parallelize_module(model, mesh, {"blocks.*": style})
        local = [cp_shard(t, mesh, seq_dim=d, layout=layout) for t, d in ((tokens, 1), (labels, 1), (positions, 0))]
        with style.layout_for(layout):
            loss = cp_cross_entropy(model(local[0], local[2]), local[1], mesh=mesh)
            loss.backward()
    else:
        with context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0],
                              strategy=strategy, layout=layout, alltoall_size=alltoall_size):
            loss = cp_cross_entropy(model(tokens, positions), labels, mesh=mesh)
            loss.backward()
    return finish(model, loss, mesh)


@pytest.mark.parametrize(
    "world,strategy,alltoall_size",
    [(w, s, None) for w in (2, 3) for s in ("ring", "allgather", "alltoall")] + [(4, "alltoall_ring", 2)],
)
@pytest.mark.parametrize("entry", ["style", "context"])
def test_packed_documents_train_exactly(
    pools, entry: str, strategy: str, world: int, alltoall_size: int | None
) -> None:
    """A pack of documents: attention stays inside each document, padding changes nothing."""
    want = packed_reference()
    for got in pools.get(world).run(train_step_packed, strategy, entry, alltoall_size):
        assert_close(got["loss"], want["loss"], **TOL)
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL)
