"""The hybrid families' tiny float64 configs and the tolerance each family's kernels allow (`HYBRIDS`).

One entry per family whose token mixers outside attention cpcompose makes exact (routed kernel
functions or methods, `cpcompose.integrations.transformers.mixer_routes`); `hybrid_cases` builds
them, runs transformers' single-process reference and the CP runs, and compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import transformers as hf

VOCAB = 64
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)

FLOAT32_KERNEL = dict(rtol=1e-5, atol=1e-7)
"""transformers' SSM and delta-rule kernels compute in float32 inside a float64 model: CP splits
their sums differently, so results agree to float32's rounding (measured ~1e-8 absolute on
gradients; the delta-rule families at most 2e-8, an eighth of this allowance, while leaving a
rank's state at zero misses by 1.4x to 500x of it). The Mamba-1 mixers (Mamba, FalconMamba,
Jamba, Zamba) hand the scan A, D and the dt bias as float32 (`.float()`), so those gradients are
float32-rounded (~1e-7 relative at P=2); Mamba's and FalconMamba's logits are float32. BailingHybrid's
KDA reaches 7e-8 absolute (a third of the allowance), xLSTM's recurrent kernel (float32 states) a
sixth, Qwen4-Exp's float32 norms 1e-9. The CP kernels themselves are held to 1e-12 in float64 by
tests/integrations/test_transformers_mixer_routes_delta_rule.py, ..._selective_scan.py and ..._recurrent.py."""
FLOAT32_WKV = dict(rtol=1e-5, atol=1e-5)
"""RWKV's WKV loop (transformers' CPU kernel) keeps exp(key) and its denominator in float32. Its
embeddings start at gain 1e-4, so the first LayerNorm scales their gradient up to ~200 here, and
float32 rounding of those gradients reaches ~3e-6 absolute (0.8 of FLOAT32_KERNEL's allowance on
the small entries of the same rows; a fifth of this one). The loss agrees to 1e-15; leaving out
the WKV route or the token-shift routes misses by 60 absolute or more."""
# Derived (tests/support/tolerance.py), float64: a weight gradient sums over batch x tokens x width (<= 64).
FLOAT64 = dict(terms=2 * 48 * 64)
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
    auto: Any = hf.AutoModelForCausalLM  # the auto class that builds it (a multimodal family's own)


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
    # Only Gated DeltaNet layers (QSA attention is refused) with PLE on two of them: hashed n-grams of the
    # preceding ids (EOS = 21 here, which the batches hold, so segments also restart inside documents, one
    # just before a rank boundary) and a dilated short conv;
    # hyper-connection streams between layers, MoE MLPs.
    "qwen4_exp": Hybrid(lambda: hf.Qwen4ExpTextConfig(
        **_GDN | dict(layer_types=["linear_attention"] * 2), moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1, hc_count=2, hc_lowrank=8,
        ple_layer_ids=[1, 2], ple_embed_dim=16, ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=101, **SPECIAL | dict(eos_token_id=21)), attention=False),
    # A KDA layer only (DSA attention is refused), its hyper-connection streams, an MoE MLP; built
    # with its vision tower (the family has no text-only causal LM), which a text batch never reaches.
    "glm5_next": Hybrid(lambda: hf.Glm5NextConfig(text_config=dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        layer_types=["linear_attention"], mlp_layer_types=["sparse"], linear_head_dim=8,
        linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3, **SPECIAL),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                           projection_intermediate_size=16, patch_size=2, image_size=4)),
        attention=False, auto=hf.AutoModelForImageTextToText),
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
