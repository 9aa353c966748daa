"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) under CP through the integration, exact against transformers.

Tiny models, plain batches (zigzag) and packed rows (pack_batch), P = 2 (region strategy
"ring": the selected rows move, or every row where that is fewer bytes) and P = 4 ("allgather":
every row). The reference is transformers' own single process (sdpa, the indexer's top-k folded
into its mask): for a plain batch its rows; for a packed row each document run alone (one row each,
one mean over every document's targets), since transformers' own packed row is not that: its
indexer's `topk` over the whole row breaks ties among equal scores (many are exactly 0: sums of
ReLU'd products) by the row's length and positions, so a packed document selects other keys than
the same document alone (DeepSeek-V3.2 on these 32 tokens in float64, one process, no cpcompose:
the loss 3.5e-4 relative apart, a gradient off by 10% of the largest gradient). Loss and every gradient must match the reference. The indexers' weights get no
gradient in either (transformers runs the indexer under no_grad).

Ties: a second GLM-5 model has its indexer's head weights zeroed, so every score of every
row is exactly 0 and the whole selection is decided by how `topk` breaks ties, which
the CP run must reproduce from the document's own row.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import allreduce_gradients, context_parallel, cp_cross_entropy, cp_unshard
from tests.support.dsa_cases import CONFIGS, REFERENCE_IMPL, V

B, SEQ = 2, 32
DOCS = (5, 17, 1, 3, 6)  # 32 tokens, a document of length 1
# The runs differ from the reference only in summation order (attention over the selected
# rows, cross-entropy over ranks), so each gradient's error is a few eps of the terms it
# summed: measured against the larger of the tensor's largest entry and the model's largest
# gradient entry (a gradient that cancels to near zero, an MoE gate's, still carries the
# rounding of terms of the model's gradient scale). Float64: 1e-9 leaves six orders of magnitude
# above eps (2e-16) x the model's depth of sums (~1e3); float32: the relative 1e-4.
REL = {torch.float64: 1e-9, torch.float32: 1e-4}
FLOAT32_INSIDE = {"hy_v4": 1e-5}  # builds its indexer norm, head weights and sinks in float32 whatever the dtype:
# float64 runs then differ by float32 rounding (eps 1.2e-7) through the depth of sums (~1e2)


def build(name: str, impl: str, dtype: torch.dtype, state: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=impl, dtype=dtype,
                                                experts_implementation="eager")  # grouped_mm has no float64
    if name.endswith("_ties"):
        for layer in model.model.layers:
            torch.nn.init.zeros_(layer.self_attn.indexer.weights_proj.weight)
    if state is not None:
        model.load_state_dict(state)
    return model


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, V, (n,), generator=g) for n in DOCS]


