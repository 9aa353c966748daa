"""Tiny torchtitan models and the CP cases the torchtitan integration tests run on every rank.

Each model is built from torchtitan's own model configs (its llama3, qwen3 and
deepseek_v3 layer builders, shrunk), its inner attention made cpcompose's by
`use_cpcompose_attention`, in float64; its weights are sent to the ranks, so the CP
run and the single-process reference start from the same parameters.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support import torchtitan_stub

torchtitan_stub.install()  # before torchtitan is imported: see the stand-in's docstring

from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.deepseek_v3 import _build_dsv3_layers
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.llama3 import _build_llama3_layers
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.models.qwen3 import _build_qwen3_layers
from torchtitan.models.qwen3.model import Qwen3Model

from cpcompose.integrations.torchtitan import (
    CPAttentionMask,
    CPComposeConfig,
    cpcompose_parallelize,
    shard_batch,
    use_cpcompose_attention,
)

STRATEGIES = ("ring", "allgather", "alltoall")
MODELS = ("llama3", "qwen3", "deepseek_v3")
VOCAB, DIM, MAX_SEQ = 64, 32, 256
IGNORE = -100


def _frame(cls: type, layers: list, **extra: Any) -> Any:
    return cls.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        **extra,
    )


def model_config(name: str) -> Any:
    """torchtitan's flex-attention config of a tiny `name`, before cpcompose replaces its attention."""
    if name == "llama3":  # GQA: 4 query heads, 2 K/V heads, fused QKV
        rope = ComplexRoPE.Config(dim=8, max_seq_len=MAX_SEQ, theta=500000, scaling="llama")
        return _frame(Llama3Model, _build_llama3_layers(
            n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, hidden_dim=64, rope=rope, attn_backend="flex"))
    if name == "qwen3":  # GQA with QK-norm, head_dim 8 (not dim / heads)
        rope = CosSinRoPE.Config(dim=8, max_seq_len=MAX_SEQ, theta=1e6)
        return _frame(Qwen3Model, _build_qwen3_layers(
            n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, rope=rope, attn_backend="flex"))
    # DeepSeek-V3: MLA (Q/K head dim 8 + 4 rope, V head dim 6), a dense layer then an MoE layer
    rope = ComplexRoPE.Config(dim=4, max_seq_len=MAX_SEQ, theta=10000.0, scaling="yarn", rope_factor=4.0,
                              original_seq_len=64)
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, mscale=0.7, dense_hidden_dim=64, moe_hidden_dim=16, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope,
    )
    return _frame(DeepSeekV3Model, layers, mtp_layers=[])


