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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import allreduce_gradients, context_parallel, cp_cross_entropy

STRATEGIES = ("ring", "allgather", "alltoall")
BATCH, SEQ, VOCAB = 2, 48, 64
DOCS = (5, 19, 1, 3, 12, 9, 23)  # 72 tokens: documents shorter and longer than a conv's width and a chunk
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)

FLOAT32_KERNEL = dict(rtol=1e-5, atol=1e-7)
"""transformers' SSM and delta-rule kernels compute in float32 inside a float64 model: CP splits
their sums differently, so results agree to float32's rounding (measured ~1e-8 absolute on
gradients; the delta-rule families at most 2e-8, an eighth of this allowance, while leaving a
rank's state at zero misses by 1.4x to 500x of it). The Mamba-1 mixers (Mamba, FalconMamba,
Jamba, Zamba) hand the scan A, D and the dt bias as float32 (`.float()`), so those gradients are
float32-rounded (~1e-7 relative at P=2); Mamba's and FalconMamba's logits are float32. The CP
kernels themselves are held to 1e-12 in float64 by tests/integrations/test_transformers_kernels_delta_rule.py
and tests/integrations/test_transformers_kernels_selective_scan.py."""
FLOAT32_WKV = dict(rtol=1e-5, atol=1e-5)
"""RWKV's WKV loop (transformers' CPU kernel) keeps exp(key) and its denominator in float32. Its
embeddings start at gain 1e-4, so the first LayerNorm scales their gradient up to ~200 here, and
float32 rounding of those gradients reaches ~3e-6 absolute (0.8 of FLOAT32_KERNEL's allowance on
the small entries of the same rows; a fifth of this one). The loss agrees to 1e-15; leaving out
the WKV route or the token-shift routes misses by 60 absolute or more."""
FLOAT64 = dict(rtol=0.0, atol=1e-12)
"""A model computed in float64 throughout: only summation order differs."""


_GDN = dict(  # the Gated DeltaNet families' shared tiny shape
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
)


@dataclass(frozen=True)
class Hybrid:
    """One family: its tiny config, whether it has attention layers, and the tolerance its kernels allow."""

    config: Callable[[], hf.PretrainedConfig]
    attention: bool = True  # False: a pure state-space model (built without attn_implementation)
    tolerance: dict = field(default_factory=lambda: dict(FLOAT32_KERNEL))
    reference_attention: str = "sdpa"  # the single-process run's attention ("eager" where sdpa is refused)


