"""The expert-parallel matrix: five tiny float64 MoE families, their one-process references and the rank case.

Each family is a transformers causal LM with 4 experts, 2 per token, 2 MoE layers, built here in float64 with
its experts' eager loop (the grouped GEMM refuses float64). Its router and every parameter transformers
zeroes at init (gpt-oss's biases, Qwen3-Next's norms) are drawn at random, so routing is far from uniform and
every path carries a gradient. The reference is transformers on one process over the whole batch (plain
rows) or each document alone (packed: transformers' torch kernels for linear attention cannot keep a pack's
documents apart, and under CP each document restarts as it does alone), with transformers' load-balancing
loss recomputed in float64 over every token (`switch_loss`, checked against transformers' own float32
`aux_loss`).

`matrix_case` runs on every rank of a pool: for each (ep, cp) it builds the trainer's meshes
(`ParallelDims(dp_shard = world / cp, cp, ep)`, ep folded out of dp_shard x cp), and for each family and
batch kind it swaps the experts for their EP form, shards the model with FSDP2 as the trainer does
(`apply_fsdp`: the dense layers over dp_shard x cp, each experts module over the experts' mesh `efsdp`
axis), deals the batch (each data-parallel rank its rows or documents, then `context_parallel` over cp:
zigzag for plain rows, `pack_batch`'s layout for packs), and runs one forward and backward of
`cp_cross_entropy` plus `cp_load_balancing_loss` over the dp x cp mesh. It returns the loss summed over the
ranks, this rank's block of every expert's gradient, and (rank 0) every dense gradient, gathered whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import context_parallel, cp_cross_entropy
from cpcompose.distributed import ParallelDims, apply_fsdp
from cpcompose.distributed.parallel_dims import flat_mesh
from cpcompose.integrations.transformers.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from cpcompose.parallel import cp_load_balancing_loss
from tests.support.hybrid_cases import one_thread

VOCAB, EXPERTS, TOP_K = 64, 4, 2
ROWS, SEQ = 4, 16  # the plain batch: 4 rows, so 4 data-parallel ranks get one each
DOCS = (5, 11, 1, 7, 9, 3, 13, 6)  # the packed batch's documents: 55 tokens, dealt in order to the dp ranks
AUX = 0.25  # the router loss's coefficient, far above transformers' 0.001 so its gradient is visible
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)
_ATTN = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8)
_LOSS = dict(output_router_logits=True, router_aux_loss_coef=AUX)

FAMILIES: dict[str, Callable[[], hf.PretrainedConfig]] = {
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(
        **_ATTN, **_LOSS, intermediate_size=64, moe_intermediate_size=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1),
    "mixtral": lambda: hf.MixtralConfig(  # softmax top-2, renormalised
        **_ATTN, **_LOSS, intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K),
    # MLA; sigmoid scores, a nonzero correction bias for the choice, 2 groups of 2 experts with 1 group kept
    # (so the group limit decides: the top 2 alone would often span both groups), a shared expert; no loss
    "deepseek_v3": lambda: hf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=0, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, n_group=2, topk_group=1, n_shared_experts=1, **SPECIAL),
    # attention sinks, sliding and full layers; experts transposed, biased, interleaved, clamped (limit 1: acting)
    "gpt_oss": lambda: hf.GptOssConfig(
        **_ATTN, **_LOSS, intermediate_size=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, swiglu_limit=1.0, **SPECIAL),
    # Gated DeltaNet beside gated attention; a shared expert behind a sigmoid gate
    "qwen3_next": lambda: hf.Qwen3NextConfig(
        **_ATTN, **_LOSS, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        intermediate_size=64, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, **SPECIAL),
}
REFERENCE_ATTENTION = {"gpt_oss": "eager"}  # sdpa takes no sinks
NO_ROUTER_LOSS = {"deepseek_v3"}  # transformers computes none (balancing by the correction bias instead)
KINDS = ("plain", "packed")


def has_router_loss(name: str) -> bool:
    return name not in NO_ROUTER_LOSS


def build(name: str, attn: str, state: dict | None = None, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The family's tiny model in `dtype` (DeepSeek-V3's float32 router weight too: it computes in float32 either
    way, and FSDP wants one dtype per unit); random where transformers zeroes, or `state`."""
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(FAMILIES[name](), attn_implementation=attn, dtype=dtype,
                                                experts_implementation="eager").to(dtype)
    if state is not None:
        model.load_state_dict(state)
        return model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            router = n.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias"))
            if router or not p.abs().max() > 0:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if router else 0.1))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # steers the choice only, never the weights
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.1)
    return model


