"""Write a tiny random Hugging Face causal LM, with its own tokenizer, into a local folder.

The folder is what `AutoModelForCausalLM.from_pretrained` and the trainer's
`model.name = "hf"` read (config.json, model.safetensors, tokenizer files with a
chat template), so the README's fine-tuning example and the tests run with no
download. The tokenizer is a byte-level BPE trained on a built-in paragraph (a few
hundred tokens; every UTF-8 text encodes), with BOS, EOS, a pad token and the
special tokens of a small chat template. The weights are random (seeded).

    python -m cpcompose.integrations.transformers.tiny_model out/tiny-llama                # Llama
    python -m cpcompose.integrations.transformers.tiny_model out/tiny-qwen3 --family qwen3

Families: see FAMILIES (attention models of several kinds and hybrids).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

__all__ = ["FAMILIES", "main", "make_tiny_model", "make_tokenizer"]

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
VOCAB = 320
"""Tokenizer and model vocabulary: the byte alphabet (256) plus merges plus the specials."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Role tokens around each message; the assistant's content is marked with `generation` so
`apply_chat_template(..., return_assistant_tokens_mask=True)` can say which tokens it wrote."""

_TRAINING_TEXT = (
    "Context parallelism splits the sequence across ranks. Attention exchanges keys and values; "
    "recurrences pass their states; convolutions pass a few tokens of halo. The quick brown fox jumps "
    "over the lazy dog. 0123456789. Long documents, short documents, conversations and code: "
    "def f(x): return x + 1. The user asks and the assistant answers.\n"
)


def _config(family: str, vocab: int, ids: dict[str, int]):
    import transformers as hf

    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=4096,
                  pad_token_id=ids["<|pad|>"], bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"])
    builders: dict[str, Callable[[], hf.PretrainedConfig]] = {
        "llama": lambda: hf.LlamaConfig(**common),
        "qwen3": lambda: hf.Qwen3Config(**common, head_dim=8),
        "mistral": lambda: hf.MistralConfig(**common, sliding_window=8),
        "gemma3": lambda: hf.Gemma3TextConfig(
            **common, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        ),
        "deepseek_v3": lambda: hf.DeepseekV3Config(
            **dict(common, num_key_value_heads=4), moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2, n_routed_experts=2,
            num_experts_per_tok=1, n_group=1, topk_group=1,
        ),
        "qwen3_next": lambda: hf.Qwen3NextConfig(
            **common, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            decoder_sparse_step=1,
        ),
        "lfm2": lambda: hf.Lfm2Config(
            **{k: v for k, v in common.items() if k != "intermediate_size"}, intermediate_size=64,
            layer_types=["conv", "full_attention"], conv_L_cache=3,
        ),
    }
    return builders[family]()


FAMILIES = ("llama", "qwen3", "mistral", "gemma3", "deepseek_v3", "qwen3_next", "lfm2")


def make_tokenizer(folder: str | Path):
    """Train the tiny byte-level BPE and save it (with the chat template) into ``folder``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def make_tiny_model(folder: str | Path, family: str = "llama", *, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write a random ``family`` model and its tokenizer into ``folder`` (created); returns the folder."""
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: choose one of {', '.join(FAMILIES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIALS}
    config = _config(family, len(tokenizer), ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    """`python -m cpcompose.integrations.transformers.tiny_model` and the `cpcompose-tiny-model` command."""
    parser = argparse.ArgumentParser(prog="cpcompose-tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write the model (created)")
    parser.add_argument("--family", default="llama", choices=FAMILIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = make_tiny_model(args.folder, args.family, seed=args.seed)
    print(f"wrote a tiny {args.family} model and its tokenizer to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
