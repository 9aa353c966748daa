"""The trainer on Hugging Face models cut into pipeline stages (`model.name = "hf"`, `parallelism.pp` > 1).

Tiny `save_pretrained` folders with 4 decoder layers (`make_deep_model`; Qwen3-Next alternating Gated DeltaNet
and gated attention) train 2 steps on packed documents at pp = 2 x cp = 2 (FSDP2 over the cp ranks, each stage
its own root; two stages per rank under the interleaved schedules, 4 microbatches, each one pack with its own
layout; activation checkpointing recomputing each layer in its microbatch's CP region, under
InterleavedZeroBubble in its split backward) with the same per-step loss as the same folder at cp = 1 on one
process, to rtol 1e-4 (the issue's bound; float32 sums in another order under CP and the schedule's
microbatches move the 7th digit, measured at most 1.6e-7 relative). Qwen3-MoE with its experts split (ep = 2)
trains alike under 1F1B, the Llama at pp = 2 x tp = 2 under Interleaved1F1B, and Qwen3-Next on 8 ranks at
pp = 2 x cp = 2 x dp_shard = 2 under ZBVZeroBubble. A checkpoint saved at pp = 2
resumes on one process to the same next loss, and its export reloads with `from_pretrained` as trained. What
cannot be cut is refused before launch: tests/training/families/hf/test_preflight.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_trainer import hf_args, make_deep_model, make_moe, run_hf, same_logits, text_corpus, train

RTOL = 1e-4
COMMON = ("--training.batch_size=4", "--parallelism.pp_microbatches=4")
PIPELINE = ("--parallelism.pp=2", "--parallelism.cp=2")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory, pools, corpus) -> tuple[Path, list[float]]:
    """The 4-layer Llama folder and its 3 steps at cp = 1 on one process."""
    folder = make_deep_model(tmp_path_factory.mktemp("llama"), "llama")
    return folder, _losses(pools, 1, folder, corpus, tmp_path_factory.mktemp("llama-one"), steps=3)


def _losses(pools, world: int, folder: Path, corpus: Path, dump: Path, *extra: str, steps: int = 2) -> list[float]:
    got = train(pools, world, hf_args(folder, corpus, dump, *COMMON, *extra, steps=steps))
    assert got["error"] is None, got["error"]
    return got["losses"]


def test_llama_at_pp2_cp2_under_interleaved_1f1b_trains_and_resumes_as_on_one_process(pools, llama, corpus,
                                                                                      tmp_path) -> None:
    """Its checkpoint of step 2 (each pipeline rank its stages' tensors, under the whole model's names) resumes on
    one process to the same step 3."""
    folder, one = llama
    saving = ("--checkpoint.enable=true", "--checkpoint.interval=2")
    got = _losses(pools, 4, folder, corpus, tmp_path, *PIPELINE, "--parallelism.pp_schedule=Interleaved1F1B", *saving)
    got += _losses(pools, 1, folder, corpus, tmp_path, *saving, steps=3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=RTOL, atol=0)


def test_llama_at_pp2_cp2_under_interleaved_zero_bubble_trains_as_on_one_process(pools, llama, corpus,
                                                                                 tmp_path) -> None:
    folder, one = llama
    got = _losses(pools, 4, folder, corpus, tmp_path, *PIPELINE, "--parallelism.pp_schedule=InterleavedZeroBubble",
                  "--activation_checkpoint.mode=full")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one[:2]), rtol=RTOL, atol=0)


def test_qwen3_next_at_pp2_cp2_trains_as_on_one_process(pools, corpus, tmp_path) -> None:
    folder = make_deep_model(tmp_path / "model", "qwen3_next")
    one = _losses(pools, 1, folder, corpus, tmp_path / "one")
    got = _losses(pools, 4, folder, corpus, tmp_path / "pp", *PIPELINE, "--parallelism.pp_schedule=Interleaved1F1B",
                  "--activation_checkpoint.mode=full")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=RTOL, atol=0)


def test_experts_split_at_pp2_cp2_ep2_train_as_on_one_process(pools, corpus, tmp_path) -> None:
    """Each pipeline rank's MoE layers with their experts over ep = 2 (folded out of the cp ranks); no router loss
    (refused under pipelining)."""
    folder = make_moe(tmp_path / "model", "qwen3_moe", output_router_logits=False)
    one = _losses(pools, 1, folder, corpus, tmp_path / "one", "--parallelism.pp_microbatches=2")
    got = _losses(pools, 4, folder, corpus, tmp_path / "pp", *PIPELINE, "--parallelism.ep=2",
                  "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=RTOL, atol=0)


def test_llama_at_pp2_tp2_trains_as_on_one_process(pools, llama, corpus, tmp_path) -> None:
    """Each stage's layers split by the family's tensor-parallel plan as well (tp = 2 inside each pipeline rank)."""
    folder, one = llama
    got = _losses(pools, 4, folder, corpus, tmp_path, "--parallelism.pp=2", "--parallelism.tp=2",
                  "--parallelism.pp_schedule=Interleaved1F1B")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one[:2]), rtol=RTOL, atol=0)


def test_qwen3_next_at_pp2_cp2_dp_shard2_under_zbv_trains_as_on_one_process(pools, corpus, tmp_path) -> None:
    """8 ranks: FSDP over dp_shard x cp inside each pipeline rank, each rank the V of ZBVZeroBubble (stages r and
    3 - r: rank 0 holds the embedding and the head)."""
    folder = make_deep_model(tmp_path / "model", "qwen3_next")
    batch = ("--training.batch_size=8",)
    one = _losses(pools, 1, folder, corpus, tmp_path / "one", *batch)
    got = _losses(pools, 8, folder, corpus, tmp_path / "pp", *batch, *PIPELINE, "--parallelism.dp_shard=2",
                  "--parallelism.pp_schedule=ZBVZeroBubble")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=RTOL, atol=0)


def test_llama_at_pp2_cp2_exports_every_stage(pools, llama, corpus, tmp_path) -> None:
    """`checkpoint.export_hf` at pp = 2 x cp = 2: each pipeline rank writes its stages' tensors, and the folder
    reloads with `from_pretrained` equal to the trained weights gathered from every rank."""
    folder, _ = llama
    out = tmp_path / "hf"
    args = hf_args(folder, corpus, tmp_path / "run", *COMMON, *PIPELINE, "--parallelism.pp_schedule=Interleaved1F1B",
                   f"--checkpoint.export_hf={out}", steps=1)
    per_rank = pools.get(4).run(run_hf, args, True)
    assert all(r["error"] is None for r in per_rank), per_rank[0]["error"]
    trained = {name: tensor for r in per_rank for name, tensor in r["weights"].items()}
    same_logits(trained, folder, out)
