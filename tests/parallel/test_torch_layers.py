"""PyTorch's own attention layers under CP, and every way attention could slip past CP.

* `nn.TransformerEncoderLayer` (through `nn.MultiheadAttention` and
  `F.multi_head_attention_forward`), causal and not, `batch_first` either way, is
  exact under `context_parallel` and under the `ContextParallel` style. Float64
  model against a float64 single process: only summation order differs, so float64 eps x the longest sum.
* Each refusal of the SDPA / MHA route, given to one rank only, raises on every
  rank, and a valid call in the same group then works (nobody was left waiting).
* flex_attention, an eager softmax, a style on a module that never attends, and a
  plan key that matches nothing: each is an error, never a silently local result.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpcompose import (
    ContextParallel,
    allreduce_gradients,
    context_parallel,
    cp_cross_entropy,
    cp_shard,
    cp_unshard,
    parallelize_module,
)
from tests.support.tolerance import assert_close

VOCAB, DIM, HEADS, SEQ, BATCH = 40, 16, 4, 32, 2
# Derived (tests/support/tolerance.py), float64: the longest sum is a weight gradient over tokens x width.
TOL = dict(terms=BATCH * SEQ * DIM)


class EncoderLM(nn.Module):
    """Token + position embeddings, PyTorch's TransformerEncoder, a head."""

    def __init__(self, causal: bool, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.causal, self.batch_first = causal, batch_first
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(positions)
        x = x if self.batch_first else x.transpose(0, 1)
        n = tokens.shape[1]  # this rank's tokens under CP
        mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=x.dtype) if self.causal else None
        x = self.encoder(x, mask=mask, is_causal=self.causal, src_key_padding_mask=pad)
        return self.head(x if self.batch_first else x.transpose(0, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.arange(SEQ)


def _result(model: nn.Module, loss: torch.Tensor) -> dict:
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def reference(causal: bool, batch_first: bool) -> dict:
    model = EncoderLM(causal, batch_first)
    tokens, labels, positions = _batch()
    loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), labels.flatten())
    loss.backward()
    return _result(model, loss)


