"""Hugging Face models under tensor parallelism: tiny float64 Llama and Qwen3, their one-process references, the case.

Each family is a transformers causal LM built here in float64 (hidden 32, 4 heads and 2 kv heads, feed-forward
64, 2 layers); Qwen3's per-head q/k norms drawn at random (transformers starts them at 1), so their gradient,
summed over the tp ranks, is not a sum of equal terms. The reference is transformers (sdpa) on one process over
the whole plain batch.

`case` runs on every rank of a pool: for each (dp_shard, cp, tp) split it builds the trainer's mesh, and for
each family makes the model parallel as the trainer does (`apply_tensor_parallel` with the family's plan over
tp, activation checkpointing whose recomputation re-enters the CP region where `ac` is on, then FSDP2 over
dp_shard x cp, always on with tp), deals the batch (each dp_shard rank its rows, then `context_parallel` over
cp: zigzag), and runs one forward and backward of `cp_cross_entropy` over the dp x cp mesh (the output layer is
replicated over tp: every tp rank computes the same loss). It returns the loss summed over dp x cp and (rank
0) every gradient, gathered whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import context_parallel, cp_cross_entropy
from cpcompose.distributed import ParallelDims, apply_activation_checkpointing, apply_fsdp
from cpcompose.distributed.parallel_dims import flat_mesh
from cpcompose.integrations.transformers.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan
from cpcompose.parallel import recompute_context
from tests.support.hybrid_cases import one_thread

VOCAB, ROWS, SEQ = 64, 4, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64)

FAMILIES: dict[str, Callable[[], hf.PretrainedConfig]] = {
    "llama": lambda: hf.LlamaConfig(**_COMMON),
    "qwen3": lambda: hf.Qwen3Config(**_COMMON, head_dim=8),
}


def build(name: str, attn: str, state: dict | None = None) -> torch.nn.Module:
    """The family's tiny float64 model: `state`, or seeded weights with random per-head norms."""
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(FAMILIES[name](), attn_implementation=attn, dtype=torch.float64)
    if state is not None:
        model.load_state_dict(state)
        return model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def plain_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid counts per rank: the global count matters
    return ids, cphf.shift_labels(labels)


@one_thread()
def reference(name: str) -> tuple[dict, dict]:
    """transformers on one process: (loss, every gradient), the weights it started from."""
    model = build(name, "sdpa")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, targets = plain_batch()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, state


def _parallel(root, dims: ParallelDims, name: str, state: dict, ac: bool) -> torch.nn.Module:  # noqa: ANN001
    model = build(name, "cpcompose", state)
    model.train()
    layers = list(model.model.layers)
    apply_tensor_parallel(layers, tensor_parallel_plan(model, layers, dims.tp), root["tp"])
    if ac:
        apply_activation_checkpointing(layers, context_fn=recompute_context)
    apply_fsdp(model, layers, mesh=root, parallel_dims=dims, embedding=model.model.embed_tokens,
               head=[model.model.norm, model.lm_head])
    return model


def _step(model: torch.nn.Module, root, dims: ParallelDims) -> dict:  # noqa: ANN001
    loss_mesh, cp_mesh = flat_mesh(root, "dp_cp"), root["cp"]
    ids, targets = plain_batch()
    share, dp_rank = dims.dp_shard, root["dp_shard"].get_local_rank()
    rows = slice(dp_rank * ROWS // share, (dp_rank + 1) * ROWS // share)
    ids, targets = ids[rows], targets[rows]
    positions = torch.arange(SEQ)[None].expand(ids.shape[0], -1).clone()
    region = context_parallel(cp_mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1],
                              verify=False) if dims.cp_enabled else torch.enable_grad()
    with region:
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = cp_cross_entropy(logits, targets, mesh=loss_mesh)
        loss.backward()
    dist.all_reduce(total := loss.detach().clone(), group=loss_mesh.get_group())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # every rank: collectives, one order
    return {"loss": total, "grads": grads if dist.get_rank() == 0 else {},
            "split": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}}


def case(mesh, splits: list[tuple[int, int, int, bool]], states: dict[str, dict]) -> dict:  # noqa: ANN001
    """Every (dp_shard, cp, tp, activation checkpointing) of `splits`, each family of `states` (its weights)."""
    out = {}
    for dp_shard, cp, tp, ac in splits:
        dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=tp, pp=1, world_size=mesh.size())
        root = dims.build_mesh("cpu")
        for name, state in states.items():
            out[(dp_shard, cp, tp, name)] = _step(_parallel(root, dims, name, state, ac), root, dims)
    return out


def saved_bytes_case(mesh, config: hf.PretrainedConfig, tokens: int) -> float:  # noqa: ANN001
    """What one decoder layer of `config` (float32), split over the pool's ranks as the trainer splits it, saves for
    backward per token inside a CP region of one rank: every saved tensor's storage once, the parameters and RoPE's
    cos and sin (saved once for the whole model) left out."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    root = init_device_mesh("cpu", (1, mesh.size()), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompose", dtype=torch.float32)
    layers = list(model.model.layers)
    apply_tensor_parallel(layers, tensor_parallel_plan(model, layers, mesh.size()), root["tp"])
    x = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rope = tuple(e.detach() for e in model.model.rotary_emb(x, positions))

    def storage(t: torch.Tensor) -> torch.UntypedStorage:
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    skip = {storage(t).data_ptr() for t in [*model.parameters(), *rope]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage(t).data_ptr() not in skip:
            saved[storage(t).data_ptr()] = storage(t).nbytes()
        return t

    with context_parallel(root["cp"], verify=False), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layers[0](x, position_embeddings=rope, position_ids=positions, attention_mask=None)
    return sum(saved.values()) / tokens
