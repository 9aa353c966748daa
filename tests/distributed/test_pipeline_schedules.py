"""Every pipeline schedule of torch 2.13, composed with CP (and FSDP2), against one process in float64.

Each case: every rank builds the same 4-layer Llama, cuts it to its stages under the case's
schedule (`stage_ids`: loop placement, or a V), wraps each stage's view in a `StageModule`,
parallelizes it (CP over `cp`, FSDP2 over dp_shard x cp with each stage module its own root,
activation checkpointing where asked), runs one schedule step over 4 microbatches, and returns
the global loss and every gradient gathered by the FULL model's FQNs from the rank's one
union-cut model. One process runs the whole batch and sequence on the uncut model.

All schedules run inside one call on one 4-rank pool (pp = 2 x cp = 2; FSDP2 over cp's 2 ranks),
and the 8-rank case (pp2 x cp2 x dp_shard2, Interleaved1F1B) in one call on one 8-rank pool.

Packed documents: each microbatch is one pack (a row's documents), its `doc_bounds` row passed to
`schedule.step` and chunked per microbatch (`cpcompose.distributed.pipeline_stage`); the reference
is one process running every document alone (positions from 0), which is what document masking
means. Cases with activation checkpointing check that the recompute, which a schedule runs outside
the microbatch's forward scope (twice under a zero-bubble split backward), sees the same layout.

Tolerance: float64 both sides, relative to each tensor's largest entry, `F64_TOL` derived from the
longest reduction (tests/support/tolerance.py: a weight gradient over batch x seq x dim = 8192 terms,
7.3e-12); a wrong stage order, a lost microbatch, a missed gradient reduction or a wrong layout is off
by 1e-3 or more.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from cpcompose import cp_cross_entropy, cp_position_ids, cp_shard
from cpcompose.distributed import (
    PIPELINE_SCHEDULES,
    StageModule,
    build_pipeline_schedule,
    build_pipeline_stages,
    flat_mesh,
    layout_of_doc_bounds,
    microbatch_doc_bounds,
    stage_ids,
)
from cpcompose.models import Llama, LlamaConfig, parallelize_llama, split_llama_for_stages
from cpcompose.parallel import ContextParallel
from cpcompose.layouts import PackedLayout
from cpcompose.sharding.packed import pack_documents
from tests.support.composition import full, parallel_dims, root_mesh
from tests.support.tolerance import relative_bound

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=64)
SEED, BATCH, SEQ, MICRO, IGNORE = 5, 8, 32, 4, -100
F64_TOL = relative_bound(terms=BATCH * SEQ * CFG.dim)
DOCS = [0, 5, 17, 32]  # every row's documents (3 of them): row i's bounds are shifted by i % 3 (below)


def _batch() -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :5] = IGNORE
    labels[3, 7:9] = IGNORE
    bounds = [[0] + [b + (i % 3) for b in DOCS[1:-1]] + [SEQ] for i in range(BATCH)]
    return tokens, labels, bounds


def _model() -> Llama:
    model = Llama(CFG)
    model.init_weights(seed=SEED)
    return model.to(torch.float64)


@functools.cache
def reference(packed: bool) -> dict[str, Any]:
    """One process, the whole batch: the mean token loss and every gradient (packed: each document alone)."""
    model = _model()
    tokens, labels, bounds = _batch()
    if not packed:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    else:
        total = torch.zeros((), dtype=torch.float64)
        for row in range(BATCH):
            for a, b in zip(bounds[row], bounds[row][1:]):
                logits = model(tokens[row:row + 1, a:b])
                total = total + F.cross_entropy(logits.flatten(0, 1), labels[row, a:b], ignore_index=IGNORE,
                                                reduction="sum")
        loss = total / (labels != IGNORE).sum()
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _local(mesh: DeviceMesh, dims, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's rows, cut for cp: `[rows, local_seq]` (packed: one pack per microbatch) and the doc_bounds."""
    tokens, labels, bounds = _batch()
    dp = flat_mesh(mesh, "dp")
    rows = BATCH // dims.dp_size
    first = dp.get_local_rank() * rows
    tokens, labels, bounds = tokens[first:first + rows], labels[first:first + rows], bounds[first:first + rows]
    if not packed:
        positions = cp_position_ids(SEQ, mesh["cp"], layout="zigzag").expand(rows, -1).contiguous()
        return (*(cp_shard(t, mesh["cp"], seq_dim=1, layout="zigzag") for t in (tokens, labels)), positions, None)
    per = rows // MICRO
    packs = []
    for m in range(MICRO):
        part = slice(m * per, (m + 1) * per)
        cu = [0] + [b + i * SEQ for i, row in enumerate(bounds[part]) for b in row[1:]]
        pack = pack_documents([tokens[part], labels[part]], cu, mesh["cp"], pad_values=[0, IGNORE], what="test")
        packs.append((*pack.local(mesh["cp"].get_local_rank()), pack.position_ids(mesh["cp"].get_local_rank()),
                      pack.layout))
    return (*(torch.cat([p[k] for p in packs]) for k in range(3)), microbatch_doc_bounds([p[3] for p in packs]))


