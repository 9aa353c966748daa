"""The delta-rule kernels' CP versions (`cpcompose.mixers.fla`) against the kernel on the full sequence.

transformers' torch kernels (`torch_chunk_gated_delta_rule` for Gated DeltaNet,
`chunk_kimi_delta_attention` for KDA) compute in float32 whatever their inputs. So each
is rebuilt here from its own source with float32 replaced by float64 (`in_float64`): the
same algorithm (chunking, padding, grouped values, key normalization, state orientation),
so the CP versions are held to float64 and exactness does not rest on a float32
tolerance. The CP version runs that kernel once on each local stretch (widened by the
identity's dk columns where the stretch continues a document, then corrected by the
composed state); the reference runs it
once per document of the full sequence. Outputs and the gradients of q, k, v, g and beta
on every rank are compared with the rank's shard of the reference, on real gloo groups,
at P = 2, 3, 4 under the zigzag, contiguous and packed layouts, with a chunk size (4) that
local runs (3 to 12 tokens) both straddle and fall short of.

Tolerance: derived (tests/support/tolerance.py). Everything is float64 and the CP result differs
from the reference only in the order of operations (chunks aligned to runs instead of the
sequence, the state composed across ranks); measured at most ~1e-14 on O(1) values, while a
missing or doubled state term is O(1e-1).
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cpcompose.attention.call.options import CPOptions
from cpcompose.mixers.fla.delta_rule import (
    cp_chunk_gated_delta_rule, cp_chunk_kimi_delta_attention,
)
from cpcompose.layouts import Layout
from cpcompose.parallel.dispatch import CPAttentionMode
from tests.support.mixer_cases import doc_starts, make_layout, randn, value_errors
from tests.support.tolerance import assert_close

B, HK, HV, DK, DV, S_LOCAL, CHUNK = 2, 2, 4, 4, 3, 12, 4
# Derived (tests/support/tolerance.py), float64: batch x sequence (P <= 4) x the state's DK x DV.
TOL = dict(terms=B * 4 * S_LOCAL * DK * DV)
LAYOUTS = ("zigzag", "contiguous", "packed")
KERNELS: dict[str, tuple[str, Callable[..., Any]]] = {  # name -> (modeling module, CP version)
    "gdn": ("qwen3_next", cp_chunk_gated_delta_rule),
    "kda": ("kimi_linear", cp_chunk_kimi_delta_attention),
}
FUNCTION = {"gdn": "torch_chunk_gated_delta_rule", "kda": "chunk_kimi_delta_attention"}


def in_float64(which: str) -> Callable[..., Any]:
    """transformers' own kernel for `which`, recompiled from its source with every float32 cast made float64."""
    module_name = f"transformers.models.{KERNELS[which][0]}.modeling_{KERNELS[which][0]}"
    module = __import__(module_name, fromlist=["_"])
    source = inspect.getsource(inspect.unwrap(getattr(module, FUNCTION[which])))
    source = re.sub(r"^@.*\n", "", source, flags=re.MULTILINE)  # the hub decorator
    rewritten = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    assert rewritten != source, f"{FUNCTION[which]} no longer casts to float32: revisit in_float64"
    namespace = dict(vars(module))
    exec(compile(rewritten, f"<{FUNCTION[which]} in float64>", "exec"), namespace)  # noqa: S102 (its own source)
    return namespace[FUNCTION[which]]  # type: ignore[no-any-return]


def inputs(which: str, seq: int) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
    """Full-sequence (q, k, v, g, beta), the output probe, and use_qk_l2norm_in_kernel.

    GDN: grouped values (4 value heads over 2 key heads), keys normalized in the kernel,
    beta in (0, 2) as OLMo-Hybrid allows. KDA: a gate per key channel, keys not normalized
    (small, so `I - beta k k^T` stays a contraction): the two flags are both covered.
    """
    heads = HV if which == "gdn" else HK
    q, k = randn(B, seq, HK, DK, seed=1), randn(B, seq, HK, DK, seed=2)
    v = randn(B, seq, heads, DV, seed=3)
    g = -0.5 * F.softplus(randn(B, seq, heads, *([DK] if which == "kda" else []), seed=4))
    beta = randn(B, seq, heads, seed=5).sigmoid()
    if which == "gdn":
        return [q, k, v, g, 2 * beta], randn(B, seq, heads, DV, seed=6), True
    return [q, 0.4 * k, v, g, beta], randn(B, seq, heads, DV, seed=6), False


def reference(which: str, layout: Layout, seq: int) -> dict:
    """The float64 kernel on each document of the full sequence: outputs and input gradients."""
    kernel, (tensors, probe, norm) = in_float64(which), inputs(which, seq)
    leaves = [t.requires_grad_() for t in tensors]
    starts = sorted(set(doc_starts(layout, seq))) + [seq]
    outputs = [kernel(*(t[:, a:b] for t in leaves[:3]), g=leaves[3][:, a:b], beta=leaves[4][:, a:b],
                      chunk_size=CHUNK, use_qk_l2norm_in_kernel=norm)[0] for a, b in itertools.pairwise(starts)]
    o = torch.cat(outputs, dim=1)
    assert o.dtype == torch.float64
    (o * probe).sum().backward()
    return {"o": o.detach(), "grads": [t.grad for t in leaves]}


