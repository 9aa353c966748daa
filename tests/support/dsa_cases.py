"""Tiny DeepSeek sparse attention (DSA) models: every family transformers ships with the shared indexer.

Shared by the indexer's exactness tests (tests/integrations/test_transformers_indexer.py) and the bfloat16
tests of every family (tests/support/bf16_cases.py).
"""

from __future__ import annotations

import transformers as hf

__all__ = ["CONFIGS", "REFERENCE_IMPL", "V"]

V = 64
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
REFERENCE_IMPL = {"hy_v4": "eager"}  # transformers runs HunYuan V4 (DSA with sinks) only with eager attention
