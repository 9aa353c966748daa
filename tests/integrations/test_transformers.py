"""Unmodified Hugging Face models under CP through `attn_implementation="cpcompose"`.

Each architecture is a tiny random float64 model built from a local config. The
reference is transformers itself on one process (its float64 "sdpa"; for Gemma 2,
whose softcap sdpa refuses, its eager formula with the softmax in float64 instead of
float32), on the full sequence; the CP run shards the inputs with
`context_parallel` and computes the loss with `cp_cross_entropy`. Loss and every
parameter gradient (summed over the CP ranks) must match, under ring, allgather and
alltoall, at P = 2 and 4.

Tolerances are derived (tests/support/tolerance.py): float64's epsilon over the longest sum
where the whole model computes in float64 (what is left is summation order), with the
model's largest gradient as the scale of every gradient (an MoE gate's gradient cancels
to far below the terms it sums). Gemma's RMSNorm computes in float32 inside a float64
model, so its norm-weight gradients are float32 sums over tokens that CP splits
differently: those models are held to float32's epsilon over the batch's tokens
(measured rel. error ~2e-7 against float32's epsilon 1.2e-7).
"""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from transformers import masking_utils

import cpcompose.integrations.transformers as cphf
from cpcompose import PackedLayout
from tests.support import hf_cases as cases
from tests.support.tolerance import assert_close

# Derived (tests/support/tolerance.py), float64: a weight gradient sums over batch x tokens x width (<= 64).
TOL = dict(terms=cases.BATCH * cases.SEQ * 64)
FLOAT32_INSIDE = {"gemma2", "gemma3"}  # RMSNorm in float32 by design
ARCHITECTURES = [
    "llama", "qwen2", "mistral", "gemma3", "gpt_neox", "phi3", "qwen3", "olmo2", "gemma2", "modernbert", "deepseek_v3",
]


def tolerance(name: str) -> dict:
    return dict(terms=cases.BATCH * cases.SEQ, dtype=torch.float32) if name in FLOAT32_INSIDE else TOL


def assert_matches(want: dict, per_rank: list[dict], name: str) -> None:
    tol = tolerance(name)
    largest = max(g.abs().max().item() for g in want["grads"].values())  # the scale of every gradient's terms
    for rank, by_strategy in enumerate(per_rank):
        for strategy, got in by_strategy.items():
            where = f"{name} rank {rank} {strategy}"
            assert_close(got["loss"], want["loss"], **tol, msg=lambda m: f"{where} loss: {m}")
            for param, grad in want["grads"].items():
                assert_close(got["grads"][param], grad, **tol, scale=largest, msg=lambda m: f"{where} {param}: {m}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_architecture_is_exact(pools, name: str, world: int) -> None:
    """Zigzag split, inputs as context_parallel buffers: loss and gradients equal transformers' own."""
    want, state = cases.reference_plain(name)
    assert_matches(want, pools.get(world).run(cases.cp_plain, name, state), name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["mistral", "gemma3", "modernbert"])
def test_packed_rows_are_exact(pools, name: str, world: int) -> None:
    """A row from transformers' flattening collator: documents from its restarting position_ids.

    Two references: transformers' own packed path (its document mask from position_ids), and each
    document run alone (what a pack means; the two differ for DSA models, test_transformers_indexer.py).
    The split is the balanced packed split of those documents, padded only at the end of the pack.
    """
    want, state = cases.reference_packed(name)
    per_rank = pools.get(world).run(cases.cp_packed, name, state, "packed")
    assert_matches(want, per_rank, name)
    if name not in cases.MASKED_LM:  # an encoder's reference already runs each document alone
        assert_matches(cases.reference_packed(name, alone=True)[0], per_rank, name)
    cu = torch.tensor([0, *cases.DOCS]).cumsum(0).tolist()
    expected = PackedLayout.build(cu, world)
    for got in per_rank[0].values():
        assert got["bounds"] == expected.doc_bounds and got["pad"] == expected.pad < world


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["llama", "mistral", "modernbert"])
def test_right_padded_batch_is_exact(pools, name: str, world: int) -> None:
    """Rows of different lengths: every real token's logits, the loss and the gradients equal each row run alone."""
    want, state = cases.reference_padded(name)
    per_rank = pools.get(world).run(cases.cp_packed, name, state, "padded")
    assert_matches(want, per_rank, name)
    real = sum(cases.ROWS)
    for got in per_rank[0].values():
        assert_close(got["logits"][:real], want["logits"], **tolerance(name))


@pytest.mark.parametrize("world", [2, 4])
def test_all_ones_attention_mask_is_exact(pools, world: int) -> None:
    want, state = cases.reference_plain("llama")
    assert_matches(want, pools.get(world).run(cases.cp_plain, "llama", state, cases.STRATEGIES, True), "llama")


