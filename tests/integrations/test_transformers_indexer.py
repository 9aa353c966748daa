"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) under CP through the integration, exact against transformers.

Tiny models, plain batches (zigzag) and packed rows (pack_batch), P = 2 (region strategy
"ring": the selected rows move, or every row where that is fewer bytes) and P = 4 ("allgather":
every row). The reference is transformers' own single process (sdpa, the indexer's top-k folded
into its mask); loss and every gradient must match it. The indexers' weights get no
gradient in either (transformers runs the indexer under no_grad).

Ties: a second GLM-5 model has its indexer's head weights zeroed, so every score of every
row is exactly 0 and the whole selection is decided by how `topk` breaks ties, which
the CP run must reproduce from the same full row.
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

B, SEQ, V = 2, 32, 64
DOCS = (5, 17, 1, 3, 6)  # 32 tokens, a document of length 1
_MLA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=2,
            num_experts_per_tok=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, index_topk=6, index_head_dim=8, index_n_heads=2,
            first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=1, attention_dropout=0.0)
_NO_DENSE = {k: v for k, v in _MLA.items() if k != "first_k_dense_replace"}
CONFIGS = {
    "deepseek_v32": lambda: hf.DeepseekV32Config(**_MLA),
    "axk2": lambda: hf.AXK2Config(**_NO_DENSE),
    "dots3_note": lambda: hf.Dots3NoteTextConfig(**_NO_DENSE),
    "hy_v4": lambda: hf.HYV4Config(**_NO_DENSE),  # with attention sinks (s_aux), one logit per head
    "glm_moe_dsa": lambda: hf.GlmMoeDsaConfig(**_MLA, indexer_types=["full", "shared"]),
    "glm_moe_dsa_ties": lambda: hf.GlmMoeDsaConfig(**_MLA, indexer_types=["full", "full"]),
}
# The runs differ from the reference only in summation order (attention over the selected
# rows, cross-entropy over ranks), so each gradient's error is a few eps of the terms it
# summed: measured against the larger of the tensor's largest entry and the model's largest
# gradient entry (a gradient that cancels to near zero, an MoE gate's, still carries the
# rounding of terms of the model's gradient scale). Float64: 1e-9 leaves six orders of magnitude
# above eps (2e-16) x the model's depth of sums (~1e3); float32: the relative 1e-4.
REL = {torch.float64: 1e-9, torch.float32: 1e-4}
FLOAT32_INSIDE = {"hy_v4": 1e-5}  # builds its indexer norm, head weights and sinks in float32 whatever the dtype:
# float64 runs then differ by float32 rounding (eps 1.2e-7) through the depth of sums (~1e2)
REFERENCE_IMPL = {"hy_v4": "eager"}  # transformers runs HunYuan V4 (DSA with sinks) only with eager attention


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


def batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "plain":
        ids = torch.randint(2, V, (B, SEQ), generator=g)
        return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(B, SEQ).clone(),
                "labels": cphf.shift_labels(ids)}
    features = [{"input_ids": torch.randint(2, V, (n,), generator=g).tolist()} for n in DOCS]
    packed = hf.DataCollatorWithFlattening(return_tensors="pt")(features)
    return {**packed, "labels": cphf.shift_labels(packed["labels"])}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def reference(name: str, kind: str, dtype: torch.dtype) -> tuple[dict, dict]:
    model = build(name, REFERENCE_IMPL.get(name, "sdpa"), dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = batch(kind)
    logits = model(input_ids=x["input_ids"], position_ids=x["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), x["labels"].flatten(), ignore_index=-100)
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
def test_indexer_selection_equals_one_process(pools, name: str) -> None:
    """The same top-k lists, order included, as torch.topk on one process's rows; with every score tied at 0
    (`_ties`) the whole choice is topk's tie-breaking, reproduced from the same full row."""
    model = build(name, "sdpa", torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = _recording(model)
    x = batch("packed")
    with torch.no_grad():
        model(input_ids=x["input_ids"], position_ids=x["position_ids"], use_cache=False)
    for got in pools.get(2).run(cp_indices, name, "packed", state):
        assert len(got) == len(seen) == _indexer_count(model)
        for cp_rows, want in zip(got, seen):
            assert torch.equal(cp_rows, want)


def test_every_dsa_indexer_of_this_transformers_is_routed() -> None:
    assert set(cphf.routed_indexers()) >= {"deepseek_v32.DeepseekV32Indexer", "glm_moe_dsa.GlmMoeDsaIndexer"}


def test_outside_a_cp_region_it_is_transformers_sparse_attention() -> None:
    """"cpcompose" on one process reads the indexer's `indices=` as transformers' sdpa path reads its mask."""
    want, state = reference("deepseek_v32", "packed", torch.float64)
    model = build("deepseek_v32", "cpcompose", torch.float64, state)
    x = batch("packed")
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
    assert any(p.endswith(f".{cls_name}") for p in cphf.kernels.REFUSED)
