"""Tiny random Hugging Face hybrid models (token mixers beside or instead of attention) and their CP cases.

Each model is built locally from a config in float64 and its weights are sent to the
ranks. The reference is transformers itself on one process. A packed row's reference runs
each document on its own: transformers' torch kernels for these mixers cannot keep a
pack's documents apart (its kernel wrapper refuses cu_seqlens without mamba-ssm/fla), and
under CP each document restarts, as it does in a batch of separate rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import allreduce_gradients, context_parallel, cp_cross_entropy
from tests.support.hybrid_families import FLOAT32_KERNEL, FLOAT64, HYBRIDS, SPECIAL, VOCAB  # noqa: F401 (for tests)
from tests.support.tolerance import assert_close

STRATEGIES = ("ring", "allgather", "alltoall")
BATCH, SEQ = 2, 48
DOCS = (5, 19, 1, 3, 12, 9, 23)  # 72 tokens: documents shorter and longer than a conv's width and a chunk


def build(name: str, state: dict | None = None, *, cp: bool = True, dtype: torch.dtype = torch.float64,
          config: hf.PretrainedConfig | None = None) -> torch.nn.Module:
    """The family's tiny model in `dtype` (with "cpcompose" attention when it has attention and `cp`), from its
    tiny config or `config`; `state` is loaded into the model's own dtypes (what transformers keeps in float32
    stays float32)."""
    hybrid = HYBRIDS[name]
    torch.manual_seed(0)
    impl = {"attn_implementation": "cpcompose" if cp else hybrid.reference_attention} if hybrid.attention else {}
    # Mixture-of-experts layers: transformers' grouped matmul has no float64 kernel, its eager loop does.
    model = hybrid.auto.from_config(config or hybrid.config(), dtype=dtype, experts_implementation="eager", **impl)
    if state is not None:
        model.load_state_dict(state)
    return model


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The reference on one intra-op thread, as the ranks run: two threads on two cores shared with other
    processes spin against each other (Zamba's packed reference took 10 s on two threads, 0.25 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _result(model: torch.nn.Module, loss: torch.Tensor) -> dict:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach().clone(), "grads": grads}


def _logits(model: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits


def plain_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid counts per rank: the global count matters
    return ids, cphf.shift_labels(labels)


@one_thread()
def reference_plain(name: str) -> tuple[dict, dict]:
    """The single-process run on the full batch, and the weights it started from."""
    model = build(name, cp=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, targets = plain_batch()
    loss = F.cross_entropy(_logits(model, input_ids=ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return _result(model, loss), state


def _strategies(name: str) -> tuple[str, ...]:
    """Every attention strategy; one for a family without attention layers (the strategies differ only there)."""
    return STRATEGIES if HYBRIDS[name].attention else STRATEGIES[:1]


def cp_plain(mesh, name: str, state: dict, strategies: tuple[str, ...] | None = None,
             checkpointing: dict | None = None) -> dict:
    """Each strategy on the zigzag split of the plain batch: loss summed over ranks, gradients all-reduced.

    `checkpointing`: transformers' activation checkpointing is enabled with these kwargs ({}: its defaults)."""
    model = build(name, state)
    if checkpointing is not None:
        model.train()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing or None)
    out = {}
    for strategy in strategies or _strategies(name):
        model.zero_grad(set_to_none=True)
        ids, targets = plain_batch()
        positions = torch.arange(SEQ)[None].clone()
        with context_parallel(mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1], strategy=strategy):
            loss = cp_cross_entropy(_logits(model, input_ids=ids, position_ids=positions), targets, mesh=mesh)
            loss.backward()
        allreduce_gradients(model, mesh)
        dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
        out[strategy] = _result(model, total)
    return out


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(2, VOCAB, (n,), generator=g) for n in DOCS]


@one_thread()
def reference_packed(name: str) -> tuple[dict, dict]:
    """Each document on its own (one row each), one mean over every document's targets."""
    model = build(name, cp=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    docs = documents()
    count = sum(len(d) - 1 for d in docs)
    total = sum(F.cross_entropy(_logits(model, input_ids=d[None])[0, :-1], d[1:], reduction="sum") for d in docs)
    loss = total / count
    loss.backward()
    return _result(model, loss), state


def cp_packed(mesh, name: str, state: dict, strategies: tuple[str, ...] | None = None) -> dict:
    """Each strategy on pack_batch's balanced split of the documents as one flattened row."""
    model = build(name, state)
    out = {}
    features = hf.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in documents()])
    for strategy in strategies or _strategies(name):
        model.zero_grad(set_to_none=True)
        batch = cphf.pack_batch(features["input_ids"], mesh, position_ids=features["position_ids"],
                                labels=features["labels"])
        with context_parallel(mesh, buffers=batch.buffers, buffer_seq_dims=batch.seq_dims, layout=batch.layout,
                              strategy=strategy):
            logits = _logits(model, input_ids=batch.input_ids, position_ids=batch.position_ids)
            loss = cp_cross_entropy(logits, batch.labels, mesh=mesh)
            loss.backward()
        allreduce_gradients(model, mesh)
        dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
        out[strategy] = _result(model, total)
    return out


def assert_matches(want: dict, per_rank: list[dict], name: str, where: str) -> None:
    """Every rank's loss and every gradient against the reference, at the family's tolerance."""
    tol = HYBRIDS[name].tolerance
    # A router's gate gradient cancels to ~1e-9 from terms the size of the model's gradients: those set its scale.
    largest = max(g.abs().max().item() for g in want["grads"].values())
    for rank, got in enumerate(per_rank):
        for strategy, r in got.items():
            at = f"{name} {where} rank {rank} {strategy}"
            assert_close(r["loss"], want["loss"], **tol, msg=lambda m: f"{at} loss: {m}")
            assert set(r["grads"]) == set(want["grads"]), f"{at}: gradients of other parameters"
            for param, grad in want["grads"].items():
                assert_close(r["grads"][param], grad, **tol, scale=largest, msg=lambda m: f"{at} {param}: {m}")