def build(name: str, state: dict | None = None) -> torch.nn.Module:
    """float64 throughout: parameters and RoPE caches (complex128) are made in float64, not cast."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = use_cpcompose_attention(model_config(name)).build()
        model.init_states(buffer_device=torch.device("cpu"))
    finally:
        torch.set_default_dtype(default)
    if state is not None:
        model.load_state_dict(state)
    return model


# --- batches: dense rows, and packed rows in torchtitan's convention (positions restart at 0 per document) ---

BATCH, DENSE_SEQ = 2, 32
# Per row: the positions each document starts at and its length. Row 1 opens with the tail of a
# document from an earlier row (positions 20..23: a row start is a document start too) and holds a
# one-token document; 62 tokens, so the packed split pads 2 at P=4 (none at P=2).
ROW_DOCS = (((0, 7), (0, 13), (0, 11)), ((20, 4), (0, 1), (0, 26)))
PACKED_SEQ = 31


def dense_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels (shifted, a few ignored) and positions 0..seq-1 of every row."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (BATCH, DENSE_SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE  # uneven valid counts per rank: the global count matters
    positions = torch.arange(DENSE_SEQ).expand(BATCH, -1).clone()
    return tokens[:, :-1].clone(), labels, positions


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of packed documents as torchtitan's dataloader emits them: labels ignored at document ends."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, VOCAB, (BATCH, PACKED_SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (BATCH, PACKED_SEQ), generator=g)
    positions = torch.cat([torch.cat([torch.arange(s, s + n) for s, n in row])[None] for row in ROW_DOCS])
    for row, docs in enumerate(ROW_DOCS):
        ends = torch.tensor([n for _, n in docs]).cumsum(0) - 1
        labels[row, ends[:-1]] = IGNORE
    return tokens, labels, positions


def _result(model: torch.nn.Module, loss: torch.Tensor) -> dict:
    return {"loss": loss.detach().clone(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


@functools.cache  # several tests compare with the same step; callers only read the result
def reference(name: str, kind: str, window: int | None = None) -> tuple[dict, dict]:
    """The single-process step, and the weights it started from.

    dense: the whole batch, causal SDPA over each row. packed: every document run through
    the model on its own (with its own positions): what document masking must reproduce,
    computed without any mask. With `window`: the batch at once on one process, the
    document and window mask applied by `CPComposeAttention`'s SDPA path.
    """
    model = build(name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tokens, labels, positions = dense_batch() if kind == "dense" else packed_batch()
    count = (labels != IGNORE).sum()
    if kind == "dense":
        total = _loss_sum(model(tokens, positions=positions), labels)
    elif window is not None:
        batch = shard_batch(tokens, labels, positions, None, CPComposeConfig(window=window))
        total = _loss_sum(model(tokens, positions=positions, attention_masks=batch.attention_masks), labels)
    else:
        total = 0.0
        for row, docs in enumerate(ROW_DOCS):
            start = 0
            for _, n in docs:
                cut = slice(start, start + n)
                logits = model(tokens[row : row + 1, cut], positions=positions[row : row + 1, cut])
                total = total + _loss_sum(logits, labels[row : row + 1, cut])
                start += n
    loss = total / count
    loss.backward()
    return _result(model, loss), state


def cp_steps(mesh, name: str, state: dict, kind: str, settings: dict | None = None,
             strategies: tuple[str, ...] = STRATEGIES) -> dict:
    """One training step per strategy under cpcompose CP: torchtitan's loss (a token sum over the
    global valid count), the loss summed and the gradients all-reduced over the CP ranks.
    `settings`: more `CPComposeConfig` fields (window, balance, layout)."""
    model = build(name, state)
    for module in model.modules():
        if hasattr(module, "cp_degree"):
            module.cp_degree = mesh.size()
    out = {}
    for strategy in strategies:
        model.zero_grad(set_to_none=True)
        tokens, labels, positions = dense_batch() if kind == "dense" else packed_batch()
        count = (labels != IGNORE).sum()
        config = CPComposeConfig(strategy=strategy, documents=kind == "packed", **(settings or {}))
        batch = shard_batch(tokens, labels, positions, mesh, config)
        assert isinstance(batch.attention_masks, CPAttentionMask)
        logits = model(batch.inputs, positions=batch.positions, attention_masks=batch.attention_masks)
        loss = _loss_sum(logits, batch.labels) / count
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.get_group())
        dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
        out[strategy] = {**_result(model, total), "layout": batch.layout}
    return out


def packed_cu_seqlens() -> list[int]:
    """The documents of `packed_batch` as one pack (rows one after the other)."""
    lengths = [n for row in ROW_DOCS for _, n in row]
    return torch.tensor([0, *lengths]).cumsum(0).tolist()


# --- torchtitan's own parallelize_fn (activation checkpointing, FSDP over the CP ranks), wrapped ---


def parallelized_step(mesh, name: str, state: dict, kind: str, strategy: str) -> dict:
    """A CPComposeTrainer step without the trainer's CUDA-only set-up: the model's own torchtitan
    parallelize_fn through `cpcompose_parallelize` (ParallelDims with cp = P, full activation
    checkpointing, FSDP2 over dp_shard x cp), the batch through `CPComposeTrainer.post_dataloading_process`,
    torchtitan's CrossEntropyLoss over the global valid-token count, backward."""
    import importlib
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.distributed.activation_checkpoint import FullAC

    from cpcompose.integrations.torchtitan import CPComposeTrainer

    world = mesh.size()
    # torchtitan picks "cuda" for its meshes whenever no other accelerator is found (tools.utils.device_type),
    # CPU-only builds included; this worker process has no GPU, so its meshes are put on the CPU (gloo).
    parallel_dims.device_type = "cpu"
    parallelism = ParallelismConfig(
        context_parallel_degree=world, data_parallel_shard_degree=1, spmd_backend="partial_dtensor"
    )
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    package = importlib.import_module(f"torchtitan.models.{name}")
    original = {"llama3": "parallelize_llama", "qwen3": "parallelize_qwen3",
                "deepseek_v3": "parallelize_deepseekv3"}[name]
    model = build(name, state)
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    model = cpcompose_parallelize(getattr(package, original))(
        model, parallel_dims=dims, training=training, parallelism=parallelism, compile_config=CompileConfig(),
        ac_config=FullAC.Config(), dump_folder="/tmp",
    )
    for module in model.modules():  # torchtitan's divide factor 1 is a PREMUL_SUM, which gloo lacks: the same SUM
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    tokens, labels, positions = dense_batch() if kind == "dense" else packed_batch()
    count = (labels != IGNORE).sum()  # what the trainer's train_step counts on the full batch
    trainer = SimpleNamespace(  # what CPComposeTrainer.post_dataloading_process reads of the trainer
        config=SimpleNamespace(parallelism=parallelism, cpcompose=CPComposeConfig(strategy=strategy,
                                                                                   documents=kind == "packed")),
        parallel_dims=dims, ntokens_seen=0,
    )
    inputs, local_labels, extra = CPComposeTrainer.post_dataloading_process(
        trainer, {"input": tokens, "positions": positions}, labels
    )
    assert isinstance(extra["attention_masks"], CPAttentionMask)
    loss, _ = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()(model(inputs, **extra), local_labels, count)
    loss.backward()
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor().double()
             for n, p in model.named_parameters()}
    return {strategy: {"loss": total.double(), "grads": grads, "ntokens_seen": trainer.ntokens_seen}}


