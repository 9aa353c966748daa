"""`torch.compile(model, fullgraph=True)` of a model whose SDPA calls are context-parallel.

The model is `PlainLM` (tests/support/plain_model.py) with `ContextParallel` on its blocks,
compiled whole: the hooks that enter the CP mode, the mode's routing and the custom op
(`cpcompose::attention`) are all inside one graph. Loss and every gradient are
compared with the single-process float64 run at the derived bound (only summation order differs,
and the compiled graph computes the same ops in float64). Each case compiles twice
over (forward and backward graphs) and runs two steps, so the second step runs the
cached graphs against the same `CPContext`.

Also: the `context_parallel` region around a compiled model, `cp_attention` called
directly in compiled code (with a `CPContext`), and the trainer's `training.compile`,
which now compiles whole transformer blocks.

Compiling costs seconds: one case per strategy with `aot_eager` (dynamo + AOTAutograd,
which is what has to see around the op), inductor (the default backend) once for the
model and in the trainer; about a minute in all with warm workers.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

from cpcompose import (
    ContextParallel,
    CPContext,
    allreduce_gradients,
    context_parallel,
    cp_attention,
    cp_cross_entropy,
    cp_position_ids,
    cp_shard,
)
from tests.support.plain_model import SEQ, TOL, make_batch, make_model, reference
from tests.support.trainer import run_trainer
from tests.support.tolerance import assert_close


def compiled_steps(
    mesh, strategy: str, causal: bool, backend: str, alltoall_size: int | None = None, device: str = "cpu"
) -> dict:
    torch._dynamo.reset()  # each case compiles from scratch: no graph from an earlier case
    model = make_model(causal).to(device)
    style = ContextParallel(strategy=strategy, alltoall_size=alltoall_size)
    parallelize_module(model, mesh, {"blocks.*": style})
    graphs: list[str] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=recording)
    tokens, labels = (cp_shard(t.to(device), mesh, seq_dim=1, layout="zigzag") for t in make_batch())
    positions = cp_position_ids(SEQ, mesh, layout="zigzag", device=device)
    steps = []
    for _ in range(2):
        model.zero_grad()
        loss = cp_cross_entropy(compiled(tokens, positions), labels, mesh=mesh)
        loss.backward()
        allreduce_gradients(model, mesh)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        steps.append({"loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return {"steps": steps, "graphs": graphs}


def _check(results: list[dict], causal: bool) -> None:
    want = reference(causal)
    for rank, got in enumerate(results):
        for step in got["steps"]:
            assert_close(step["loss"], want["loss"], **TOL)
            for name, grad in want["grads"].items():
                assert_close(
                    step["grads"][name], grad, **TOL, msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}"
                )
        if got["graphs"] is None:
            continue
        assert len(got["graphs"]) == 1, f"rank {rank}: {len(got['graphs'])} graphs, expected one (no recompile)"
        assert got["graphs"][0].count("target=torch.ops.cpcompose.attention") == 2, "each block's attention is one custom op call"


@pytest.mark.parametrize(
    "strategy,world,alltoall_size",
    [("ring", 2, None), ("allgather", 2, None), ("alltoall", 2, None), ("alltoall", 3, None), ("alltoall_ring", 2, 1)],
)  # all-to-all on 3 ranks: 4 query heads split 2,1,1, so its saved head shards differ per rank;
# 2-D as 1 x 2 (blocks of one rank, a ring of two): its saved shards have all 4 heads of the
# block's tokens, not all-to-all's 2 heads of the whole sequence (2 x 2 passes too; four ranks compile slower)
def test_fullgraph_compile_is_exact(pools, strategy: str, world: int, alltoall_size: int | None) -> None:
    _check(pools.get(world).run(compiled_steps, strategy, True, "aot_eager", alltoall_size), True)


def test_fullgraph_compile_inductor(pools) -> None:
    _check(pools.get(2).run(compiled_steps, "ring", False, "inductor"), False)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy,backend", [("ring", "inductor"), ("allgather", "aot_eager"), ("alltoall", "aot_eager")])
def test_cuda_fullgraph_compile_is_exact(pools, strategy: str, backend: str) -> None:
    """The same float64 model on CUDA (the explicit path; no fused CUDA kernel takes float64), inductor once."""
    _check(pools.get(2, "cuda").run(compiled_steps, strategy, True, backend, None, "cuda"), True)


def compiled_context_parallel(mesh, strategy: str) -> dict:
    """The `context_parallel` region entered outside the compiled model: its mode is active while dynamo traces."""
    torch._dynamo.reset()
    model = make_model(True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    tokens, labels = make_batch()
    positions = torch.arange(SEQ)
    with context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0], strategy=strategy):
        loss = cp_cross_entropy(compiled(tokens, positions), labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return {"steps": [{"loss": total, "grads": {n: p.grad for n, p in model.named_parameters()}}], "graphs": None}


def test_context_parallel_region_compiles(pools) -> None:
    _check(pools.get(2).run(compiled_context_parallel, "allgather"), True)


def compiled_cp_attention(mesh) -> dict:
    """`cp_attention` called directly in compiled code, with a `CPContext`: equal to eager, bit for bit."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    local = [cp_shard(t, mesh, seq_dim=2).requires_grad_() for t in full]
    context = CPContext(mesh, strategy="alltoall")

    def attention(q, k, v, mesh):
        return cp_attention(q, k, v, mesh=mesh, is_causal=True, softcap=2.0, return_lse=True)

    results = []
    for fn in (torch.compile(attention, fullgraph=True, backend="aot_eager"), attention):
        for t in local:
            t.grad = None
        out, lse = fn(*local, mesh=context)
        (out * out).sum().backward()
        results.append([out.detach(), lse, *(t.grad for t in local)])
    try:
        torch.compile(attention, fullgraph=True, backend="aot_eager")(*local, mesh=mesh)
        error = "no error"
    except Exception as e:  # noqa: BLE001 (dynamo wraps the ValueError raised while tracing in its own type)
        error = str(e)
    # Rank 1 alone passes a shorter shard: the agreement inside the op makes every rank raise.
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    mine = [t[:, :, : 4 if mesh.get_local_rank() == 1 else 8].detach() for t in local]
    try:
        compiled(*mine, mesh=context)
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    # Rank 1 alone passes a key mask, which the compiled op cannot take: every rank raises, naming it.
    key_padding = torch.ones(1, 8, dtype=torch.bool) if mesh.get_local_rank() == 1 else None
    try:
        torch.compile(lambda q, k, v: cp_attention(q, k, v, mesh=context, key_padding=key_padding), fullgraph=True,
                      backend="aot_eager")(*(t.detach() for t in local))
        padded = "no error"
    except ValueError as e:
        padded = str(e)
    return {"compiled": results[0], "eager": results[1], "error": error, "mismatch": mismatch, "padded": padded}


