"""The CP versions of RWKV's, xLSTM's and Qwen4-Exp's token mixers against transformers' originals, in float64.

The model tests (`test_transformers_hybrids`) run these families as transformers computes them,
partly in float32; here each mixer runs in float64 throughout, so CP must equal the original
run on each document alone to float64's derived bound, on zigzag, contiguous, a pack (documents shorter than
a conv width and longer than a rank's share) and a pack with a padding document:

* RWKV's WKV recurrence (its CP version around a float64 copy of transformers' CPU loop,
  which casts keys to float32) and its token shift (`RwkvFeedForward`, routed);
* xLSTM's mLSTM backend (states in float64; at 1e-12 the stabilizer `m` a run restarts
  from must be the sequential one, since `h` holds `eps * e^m`);
* Qwen4-Exp's dilated PLE conv, and its n-gram embedding (lookups: equal exactly, EOS
  resets inside documents included).

A bad input on one rank raises the same error on every rank, and the group stays usable.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers as hf
from torch import Tensor, nn
from transformers.models.qwen4_exp import modeling_qwen4_exp as q4
from transformers.models.rwkv import modeling_rwkv as rw
from transformers.models.xlstm import modeling_xlstm as xl

import cpcompose.integrations.transformers  # noqa: F401  (installs the routes)
from cpcompose import context_parallel
from cpcompose.mixers.transformers_models.rwkv import cp_rwkv_linear_attention
from cpcompose.layouts import Layout, PackedLayout
from cpcompose.parallel.dispatch import active_cp_region
from tests.support.mixer_cases import float64_module, make_layout, pack_bounds, value_errors
from tests.support.tolerance import assert_close

B, S_LOCAL, WIDTH, HEADS = 2, 12, 16, 2
LAYOUTS = ("zigzag", "contiguous", "packed", "padded")
# Derived (tests/support/tolerance.py), float64: batch x sequence (P <= 4) x width.
FLOAT64 = dict(terms=B * 4 * S_LOCAL * WIDTH)
"""Float64 throughout: only the order of sums differs."""
FLOAT64_EXP = FLOAT64
"""The mLSTM's gradients reach ~20 here (its large input gates, through exponentials): float64's
rounding leaves ~1e-13 relative (measured up to 1.6e-12 absolute at P=3)."""
EOS = 3


def _built(build: Callable[[], nn.Module]) -> nn.Module:
    return float64_module(build, scale=0.5)


def _wkv64(time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor, state=None, return_state=False):
    """transformers' `rwkv_linear_attention_cpu`, step for step, without its cast of the keys to float32."""
    if state is None:
        num, den, top = torch.zeros_like(key[:, 0]), torch.zeros_like(key[:, 0]), torch.full_like(key[:, 0], -1e38)
    else:
        num, den, top = state
    decay, out = -torch.exp(time_decay), []
    for t in range(key.shape[1]):
        k, v = key[:, t], value[:, t]
        m = torch.maximum(top, k + time_first)
        e1, e2 = torch.exp(top - m), torch.exp(k + time_first - m)
        out.append((e1 * num + e2 * v) / (e1 * den + e2))
        m = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - m), torch.exp(k - m)
        num, den, top = e1 * num + e2 * v, e1 * den + e2, m
    return torch.stack(out, dim=1), ([num, den, top] if return_state or state is not None else None)


class _Wkv(nn.Module):
    """The WKV kernel as the model routes it: the original outside a region, its CP version inside."""

    def __init__(self) -> None:
        super().__init__()
        self.time_decay, self.time_first = nn.Parameter(torch.empty(WIDTH)), nn.Parameter(torch.empty(WIDTH))

    def forward(self, key: Tensor, value: Tensor, state=None) -> Tensor:
        region = active_cp_region()
        if region is not None:
            region.routed += 1  # as the routing wrapper counts a CP mixer (a region with none is refused)
        args = (self.time_decay, self.time_first, key, value, state)
        return (cp_rwkv_linear_attention(_wkv64, region, *args) if region else _wkv64(*args))[0]


def _mlstm() -> nn.Module:
    config = hf.xLSTMConfig(hidden_size=WIDTH, num_heads=HEADS, chunk_size=4, vocab_size=8, num_hidden_layers=1)
    object.__setattr__(config, "inference_state_dtype", "float64")  # transformers allows float32 or narrower
    return xl.xLSTMBackend(config)


def _ple_config() -> hf.Qwen4ExpTextConfig:
    return hf.Qwen4ExpTextConfig(
        vocab_size=16, hidden_size=WIDTH // 2, num_hidden_layers=1, layer_types=["linear_attention"], hc_count=2,
        hc_lowrank=4, ple_layer_ids=[1], ple_embed_dim=8, ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=11, num_experts=2, num_experts_per_tok=1, eos_token_id=EOS)