def batch(kind: str) -> dict[str, torch.Tensor]:
    if kind == "plain":
        ids = torch.randint(2, V, (B, SEQ), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(B, SEQ).clone(),
                "labels": cphf.shift_labels(ids)}
    features = [{"input_ids": d.tolist()} for d in documents()]
    packed = hf.DataCollatorWithFlattening(return_tensors="pt")(features)
    return {**packed, "labels": cphf.shift_labels(packed["labels"])}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def reference(name: str, kind: str, dtype: torch.dtype) -> tuple[dict, dict]:
    """transformers on one process: the plain batch's rows, or each packed document alone (one row each), with one
    mean over every document's targets."""
    model = build(name, REFERENCE_IMPL.get(name, "sdpa"), dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if kind == "plain":
        x = batch(kind)
        logits = model(input_ids=x["input_ids"], position_ids=x["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x["labels"].flatten(), ignore_index=-100)
    else:
        docs = documents()
        total = sum(F.cross_entropy(model(input_ids=d[None], use_cache=False).logits[0, :-1], d[1:], reduction="sum")
                    for d in docs)
        loss = total / sum(len(d) - 1 for d in docs)
    loss.backward()
    return {"loss": loss.detach(), "grads": grads(model)}, state


def cp_step(mesh, name: str, kind: str, dtype: torch.dtype, state: dict, strategy: str) -> dict[str, Any]:
    model = build(name, "cpcompose", dtype, state)
    x = batch(kind)
    if kind == "plain":
        buffers = [x["input_ids"], x["labels"], x["position_ids"]]
        region = dict(buffers=buffers, buffer_seq_dims=[1, 1, 1])
        ids, labels, positions = buffers
    else:
        packed = cphf.pack_batch(x["input_ids"], mesh, position_ids=x["position_ids"], labels=x["labels"],
                                 shift=False)
        region = dict(buffers=packed.buffers, buffer_seq_dims=packed.seq_dims, layout=packed.layout)
        ids, labels, positions = packed.input_ids, packed.labels, packed.position_ids
    with context_parallel(mesh, strategy=strategy, **region):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = cp_cross_entropy(logits, labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return {"loss": total, "grads": grads(model)}


def assert_matches(got: dict, want: dict, rel: float) -> None:
    assert torch.allclose(got["loss"], want["loss"], rtol=rel, atol=0.0), (got["loss"], want["loss"])
    assert got["grads"].keys() == want["grads"].keys()
    scale = max(w.abs().max() for w in want["grads"].values() if w is not None)
    for n, w in want["grads"].items():
        g = got["grads"][n]
        if w is None:  # the indexers' weights: no gradient in either run
            assert g is None, n
            continue
        err = (g - w).abs().max()
        bound = rel * max(w.abs().max(), scale)
        assert err <= bound, f"{n}: max error {err:.3e} > {bound:.3e} (largest entry {w.abs().max():.3e})"


CASES = [  # (family, batch, world, region strategy, dtype)
    ("deepseek_v32", "plain", 2, "ring", torch.float64),
    ("deepseek_v32", "packed", 2, "ring", torch.float64),
    ("glm_moe_dsa", "plain", 2, "ring", torch.float64),
    ("glm_moe_dsa", "packed", 4, "allgather", torch.float64),
    ("glm_moe_dsa_ties", "packed", 2, "ring", torch.float64),
    ("deepseek_v32", "plain", 4, "allgather", torch.float32),
    ("axk2", "plain", 2, "ring", torch.float64),
    ("dots3_note", "packed", 2, "ring", torch.float64),
    ("hy_v4", "packed", 2, "ring", torch.float64),
]


@pytest.mark.parametrize("name,kind,world,strategy,dtype", CASES)
def test_dsa_model_is_exact(pools, name: str, kind: str, world: int, strategy: str, dtype: torch.dtype) -> None:
    want, state = reference(name, kind, dtype)
    for got in pools.get(world).run(cp_step, name, kind, dtype, state, strategy):
        assert_matches(got, want, FLOAT32_INSIDE.get(name, REL[dtype]))


def _recording(model: torch.nn.Module) -> list[torch.Tensor]:
    """The indices every indexer returns, in call order."""
    seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    return seen


def cp_indices(mesh, name: str, kind: str, state: dict) -> list[torch.Tensor]:
    """Each indexer's top-k on every rank, joined into the whole sequence's rows in global order."""
    model = build(name, "cpcompose", torch.float32, state)
    seen = _recording(model)
    x = batch(kind)
    packed = cphf.pack_batch(x["input_ids"], mesh, position_ids=x["position_ids"], labels=x["labels"], shift=False)
    with context_parallel(mesh, buffers=packed.buffers, buffer_seq_dims=packed.seq_dims, layout=packed.layout):
        model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    ours = seen[-_indexer_count(model):]  # the first-use probe ran the model on its own tokens before
    return [cp_unshard(t, mesh, seq_dim=1, layout=packed.layout)[:, : x["input_ids"].shape[1]] for t in ours]


def _indexer_count(model: torch.nn.Module) -> int:
    return sum(layer.self_attn.indexer is not None for layer in model.model.layers)


@pytest.mark.parametrize("name", ["glm_moe_dsa", "glm_moe_dsa_ties"])
def test_indexer_selection_equals_each_document_alone(pools, name: str) -> None:
    """Each packed query's top-k list, order included, is the list torch.topk gives the same query of its
    document run alone on one process (shifted to the document's start), the rest of the list positions outside
    the document; with every score tied at 0 (`_ties`) the whole choice is topk's tie-breaking, reproduced from
    the document's own row."""
    model = build(name, "sdpa", torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = _recording(model)
    alone = []
    with torch.no_grad():
        for d in documents():
            model(input_ids=d[None], use_cache=False)
            alone.append(seen[-_indexer_count(model):])
    starts = torch.tensor((0, *DOCS)).cumsum(0).tolist()
    for got in pools.get(2).run(cp_indices, name, "packed", state):
        assert len(got) == _indexer_count(model)
        for layer, cp_rows in enumerate(got):
            for doc, (start, length) in enumerate(zip(starts, DOCS)):
                want = alone[doc][layer][0] + start  # (length, min(index_topk, length))
                rows = cp_rows[0, start : start + length]
                assert torch.equal(rows[:, : want.shape[1]], want), (layer, doc)
                rest = rows[:, want.shape[1] :]
                assert bool(((rest < start) | (rest >= start + length)).all()), (layer, doc)


def test_every_dsa_indexer_of_this_transformers_is_routed() -> None:
    assert set(cphf.routed_indexers()) >= {"deepseek_v32.DeepseekV32Indexer", "glm_moe_dsa.GlmMoeDsaIndexer"}


@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_outside_a_cp_region_each_document_is_alone(kind: str) -> None:
    """"cpcompose" on one process reads the indexer's `indices=` as transformers' sdpa path reads its mask, and
    on a packed row (positions restarting at each document) takes each document's top-k as the document alone:
    the trainer's cp = 1 and a user's one-process evaluation give what CP gives."""
    want, state = reference("deepseek_v32", kind, torch.float64)
    model = build("deepseek_v32", "cpcompose", torch.float64, state)
    x = batch(kind)
    logits = model(input_ids=x["input_ids"], position_ids=x["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), x["labels"].flatten(), ignore_index=-100)
    loss.backward()
    assert_matches({"loss": loss.detach(), "grads": grads(model)}, want, REL[torch.float64])


@pytest.mark.parametrize("path", ["deepseek_v4.DeepseekV4Attention", "minimax_m3_vl.MiniMaxM3VLAttention"])
def test_pooled_sparse_attention_is_refused_by_class(path: str) -> None:
    """Indexers over pooled entries or blocks (not per-token rows) are refused by name, before any collective."""
    import importlib

    name, cls_name = path.split(".")
    cls = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), cls_name)
    assert getattr(cls.forward, "__cpcompose_refused__", False)
    assert any(p.endswith(f".{cls_name}") for p in cphf.mixer_routes.REFUSED)


def sdpa_on_one_rank(mesh, state: dict) -> dict[str, Any]:
    """DeepSeek-V3.2 under CP built with sdpa on rank 1 (the PyTorch-API route) and "cpcompose" on rank 0, with the
    first-use probe and without: the same refusal on every rank; then a valid step in the same group."""
    messages = {}
    impl = "sdpa" if mesh.get_local_rank() == 1 else "cpcompose"
    for verify in (True, False):
        model = build("deepseek_v32", impl, torch.float64, state)
        x = batch("plain")
        buffers = [x["input_ids"], x["position_ids"]]
        try:
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1], verify=verify):
                model(input_ids=buffers[0], position_ids=buffers[1], use_cache=False)
            messages[verify] = "no error"
        except ValueError as e:
            messages[verify] = str(e)
    return {"messages": messages, "valid": cp_step(mesh, "deepseek_v32", "plain", torch.float64, state, "ring")}


def test_dsa_without_cpcompose_attention_is_refused_on_every_rank(pools) -> None:
    """Inside a CP region a DSA model's attention must read the indexer's global top-k: transformers' sdpa and
    eager paths scatter it into a mask of the rank's shard (before: `index 21 is out of bounds for dimension 2
    with size 16` on one rank, another index on the other). The same ValueError on every rank, naming the
    implementation to use, before any collective; the group then runs a valid step."""
    want, state = reference("deepseek_v32", "plain", torch.float64)
    results = pools.get(2).run(sdpa_on_one_rank, state)
    for verify in (True, False):
        messages = {r["messages"][verify] for r in results}
        assert len(messages) == 1, messages  # the same error on every rank
        message = messages.pop()
        assert "rank 1: DeepseekV32Indexer (layer 0)" in message and 'attn_implementation="cpcompose"' in message, \
            message
        assert "'sdpa'" in message and "rank 0" not in message, message
    for got in results:
        assert_matches(got["valid"], want, REL[torch.float64])