def test_cp_attention_compiles_with_a_context(pools) -> None:
    for got in pools.get(2).run(compiled_cp_attention):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got["compiled"], got["eager"]):
            assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
        assert "needs mesh=CPContext(mesh, options)" in got["error"]
        assert "inputs differ between CP ranks" in got["mismatch"], got["mismatch"]
        assert "rank 1: key_padding is not supported inside torch.compile" in got["padded"], got["padded"]


def trainer_losses(mesh, args: list[str]) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = run_trainer(mesh, args)
    return {"losses": losses, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


@pytest.mark.parametrize("ac", ["none", "full"])
def test_trainer_compiles_whole_blocks(pools, tmp_path, ac: str) -> None:
    """`training.compile` at cp=2 (FSDP over cp, inductor) gives compile-off's losses.

    Tolerance 1e-5 relative, as between layouts in training/test_trainer.py: inductor may fuse float32
    sums in another order (measured: equal to the last bit here, 3e-8 under pp=2).
    Blocks compile with fullgraph=True, so a graph break would fail the run.
    """
    common = ["--parallelism.cp=2", "--training.steps=2", f"--activation_checkpoint.mode={ac}"]
    runs = {
        flag: pools.get(2).run(
            trainer_losses, common + [f"--training.compile={flag}", f"--job.dump_folder={tmp_path / flag}"]
        )
        for flag in ("false", "true")
    }
    assert runs["false"][0]["graphs"] == 0 and runs["true"][0]["graphs"] >= 1
    for eager, compiled in zip(runs["false"], runs["true"]):
        assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
