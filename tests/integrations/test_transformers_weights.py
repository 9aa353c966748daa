"""A checkpoint folder straight into an FSDP-sharded model built on the meta device, and back out.

On two ranks: every parameter shard, and every buffer recomputed after `to_empty`, equals the
tensor `from_pretrained` gives on one process, bit for bit; the exported folder loads with
`from_pretrained` to the same tensors, in the stored dtype. The folders: Gemma 3 (tied output
layer, `embed_scale` and per-layer-type RoPE buffers), Qwen3-Next with 3 experts per layer (stored
one tensor per expert, stacked by transformers; FSDP gives one rank 2 experts and the other 1), and
a Llama stored in bfloat16 (read into float32 shards, written back in bfloat16), and hybrids whose
`save_pretrained` folders transformers converts on loading: GraniteMoeHybrid and Kimi-Linear (renamings
written as regexes, experts stacked), OLMo-Hybrid and Kimi-Linear (q/k/v short convs stored apart,
concatenated along dim 0, each rank reading its own rows), Falcon-H1 (`mup_vector`, a buffer its
`_init_weights` sets from the base model's branch), LaraMini (one stored `in_proj` split into four
projections), Bailing-Hybrid (renamings applied in turn, an anchored one). (Qwen4-Exp's n-gram tables,
stored as numbered shards, load in tests/training/families/hf/test_hybrids.py; its integer buffers are beyond
torch's safetensors consolidation, so its export is refused before launch.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf
from torch.distributed.fsdp import fully_shard

import cpcompose.integrations.transformers as cphf
from tests.support.hybrid_families import HYBRIDS

_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
CONFIGS = {
    "gemma3": lambda: hf.Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=8, query_pre_attn_scalar=16,
                                          layer_types=["sliding_attention", "full_attention"]),
    "qwen3_next": lambda: hf.Qwen3NextConfig(
        **_COMMON, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=3, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
    ),
    "llama-bf16": lambda: hf.LlamaConfig(**_COMMON),
    **{name: HYBRIDS[name].config for name in ("granitemoehybrid", "kimi_linear", "olmo_hybrid", "falcon_h1",
                                                "lara_mini", "bailing_hybrid")},
}
RECOMPUTED = ("inv_freq", "embed_scale", "mup_vector")  # the non-persistent buffers of these families


def _folder(root: Path, name: str) -> Path:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    hf.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype).save_pretrained(root / name)
    return root / name


def load_sharded_and_export(mesh, folder: Path, out: Path) -> dict:
    config = hf.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plan = cphf.weight_plan(model, folder)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    buffers = cphf.init_non_persistent_buffers(model)
    cphf.load_pretrained_weights(model, folder, plan)
    cphf.export_pretrained(model, out, source=folder, config=config, plan=plan)
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"buffers": {n: b.clone() for n, b in model.named_buffers()}, "recomputed": buffers, "full": full,
            "local": local, "tied": dict(plan.tied), "stacked": sorted(plan.stacked)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_load_and_export_equal_from_pretrained(pools, tmp_path: Path, name: str) -> None:
    folder = _folder(tmp_path, name)
    out = tmp_path / "exported"
    ranks = pools.get(2).run(load_sharded_and_export, folder, out)
    want = hf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params, buffers = dict(want.named_parameters()), dict(want.named_buffers())
    for r in ranks:
        assert r["full"].keys() == params.keys()
        for n, p in params.items():
            assert torch.equal(r["full"][n], p), n
        for n, b in buffers.items():
            assert torch.equal(r["buffers"][n], b), n
        assert set(r["recomputed"]) == {n for n in buffers if any(k in n for k in RECOMPUTED)}
    if name == "qwen3_next":  # each rank read its own experts only: 2 and 1 of the 3
        rows = sorted(r["local"]["model.layers.0.mlp.experts.gate_up_proj"].shape[0] for r in ranks)
        assert rows == [1, 2] and ranks[0]["stacked"], ranks[0]["stacked"]
    if name == "gemma3":
        assert ranks[0]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    back = hf.AutoModelForCausalLM.from_pretrained(out)
    source = hf.AutoModelForCausalLM.from_pretrained(folder)
    assert back.dtype == source.dtype
    for n, p in source.state_dict().items():
        assert torch.equal(back.state_dict()[n], p), n


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, "llama-bf16")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:8]
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(folder))
    with pytest.raises(ValueError, match=r"q_proj.weight: stored with shape \(8, 32\).*model.norm.weight: not in"):
        cphf.weight_plan(model, folder)
