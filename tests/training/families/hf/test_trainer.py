"""The trainer on Hugging Face models (`model.name = "hf"`): every family at cp=2 equals cp=1.

Each family is a tiny random float32 model written by `cpcompose/integrations/transformers/tiny_model.py`, trained
4 steps on packed text tokenized with its own tokenizer (documents of 1-40 words: several
documents per row and documents cut by the row's end), each rank running the trainer in-process.
cp=1 runs the same packs through a CP region of one rank (documents masked the same way).

The reference: step 1's loss equals transformers' own computation with no cpcompose code at all
(`reference_first_loss`: `from_pretrained`, each packed document run alone, sdpa), to rtol 1e-6
(float32 sums in another order; measured at most 9e-8), at cp=1 and cp=2. So the weights were
loaded into the shards, the RoPE buffers recomputed, documents kept apart by attention and by
the hybrids' convolutions and recurrences, and the loss counted over the global valid tokens.

Later steps: the losses agree with cp=1's to rtol 1e-5, as the Llama trainer's do
(tests/training/loop/test_trainer.py): float32 sums run in another order under CP (attention blocks
merged through their LSE, FSDP's reduce-scatter over the CP ranks, the GDN/conv states passed
between ranks), which changes the 7th digit of step 1, and AdamW, dividing each update by the
gradient's own scale, lets those last bits move a tiny-gradient weight by up to lr per step.
Measured: at most 1.3e-7 relative over the 4 steps, against a loss change of ~1e-1 a step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_data import chat_records, write_jsonl
from tests.support.hf_trainer import hf_args, make_model, reference_first_loss, text_corpus, train

RTOL = 1e-5
REFERENCE_RTOL = 1e-6
FAMILIES = ("qwen3", "mistral", "gemma3", "deepseek_v3", "qwen3_next", "lfm2")  # llama: below, every strategy


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(family: str) -> Path:
        if family not in made:
            made[family] = make_model(tmp_path_factory.mktemp(family), family)
        return made[family]

    return folder


@pytest.fixture(scope="module")
def llama_cp1(pools, folders, corpus, tmp_path_factory) -> list[float]:
    args = hf_args(folders("llama"), corpus, tmp_path_factory.mktemp("llama-cp1"))
    losses = train(pools, 1, args)["losses"]
    assert losses[0] == pytest.approx(reference_first_loss(args), rel=REFERENCE_RTOL)
    return losses


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_llama_every_strategy_matches_cp1(pools, folders, corpus, llama_cp1, tmp_path, strategy: str) -> None:
    got = train(pools, 2, hf_args(folders("llama"), corpus, tmp_path, "--parallelism.cp=2",
                                  f"--parallelism.cp_strategy={strategy}"))
    assert got["error"] is None, got["error"]
    _close(got["losses"], llama_cp1)
    assert llama_cp1[-1] < llama_cp1[0], "the loss falls"


def test_llama_checkpointing_tiles_and_unfused_loss_match_cp1(pools, folders, corpus, llama_cp1, tmp_path) -> None:
    """Activation checkpointing recomputes inside the CP region (recompute_context); tiled MLPs; the model's
    own logits with cp_cross_entropy instead of the fused loss: the same curve."""
    got = train(pools, 2, hf_args(folders("llama"), corpus, tmp_path, "--parallelism.cp=2",
                                  "--activation_checkpoint.mode=full", "--training.tiled_mlp=2",
                                  "--training.fused_loss=false"))
    assert got["error"] is None, got["error"]
    _close(got["losses"], llama_cp1)


def test_llama_dp2_cp2_matches_cp1(pools, folders, corpus, llama_cp1, tmp_path) -> None:
    """FSDP over dp_shard x cp: each dp rank its own half of the batch, each cp rank half of each pack."""
    got = train(pools, 4, hf_args(folders("llama"), corpus, tmp_path, "--parallelism.cp=2",
                                  "--parallelism.dp_shard=2"))
    assert got["error"] is None, got["error"]
    _close(got["losses"], llama_cp1)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_cp1(pools, folders, corpus, tmp_path, family: str) -> None:
    """Each family at cp=2 (ring; all-to-all for the hybrids, whose mixers pass states and halos) equals cp=1."""
    strategy = "alltoall" if family in ("qwen3_next", "lfm2") else "ring"
    one = train(pools, 1, hf_args(folders(family), corpus, tmp_path / "one"))
    two = train(pools, 2, hf_args(folders(family), corpus, tmp_path / "two", "--parallelism.cp=2",
                                  f"--parallelism.cp_strategy={strategy}"))
    assert one["error"] is None and two["error"] is None, (one["error"], two["error"])
    reference = reference_first_loss(hf_args(folders(family), corpus, tmp_path / "one"))
    assert one["losses"][0] == pytest.approx(reference, rel=REFERENCE_RTOL)
    assert two["losses"][0] == pytest.approx(reference, rel=REFERENCE_RTOL)
    _close(two["losses"], one["losses"])
    assert one["losses"][-1] < one["losses"][0], "the loss falls"


def test_chat_records_match_cp1_and_transformers(pools, folders, tmp_path) -> None:
    """Conversations rendered with the model's own chat template, loss on the assistant's tokens only, packed
    whole: Qwen3 at cp=2 equals cp=1, and step 1 equals transformers' loss on each conversation alone."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(24, seed=5))
    args = ["--data.format=chat", "--training.seq_len=128"]
    one = train(pools, 1, hf_args(folders("qwen3"), data, tmp_path / "one", *args))
    two = train(pools, 2, hf_args(folders("qwen3"), data, tmp_path / "two", "--parallelism.cp=2",
                                  "--parallelism.cp_strategy=allgather", *args))
    assert one["error"] is None and two["error"] is None, (one["error"], two["error"])
    reference = reference_first_loss(hf_args(folders("qwen3"), data, tmp_path / "one", *args))
    assert two["losses"][0] == pytest.approx(reference, rel=REFERENCE_RTOL)
    _close(two["losses"], one["losses"])
