"""Tiny Hugging Face model folders and the trainer runs the `model.name = "hf"` tests share.

A folder is what `cpcompose/integrations/transformers/tiny_model.py` writes (config.json, model.safetensors, a
byte-level BPE tokenizer with `<|eos|>`): a 2-layer random model of each family, float32, vocab
320. `run_hf` is a pool case: every rank runs the trainer in-process and returns its losses and,
from rank 0, the trained weights gathered whole (for the export round trip, `same_logits`).
"""

from __future__ import annotations

import importlib

import json
from pathlib import Path

import torch

from cpcompose.config import load_config
from cpcompose.training.errors import TrainingError
from cpcompose.training.loop.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]

WORDS = ("context", "parallel", "ring", "zig", "zag", "token", "rank", "shard", "mask", "pack", "the", "fox")


def tiny_model_script():
    """`cpcompose.integrations.transformers.tiny_model`."""
    return importlib.import_module("cpcompose.integrations.transformers.tiny_model")


def make_model(folder: Path, family: str) -> Path:
    """A tiny random `family` model with its tokenizer in `folder` (float32, seed 0)."""
    return tiny_model_script().make_tiny_model(folder, family, seed=0)


def make_hybrid_model(folder: Path, family: str) -> Path:
    """`tests.support.hybrid_families.HYBRIDS[family]`'s tiny model, float32, written by transformers' own
    `save_pretrained` with the tiny tokenizer (its vocabulary and special ids), into `folder`."""
    from tests.support.hybrid_families import HYBRIDS

    script = tiny_model_script()
    tokenizer = script.make_tokenizer(folder)
    config = HYBRIDS[family].config()
    config.vocab_size = len(tokenizer)
    for key, token in (("pad_token_id", "<|pad|>"), ("bos_token_id", "<|bos|>"), ("eos_token_id", "<|eos|>")):
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    torch.manual_seed(0)
    HYBRIDS[family].auto.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def make_deep_model(folder: Path, family: str, layers: int = 4) -> Path:
    """`make_model`'s tiny `family` model with `layers` decoder layers (its layer types repeated): enough to cut
    into two pipeline stages per rank at pp = 2."""
    import transformers as hf

    script = tiny_model_script()
    tokenizer = script.make_tokenizer(folder)
    config = script._config(family, len(tokenizer), {name: tokenizer.convert_tokens_to_ids(name)
                                                     for name in script.SPECIALS})
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_next")
"""The MoE families `make_moe` writes: each one's router, experts layout and attention differ (below)."""


def _moe_config(family: str, common: dict):
    """`family`'s tiny config: 4 experts, 2 per token, hidden 32, 2 layers, `common` (vocabulary, special ids)."""
    import transformers as hf

    attention = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    moe = dict(num_experts_per_tok=2, output_router_logits=True)
    return {
        # softmax top-2, not renormalised; every layer MoE
        "qwen3_moe": lambda: hf.Qwen3MoeConfig(**common, **attention, **moe, intermediate_size=64,
                                               moe_intermediate_size=16, num_experts=4, decoder_sparse_step=1,
                                               max_position_embeddings=256),
        # softmax top-2 renormalised, the routing weights kept in float32; jitter off (refused under CP)
        "mixtral": lambda: hf.MixtralConfig(**common, **attention, **moe, intermediate_size=16, num_local_experts=4,
                                            router_jitter_noise=0.0, max_position_embeddings=256),
        # MLA, sigmoid scores plus a correction bias for the choice, 2 groups of 2 experts with 1 kept (so the group
        # limit acts), a shared expert, layer 0 dense (head_dim: the rotary part's, transformers' rule); no router
        # loss in transformers: output_router_logits off
        "deepseek_v3": lambda: hf.DeepseekV3Config(
            **common, **dict(attention, num_key_value_heads=4, head_dim=4), intermediate_size=64,
            moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=6, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
            num_experts_per_tok=2, output_router_logits=False, max_position_embeddings=256),
        # transposed, biased, interleaved and clamped experts; a biased router, softmax over the top 2; attention
        # sinks; a sliding layer (window 8) then a full one; yarn RoPE (transformers' default for the family)
        "gpt_oss": lambda: hf.GptOssConfig(**common, **attention, **moe, intermediate_size=16, num_local_experts=4,
                                           sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        # a Gated DeltaNet layer then gated attention; softmax top-2 renormalised; a shared expert behind a sigmoid
        # gate in every layer
        "qwen3_next": lambda: hf.Qwen3NextConfig(
            **common, **attention, **moe, intermediate_size=64, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            decoder_sparse_step=1, max_position_embeddings=256),
    }[family]()


def make_moe(folder: Path, family: str = "qwen3_moe", **overrides) -> Path:
    """A tiny float32 MoE model of `family` (MOE_FAMILIES: 4 experts, 2 per token, hidden 32, 2 layers; the router
    loss on, `output_router_logits = true`, except DeepSeek-V3, which has none) with the tiny tokenizer, written by
    transformers' `save_pretrained` (one tensor per expert) into `folder`; `overrides` go to its config. The routers'
    weights (and biases, DeepSeek-V3's `e_score_correction_bias`) are drawn N(0, 0.5): transformers zeroes some at
    init, which routes every token alike, and leaves the correction bias at 0, which would not exercise it."""
    import transformers as hf

    tokenizer = tiny_model_script().make_tokenizer(folder)
    common = {"vocab_size": len(tokenizer), **{
        key: tokenizer.convert_tokens_to_ids(token)
        for key, token in (("pad_token_id", "<|pad|>"), ("bos_token_id", "<|bos|>"), ("eos_token_id", "<|eos|>"))}}
    config = _moe_config(family, common)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    assert routers, f"{family}: no router found"
    with torch.no_grad():
        for router in routers:
            for name in ("weight", "bias", "e_score_correction_bias"):
                if isinstance(getattr(router, name, None), torch.Tensor):
                    getattr(router, name).normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def text_corpus(folder: Path, documents: int = 60) -> Path:
    """Documents of very different lengths (1 to 40 words), one JSON line each."""
    g = torch.Generator().manual_seed(0)
    path = folder / "corpus.jsonl"
    with path.open("w") as f:
        for _ in range(documents):
            n = int(torch.randint(1, 40, (), generator=g))
            f.write(json.dumps({"text": " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,),
                                                                                     generator=g))}) + "\n")
    return path


