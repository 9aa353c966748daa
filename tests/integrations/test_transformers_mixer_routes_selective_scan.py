"""Mamba's selective scan under CP (`cpcompose.mixers.mamba_ssm.selective_scan`) against the original kernel on
one process, float64.

Two originals with mamba_ssm's `selective_scan_fn` API, each run on the whole sequence (a pack: each
document alone, since under CP every document restarts):

- "float64": a sequential scan in float64 throughout (mamba_ssm's `selective_scan_ref` recurrence),
  given to the CP version directly. CP then differs from it only in the order of operations (a run's
  decay is `exp(cumsum(delta A))`, not a product of `exp(delta A)`; states compose across ranks): a
  few ulps of O(1) values (<= 3e-14 measured), so every output and gradient is held to `TOL` (derived, float64),
  which still catches a dropped, doubled or misplaced correction (carried states are O(0.1) here:
  decays of ~0.95 a token).
- "transformers": transformers' own `mamba_selective_scan`, called through the route inside a
  `context_parallel` region, as a model calls it. It reads u and B in float32 (`hidden_states.float()`,
  `B.float()`), so u and B are float32-representable here (the forward is then float64 to `TOL`), but
  its gradients w.r.t. u and B are rounded to float32 by those casts: they are held to `F32_CAST`.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

import cpcompose.integrations.transformers  # noqa: F401  (installs the routes)
from cpcompose import CommMeter, CPOptions, context_parallel
from cpcompose.mixers.mamba_ssm.selective_scan import cp_mamba_selective_scan
from cpcompose.mixers.states import continued_runs
from cpcompose.parallel.dispatch import CPAttentionMode
from tests.support.mixer_cases import F64, LAYOUTS, S_LOCAL, doc_starts, make_layout, randn
from tests.support.tolerance import assert_close

BATCH, D_INNER, D_STATE = 2, 3, 4
# Derived (tests/support/tolerance.py), float64: batch x sequence (P <= 4) x width x state.
TOL = dict(terms=BATCH * 4 * S_LOCAL * D_INNER * D_STATE)
F32_CAST = dict(rtol=1e-5, atol=1e-7)  # float32-rounded O(1) terms: <= 1.1e-7 measured, under 0.09 of this
KERNELS = ("float64", "transformers")
VARIANTS = ("model", "bare")  # the models' call (D, z gate, dt bias, softplus) and the kernel with none of them
SHARDED = ("u", "delta", "B", "C", "z")  # (batch, ..., seq): each rank holds its shard
REPLICATED = ("A", "D", "delta_bias")  # every rank holds all: their gradients sum over ranks


def scan64(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
           **_):
    """The selective scan token by token in float64 (mamba_ssm's `selective_scan_ref` recurrence)."""
    if delta_bias is not None:
        delta = delta + delta_bias[..., None]
    if delta_softplus:
        delta = F.softplus(delta)
    h, ys = u.new_zeros(*u.shape[:2], A.shape[1]), []
    for t in range(u.shape[-1]):
        h = torch.exp(delta[..., t, None] * A) * h + (delta[..., t] * u[..., t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    y = y if D is None else y + u * D[:, None]
    y = y if z is None else y * F.silu(z)
    return (y, h) if return_last_state else y


def transformers_scan():
    """transformers' `mamba_selective_scan`: routed inside a CP region, the original outside."""
    from transformers.models.mamba import modeling_mamba

    return modeling_mamba.mamba_selective_scan


def inputs(seq: int, variant: str) -> dict[str, torch.Tensor | None]:
    """The kernel's tensors over the whole sequence, the same on every rank (seeded); u and B float32-exact."""
    raw = 0.5 * randn(BATCH, D_INNER, seq, seed=1) - 3.0  # softplus(raw) ~ 0.05: decays ~0.95 a token
    model = variant == "model"
    return {
        "u": randn(BATCH, D_INNER, seq, seed=2).float().double(),
        "delta": raw if model else F.softplus(raw),
        "A": -torch.exp(0.3 * randn(D_INNER, D_STATE, seed=3)),
        "B": randn(BATCH, D_STATE, seq, seed=4).float().double(),
        "C": randn(BATCH, D_STATE, seq, seed=5),
        "D": randn(D_INNER, seed=6) if model else None,
        "z": randn(BATCH, D_INNER, seq, seed=7) if model else None,
        "delta_bias": 0.1 * randn(D_INNER, seed=8) if model else None,
    }


def call(scan, t: dict, variant: str) -> torch.Tensor:
    return scan(t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"], delta_bias=t["delta_bias"],
                delta_softplus=variant == "model")


def probe(seq: int) -> torch.Tensor:
    return randn(BATCH, D_INNER, seq, seed=9)


def scan_cases(mesh, kernel: str) -> list[dict]:
    """Every layout and variant: this rank's outputs, gradients of `sum(out * probe)`, summary bytes."""
    world, rank, results = mesh.size(), mesh.get_local_rank(), []
    for spec in LAYOUTS:
        layout, seq = make_layout(spec, world), world * S_LOCAL
        for variant in VARIANTS:
            t = {k: None if v is None else (layout.shard(v, -1, rank) if k in SHARDED else v).requires_grad_()
                 for k, v in inputs(seq, variant).items()}
            meter = CommMeter()
            if kernel == "float64":
                region = CPAttentionMode(mesh, CPOptions(layout=layout, meter=meter))
                out = call(lambda *a, **k: cp_mamba_selective_scan(scan64, region, *a, **k), t, variant)
                (out * layout.shard(probe(seq), -1, rank)).sum().backward()
            else:
                with context_parallel(mesh, layout=layout):
                    out = call(transformers_scan(), t, variant)
                    (out * layout.shard(probe(seq), -1, rank)).sum().backward()
            results.append({"out": out.detach(), "bytes": dict(meter.bytes_sent),
                            **{k: v.grad for k, v in t.items() if v is not None}})
    return results


def reference(scan, layout, seq: int, variant: str) -> dict[str, torch.Tensor]:
    """The original on one process, each document on its own: outputs and gradients."""
    t = {k: None if v is None else v.requires_grad_() for k, v in inputs(seq, variant).items()}
    bounds = [*sorted(set(doc_starts(layout, seq))), seq]
    out = torch.cat([call(scan, {k: v[..., a:b] if k in SHARDED and v is not None else v for k, v in t.items()},
                          variant) for a, b in pairwise(bounds)], dim=-1)
    (out * probe(seq)).sum().backward()
    return {"out": out.detach(), **{k: v.grad for k, v in t.items() if v is not None}}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_selective_scan_is_exact(pools, world: int, kernel: str) -> None:
    results = pools.get(world).run(scan_cases, kernel)
    seq, case, original = world * S_LOCAL, 0, scan64 if kernel == "float64" else transformers_scan()
    for spec in LAYOUTS:
        layout = make_layout(spec, world)
        every = [layout.runs(r, seq) for r in range(world)]
        most, row = max(map(len, continued_runs(every))), 2 * BATCH * D_INNER * D_STATE * F64
        for variant in VARIANTS:
            want, at = reference(original, layout, seq, variant), f"{kernel} {spec} {variant} P={world}"
            for rank, got in enumerate(r[case] for r in results):
                for name in ("out", *SHARDED):
                    tol = F32_CAST if kernel == "transformers" and name in ("u", "B") else TOL
                    if name in want:
                        assert_close(got[name], layout.shard(want[name], -1, rank), **tol,
                                                   msg=lambda m: f"{at} rank {rank} {name}: {m}")
                if kernel == "float64":  # (transition, final) rows of the runs continued, padded to `most`
                    assert got["bytes"] == {"all_gather": (world - 1) * most * row,
                                            "reduce_scatter": (world - 1) * most * row}, at
            for name in REPLICATED:
                if name in want:
                    assert_close(sum(r[case][name] for r in results), want[name], **TOL,
                                               msg=lambda m: f"{at} {name}: {m}")
            case += 1


def test_the_cut_carries_state() -> None:
    """The layouts cut documents where the carried state matters: each rank's runs scanned from zero
    (no CP correction) miss the reference by far more than the tolerance."""
    seq, layout = 2 * S_LOCAL, make_layout("zigzag", 2)
    full, t = reference(scan64, layout, seq, "model")["out"], inputs(seq, "model")
    local = torch.cat([call(scan64, {k: v[..., run.pos:run.pos + run.length] if k in SHARDED and v is not None
                                     else v for k, v in t.items()}, "model") for run in layout.runs(0, seq)], dim=-1)
    assert (local - layout.shard(full, -1, 0)).abs().max() > 1e-3


def refusals(mesh) -> dict[str, str | None]:
    """A bad call on one rank raises the same ValueError on every rank (no rank is left in a collective)."""
    rank, seq, messages = mesh.get_local_rank(), mesh.size() * S_LOCAL, {}
    layout = make_layout("zigzag", mesh.size())
    t = {k: None if v is None else (layout.shard(v, -1, rank) if k in SHARDED else v)
         for k, v in inputs(seq, "model").items()}
    grouped = t["B"][:, None] if rank == 1 else t["B"]  # mamba_ssm's (batch, groups, d_state, seq) form
    for name, kwargs in {
        "last_state": {"return_last_state": rank == 1},
        "cu_seqlens": {"cu_seqlens": torch.tensor([0, seq]) if rank == 0 else None},
        "grouped": {},
    }.items():
        try:
            with context_parallel(mesh, layout=layout):
                transformers_scan()(t["u"], t["delta"], t["A"], grouped if name == "grouped" else t["B"], t["C"],
                                    D=t["D"], z=t["z"], delta_bias=t["delta_bias"], delta_softplus=True, **kwargs)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_bad_input_on_one_rank_raises_everywhere(pools) -> None:
    results = pools.get(2).run(refusals)
    assert results[0] == results[1]
    messages = results[0]
    assert "rank 1" in messages["last_state"] and "use_cache=False" in messages["last_state"]
    assert "rank 0" in messages["cu_seqlens"] and "seq_idx/cu_seqlens" in messages["cu_seqlens"]
    assert "rank 1" in messages["grouped"] and "B must be input-dependent (batch, d_state, seq)" in messages["grouped"]
