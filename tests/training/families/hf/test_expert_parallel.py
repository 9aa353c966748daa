"""The trainer on a Hugging Face mixture-of-experts model with expert parallelism (`parallelism.ep`, issue 38).

A tiny float32 Qwen3-MoE (4 experts, 2 per token, 2 MoE layers, the router randomised: transformers zeroes it)
written by `save_pretrained` (one tensor per expert) with the tiny tokenizer, trained 4 steps on packed text:
at cp = 2 x ep = 2 on 2 ranks (each rank reads its 2 experts of each layer from the folder, the routed tokens
travel to their expert's rank and back; the dense weights FSDP-sharded over both ranks, the experts over the
expert mesh's efsdp axis, size 1) and at cp = 1 on one process (the whole model, no EP).

Tolerance, relative 1e-4 on every step's train/loss: step 1 differs only by float32 summation order (attention
merged through its LSE, the experts' rows summed in another order, the loss's token sums), ~1e-7 relative; the
later steps add AdamW's update, which divides by each gradient's own scale, so reordered last bits of a tiny
gradient move its weight by up to lr (3e-3) times a relative error of that gradient; through a 2-layer model of
width 32 that stays orders below 1e-4 (measured: at most 1.3e-7 over the 4 steps, as the dense families' 4
steps, tests/training/families/hf/test_trainer.py); a top-2 choice flipped by those bits would change a loss by
far more than 1e-4, so the check also says the routing agreed. Each step's gradient norm (1.3 to 1.8, so
max_norm = 1 clips) agrees to relative 1e-5: AdamW's update barely sees a uniform clip, so the losses alone
would not catch an EP rank leaving out the other rank's experts, which moves the norm by 2e-4 relative here
(measured: at most 1.3e-7). The router loss is
off here (output_router_logits = false); tests/training/families/hf/test_moe_router_loss.py trains it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.train import main
from cpcompose.training.loop.trainer import Trainer
from tests.support.hf_trainer import hf_args, make_qwen3_moe, text_corpus

RTOL = 1e-4
NORM_RTOL = 1e-5  # the experts' share of the norm is small: leaving the other EP rank's out moves it by 2e-4


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


def run_with_norms(mesh, args: list[str]) -> dict:  # noqa: ANN001
    """The trainer's run on every rank: its losses, each step's gradient norm, the experts modules' classes."""
    trainer = Trainer(load_config(args))
    norms, step = [], trainer.train_step

    def recorded() -> float:
        loss = step()
        norms.append(trainer.grad_norm)
        return loss

    trainer.train_step = recorded  # type: ignore[method-assign]
    losses = trainer.run()
    kinds = {type(m).__name__ for name, m in trainer.model.named_modules() if name.endswith("mlp.experts")}
    return {"losses": losses, "norms": norms, "kinds": kinds, "split": len(trainer.trained.expert_parameters)}


def test_cp2_ep2_matches_one_process(pools, moe, tmp_path) -> None:
    corpus = text_corpus(tmp_path)
    [one] = pools.get(1).run(run_with_norms, hf_args(moe, corpus, tmp_path / "one"))
    two = pools.get(2).run(run_with_norms, hf_args(moe, corpus, tmp_path / "two", "--parallelism.cp=2",
                                                   "--parallelism.ep=2"))
    assert one["kinds"] == {"Qwen3MoeExperts"} and one["split"] == 0
    for got in two:
        assert got["kinds"] == {"FSDPExpertParallelExperts"} and got["split"] == 4  # 2 layers x 2 projections
        assert got["losses"] == two[0]["losses"] and len(got["losses"]) == 4
        for step, (loss, norm, want_loss, want_norm) in enumerate(zip(got["losses"], got["norms"], one["losses"],
                                                                      one["norms"]), 1):
            assert loss == pytest.approx(want_loss, rel=RTOL), (step, got["losses"], one["losses"])
            assert norm == pytest.approx(want_norm, rel=NORM_RTOL), (step, got["norms"], one["norms"])
    assert one["losses"][-1] < one["losses"][0], "the loss falls"
    assert min(one["norms"]) > 1.0, "max_norm = 1 clips: the norm's EP sum matters"


def test_the_dry_run_names_ep(moe, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    corpus = text_corpus(tmp_path)
    code = main([*hf_args(moe, corpus, tmp_path / "dry", "--parallelism.cp=2", "--parallelism.ep=2"), "--job.dry_run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ep=2" in out and "Qwen3MoeForCausalLM" in out, out