REFUSALS = [
    ("softcap_padding", "cannot combine with a logit softcap"),
    ("padding_not_a_buffer", "is not a context_parallel buffer"),
    ("no_position_ids", "position_ids are not the positions of this rank's tokens"),
    ("packed_positions_zigzag", "restarting at 0 per document"),
    ("dropout_one_rank", "attention dropout"),
    ("kv_cache", "a KV cache"),
    ("mask_4d", "got a mask tensor"),
    ("overlay", "custom mask function"),
    ("chunked", "not its config's sliding_window"),
    ("flash_kwargs", "flash-attention varlen kwargs"),
    ("window_option", "leave window_size unset"),
    ("unsplittable", "not divisible by 4"),
    ("left_padding_one_rank", "left (or inner) padding"),
]


@pytest.mark.parametrize("case,message", REFUSALS, ids=[c for c, _ in REFUSALS])
def test_refusal_raises_on_every_rank(pools, case: str, message: str) -> None:
    """What cannot be honoured raises on every rank (even when only one rank's input is bad), naming it;
    a valid step in the same group then runs."""
    results = pools.get(2).run(cases.refusal, case)
    for rank, got in enumerate(results):
        assert message in got["message"], f"rank {rank}: {got['message']}"
        assert torch.isfinite(got["after"]) and got["after"] == results[0]["after"]


def _mask_from(config: hf.PretrainedConfig, make: object, seq: int) -> torch.Tensor:
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, seq, config.hidden_size)
    mask = make(config=config, inputs_embeds=embeds, attention_mask=None, **{cases.CACHE_KW: None})
    assert mask is not None
    return mask[0, 0]


def _window_mask(window: tuple[int, int], causal: bool, seq: int) -> torch.Tensor:
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    inside = (j >= i - window[0]) & (j <= i + window[1])
    return inside & (j <= i) if causal else inside


@pytest.mark.parametrize("width", [2, 3, 8])
def test_window_convention_matches_transformers_masks(width: int) -> None:
    """`hf_window` against the masks transformers itself builds for sdpa/eager, on one process."""
    seq = 24
    causal = _mask_from(hf.MistralConfig(hidden_size=8, sliding_window=width),
                        masking_utils.create_sliding_window_causal_mask, seq)
    assert_close(causal, _window_mask(cphf.hf_window(width, True), True, seq))
    # ModernBERT: config.sliding_window = local_attention // 2; its module passes that + 1.
    bert = hf.ModernBertConfig(hidden_size=8, local_attention=2 * width)
    local = _mask_from(bert, masking_utils.create_bidirectional_sliding_window_mask, seq)
    assert_close(local, _window_mask(cphf.hf_window(bert.sliding_window + 1, False), False, seq))


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_outside_a_cp_region_it_is_plain_attention(name: str) -> None:
    """Without CP, "cpcompose" runs as transformers' attention: right-padded rows equal each row alone."""
    model = cases.build(name, "cpcompose")
    batch = cases.padded_batch(name)
    logits = cases.forward(model, name, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    reference = cases.build(name, cases.reference_impl(name), model.state_dict())
    for row, n in enumerate(cases.ROWS):
        alone = cases.forward(reference, name, input_ids=batch["input_ids"][row : row + 1, :n])
        assert_close(logits[row, :n], alone[0], **tolerance(name))


def test_gqa_kv_is_not_expanded_before_sending(pools) -> None:
    """Llama with 2 K/V heads for 4 query heads sends exactly half the K/V bytes of the same model with 4."""
    pool = pools.get(2)
    for gqa, mha in zip(pool.run(cases.kv_bytes, 2), pool.run(cases.kv_bytes, 4)):
        assert gqa > 0 and 2 * gqa == mha


def test_gradient_checkpointing_recompute_is_exact(pools) -> None:
    want, state = cases.reference_plain("llama")
    assert_matches(want, pools.get(2).run(cases.checkpointed_step, state), "llama")
    # transformers' kwargs without context_fn: its checkpoint function is wrapped to re-enter the region
    assert_matches(want, pools.get(2).run(cases.checkpointed_step, state, False), "llama")


def test_checkpointing_without_recompute_context_is_refused(pools) -> None:
    want, state = cases.reference_plain("llama")
    pool = pools.get(2)
    for message in pool.run(cases.checkpoint_without_context, state):
        assert "recomputed outside its CP region" in message and "recompute_context" in message, message
    assert_matches(want, pool.run(cases.checkpointed_step, state), "llama")  # the group is still usable


def test_fsdp_reduces_gradients_exactly(pools) -> None:
    """FSDP2 over the CP ranks in place of allreduce_gradients."""
    want, state = cases.reference_plain("llama")
    assert_matches(want, pools.get(2).run(cases.fsdp_step, state), "llama")