def encoder_context(mesh, strategy: str, causal: bool, batch_first: bool) -> dict:
    model = EncoderLM(causal, batch_first)
    tokens, labels, positions = _batch()
    with context_parallel(mesh, buffers=[tokens, labels, positions], buffer_seq_dims=[1, 1, 0], strategy=strategy):
        loss = cp_cross_entropy(model(tokens, positions), labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    torch.distributed.all_reduce(loss.detach_(), group=mesh.get_group())
    return _result(model, loss)


def encoder_style(mesh, strategy: str, causal: bool, batch_first: bool) -> dict:
    model = EncoderLM(causal, batch_first)
    parallelize_module(model, mesh, {"encoder.layers.*.self_attn": ContextParallel(strategy=strategy)})
    tokens, labels = (cp_shard(t, mesh, seq_dim=1) for t in _batch()[:2])
    positions = cp_shard(torch.arange(SEQ), mesh, seq_dim=0)
    loss = cp_cross_entropy(model(tokens, positions), labels, mesh=mesh)
    loss.backward()
    allreduce_gradients(model, mesh)
    torch.distributed.all_reduce(loss.detach_(), group=mesh.get_group())
    return _result(model, loss)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("entry", ["context", "style"])
def test_transformer_encoder_layer_is_exact(pools, entry: str, causal: bool, batch_first: bool) -> None:
    want = reference(causal, batch_first)
    fn = encoder_context if entry == "context" else encoder_style
    for strategy, world in (("ring", 2), ("allgather", 2), ("alltoall", 4)):
        for rank, got in enumerate(pools.get(world).run(fn, strategy, causal, batch_first)):
            assert_close(got["loss"], want["loss"], **TOL)
            for name, grad in want["grads"].items():
                assert_close(
                    got["grads"][name], grad, **TOL, msg=lambda m: f"{strategy} r{rank} {name}: {m}"
                )


PAD = torch.stack([torch.arange(SEQ) >= 21, torch.arange(SEQ) < 6])  # True = padding: right, and left padding


def padded_reference() -> dict:
    model = EncoderLM(False, True)
    tokens, labels, positions = _batch()
    loss = F.cross_entropy(model(tokens, positions, PAD.clone()).flatten(0, 1), labels.flatten())
    loss.backward()
    return _result(model, loss)


def padded_encoder(mesh) -> dict:
    model = EncoderLM(False, True)
    tokens, labels, positions = _batch()
    pad = PAD.clone()
    with context_parallel(mesh, buffers=[tokens, labels, positions, pad], buffer_seq_dims=[1, 1, 0, 1]):
        loss = cp_cross_entropy(model(tokens, positions, pad), labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    torch.distributed.all_reduce(loss.detach_(), group=mesh.get_group())
    return _result(model, loss)


def test_key_padding_mask_is_exact(pools) -> None:
    """A bidirectional encoder with src_key_padding_mask (a buffer): the mask's shard travels with K/V."""
    want = padded_reference()
    for rank, got in enumerate(pools.get(2).run(padded_encoder)):
        assert_close(got["loss"], want["loss"], **TOL)
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=lambda m: f"r{rank} {name}: {m}")


def sdpa_key_mask(mesh, x: list[torch.Tensor]) -> list[torch.Tensor]:
    """SDPA in a region with a mask of the key alone, built from the padding buffer's shard (True = attend)."""
    real = ~PAD
    q, k, v, dout = (cp_shard(t, mesh, seq_dim=2).requires_grad_(i < 3) for i, t in enumerate(x))
    with context_parallel(mesh, buffers=[real], buffer_seq_dims=[1]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
        (out * dout).sum().backward()
        return [cp_unshard(t.detach(), mesh, seq_dim=2) for t in (out, q.grad, k.grad, v.grad)]


def test_sdpa_key_mask_is_exact(pools) -> None:
    g = torch.Generator().manual_seed(4)
    x = [torch.randn(len(PAD), HEADS, SEQ, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    q, k, v = (t.clone().requires_grad_() for t in x[:3])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~PAD[:, None, None, :])
    (out * x[3]).sum().backward()
    for rank, got in enumerate(pools.get(2).run(sdpa_key_mask, x)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, (out, q.grad, k.grad, v.grad)):
            # Derived (tests/support/tolerance.py), float64: a gradient sums over the batch's keys x head dim.
            assert_close(a, b, terms=len(PAD) * SEQ * 8, msg=lambda m, name=name: f"r{rank} {name}: {m}")


# --- refusals with the bad input on one rank only, then a valid call in the same group ---


def _qkv(heads: int = 4, kv_heads: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    return (torch.randn(1, heads, 8, 8, generator=g), torch.randn(1, kv_heads, 8, 8, generator=g),
            torch.randn(1, kv_heads, 8, 8, generator=g))


def one_rank_refusal(mesh, case: str) -> dict:
    bad = mesh.get_local_rank() == (1 if case.endswith("rank1") else 0)
    q, k, v = _qkv()
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 8, 8)
    out: dict = {}
    with context_parallel(mesh):
        try:
            if case.startswith("mask"):
                F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, 8) if bad else None)
            elif case.startswith("dropout"):
                F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if bad else 0.0)
            elif case.startswith("gqa_flag"):
                q2, k2, v2 = _qkv(4, 2)
                F.scaled_dot_product_attention(q2, k2, v2, enable_gqa=not bad)
            elif case.startswith("key_bias"):  # a float bias per key, not padding
                F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((1, 1, 1, 8), 0.5) if bad else None)
            elif case.startswith("mha_key_padding"):
                mha(x, x, x, need_weights=False, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool) if bad else None)
            elif case.startswith("mha_weights"):
                mha(x, x, x, need_weights=bad)
            out["error"] = "no error"
        except ValueError as e:
            out["error"] = str(e)
        out["valid"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the group is still healthy
    return out


@pytest.mark.parametrize(
    "case,message",
    [
        ("mask_rank0", "rank 0: context-parallel SDPA cannot honour an explicit attn_mask"),
        ("dropout_rank1", "rank 1: context-parallel SDPA does not support dropout"),
        ("gqa_flag_rank0", "rank 0: query has 4 heads and key 2: pass enable_gqa=True"),
        ("mha_key_padding_rank1", "inputs differ between CP ranks (key_padding"),
        ("key_bias_rank0", "rank 0: SDPA attn_mask must be bool or hold 0 and -inf only"),
        ("mha_weights_rank0", "rank 0: nn.MultiheadAttention under context parallelism cannot return attention"),
    ],
)
def test_refusal_on_one_rank_raises_on_every_rank(pools, case: str, message: str) -> None:
    for rank, got in enumerate(pools.get(2).run(one_rank_refusal, case)):
        assert message in got["error"], f"rank {rank}: {got['error']}"
        assert got["valid"].shape == (1, 4, 8, 8)


# --- paths that would have attended locally ---


class EagerAttention(nn.Module):
    """Attention as an explicit softmax: nothing CP can intercept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x @ x.transpose(-1, -2)
        return torch.softmax(s, -1) @ x


class FlexAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(x, x, x)


def silent_paths(mesh) -> dict:
    found: dict = {}
    x = torch.randn(1, 2, 8, 8)
    for name, fn in (
        ("flex", lambda: FlexAttention()(x)),
        ("eager_region", lambda: EagerAttention()(x)),
    ):
        try:
            with context_parallel(mesh):
                fn()
            found[name] = "no error"
        except ValueError as e:
            found[name] = str(e)
    eager = nn.Sequential(EagerAttention())
    parallelize_module(eager, mesh, {"0": ContextParallel()})
    try:
        eager(x)
        found["eager_style"] = "no error"
    except ValueError as e:
        found["eager_style"] = str(e)
    try:
        parallelize_module(nn.Sequential(EagerAttention()), mesh, {"layers.*.attention": ContextParallel()})
        found["unmatched_key"] = "no error"
    except ValueError as e:
        found["unmatched_key"] = str(e)
    # Why cpcompose has its own parallelize_module: PyTorch's goes on after a warning.
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_parallelize_module(nn.Sequential(EagerAttention()), mesh, {"layers.*.attention": ContextParallel()})
    found["torch_warned"] = any("could not be resolved" in str(w.message) for w in caught)
    with context_parallel(mesh):  # a valid call in the same group afterwards
        found["valid"] = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    return found


def test_no_path_attends_locally_in_silence(pools) -> None:
    for got in pools.get(2).run(silent_paths):
        assert "context_parallel: flex_attention is not context-parallel" in got["flex"], got["flex"]
        assert "context_parallel: no attention call went through context parallelism" in got["eager_region"]
        assert "ContextParallel on EagerAttention: no attention call went through" in got["eager_style"]
        assert "plan key 'layers.*.attention' matches no module" in got["unmatched_key"]
        assert got["torch_warned"]
        assert got["valid"].shape == (1, 2, 8, 8)