HYBRIDS: dict[str, Hybrid] = {
    "lfm2": Hybrid(lambda: hf.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
        block_auto_adjust_ff_dim=False, **SPECIAL), tolerance=FLOAT64),
    "mamba2": Hybrid(lambda: hf.Mamba2Config(
        vocab_size=VOCAB, hidden_size=16, num_heads=4, head_dim=8, expand=2, state_size=4, n_groups=2, chunk_size=4,
        conv_kernel=4, num_hidden_layers=2, **SPECIAL), attention=False),
    "bamba": Hybrid(lambda: hf.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=4, mamba_chunk_size=4, mamba_d_conv=4, mamba_expand=1, **SPECIAL)),
    "falcon_h1": Hybrid(lambda: hf.FalconH1Config(  # Mamba2 beside attention in every layer, muP multipliers
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=4, mamba_rms_norm=True, **SPECIAL)),
    "granitemoehybrid": Hybrid(lambda: hf.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
        shared_intermediate_size=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=4, **SPECIAL)),
    "nemotron_h": Hybrid(lambda: hf.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "attention", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=4, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=2, conv_kernel=4, expand=1, chunk_size=4, **SPECIAL)),
    "zamba2": Hybrid(lambda: hf.Zamba2Config(  # Mamba2 layers and a shared attention block
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
        mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=4,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, num_mem_blocks=1, **SPECIAL)),
    "mamba": Hybrid(lambda: hf.MambaConfig(  # Mamba-1: the selective scan, no attention
        vocab_size=VOCAB, hidden_size=16, state_size=4, expand=2, conv_kernel=4, num_hidden_layers=2, **SPECIAL),
        attention=False),
    "rwkv": Hybrid(lambda: hf.RwkvConfig(  # RWKV-4: token shifts and the WKV recurrence, no attention
        vocab_size=VOCAB, hidden_size=16, attention_hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        context_length=128, **SPECIAL), attention=False, tolerance=FLOAT32_WKV),
    # mLSTM blocks (matrix memory, max-plus stabilizer m), no attention. eps=1e-2 (default 1e-6) makes the
    # stabilizer matter at this init (h's denominator holds eps * e^m): restarting runs at m = 0 instead of
    # the composed m then misses by ~1800x the tolerance, as a trained model's large gates would at 1e-6.
    "xlstm": Hybrid(lambda: hf.xLSTMConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, chunk_size=8, eps=1e-2, **SPECIAL),
        attention=False),
    "falcon_mamba": Hybrid(lambda: hf.FalconMambaConfig(  # Mamba-1 with RMS norms (float32) on B, C and dt
        vocab_size=VOCAB, hidden_size=16, state_size=4, expand=2, conv_kernel=4, num_hidden_layers=2, **SPECIAL),
        attention=False),
    "jamba": Hybrid(lambda: hf.JambaConfig(  # Mamba-1 layers beside attention with mixture-of-experts
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=1, **SPECIAL)),
    # Multi-head Mamba-1 layers and a shared attention block. Its default init (std 0.02) leaves B and C so
    # small that a state carried between ranks moves the gradients by less than the tolerance: at std 0.15
    # a scan without CP misses by ~2e-5, while CP agrees to ~1e-9.
    "zamba": Hybrid(lambda: hf.ZambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, n_mamba_heads=2, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, initializer_range=0.15, **SPECIAL)),
    "lfm2_moe": Hybrid(lambda: hf.Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3, num_dense_layers=1, num_experts=2, num_experts_per_tok=1, **SPECIAL), tolerance=FLOAT64),
    "lfm3": Hybrid(lambda: hf.Lfm3Config(  # short convs beside sliding and full attention, gated heads
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, layer_types=["conv", "sliding_attention",
        "full_attention"], conv_L_cache=3, **SPECIAL), tolerance=FLOAT64),
    "gpt_oss": Hybrid(lambda: hf.GptOssConfig(  # attention sinks, sliding and full layers, MoE
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=1, **SPECIAL), tolerance=FLOAT64, reference_attention="eager"),
    # Gated DeltaNet (short conv + `torch_chunk_gated_delta_rule`) beside attention; 4 value heads
    # over 2 key heads, so the kernels' grouped values are covered.
    "qwen3_next": Hybrid(lambda: hf.Qwen3NextConfig(
        **_GDN, intermediate_size=64, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, **SPECIAL)),
    "qwen3_5": Hybrid(lambda: hf.Qwen3_5TextConfig(**_GDN, intermediate_size=64, **SPECIAL)),
    "qwen3_5_moe": Hybrid(lambda: hf.Qwen3_5MoeTextConfig(
        **_GDN, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        **SPECIAL)),
    "olmo_hybrid": Hybrid(lambda: hf.OlmoHybridConfig(  # beta in (0, 2): negative eigenvalues
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, **SPECIAL)),
    "kimi_linear": Hybrid(lambda: hf.KimiLinearConfig(  # KDA (per-channel gates) beside MLA attention
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, num_local_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], linear_head_dim=8,
        linear_num_heads=4, linear_conv_kernel_dim=4, **SPECIAL)),
    "lara_mini": Hybrid(lambda: hf.LaraMiniConfig(  # GDN beside sliding (RoPE) and full (NoPE) attention, MoE
        **_GDN | dict(layer_types=["linear_attention", "sliding_attention", "full_attention"], num_hidden_layers=3),
        sliding_window=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
        num_experts_per_tok=1, **SPECIAL)),
    "bailing_hybrid": Hybrid(lambda: hf.BailingHybridConfig(  # KDA beside gated MLA attention, MoE
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_local_experts=2, num_experts_per_tok=1, n_group=1,
        topk_group=1, layer_types=["linear_attention", "full_attention"], first_k_dense_replace=1,
        short_conv_kernel_size=4, num_mtp_layers=0, **SPECIAL)),
    # Its own conv and RG-LRU scan (routed methods) beside sliding-window attention. Not FLOAT64:
    # transformers' scan accumulates in float32, so the state entering a run, composed, rounds
    # differently from the sequential one (measured ~2e-10 on the loss).
    "recurrent_gemma": Hybrid(lambda: hf.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, lru_width=32, attention_window_size=16, conv1d_width=4,
        block_types=["recurrent", "attention", "recurrent"], **SPECIAL)),
    # Lightning attention (a routed method) beside softmax attention, MoE MLPs; blocks of 4 cut every
    # run. FLOAT64: its RMSNorms round to float32, but CP moves their inputs by ~1e-16 only, which
    # moves no float32 rounding on these (fixed) inputs.
    "minimax": Hybrid(lambda: hf.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention", "linear_attention"],
        block_size=4, num_local_experts=2, num_experts_per_tok=1, **SPECIAL), tolerance=FLOAT64),
}


def build(name: str, state: dict | None = None, *, cp: bool = True) -> torch.nn.Module:
    """The family's tiny model in float64 (with "cpcompose" attention when it has attention and `cp`)."""
    hybrid = HYBRIDS[name]
    torch.manual_seed(0)
    impl = {"attn_implementation": "cpcompose" if cp else hybrid.reference_attention} if hybrid.attention else {}
    # Mixture-of-experts layers: transformers' grouped matmul has no float64 kernel, its eager loop does.
    model = hf.AutoModelForCausalLM.from_config(hybrid.config(), dtype=torch.float64, experts_implementation="eager",
                                                **impl)
    if state is not None:
        model.load_state_dict(state)
    return model


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
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


@_one_thread()
def reference_plain(name: str) -> tuple[dict, dict]:
    """The single-process run on the full batch, and the weights it started from."""
    model = build(name, cp=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, targets = plain_batch()
    loss = F.cross_entropy(_logits(model, input_ids=ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return _result(model, loss), state


def cp_plain(mesh, name: str, state: dict, strategies: tuple[str, ...] = STRATEGIES) -> dict:
    """Each strategy on the zigzag split of the plain batch: loss summed over ranks, gradients all-reduced."""
    model = build(name, state)
    out = {}
    for strategy in strategies:
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


@_one_thread()
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


def cp_packed(mesh, name: str, state: dict, strategies: tuple[str, ...] = STRATEGIES) -> dict:
    """Each strategy on pack_batch's balanced split of the documents as one flattened row."""
    model = build(name, state)
    out = {}
    features = hf.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in documents()])
    for strategy in strategies:
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
    for rank, got in enumerate(per_rank):
        for strategy, r in got.items():
            at = f"{name} {where} rank {rank} {strategy}"
            torch.testing.assert_close(r["loss"], want["loss"], **tol, msg=lambda m: f"{at} loss: {m}")
            assert set(r["grads"]) == set(want["grads"]), f"{at}: gradients of other parameters"
            for param, grad in want["grads"].items():
                torch.testing.assert_close(r["grads"][param], grad, **tol, msg=lambda m: f"{at} {param}: {m}")