def _gated_mlstm(m: nn.Module, t: list[Tensor]) -> Tensor:
    """q, k, v and the gates from three `(B, seq, WIDTH)` inputs; h back as `(B, seq, WIDTH)`."""
    heads = lambda x: x.unflatten(-1, (HEADS, -1)).transpose(1, 2)  # noqa: E731
    gates = heads(t[2][..., :2 * HEADS]) * 3.0  # large input gates: m well above 0, so eps * e^m shows
    h = m(heads(t[0][..., :WIDTH // 2]), heads(t[0][..., WIDTH // 2:]), heads(t[1]), gates[..., 0], gates[..., 1])[0]
    return h.transpose(1, 2).flatten(2)


# name -> (build, call(module, inputs), input count, tolerance)
MIXERS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, list[Tensor]], Tensor], int, dict]] = {
    "wkv": (lambda: _built(_Wkv), lambda m, t: m(t[0], t[1]), 2, FLOAT64),
    "rwkv_shift": (lambda: _built(lambda: rw.RwkvFeedForward(hf.RwkvConfig(hidden_size=WIDTH, intermediate_size=32))),
                   lambda m, t: m(t[0])[0], 1, FLOAT64),
    "mlstm": (lambda: _built(_mlstm), _gated_mlstm, 3, FLOAT64_EXP),
    "ple_conv": (lambda: _built(lambda: q4.Qwen4ExpTextPLELayer(_ple_config(), 0, 0)),
                 lambda m, t: m._short_conv(t[0], None), 1, FLOAT64),
}


def _layout(spec: str, world: int) -> Layout:
    if spec == "padded":  # one token short of a multiple of the world: the layout adds a padding document
        return PackedLayout.build(pack_bounds(world * S_LOCAL - 1), world)
    return make_layout(spec, world, S_LOCAL)


def _data(count: int, layout: Layout) -> tuple[list[Tensor], Tensor, Tensor]:
    """Float inputs, token ids (EOS among them) and a probe (0 on a padding document)."""
    seq, g = layout.world * S_LOCAL, torch.Generator().manual_seed(1)
    inputs = [torch.randn(B, seq, WIDTH, generator=g, dtype=torch.float64) for _ in range(count)]
    ids = torch.randint(0, 16, (B, seq), generator=g)
    probe = torch.randn(B, seq, WIDTH, generator=g, dtype=torch.float64)
    if isinstance(layout, PackedLayout) and layout.pad:
        probe[:, seq - layout.pad:] = 0.0
    return inputs, ids, probe


def cp_cases(mesh) -> dict:
    """Every mixer (and the n-gram embedding) on every layout, on this rank's shard inside a CP region."""
    world, rank, results = mesh.size(), mesh.get_local_rank(), {}
    for spec in LAYOUTS:
        layout = _layout(spec, world)
        for name, (build, call, count, _) in MIXERS.items():
            module, (inputs, _, probe) = build(), _data(count, layout)
            leaves = [layout.shard(t, 1, rank).requires_grad_() for t in inputs]
            with context_parallel(mesh, layout=layout):
                out = call(module, leaves)
                (out * layout.shard(probe, 1, rank)).sum().backward()
            results[spec, name] = {"out": out.detach(), "inputs": [t.grad for t in leaves],
                                   "params": {n: p.grad for n, p in module.named_parameters()}}
        embedding, (_, ids, _) = _built(lambda: q4.Qwen4ExpTextNGramEmbedding(_ple_config(), 8, 0)), _data(0, layout)
        with context_parallel(mesh, layout=layout):
            results[spec, "ngram"] = embedding(layout.shard(ids, 1, rank), None).detach()
    return results


def _reference(spec: str, world: int) -> dict:
    """Every original (no CP region) on each document alone, in global order."""
    layout, out = _layout(spec, world), {}
    docs = layout.global_runs(layout.world * S_LOCAL)
    for name, (build, call, count, _) in MIXERS.items():
        module, (inputs, _, probe) = build(), _data(count, layout)
        leaves = [t.requires_grad_() for t in inputs]
        y = torch.cat([call(module, [t[:, r.pos:r.pos + r.length] for t in leaves]) for r in docs], dim=1)
        (y * probe).sum().backward()
        out[name] = {"out": y.detach(), "inputs": [t.grad for t in leaves],
                     "params": {n: p.grad for n, p in module.named_parameters()}}
    embedding, (_, ids, _) = _built(lambda: q4.Qwen4ExpTextNGramEmbedding(_ple_config(), 8, 0)), _data(0, layout)
    out["ngram"] = torch.cat([embedding(ids[:, r.pos:r.pos + r.length], None) for r in docs], dim=1).detach()
    return out