def pipeline_step(mesh: DeviceMesh, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case on this rank in turn; each returns the global loss and every full gradient by FQN."""
    results = []
    for case in cases:
        dims = parallel_dims(torch.distributed.get_world_size(), pp=2, cp=2, dp_shard=case.get("dp_shard", 1))
        mesh = root_mesh(dims)
        name, per_rank = case["schedule"], case.get("per_rank", 1 if case["schedule"] in ("GPipe", "1F1B") else 2)
        num_stages = dims.pp * per_rank
        ids = stage_ids(name, dims.pp, mesh["pp"].get_local_rank(), per_rank)
        model, views = split_llama_for_stages(_model(), num_stages=num_stages, stage_ids=ids)
        style = ContextParallel(seq_dim=1)

        def scope(layout):
            return style.layout_for(layout) if layout is not None else contextlib.nullcontext()

        modules = tuple(StageModule(view, scope, dims.cp) for view in views)
        parallelize_llama(model, parallel_dims=dims, mesh=mesh, cp=style, activation_checkpoint=case.get("ac", False),
                          stages=modules)
        loss_mesh = flat_mesh(mesh, "dp_cp")
        tokens, labels, positions, doc_bounds = _local(mesh, dims, case.get("packed", False))
        count = (_batch()[1] != IGNORE).sum()

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return cp_cross_entropy(logits, target, mesh=loss_mesh, ignore_index=IGNORE, num_tokens=count)

        stages = build_pipeline_stages(modules, ids, num_stages=num_stages, parallel_dims=dims, mesh=mesh)
        schedule = build_pipeline_schedule(stages, schedule=name, microbatches=MICRO, loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        meta = {} if doc_bounds is None else {"doc_bounds": doc_bounds}
        last = num_stages - 1 in ids
        schedule.step(*((tokens,) if 0 in ids else ()), target=labels if last else None, losses=losses,
                      position_ids=positions, **meta)
        loss = torch.stack(losses).sum().detach() if last else torch.zeros((), dtype=torch.float64)
        torch.distributed.all_reduce(loss, group=loss_mesh.get_group())
        torch.distributed.all_reduce(loss, group=mesh["pp"].get_group())
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        results.append({"loss": loss, "grads": grads})
    return results


def check(case: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    ref = reference(case.get("packed", False))
    seen: set[str] = set()
    worst = 0.0
    for rank, got in enumerate(per_rank):
        err = abs(got["loss"].item() - ref["loss"].item()) / abs(ref["loss"].item())
        assert err <= F64_TOL, f"{case} rank {rank}: loss off by {err:.3g}"
        for name, value in got["grads"].items():
            truth = ref["grads"][name]
            err = (value - truth).abs().max().item() / truth.abs().max().item()
            worst = max(worst, err)
            assert err <= F64_TOL, f"{case} rank {rank} {name}: gradient off by {err:.3g} > {F64_TOL:.2g}"
        seen |= set(got["grads"])
    assert seen == set(ref["grads"]), f"{case}: parameters on no rank: {set(ref['grads']) - seen}"
    print(f"{case['schedule']}: worst grad {worst:.2g}", end="; ")


CASES = [{"schedule": name} for name in PIPELINE_SCHEDULES] + [
    {"schedule": "InterleavedZeroBubble", "ac": True},  # the split backward recomputes in both its parts
    {"schedule": "Interleaved1F1B", "per_rank": 1},  # pp_layers_per_stage = 2: one stage a rank, looped anyway
    {"schedule": "Interleaved1F1B", "packed": True, "ac": True},
    {"schedule": "ZBVZeroBubble", "packed": True, "ac": True},
    {"schedule": "1F1B", "packed": True},
]


def test_every_schedule_at_pp2_cp2_matches_one_process(pools) -> None:
    """pp = 2 x cp = 2 (FSDP2 over cp) under each of torch's schedules, packed documents under three: the loss
    and every gradient of one float64 process."""
    results = pools.get(4).run(pipeline_step, CASES)
    for i, case in enumerate(CASES):
        check(case, [rank[i] for rank in results])


def test_pp_cp_dp_shard_on_eight_ranks_matches_one_process(pools) -> None:
    """pp2 x cp2 x dp_shard2 under Interleaved1F1B (FSDP2 over dp_shard x cp, each stage its own root), plain and
    packed: the loss and every gradient of one float64 process."""
    cases = [{"schedule": "Interleaved1F1B", "dp_shard": 2}, {"schedule": "Interleaved1F1B", "dp_shard": 2,
                                                              "packed": True, "ac": True}]
    results = pools.get(8).run(pipeline_step, cases)
    for i, case in enumerate(cases):
        check(case, [rank[i] for rank in results])


def test_doc_bounds_rows_give_back_each_microbatch_layout() -> None:
    """One process: each microbatch's `doc_bounds` row rebuilds the very layout its pack was cut by (the same
    identity, so the same split of the tokens), whatever the widths of the other rows; an unpadded row is refused."""
    layouts = [PackedLayout.build([0, 5, 17, 31], 2), PackedLayout.build([0, 32], 2), PackedLayout.build([0, 3, 9], 2)]
    rows = microbatch_doc_bounds(layouts)
    assert rows.shape == (3, 5) and rows.dtype == torch.int64 and rows[1, 2:].eq(-1).all()
    for row, layout in zip(rows.chunk(3), layouts):
        assert layout_of_doc_bounds(row, 2) == layout
    with pytest.raises(ValueError, match="not padded to a multiple of cp = 2"):
        layout_of_doc_bounds(torch.tensor([[0, 5, 17, 31]]), 2)
