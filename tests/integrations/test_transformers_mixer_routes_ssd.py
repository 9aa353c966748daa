"""Mamba2's SSD scan under CP (`cpcompose.mixers.mamba_ssm.ssd`) against the original kernel on one process, in float64.

The original here is a float64 sequential SSD with `mamba_chunk_scan_combined`'s API (initial and
final states, D, dt bias, softplus, clamp), given to the CP version directly: the CP version runs
it on each local run from zero, passes the states, and adds each continuing run's carried term
itself (`exp(sum dt A) * C . h0`). Against the same kernel on the whole sequence (each document
alone in a pack) every output and gradient is held to the derived float64 bound: only the order of operations differs
(states compose across ranks; a run's decay is one `exp(cumsum)`), a few ulps of O(1) values, while
a dropped or misplaced carried term misses by ~1e-2 (checked below). transformers' own float32
kernel through the route is covered by the model tests (`test_transformers_hybrids.py`).
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from cpcompose import CPOptions
from cpcompose.mixers.mamba_ssm.ssd import cp_mamba2_chunk_scan
from cpcompose.parallel.dispatch import CPAttentionMode
from tests.support.mixer_cases import LAYOUTS, S_LOCAL, doc_starts, make_layout, randn
from tests.support.tolerance import assert_close

BATCH, HEADS, HEAD_DIM, GROUPS, STATE = 2, 4, 3, 2, 5
# Derived (tests/support/tolerance.py), float64: batch x sequence (P <= 4) x head dim x state.
TOL = dict(terms=BATCH * 4 * S_LOCAL * HEAD_DIM * STATE)
SHARDED = ("x", "dt", "B", "C")  # (batch, seq, ...): each rank holds its shard
REPLICATED = ("A", "D", "dt_bias")  # their gradients sum over ranks


def ssd64(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
          dt_limit=(0.0, math.inf), return_final_states=False, **_):
    """The SSD recurrence token by token in float64: h = exp(dt A) h + dt x B^T, y = C . h + D x."""
    dt = dt if dt_bias is None else dt + dt_bias
    dt = torch.clamp(F.softplus(dt) if dt_softplus else dt, min=dt_limit[0], max=dt_limit[1])
    b, seq, heads, head_dim = hidden_states.shape
    rep = heads // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    h = initial_states if initial_states is not None else hidden_states.new_zeros(b, heads, head_dim, B.shape[-1])
    ys = []
    for t in range(seq):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h \
            + (dt[:, t, :, None] * hidden_states[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    y = y if D is None else y + D[:, None] * hidden_states
    return (y, h) if return_final_states else y


def inputs(seq: int) -> dict[str, torch.Tensor]:
    return {
        "x": randn(BATCH, seq, HEADS, HEAD_DIM, seed=1), "dt": 0.5 * randn(BATCH, seq, HEADS, seed=2) - 3.0,
        "A": -torch.exp(0.3 * randn(HEADS, seed=3)), "B": randn(BATCH, seq, GROUPS, STATE, seed=4),
        "C": randn(BATCH, seq, GROUPS, STATE, seed=5), "D": randn(HEADS, seed=6), "dt_bias": 0.1 * randn(HEADS, seed=7),
    }


def call(scan, t: dict) -> torch.Tensor:
    return scan(t["x"], t["dt"], t["A"], t["B"], t["C"], 4, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True,
                dt_limit=(0.0, 10.0))


def probe(seq: int) -> torch.Tensor:
    return randn(BATCH, seq, HEADS, HEAD_DIM, seed=9)


def ssd_cases(mesh) -> list[dict]:
    world, rank, results = mesh.size(), mesh.get_local_rank(), []
    for spec in LAYOUTS:
        layout, seq = make_layout(spec, world), world * S_LOCAL
        t = {k: (layout.shard(v, 1, rank) if k in SHARDED else v).requires_grad_() for k, v in inputs(seq).items()}
        region = CPAttentionMode(mesh, CPOptions(layout=layout))
        out = call(lambda *a, **k: cp_mamba2_chunk_scan(ssd64, region, *a, **k), t)
        (out * layout.shard(probe(seq), 1, rank)).sum().backward()
        results.append({"out": out.detach(), **{k: v.grad for k, v in t.items()}})
    return results


def reference(layout, seq: int) -> dict[str, torch.Tensor]:
    t = {k: v.requires_grad_() for k, v in inputs(seq).items()}
    bounds = [*sorted(set(doc_starts(layout, seq))), seq]
    out = torch.cat([call(ssd64, {k: v[:, a:b] if k in SHARDED else v for k, v in t.items()})
                     for a, b in pairwise(bounds)], dim=1)
    (out * probe(seq)).sum().backward()
    return {"out": out.detach(), **{k: v.grad for k, v in t.items()}}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ssd_is_exact(pools, world: int) -> None:
    results = pools.get(world).run(ssd_cases)
    seq = world * S_LOCAL
    for case, spec in enumerate(LAYOUTS):
        layout = make_layout(spec, world)
        want = reference(layout, seq)
        for rank, got in enumerate(r[case] for r in results):
            for name in ("out", *SHARDED):
                assert_close(got[name], layout.shard(want[name], 1, rank), **TOL,
                                           msg=lambda m: f"{spec} P={world} rank {rank} {name}: {m}")
        for name in REPLICATED:
            assert_close(sum(r[case][name] for r in results), want[name], **TOL,
                                       msg=lambda m: f"{spec} P={world} {name}: {m}")


def test_the_cut_carries_state() -> None:
    """Each rank's runs scanned from zero (no carried term) miss the reference by far more than 1e-12."""
    seq, layout = 2 * S_LOCAL, make_layout("zigzag", 2)
    full, t = reference(layout, seq)["out"], inputs(seq)
    local = torch.cat([call(ssd64, {k: v[:, run.pos:run.pos + run.length] if k in SHARDED else v
                                    for k, v in t.items()}) for run in layout.runs(0, seq)], dim=1)
    assert (local - layout.shard(full, 1, 0)).abs().max() > 1e-3