def _unshard(parts: list[Tensor], layout: Layout) -> Tensor:
    full = torch.empty(parts[0].shape[0], layout.world * S_LOCAL, *parts[0].shape[2:], dtype=parts[0].dtype)
    for rank, part in enumerate(parts):
        full[:, layout.local_indices(rank, layout.world * S_LOCAL)] = part
    return full


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_versions_equal_the_originals(pools, world: int) -> None:
    per_rank = pools.get(world).run(cp_cases)
    for spec in LAYOUTS:
        layout, want = _layout(spec, world), _reference(spec, world)
        real = world * S_LOCAL - (layout.pad if isinstance(layout, PackedLayout) else 0)  # padding's outputs: unread
        assert torch.equal(_unshard([r[spec, "ngram"] for r in per_rank], layout)[:, :real], want["ngram"][:, :real])
        for name, (_, _, _, tol) in MIXERS.items():
            got, at = [r[spec, name] for r in per_rank], f"{name} {spec} P={world}"
            assert_close(_unshard([g["out"] for g in got], layout)[:, :real], want[name]["out"][:, :real],
                                       **tol, msg=lambda m, at=at: f"{at} outputs: {m}")
            for k, grad in enumerate(want[name]["inputs"]):
                assert_close(_unshard([g["inputs"][k] for g in got], layout), grad, **tol,
                                           msg=lambda m, at=at, k=k: f"{at} input {k} gradient: {m}")
            for param, grad in want[name]["params"].items():
                if grad is not None:
                    assert_close(sum(g["params"][param] for g in got), grad, **tol,
                                               msg=lambda m, at=at, p=param: f"{at} {p} gradient: {m}")


def refusals(mesh) -> dict:
    """A cache or state on one rank only raises the same error on every rank; then a valid call runs."""
    rank, layout = mesh.get_local_rank(), _layout("zigzag", mesh.size())
    inputs, ids, _ = _data(3, layout)
    x = [layout.shard(t, 1, rank) for t in inputs]
    wkv, shift, mlstm = MIXERS["wkv"][0](), MIXERS["rwkv_shift"][0](), MIXERS["mlstm"][0]()
    ple, embedding = MIXERS["ple_conv"][0](), q4.Qwen4ExpTextNGramEmbedding(_ple_config(), 8, 0)
    state = [torch.zeros(B, WIDTH, dtype=torch.float64)] * 3
    cache = object()  # any cache: under CP none is allowed
    messages = value_errors({
        "wkv": lambda: wkv(x[0], x[1], state if rank == 1 else None),
        "shift": lambda: shift(x[0], state if rank == 0 else None),
        "mlstm": lambda: mlstm(*(torch.zeros(B, HEADS, S_LOCAL, 8, dtype=torch.float64),) * 3,
                               torch.zeros(B, HEADS, S_LOCAL), torch.zeros(B, HEADS, S_LOCAL, dtype=torch.float64),
                               c_initial=torch.zeros(B, HEADS, 8, 8) if rank == 1 else None),
        "ngram": lambda: embedding(layout.shard(ids, 1, rank), cache if rank == 0 else None),
        "ple_conv": lambda: ple._short_conv(x[0], cache if rank == 1 else None),
    }, region=lambda: context_parallel(mesh, layout=layout))
    with context_parallel(mesh, layout=layout):
        good = MIXERS["wkv"][1](wkv, x)
    return {"messages": messages, "shape": tuple(good.shape)}


def test_bad_input_on_one_rank_raises_everywhere(pools) -> None:
    results = pools.get(2).run(refusals)
    messages = results[0]["messages"]
    assert "rank 1: rwkv_linear_attention got an initial state" in messages["wkv"]
    assert "rank 0: RwkvFeedForward got a state" in messages["shift"]
    assert "rank 1: xLSTMBackend got initial states" in messages["mlstm"]
    assert "rank 0: Qwen4ExpTextNGramEmbedding got a cache" in messages["ngram"]
    assert "rank 1: Qwen4ExpTextPLELayer got a cache" in messages["ple_conv"]
    assert results[1]["messages"] == messages
    assert [r["shape"] for r in results] == [(B, S_LOCAL, WIDTH)] * 2


def test_mlstm_backend_runs_in_bfloat16_on_one_process() -> None:
    """transformers' "inference" kernels fail in bfloat16 from `chunk_size` tokens on (its chunkwise kernel meets
    its float32 states with bfloat16 keys); outside a region the routed backend runs those calls in float32 and
    returns bfloat16 outputs, so the first-use probe's one-process run of a bfloat16 xLSTM runs. A call the
    original runs (fewer tokens) stays the original's, bit for bit."""
    config = hf.xLSTMConfig(hidden_size=WIDTH, num_heads=HEADS, chunk_size=4, vocab_size=8, num_hidden_layers=1)
    backend, original = xl.xLSTMBackend(config), xl.xLSTMBackend.forward.__wrapped__
    g = torch.Generator().manual_seed(0)
    for seq, fails in ((2 * config.chunk_size, True), (config.chunk_size - 1, False)):
        inputs = [torch.randn(B, HEADS, seq, *shape, generator=g).bfloat16() for shape in ((8,), (8,), (8,), (), ())]
        h, states = backend(*inputs)
        if fails:
            with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
                original(backend, *inputs)  # transformers' own: when it stops failing, the fix can go
            want, want_states = original(backend, *(t.float() for t in inputs))
            want = want.bfloat16()
        else:
            want, want_states = original(backend, *inputs)
        assert h.dtype == torch.bfloat16 and torch.equal(h, want)
        assert all(torch.equal(a, b) for a, b in zip(states, want_states))
