"""The CP versions of the token mixers Hugging Face families write in their own code (routed methods), against
transformers' originals.

Every rank builds the same float64 module, runs it on its shard inside a CP region (so
the routed CP version runs) with a probe loss `sum(out * probe)`, and returns outputs and
gradients. The parent runs the original (outside any region) on each document of the full
sequence alone, which is what CP must equal, and compares outputs, input gradients
(unsharded) and parameter gradients (summed over ranks). Layouts: zigzag, contiguous, a
pack with documents shorter and longer than a conv width, a block and a rank's share, and
a pack with a padding document whose positions are arbitrary (CP leaves them unchecked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers as hf
from torch import Tensor, nn
from transformers.models.minimax import modeling_minimax as mm
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

import cpcompose.integrations.transformers  # noqa: F401  (installs the routes)
from cpcompose import context_parallel
from cpcompose.layouts import Layout, PackedLayout
from tests.support.mixer_cases import float64_module, make_layout, pack_bounds, value_errors
from tests.support.tolerance import assert_close

B, S_LOCAL, WIDTH = 2, 12, 16
LAYOUTS = ("zigzag", "contiguous", "packed", "padded")
# Derived (tests/support/tolerance.py), float64: batch x sequence (P <= 4) x width.
FLOAT64 = dict(terms=B * 4 * S_LOCAL * WIDTH)
"""Float64 throughout: only the order of sums differs (measured up to 1e-14 on gradients of ~40)."""
FLOAT32_SCAN = {"rtol": 1e-5, "atol": 1e-5}
"""The RG-LRU as the block calls it accumulates its scan in float32: the state entering a run,
composed, rounds differently from the sequential one. Gradients here reach ~60, so float32's
rounding (6e-8 relative) leaves up to 2.3e-6 absolute (measured, P=2-4, every layout)."""


def _built(build: Callable[[], nn.Module]) -> nn.Module:
    return float64_module(build, scale=0.4)


@dataclass(frozen=True)
class Mixer:
    """A module, how to call it on `(inputs, position_ids)`, its inputs' count, and the tolerance it allows."""

    build: Callable[[], nn.Module]
    call: Callable[[nn.Module, list[Tensor], Tensor], Tensor]
    inputs: int
    tolerance: dict


def _gemma() -> hf.RecurrentGemmaConfig:
    return hf.RecurrentGemmaConfig(hidden_size=WIDTH, lru_width=WIDTH, num_attention_heads=2, conv1d_width=4,
                                   num_hidden_layers=1, vocab_size=8)


def _lightning() -> nn.Module:
    config = hf.MiniMaxConfig(hidden_size=WIDTH, num_attention_heads=2, head_dim=8, block_size=5, num_hidden_layers=2,
                              layer_types=["linear_attention", "full_attention"], vocab_size=8)
    module = mm.MiniMaxLightningAttention(config, 0)
    module.norm = nn.RMSNorm(WIDTH, eps=1e-5)  # float64 throughout (transformers' RMSNorm rounds to float32)
    return module


MIXERS: dict[str, Mixer] = {
    # The scan alone, accumulating in float64: h_t = a_t * h_{t-1} + x_t, reset where position_ids == 0.
    "rglru_scan": Mixer(lambda: _built(lambda: rg.RecurrentGemmaRglru(_gemma())),
                        lambda m, t, pos: m._rnn_scan(t[0], torch.sigmoid(t[1]), pos[:, :, None] == 0, None,
                                                      acc_dtype=torch.float64)[0], 2, FLOAT64),
    # The whole recurrent block as the model calls it: its conv_1d, the RG-LRU's gates and float32 scan.
    "recurrent_block": Mixer(lambda: _built(lambda: rg.RecurrentGemmaRecurrentBlock(_gemma(), 0)),
                             lambda m, t, pos: m(t[0], pos, None, use_cache=False)[0], 1, FLOAT32_SCAN),
    "lightning": Mixer(lambda: _built(_lightning), lambda m, t, pos: m(t[0], None, None)[0], 1, FLOAT64),
}


def _layout(spec: str, world: int) -> Layout:
    if spec == "padded":  # one token short of a multiple of the world: the layout adds a padding document
        return PackedLayout.build(pack_bounds(world * S_LOCAL - 1), world)
    return make_layout(spec, world, S_LOCAL)


def _data(name: str, layout: Layout) -> tuple[list[Tensor], Tensor, Tensor]:
    """Full inputs, position_ids (per document; the padding document's all 0) and probe (0 on padding)."""
    seq = layout.world * S_LOCAL
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(B, seq, WIDTH, generator=g, dtype=torch.float64) for _ in range(MIXERS[name].inputs)]
    probe = torch.randn(B, seq, WIDTH, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(r.length) for r in layout.global_runs(seq)])[None]
    pad = layout.pad if isinstance(layout, PackedLayout) else 0
    if pad:
        positions[:, seq - pad:], probe[:, seq - pad:] = 0, 0.0
    return inputs, positions, probe