def exact_cases(mesh, which: str) -> list[dict]:
    """On every rank: the CP version of `which` over each layout, on the float64 kernel."""
    world, rank, kernel = mesh.size(), mesh.get_local_rank(), in_float64(which)
    results = []
    for spec in LAYOUTS:
        layout, seq = make_layout(spec, world, S_LOCAL), world * S_LOCAL
        tensors, probe, norm = inputs(which, seq)
        q, k, v, g, beta = (layout.shard(t, 1, rank).requires_grad_() for t in tensors)
        region = CPAttentionMode(mesh, CPOptions(layout=layout))
        o, final = KERNELS[which][1](kernel, region, q, k, v, g=g, beta=beta, chunk_size=CHUNK,
                                     use_qk_l2norm_in_kernel=norm)
        (o * layout.shard(probe, 1, rank)).sum().backward()
        results.append({"o": o.detach(), "final": final, "grads": [t.grad for t in (q, k, v, g, beta)]})
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("which", sorted(KERNELS))
def test_cp_delta_rule_is_exact(pools, which: str, world: int) -> None:
    results = pools.get(world).run(exact_cases, which)
    for case, spec in enumerate(LAYOUTS):
        layout, seq = make_layout(spec, world, S_LOCAL), world * S_LOCAL
        want = reference(which, layout, seq)
        for rank, got in enumerate(r[case] for r in results):
            at = f"{which} {spec} P={world} rank {rank}"
            assert got["final"] is None, at
            for name, value, ref in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [got["o"], *got["grads"]],
                                        [want["o"], *want["grads"]]):
                assert_close(value, layout.shard(ref, 1, rank), **TOL,
                                           msg=lambda m, where=f"{at} {name}": f"{where}: {m}")


def refusal_cases(mesh) -> dict:
    """A bad call on rank 1 only: every rank raises the same ValueError, and the group stays usable."""
    rank, kernel = mesh.get_local_rank(), in_float64("gdn")
    region = CPAttentionMode(mesh, CPOptions(layout="zigzag"))
    (q, k, v, g, beta), _, _ = inputs("gdn", 2 * S_LOCAL)
    q, k, v, g, beta = (t[:, :S_LOCAL] for t in (q, k, v, g, beta))
    state = torch.zeros(B, HV, DK, DV, dtype=torch.float64)
    bad = rank == 1
    calls: dict[str, Callable[[], Any]] = {
        "state": lambda: cp_chunk_gated_delta_rule(kernel, region, q, k, v, g, beta,
                                                   initial_state=state if bad else None),
        "final": lambda: cp_chunk_gated_delta_rule(kernel, region, q, k, v, g, beta, output_final_state=bad),
        "cu_seqlens": lambda: cp_chunk_gated_delta_rule(kernel, region, q, k, v, g, beta,
                                                        cu_seqlens=torch.tensor([0, S_LOCAL]) if bad else None),
        "gate": lambda: cp_chunk_gated_delta_rule(kernel, region, q, k, v, g[..., :2] if bad else g, beta),
        "kda_heads": lambda: cp_chunk_kimi_delta_attention(kernel, region, q, k, v, g[..., None].expand(-1, -1, -1, DK),
                                                           beta),
    }
    messages = value_errors(calls)
    o, _ = cp_chunk_gated_delta_rule(kernel, region, q, k, v, g, beta)
    return {"messages": messages, "shape": tuple(o.shape)}


def test_bad_input_on_one_rank_raises_on_every_rank(pools) -> None:
    results = pools.get(2).run(refusal_cases)
    messages = results[0]["messages"]
    assert "rank 1: torch_chunk_gated_delta_rule got an initial state" in messages["state"]
    assert "rank 1: torch_chunk_gated_delta_rule got an initial state" in messages["final"]
    assert "rank 1: torch_chunk_gated_delta_rule got seq_idx/cu_seqlens" in messages["cu_seqlens"]
    assert f"rank 1: torch_chunk_gated_delta_rule: g must be ({B}, {S_LOCAL}, {HV})" in messages["gate"]
    assert "rank 0: chunk_kimi_delta_attention: value must be (batch, seq, k_heads, dv)" in messages["kda_heads"]
    assert results[1]["messages"] == messages
    assert [r["shape"] for r in results] == [(B, S_LOCAL, HV, DV)] * 2


def test_kernels_are_routed_in_every_delta_rule_family() -> None:
    from cpcompose.integrations.transformers.mixer_routes import install, routed_functions

    install()
    routed = routed_functions()
    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp"):
        assert {"causal_conv1d_fn", "torch_chunk_gated_delta_rule"} <= set(routed[family]), family
    for family in ("kimi_linear", "bailing_hybrid", "glm5_next"):
        assert {"causal_conv1d_fn", "chunk_kimi_delta_attention"} <= set(routed[family]), family

