"""flash-linear-attention's and mamba-ssm's kernel APIs called through `cpcompose.mixers` directly.

No transformers routing and no `context_parallel` block: a `MixerRegion` names the mesh and
the layout, and the CP versions run the kernel they are given on this rank's stretches. The
kernels are the CPU fallbacks of those APIs (transformers' torch `torch_chunk_gated_delta_rule`
and `mamba2_chunk_scan`), in float32 as they compute. Each rank's outputs and input gradients
are compared with its shard of the same kernel run on each document of the full sequence on
one process, at P = 2 under zigzag (one document, both of rank 1's runs one stretch) and a pack.

Tolerance: CP differs from the reference only in float32 rounding (chunks aligned to the
stretches, states composed across ranks): each value is a chain of at most L float32 steps,
so `eps32 * L` relative to the reference's largest value bounds it. Dropping the
correction (the true state's contribution) misses by far more, checked on the same data.
"""

from __future__ import annotations

import torch
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from cpcompose.layouts import Layout
from cpcompose.mixers import MixerOptions, MixerRegion
from cpcompose.mixers.fla import cp_chunk_gated_delta_rule
from cpcompose.mixers.mamba_ssm import cp_mamba2_chunk_scan
from tests.support.mixer_cases import make_layout, randn

S_LOCAL, CHUNK = 12, 4
SPECS = ("zigzag", "packed")


def _inputs(api: str, seq: int) -> dict[str, torch.Tensor]:
    if api == "fla":
        return {"q": randn(1, seq, 2, 4, seed=1), "k": randn(1, seq, 2, 4, seed=2), "v": randn(1, seq, 4, 3, seed=3),
                "g": -torch.rand(1, seq, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64),
                "beta": torch.sigmoid(randn(1, seq, 4, seed=5))}
    return {"x": randn(1, seq, 4, 3, seed=1), "dt": 0.5 * randn(1, seq, 4, seed=2) - 1.0,
            "B": randn(1, seq, 2, 5, seed=4), "C": randn(1, seq, 2, 5, seed=5)}


_A = -torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float32)


def _call(api: str, t: dict[str, torch.Tensor], region: MixerRegion | None) -> torch.Tensor:
    """The API on `t`: through its CP version under `region`, or the kernel itself when None."""
    if api == "fla":
        args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
        if region is None:
            return torch_chunk_gated_delta_rule(*args, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)[0]
        return cp_chunk_gated_delta_rule(torch_chunk_gated_delta_rule, region, *args, chunk_size=CHUNK,
                                         use_qk_l2norm_in_kernel=True)[0]
    args = (t["x"], t["dt"], _A, t["B"], t["C"])
    if region is None:
        return mamba2_chunk_scan(*args, chunk_size=CHUNK, dt_softplus=True)
    return cp_mamba2_chunk_scan(mamba2_chunk_scan, region, *args, chunk_size=CHUNK, dt_softplus=True)


def api_cases(mesh) -> dict:
    rank, world, results = mesh.get_local_rank(), mesh.size(), {}
    for spec in SPECS:
        layout = make_layout(spec, world, S_LOCAL)
        region = MixerRegion(mesh, MixerOptions(layout=layout))
        for api in ("fla", "mamba_ssm"):
            full = _inputs(api, world * S_LOCAL)
            local = {k: layout.shard(v.float(), 1, rank).requires_grad_() for k, v in full.items()}
            out = _call(api, local, region)
            out.sum().backward()
            results[spec, api] = {"out": out.detach(), "grads": {k: v.grad for k, v in local.items()}}
    return results


def _reference(api: str, layout: Layout, seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The kernel on each document alone (a pack's documents restart), outputs in global order."""
    full = {k: v.float().requires_grad_() for k, v in _inputs(api, seq).items()}
    docs = layout.global_runs(seq)
    out = torch.cat([_call(api, {k: v[:, d.pos:d.pos + d.length] for k, v in full.items()}, None) for d in docs], 1)
    out.sum().backward()
    return out.detach(), {k: v.grad for k, v in full.items()}


def test_kernel_apis_through_cpcompose_directly(pools) -> None:
    world = 2
    seq = world * S_LOCAL
    results = pools.get(world).run(api_cases)
    for spec in SPECS:
        layout = make_layout(spec, world, S_LOCAL)
        for api in ("fla", "mamba_ssm"):
            want, grads = _reference(api, layout, seq)
            # float32 chains of at most `seq` steps, relative to the largest value (module docstring)
            tol = torch.finfo(torch.float32).eps * seq
            zero_state = []  # every document restarting at every run: what the CP version would give uncorrected
            for rank in range(world):
                got = results[rank][spec, api]
                scale = want.abs().max().item()
                torch.testing.assert_close(got["out"], layout.shard(want, 1, rank), rtol=tol, atol=tol * scale,
                                           msg=lambda m, at=(spec, api, rank): f"{at} outputs: {m}")
                for name, grad in grads.items():
                    torch.testing.assert_close(got["grads"][name], layout.shard(grad, 1, rank), rtol=tol,
                                               atol=tol * grad.abs().max().item(),
                                               msg=lambda m, at=(spec, api, rank, name): f"{at} grad: {m}")
                runs = layout.runs(rank, seq)
                local = {k: layout.shard(v.float(), 1, rank) for k, v in _inputs(api, seq).items()}
                zero_state.append(torch.cat([_call(api, {k: v[:, r.row:r.row + r.length] for k, v in local.items()},
                                                   None) for r in runs], 1))
            missed = max((z - layout.shard(want, 1, r)).abs().max().item() for r, z in enumerate(zero_state))
            assert missed > 100 * tol * want.abs().max().item(), f"{spec} {api}: the check cannot tell a dropped state"


def test_mixer_region_reports_a_bad_layout() -> None:
    assert MixerOptions(layout="no-such-layout").error(2) is not None
    assert MixerOptions(layout="zigzag").error(2) is None