# --- refusals: a bad input (on one rank only where it can be), then a valid step in the same group ---


def _bad_call(mesh, case: str, rank: int) -> None:
    tokens, labels, positions = dense_batch()
    config = CPComposeConfig()
    if case == "positions_one_rank":
        shard_batch(tokens, labels, positions[:, :-1] if rank == 1 else positions, mesh, config)
        return
    if case == "unsplittable":  # zigzag at P=2 needs a multiple of 4
        shard_batch(tokens[:, :30], labels[:, :30], positions[:, :30], mesh, CPComposeConfig(documents=False))
        return
    model = build("llama3")
    for module in model.modules():
        if hasattr(module, "cp_degree"):
            module.cp_degree = mesh.size()
    batch = shard_batch(tokens, labels, positions, mesh, config)
    if case == "score_mod_one_rank":  # torchtitan's inner attention signature, called as its attention layers do
        attention = next(m for m in model.modules() if hasattr(m, "cp_degree"))
        q = torch.randn(1, 8, 4, 8, dtype=torch.float64)
        attention(q, q, q, attention_masks=batch.attention_masks, score_mod=(lambda s, *a: s) if rank == 1 else None)
        return
    masks = {"no_region": None, "flex_mask": {"block_causal": object()}}[case]
    model(batch.inputs, positions=batch.positions, attention_masks=masks)


def refusal(mesh, case: str, state: dict) -> dict:
    """The error each rank raised for `case`, and the loss of a valid dense step run right after."""
    message = "no error"
    try:
        _bad_call(mesh, case, mesh.get_local_rank())
    except ValueError as e:
        message = str(e)
    after = cp_steps(mesh, "llama3", state, "dense", strategies=("ring",))
    return {"message": message, "after": after["ring"]["loss"]}


def one_process_step(name: str, state: dict) -> dict:
    """The packed batch at once on one process (no CP mesh): `CPComposeAttention`'s own document mask."""
    model = build(name, state)
    tokens, labels, positions = packed_batch()
    batch = shard_batch(tokens, labels, positions, None, CPComposeConfig())
    loss = _loss_sum(model(batch.inputs, positions=batch.positions, attention_masks=batch.attention_masks),
                     batch.labels) / (labels != IGNORE).sum()
    loss.backward()
    return _result(model, loss)
