"""The trainer on the indexer-selected (DSA) families: DeepSeek-V3.2 and GLM-5 at cp=2 equal cp=1.

A tiny model of each (MLA + a 2-head indexer choosing 6 keys per query, float32, the tiny tokenizer's
vocabulary) written by transformers' own `save_pretrained`, trained 2 steps by the trainer with the fused
loss at its default (on), packed and unpacked, ring at cp=2: each query's top-k is taken over its
document's global row (tests/integrations/test_transformers_indexer.py checks the selection itself against
each document alone on one process).
Step 1 against transformers alone (`reference_first_loss`: each packed document run by itself, sdpa, no
cpcompose), at cp=1 (a CP region of one rank around each pack) and cp=2: rtol 1e-6, the bound
tests/training/families/hf/test_trainer.py derives (float32 sums in another order). transformers' own packed row
would not do: its top-k over the whole row breaks ties among equal scores otherwise than each document
alone does (this pack's first loss: 1.4e-4 relative apart), so "cp=2 equals cp=1" alone could compare two
wrong answers.
cp=2 against cp=1: float32 sums in another order (the attention over the selected rows, the loss over
ranks), then one AdamW step, whose update moves a weight by up to lr when a tiny gradient's last bits move:
rtol 1e-5, the bound tests/training/families/hf/test_trainer.py derives for the same two steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from tests.support.hf_trainer import hf_args, reference_first_loss, text_corpus, tiny_model_script, train

RTOL = 1e-5
REFERENCE_RTOL = 1e-6
_MLA = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=2,
            num_experts_per_tok=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, index_topk=6, index_head_dim=8, index_n_heads=2,
            first_k_dense_replace=1, attention_dropout=0.0, max_position_embeddings=256)
CONFIGS = {"deepseek_v32": hf.DeepseekV32Config, "glm_moe_dsa": hf.GlmMoeDsaConfig}


def _model(folder: Path, family: str) -> Path:
    tokenizer = tiny_model_script().make_tokenizer(folder)
    ids = {key: tokenizer.convert_tokens_to_ids(token)
           for key, token in (("pad_token_id", "<|pad|>"), ("bos_token_id", "<|bos|>"), ("eos_token_id", "<|eos|>"))}
    config = CONFIGS[family](vocab_size=len(tokenizer), **_MLA, **ids)
    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("family", "pack"), [("deepseek_v32", "true"), ("glm_moe_dsa", "false")])
def test_dsa_family_trains_at_cp2_as_at_cp1(pools, tmp_path, family: str, pack: str) -> None:
    folder, corpus = _model(tmp_path / "model", family), text_corpus(tmp_path)
    runs = []
    for cp in (1, 2):
        args = hf_args(folder, corpus, tmp_path / f"cp{cp}", f"--parallelism.cp={cp}", "--parallelism.cp_strategy=ring",
                       f"--data.pack={pack}", steps=2)
        got = train(pools, cp, args)
        assert got["error"] is None, got["error"]
        assert got["losses"][0] == pytest.approx(reference_first_loss(args), rel=REFERENCE_RTOL), cp
        runs.append(got["losses"])
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=RTOL, atol=0)
