"""`PlainLM`: a model nobody wrote for cpcompose, its batch and its single-process reference.

Ordinary PyTorch: embeddings, two attention blocks that call
`F.scaled_dot_product_attention`, a head, in float64. The entry-point tests
(tests/parallel/test_entry_points.py) train it under CP through each entry point;
the compile, recompute and agreement tests reuse it. `TOL`: float64 against float64,
only summation order differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpcompose import allreduce_gradients

VOCAB, DIM, HEADS, KV_HEADS, SEQ, BATCH = 50, 24, 4, 2, 48, 2
# Derived (tests/support/tolerance.py), float64: the longest sum is a weight gradient over tokens x width.
TOL = dict(terms=BATCH * SEQ * DIM)


class PlainAttention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM * KV_HEADS // HEADS)
        self.o, self.causal = nn.Linear(DIM, DIM), causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, DIM))


class PlainLM(nn.Module):
    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(PlainAttention(causal) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = x + block(torch.tanh(x))
        return self.head(x)


def make_model(causal: bool) -> PlainLM:
    torch.manual_seed(0)
    return PlainLM(causal).double()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :7] = -100  # uneven valid counts per rank: the global count matters
    return tokens, labels


def reference(causal: bool) -> dict:
    model = make_model(causal)
    tokens, labels = make_batch()
    loss = F.cross_entropy(model(tokens, torch.arange(SEQ)).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def finish(model: nn.Module, loss: torch.Tensor, mesh) -> dict:
    unreduced = {n: p.grad.clone() for n, p in model.named_parameters()}
    allreduce_gradients(model, mesh)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return {"loss": total, "grads": {n: p.grad for n, p in model.named_parameters()}, "unreduced": unreduced}
