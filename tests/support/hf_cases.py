"""Tiny random Hugging Face models and the CP cases the HF integration tests run on every rank.

Every model is built locally from a config (nothing is downloaded), in float64, and
its weights are sent to the ranks, so the CP run and the single-process reference
start from the same parameters.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf
from transformers import masking_utils

import cpcompose.integrations.transformers as cphf
from cpcompose.distributed import apply_activation_checkpointing
from cpcompose.layouts import ZigzagLayout
from cpcompose.parallel import recompute_context
from cpcompose import CommMeter, allreduce_gradients, context_parallel, cp_cross_entropy, cp_unshard

# The keyword a model's forward and the mask builders take a KV cache by: `cache` since transformers 5.x,
# `past_key_values` before. The old name warns from 5.24 and is gone in 5.40 (pyproject makes the warning an
# error), so the tests pass whichever name the installed release takes.
CACHE_KW = "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"

STRATEGIES = ("ring", "allgather", "alltoall")
BATCH, SEQ, VOCAB = 2, 32, 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_GQA = dict(_COMMON, num_key_value_heads=2)

ARCHS: dict[str, Callable[[], hf.PretrainedConfig]] = {
    "llama": lambda: hf.LlamaConfig(**_GQA),
    "qwen2": lambda: hf.Qwen2Config(**_GQA, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "mistral": lambda: hf.MistralConfig(**_GQA, sliding_window=8),
    "gemma3": lambda: hf.Gemma3TextConfig(
        **_GQA, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    ),
    "gpt_neox": lambda: hf.GPTNeoXConfig(**_COMMON, rotary_pct=0.5),
    "phi3": lambda: hf.Phi3Config(**_GQA, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "qwen3": lambda: hf.Qwen3Config(**_GQA, head_dim=8),
    "olmo2": lambda: hf.Olmo2Config(**_GQA, pad_token_id=0, eos_token_id=1),
    "gemma2": lambda: hf.Gemma2Config(
        **_GQA, head_dim=8, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
    ),
    "modernbert": lambda: hf.ModernBertConfig(
        **_COMMON, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        cls_token_id=1, sep_token_id=1,
    ),
    "deepseek_v3": lambda: hf.DeepseekV3Config(  # MLA: V head dim 6, Q/K head dim 8 + 4 (rope)
        **dict(_COMMON, num_key_value_heads=4), moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2, n_routed_experts=2,
        num_experts_per_tok=1, n_group=1, topk_group=1, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    ),
}
MASKED_LM = {"modernbert"}  # bidirectional encoders: per-token targets, no shift


def _eager64(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    softcap: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention (Gemma 2's, with softcap) with its softmax in float64, not float32."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


hf.AttentionInterface.register("eager64", _eager64)
masking_utils.AttentionMaskInterface.register("eager64", masking_utils.eager_mask)


def reference_impl(name: str) -> str:
    """The reference's attention: transformers' float64 sdpa; eager with a float64 softmax where sdpa refuses softcap."""
    return "eager64" if name == "gemma2" else "sdpa"


def build(name: str, impl: str, state: dict | None = None) -> torch.nn.Module:
    cls = hf.AutoModelForMaskedLM if name in MASKED_LM else hf.AutoModelForCausalLM
    torch.manual_seed(0)
    model = cls.from_config(ARCHS[name](), attn_implementation=impl, dtype=torch.float64)
    if state is not None:
        model.load_state_dict(state)
    return model


def plain_batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `(BATCH, SEQ)` and each token's target (-100: none)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid counts per rank: the global count matters
    return ids, labels if name in MASKED_LM else cphf.shift_labels(labels)


def forward(model: torch.nn.Module, name: str, **inputs: Any) -> torch.Tensor:
    extra = {} if name in MASKED_LM else {"use_cache": False}
    return model(**inputs, **extra).logits


def result(model: torch.nn.Module, loss: torch.Tensor) -> dict:
    return {"loss": loss.detach().clone(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def reference_plain(name: str) -> tuple[dict, dict]:
    """The single-process run on the full batch, and the weights it started from."""
    model = build(name, reference_impl(name))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, targets = plain_batch(name)
    logits = forward(model, name, input_ids=ids)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return result(model, loss), state


def cp_plain(
    mesh, name: str, state: dict, strategies: tuple[str, ...] = STRATEGIES, ones_mask: bool = False
) -> dict:
    """Each strategy on the zigzag split of the plain batch: loss summed over ranks, gradients all-reduced.

    `ones_mask`: also give the model an explicit all-ones attention_mask (as a buffer).
    """
    model = build(name, "cpcompose", state)
    out = {}
    for strategy in strategies:
        model.zero_grad(set_to_none=True)
        ids, targets = plain_batch(name)
        positions = torch.arange(SEQ)[None].clone()
        buffers, extra = [ids, targets, positions], {}
        if ones_mask:
            buffers.append(extra.setdefault("attention_mask", torch.ones_like(ids)))
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), strategy=strategy):
            logits = forward(model, name, input_ids=ids, position_ids=positions, **extra)
            loss = cp_cross_entropy(logits, targets, mesh=mesh)
            loss.backward()
        allreduce_gradients(model, mesh)
        dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
        out[strategy] = result(model, total)
    return out


# --- packed rows (transformers' flattening collator) and right-padded batches, through pack_batch ---

DOCS = (5, 17, 1, 3, 12, 9)  # 47 tokens: documents of length 1, a pack no group size divides
ROWS = (29, 18, 32)  # real lengths of a right-padded batch of 3 rows of 32


def flattened_features() -> dict[str, torch.Tensor]:
    """One packed row as transformers' DataCollatorWithFlattening builds it."""
    g = torch.Generator().manual_seed(2)
    features = [{"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist()} for n in DOCS]
    return hf.DataCollatorWithFlattening(return_tensors="pt")(features)


def padded_batch(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (len(ROWS), SEQ), generator=g)
    mask = (torch.arange(SEQ)[None] < torch.tensor(ROWS)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    ids = ids.masked_fill(mask == 0, 0)  # pad_token_id
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def targets_of(name: str, labels: torch.Tensor) -> torch.Tensor:
    return labels if name in MASKED_LM else cphf.shift_labels(labels)


def reference_packed(name: str, *, alone: bool = False) -> tuple[dict, dict]:
    """transformers on the whole packed row (its own document mask from the restarting position_ids), or with
    `alone` each document run by itself (one row each), one mean over every document's targets: what a pack
    must equal, whatever transformers' packed route does (its DSA indexer's top-k does not: see
    tests/integrations/test_transformers_indexer.py).

    Its sdpa/eager masks for encoders ignore packing (only its flash-attention path honours it),
    so an encoder's reference always runs each document on its own.
    """
    model = build(name, reference_impl(name))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = flattened_features()
    targets = targets_of(name, batch["labels"])[0]
    if alone or name in MASKED_LM:
        bounds = torch.tensor([0, *DOCS]).cumsum(0).tolist()
        total = sum(
            F.cross_entropy(forward(model, name, input_ids=batch["input_ids"][:, a:b])[0], targets[a:b],
                            ignore_index=-100, reduction="sum")
            for a, b in zip(bounds, bounds[1:])
        )
        loss = total / (targets != -100).sum()
    else:
        logits = forward(model, name, input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = F.cross_entropy(logits[0], targets, ignore_index=-100)
    loss.backward()
    return result(model, loss), state


def reference_padded(name: str) -> tuple[dict, dict]:
    """Each row's real tokens on their own (no padding anywhere); one mean over every real target."""
    model = build(name, reference_impl(name))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = padded_batch(name)
    targets = targets_of(name, batch["labels"])
    total, count, logits_rows = 0.0, (targets != -100).sum(), []
    for row, n in enumerate(ROWS):
        logits = forward(model, name, input_ids=batch["input_ids"][row : row + 1, :n])
        total = total + F.cross_entropy(logits[0], targets[row, :n], ignore_index=-100, reduction="sum")
        logits_rows.append(logits[0].detach())
    loss = total / count
    loss.backward()
    return {**result(model, loss), "logits": torch.cat(logits_rows)}, state


def cp_packed(mesh, name: str, state: dict, kind: str) -> dict:
    """Each strategy on pack_batch's balanced split of a flattened row (kind="packed") or a padded batch."""
    model = build(name, "cpcompose", state)
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        model.zero_grad(set_to_none=True)
        if kind == "packed":
            f = flattened_features()
            batch = cphf.pack_batch(
                f["input_ids"], mesh, position_ids=f["position_ids"], labels=f["labels"], shift=name not in MASKED_LM
            )
        else:
            f = padded_batch(name)
            batch = cphf.pack_batch(
                f["input_ids"], mesh, attention_mask=f["attention_mask"], labels=f["labels"],
                shift=name not in MASKED_LM,
            )
        layout = batch.layout
        with context_parallel(mesh, buffers=batch.buffers, buffer_seq_dims=batch.seq_dims, layout=layout,
                              strategy=strategy):
            logits = forward(model, name, input_ids=batch.input_ids, position_ids=batch.position_ids)
            loss = cp_cross_entropy(logits, batch.labels, mesh=mesh)
            loss.backward()
            full_logits = cp_unshard(logits.detach(), mesh, seq_dim=1, layout=layout)[0]
        allreduce_gradients(model, mesh)
        dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
        out[strategy] = {**result(model, total), "logits": full_logits, "bounds": layout.doc_bounds,
                         "pad": layout.pad}
    return out


# --- refusals: a bad input (on one rank only where it can be), then a valid step in the same group ---


def _plain_inputs(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, targets = plain_batch("llama")
    return ids[:, :seq].clone(), targets[:, :seq].clone(), torch.arange(seq)[None].clone()


_REFUSAL_MODELS = {"overlay": "gemma3", "window_option": "mistral", "softcap_padding": "gemma2"}


def _refusal_model(case: str) -> tuple[str, torch.nn.Module]:
    name = _REFUSAL_MODELS.get(case, "llama")
    if case == "chunked":
        return name, llama4_text()
    if case == "overlay":  # Gemma 3 as an encoder: transformers lays a bidirectional overlay on its masks
        config = ARCHS[name]()
        config.use_bidirectional_attention = True
        return name, hf.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompose", dtype=torch.float64)
    return name, build(name, "cpcompose")


def _bad_step(mesh, case: str, rank: int) -> None:
    name, model = _refusal_model(case)
    ids, targets, positions = _plain_inputs(30 if case == "unsplittable" else SEQ)
    inputs: dict[str, Any] = {"input_ids": ids, "position_ids": positions}
    buffers, options = [ids, targets, positions], {}
    if case == "softcap_padding":  # zeros inside row 1: keys masked per row, which a logit softcap would squash
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["attention_mask"][1, 3:6] = 0
        buffers.append(inputs["attention_mask"])
    if case == "padding_not_a_buffer":  # right padding, but the rank's shard cut by hand: no rank sees the whole
        full = torch.ones_like(ids)
        full[1, -3:] = 0
        inputs["attention_mask"] = ZigzagLayout(mesh.size()).shard(full, 1, rank)
    if case == "no_position_ids":  # contiguous: rank 0's local 0..L-1 happen to be right, the others' are not
        del inputs["position_ids"]
        options["layout"] = "contiguous"
    if case == "packed_positions_zigzag":  # two documents in transformers' convention, but no PackedLayout
        positions.copy_(torch.arange(SEQ)[None] % (SEQ // 2))
    if case == "dropout_one_rank":
        model.train()
        if rank == 1:
            for module in model.modules():
                if hasattr(module, "attention_dropout"):
                    module.attention_dropout = 0.1
    if case == "window_option":
        options["window_size"] = 4
    if case == "left_padding_one_rank":
        mask = torch.ones_like(ids)
        if rank == 1:
            mask[0, :3] = 0
        cphf.pack_batch(ids, mesh, attention_mask=mask)
        return
    seq_dims = [1] * len(buffers)
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, **options):
        if case == "mask_4d" and rank == 0:
            local = ids.shape[1]
            inputs["attention_mask"] = torch.ones(1, 1, local, local, dtype=torch.bool).tril()
        if case == "kv_cache":
            cache = hf.DynamicCache(config=model.config)
            model(**inputs, use_cache=True, **{CACHE_KW: cache})
            if rank == 1:
                inputs[CACHE_KW] = cache
            model(**inputs, use_cache=rank == 1)
            return
        if case == "flash_kwargs":  # DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds these
            cu = torch.tensor([0, SEQ // 2, SEQ], dtype=torch.int32)
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=SEQ // 2, max_length_k=SEQ // 2)
        forward(model, name, **inputs)


def refusal(mesh, case: str) -> dict:
    """The error each rank raised for `case`, and the loss of a valid step run right after."""
    message = "no error"
    try:
        _bad_step(mesh, case, mesh.get_local_rank())
    except ValueError as e:
        message = str(e)
    model = build("llama", "cpcompose")
    ids, targets, positions = _plain_inputs()
    with context_parallel(mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1]):
        loss = cp_cross_entropy(forward(model, "llama", input_ids=ids, position_ids=positions), targets, mesh=mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return {"message": message, "after": total}


def kv_bytes(mesh, kv_heads: int) -> int:
    """Bytes this rank's ring attention sends in one forward of a Llama with `kv_heads` K/V heads."""
    model = llama_with_kv_heads(kv_heads)
    meter = CommMeter()
    ids, _, positions = _plain_inputs()
    with torch.no_grad(), context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1], meter=meter):
        forward(model, "llama", input_ids=ids, position_ids=positions)
    return meter.total


def llama_with_kv_heads(kv_heads: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = hf.LlamaConfig(**dict(_GQA, num_key_value_heads=kv_heads))
    return hf.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompose", dtype=torch.float64)


def checkpointed_step(mesh, state: dict, context_fn: bool = True, by_torch: bool = False) -> dict:
    """transformers' activation checkpointing, the recomputation re-entering the CP region (`recompute_context`,
    or with `context_fn=False` cphf's wrapper of transformers' checkpoint function). `by_torch`: torch's
    checkpoint put on each layer directly, bypassing transformers (and its wrapper)."""
    model = build("llama", "cpcompose", state)
    kwargs = {"use_reentrant": False, **({"context_fn": recompute_context} if context_fn else {})}
    if by_torch:
        apply_activation_checkpointing(model.model.layers, context_fn=recompute_context if context_fn else None)
    else:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    model.train()
    ids, targets = plain_batch("llama")
    positions = torch.arange(SEQ)[None].clone()
    with context_parallel(mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1]):
        loss = cp_cross_entropy(forward(model, "llama", input_ids=ids, position_ids=positions), targets, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return {"ring": result(model, total)}


def checkpoint_without_context(mesh, state: dict) -> str:
    """torch's checkpointing without `recompute_context`: every rank refuses the recomputation outside the region."""
    try:
        checkpointed_step(mesh, state, context_fn=False, by_torch=True)
    except ValueError as e:
        return str(e)
    return "no error"


def llama4_text() -> torch.nn.Module:
    """Llama 4's text model with chunked attention layers (their chunk reaches attention only through the mask)."""
    torch.manual_seed(0)
    config = hf.Llama4TextConfig(
        **_GQA, head_dim=8, intermediate_size_mlp=64, num_local_experts=1, attention_chunk_size=8,
        layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0], pad_token_id=0,
        eos_token_id=1, bos_token_id=1,
    )
    return hf.Llama4ForCausalLM._from_config(config, attn_implementation="cpcompose", dtype=torch.float64)


def fsdp_step(mesh, state: dict) -> dict:
    """FSDP2 over the CP mesh instead of allreduce_gradients: gradients summed (the loss is a share of the mean)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = build("llama", "cpcompose", state)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    ids, targets = plain_batch("llama")
    positions = torch.arange(SEQ)[None].clone()
    with context_parallel(mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1], strategy="alltoall"):
        loss = cp_cross_entropy(forward(model, "llama", input_ids=ids, position_ids=positions), targets, mesh=mesh)
        loss.backward()
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"alltoall": {"loss": total, "grads": grads}}