def hf_args(model: Path, corpus: Path, dump: Path, *extra: str, steps: int = 4) -> list[str]:
    """A short run of the model in `model` on packed text tokenized with the model's own tokenizer (model.path's:
    data.tokenizer unset)."""
    return [
        "--model.name=hf", f"--model.path={model}", "--data.source=text", f"--data.path={corpus}", "--data.pack=true",
        "--training.seq_len=64", "--training.batch_size=2", f"--training.steps={steps}", "--training.device=cpu",
        "--lr_scheduler.warmup_steps=1", "--optimizer.lr=3e-3", "--metrics.log_freq=100",
        f"--job.dump_folder={dump}", *extra,
    ]


def run_hf(mesh, args: list[str], weights: bool = False) -> dict:
    """Every rank trains; returns the losses (or the TrainingError's message) and, on request, the weights whole."""
    try:
        trainer = Trainer(load_config(args))
        losses = trainer.run()
    except TrainingError as e:
        return {"losses": None, "error": str(e), "weights": None}
    state = None
    if weights:  # expert-parallel blocks gathered whole (each rank holds its experts under the full tensor's name)
        state = trainer.model.state_dict()
        if trainer.trained.expert_shards is not None:
            state = trainer.trained.expert_shards.view(state)["model"]
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    return {"losses": losses, "error": None, "weights": state}


def train(pools, world: int, args: list[str], weights: bool = False) -> dict:
    """`run_hf` on a pool of `world` ranks; every rank must report the same losses (the global mean)."""
    results = pools.get(world).run(run_hf, args, weights)
    assert all(r["losses"] == results[0]["losses"] and r["error"] == results[0]["error"] for r in results), results
    return results[0]


def same_logits(trained: dict[str, torch.Tensor], source: Path, exported: Path) -> None:
    """from_pretrained(exported) and the source's model holding the trained weights: equal weights, equal logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    state = back.state_dict()
    assert set(trained) == set(state)
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    again = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                 config=AutoConfig.from_pretrained(exported))
    again.load_state_dict(trained)
    ids = torch.randint(0, back.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, again(input_ids=ids).logits)


def reference_first_loss(args: list[str], hf_config=None, attention: str | None = "sdpa") -> float:
    """Step 1's loss computed by transformers alone: each packed document run by itself through
    `from_pretrained`'s model (sdpa, one process, no cpcompose; with `hf_config` in place of the
    folder's config when given; `attention=None` for a family without attention layers, which refuses an
    attention implementation), its token losses summed, divided by the batch's valid labels.
    What the trainer's packed first step must equal, at any cp."""
    from transformers import AutoModelForCausalLM

    from cpcompose.data import IGNORE_INDEX, build_data_source

    config = load_config(args)
    batch = next(build_data_source(config, dp_rank=0, dp_size=1))
    extra = ({} if hf_config is None else {"config": hf_config}) | (
        {} if attention is None else {"attn_implementation": attention})
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32, **extra)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row in range(batch.input_ids.shape[0]):
            width = batch.input_ids.shape[1]  # unpacked: each row is one window of the concatenated documents
            cu = batch.cu_seqlens[row].tolist() if batch.cu_seqlens is not None else [0, width]
            for start, end in zip(cu[:-1], cu[1:]):
                ids, labels = batch.input_ids[row, start:end], batch.labels[row, start:end]
                logits = model(input_ids=ids[None], use_cache=False).logits[0]
                total += torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=IGNORE_INDEX,
                                                           reduction="sum")
                count += int((labels != IGNORE_INDEX).sum())
    return float(total / count)