def cp_cases(mesh) -> dict:
    """Every mixer on every layout, on this rank's shard inside a CP region."""
    world, rank, results = mesh.size(), mesh.get_local_rank(), {}
    for spec in LAYOUTS:
        layout = _layout(spec, world)
        for name, mixer in MIXERS.items():
            module = mixer.build()
            inputs, positions, probe = _data(name, layout)
            leaves = [layout.shard(t, 1, rank).requires_grad_() for t in inputs]
            with context_parallel(mesh, layout=layout):
                out = mixer.call(module, leaves, layout.shard(positions, 1, rank))
                (out * layout.shard(probe, 1, rank)).sum().backward()
            results[spec, name] = {"out": out.detach(), "inputs": [t.grad for t in leaves],
                                   "params": {n: p.grad for n, p in module.named_parameters()}}
    return results


def _reference(name: str, layout: Layout) -> dict:
    """The original (no CP region) on each document alone, in global order."""
    mixer = MIXERS[name]
    module = mixer.build()
    inputs, _, probe = _data(name, layout)
    leaves = [t.requires_grad_() for t in inputs]
    docs = layout.global_runs(layout.world * S_LOCAL)
    out = torch.cat([mixer.call(module, [t[:, r.pos:r.pos + r.length] for t in leaves], torch.arange(r.length)[None])
                     for r in docs], dim=1)
    (out * probe).sum().backward()
    return {"out": out.detach(), "inputs": [t.grad for t in leaves],
            "params": {n: p.grad for n, p in module.named_parameters()}}


def _unshard(parts: list[Tensor], layout: Layout) -> Tensor:
    """The ranks' local tensors `(batch, seq_local, ...)` as one in global order."""
    seq = layout.world * S_LOCAL
    full = torch.empty(B, seq, *parts[0].shape[2:], dtype=parts[0].dtype)
    for rank, part in enumerate(parts):
        full[:, layout.local_indices(rank, seq)] = part
    return full


@pytest.mark.parametrize("world", [2, 3, 4])
def test_routed_methods_equal_the_originals(pools, world: int) -> None:
    per_rank = pools.get(world).run(cp_cases)
    for spec in LAYOUTS:
        layout = _layout(spec, world)
        real = world * S_LOCAL - (layout.pad if isinstance(layout, PackedLayout) else 0)  # padding's outputs: unread
        for name, mixer in MIXERS.items():
            want, tol, at = _reference(name, layout), mixer.tolerance, f"{name} {spec} P={world}"
            got = [r[spec, name] for r in per_rank]
            out = _unshard([g["out"] for g in got], layout)
            assert_close(out[:, :real], want["out"][:, :real], **tol,
                                       msg=lambda m, at=at: f"{at} outputs: {m}")
            for k, grad in enumerate(want["inputs"]):
                assert_close(_unshard([g["inputs"][k] for g in got], layout), grad, **tol,
                                           msg=lambda m, at=at, k=k: f"{at} input {k} gradient: {m}")
            for param, grad in want["params"].items():
                if grad is None:  # a parameter the call does not use (the scan alone uses none)
                    assert all(g["params"][param] is None for g in got), f"{at}: {param} got a gradient under CP"
                    continue
                assert_close(sum(g["params"][param] for g in got), grad, **tol,
                                           msg=lambda m, at=at, p=param: f"{at} {p} gradient: {m}")


def refusals(mesh) -> dict:
    """What CP cannot honour, on one rank or all, raises the same error on every rank; the group stays usable."""
    rank, layout = mesh.get_local_rank(), _layout("zigzag", mesh.size())
    block, lightning = MIXERS["recurrent_block"].build(), MIXERS["lightning"].build()
    inputs, positions, _ = _data("recurrent_block", layout)
    x, pos = layout.shard(inputs[0], 1, rank), layout.shard(positions, 1, rank)
    local = torch.arange(S_LOCAL)[None]  # position_ids not given as a buffer: each shard numbered from 0
    messages = value_errors({
        "positions": lambda: block(x, local if rank else pos, None, use_cache=False),
        "cache": lambda: block(x, pos, None, use_cache=True),
        "mask": lambda: lightning(x, None, torch.ones(B, S_LOCAL) if rank == 0 else None),
    }, region=lambda: context_parallel(mesh, layout=layout))
    with context_parallel(mesh, layout=layout):
        good = block(x, pos, None, use_cache=False)[0]
    return {"messages": messages, "shape": tuple(good.shape)}


def test_bad_input_on_one_rank_raises_everywhere(pools) -> None:
    results = pools.get(2).run(refusals)
    for r in results:
        assert r["shape"] == (B, S_LOCAL, WIDTH)
        assert "rank 1: RecurrentGemmaRglru resets its state where position_ids == 0" in r["messages"]["positions"]
        assert "call the model with use_cache=False" in r["messages"]["cache"]
        assert "rank 0: MiniMaxLightningAttention got a padding mask" in r["messages"]["mask"]
    assert results[0]["messages"] == results[1]["messages"]