def plain_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid counts per rank: the global count matters
    return ids, cphf.shift_labels(labels)


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(2, VOCAB, (n,), generator=g) for n in DOCS]


def switch_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (no mask) in float64, where transformers sums in float32."""
    probs = [F.softmax(x.double(), dim=-1) for x in router_logits]
    chosen = torch.cat([p.topk(TOP_K, dim=-1).indices.reshape(-1) for p in probs])
    counts = torch.bincount(chosen, minlength=EXPERTS).to(torch.float64)
    prob_sum = sum(p.sum(0) for p in probs)
    rows = sum(p.shape[0] for p in probs)
    return EXPERTS * torch.sum(counts / rows * prob_sum / rows)


@one_thread()
def reference(name: str, kind: str) -> tuple[dict, dict]:
    """transformers on one process: (loss, every gradient, transformers' and the float64 router loss), weights."""
    model = build(name, REFERENCE_ATTENTION.get(name, "sdpa"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if kind == "plain":
        ids, targets = plain_batch()
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        logits, hf_aux = list(out.router_logits), getattr(out, "aux_loss", None)
    else:
        docs = documents()
        outs = [model(input_ids=d[None], use_cache=False, output_router_logits=True) for d in docs]
        total = sum(F.cross_entropy(o.logits[0, :-1], d[1:], reduction="sum") for o, d in zip(outs, docs))
        loss = total / sum(len(d) - 1 for d in docs)
        logits, hf_aux = [x for o in outs for x in o.router_logits], None
    aux = None
    if has_router_loss(name):
        aux = switch_loss(logits)
        loss = loss + AUX * aux
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "aux": None if aux is None else aux.detach(),
            "hf_aux": None if hf_aux is None else hf_aux.detach()}, state


def _dealt(dims: ParallelDims, dp_rank: int, kind: str) -> dict[str, torch.Tensor]:
    """This data-parallel rank's share of the global batch: its rows, or its documents packed as
    transformers' flattening collator packs them."""
    share = dims.dp_shard
    if kind == "plain":
        ids, targets = plain_batch()
        rows = slice(dp_rank * ROWS // share, (dp_rank + 1) * ROWS // share)
        return {"input_ids": ids[rows], "targets": targets[rows]}
    docs = documents()[dp_rank * len(DOCS) // share:(dp_rank + 1) * len(DOCS) // share]
    return hf.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])


def _parallel(root, experts_mesh, dims: ParallelDims, name: str, state: dict) -> torch.nn.Module:  # noqa: ANN001
    """The family's model made parallel as the trainer makes it: experts swapped for their EP form, then FSDP2."""
    model = build(name, "cpcompose", state)
    model.train()
    swapped = apply_expert_parallel(model, experts_mesh["ep"])
    apply_fsdp(model, list(model.model.layers), mesh=root, parallel_dims=dims,
               experts=[model.get_submodule(n) for n in swapped], expert_mesh=experts_mesh)
    return model


def _step(model: torch.nn.Module, root, dims: ParallelDims, name: str, kind: str) -> dict:  # noqa: ANN001
    """One forward and backward of `model` on this rank's share of the batch `kind`."""
    model.zero_grad(set_to_none=True)
    loss_mesh, cp_mesh = flat_mesh(root, "dp_cp"), root["cp"]
    batch = _dealt(dims, root["dp_shard"].get_local_rank(), kind)
    valid = None
    if kind == "plain":
        ids, targets = batch["input_ids"], batch["targets"]
        positions = torch.arange(SEQ)[None].expand(ids.shape[0], -1).clone()
        region = context_parallel(cp_mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1],
                                  verify=False) if dims.cp_enabled else torch.enable_grad()
    else:  # a pack is always a region (as the trainer's): its layout keeps the documents apart
        packed = cphf.pack_batch(batch["input_ids"], cp_mesh, position_ids=batch["position_ids"],
                                 labels=batch["labels"])
        ids, targets, positions = packed.input_ids, packed.labels, packed.position_ids
        length = ids.shape[1]  # the padded pack: its padding document (one process has none) is no token
        valid = (torch.arange(length) < length - packed.layout.pad).to(torch.float64)[None]
        region = context_parallel(cp_mesh, buffers=[*packed.buffers, valid], buffer_seq_dims=[*packed.seq_dims, 1],
                                  layout=packed.layout, verify=False)
    with region:
        out = model(input_ids=ids, position_ids=positions, use_cache=False, output_router_logits=True)
        loss = cp_cross_entropy(out.logits, targets, mesh=loss_mesh)
        if has_router_loss(name):
            loss = loss + AUX * cp_load_balancing_loss(out.router_logits, num_experts=EXPERTS, top_k=TOP_K,
                                                       mesh=loss_mesh, valid=valid)
        loss.backward()
    dist.all_reduce(total := loss.detach().clone(), group=loss_mesh.get_group())
    blocks = {n: (m.first_expert, m.num_local_experts) for n, m in model.named_modules()
              if isinstance(m, ExpertParallelExperts)}
    expert_names = {f"{m}.{p}" for m in blocks for p, _ in model.get_submodule(m).named_parameters()}
    grads, rank = {}, dist.get_rank()
    for n, p in model.named_parameters():  # every rank gathers every gradient, in one order (collectives)
        whole = p.grad.full_tensor() if p.grad is not None else None
        if n in expert_names or rank == 0:
            grads[n] = whole
    swapped = [n for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]
    return {"loss": total, "grads": grads, "blocks": blocks, "swapped": swapped}


def matrix_case(mesh, splits: list[tuple[int, int, tuple[str, ...] | None]],  # noqa: ANN001
                states: dict[str, dict]) -> dict:
    """Every (ep, cp, families) of `splits` on this pool's ranks, each of those families (None: every family of
    `states`, their weights), both batch kinds."""
    world = mesh.size()
    out: dict[Any, dict] = {}
    for ep, cp, only in splits:
        dims = ParallelDims(dp_replicate=1, dp_shard=world // cp, cp=cp, tp=1, pp=1, world_size=world, ep=ep)
        root = dims.build_mesh("cpu")
        experts_mesh = dims.build_expert_mesh(root)
        for name, state in states.items():
            if only is not None and name not in only:
                continue
            model = _parallel(root, experts_mesh, dims, name, state)  # once for both batches
            for kind in KINDS:
                out[(ep, cp, name, kind)] = _step(model, root, dims, name, kind)
    return out


class _SequenceSum(torch.nn.Module):
    """A token mixer that is not CP-aware (a running sum over the sequence, on a rank's shard alone under CP)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden) + 0.1 * hidden.cumsum(dim=1)


def probe_case(mesh) -> dict[tuple[str, bool, bool, bool], str]:  # noqa: ANN001
    """`cphf.verify` at cp = 2 x ep = 2 on a model whose experts are in their EP form: every family as the trainer
    builds it (float32, FSDP2 over the ranks, the experts over `efsdp`), one without FSDP (the probe's float64
    run then casts the EP modules too), one without EP (the router loss's `aux_loss` under CP alone), and one
    with a token mixer the probe must name. -> (family, ep, fsdp, mixer): "ok" or the error."""
    world = mesh.size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world // 2, cp=2, tp=1, pp=1, world_size=world, ep=2)
    root = dims.build_mesh("cpu")
    experts_mesh = dims.build_expert_mesh(root)
    out = {}
    cases = [(name, True, True, False) for name in FAMILIES]
    cases += [("qwen3_moe", True, False, False), ("qwen3_moe", False, False, False), ("qwen3_moe", True, True, True)]
    for name, ep, sharded, mixer in cases:
        model = build(name, "cpcompose", dtype=torch.float32)
        model.train()
        swapped = apply_expert_parallel(model, experts_mesh["ep"]) if ep else []
        if mixer:
            model.model.norm = _SequenceSum(model.model.norm)
        if sharded:
            apply_fsdp(model, list(model.model.layers), mesh=root, parallel_dims=dims,
                       experts=[model.get_submodule(n) for n in swapped], expert_mesh=experts_mesh)
        try:
            cphf.verify(model, root["cp"])
            out[name, ep, sharded, mixer] = "ok"
        except ValueError as e:
            out[name, ep, sharded, mixer] = str(e)
    return out
