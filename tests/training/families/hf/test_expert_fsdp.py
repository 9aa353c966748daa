"""Experts FSDP-sharded beside expert parallelism on 4 ranks, as torchtitan folds them (issue 38).

The tiny Qwen3-MoE folder of test_expert_parallel.py (its router loss on), trained 4 steps on 4 ranks in two foldings and at cp = 1 on
one process:

* cp = 2 x dp_shard = 2 x ep = 2: the expert mesh's `efsdp` axis has size 2, so each rank holds half of its EP
  block of experts and FSDP2 gathers it (the 2-rank tests have efsdp = 1: FSDP over one rank);
* dp_replicate = 2 x cp = 2 x ep = 2 (HSDP): the experts are replicated over dp_replicate, their gradients
  averaged over it.

Tolerance as test_expert_parallel.py (relative 1e-4 on the losses, 1e-5 on the gradient norms: float32 summation
order, measured at most 3e-8 and 1e-7).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.training.loop.trainer import Trainer
from tests.support.hf_trainer import hf_args, make_moe, text_corpus

RTOL, NORM_RTOL = 1e-4, 1e-5


def run_with_norms(mesh, args: list[str]) -> dict:  # noqa: ANN001
    """The trainer's run on every rank: its losses, each step's gradient norm, and how many ranks share each
    expert parameter's FSDP2 mesh (its DTensor's axes and sizes)."""
    trainer = Trainer(load_config(args))
    norms, step = [], trainer.train_step

    def recorded() -> float:
        loss = step()
        norms.append(trainer.grad_norm)
        return loss

    trainer.train_step = recorded  # type: ignore[method-assign]
    losses = trainer.run()
    fsdp = {tuple(zip(p.device_mesh.mesh_dim_names, p.device_mesh.shape)) for p in trainer.trained.expert_parameters}
    return {"losses": losses, "norms": norms, "experts": len(trainer.trained.expert_parameters), "fsdp": fsdp}


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.mark.parametrize(("folding", "fsdp"), [(("--parallelism.cp=2", "--parallelism.dp_shard=2"), (("efsdp", 2),)),
                                               (("--parallelism.dp_replicate=2", "--parallelism.cp=2"),
                                                (("dp_replicate", 2), ("efsdp", 1)))],
                         ids=["efsdp2", "hsdp"])
def test_experts_fsdp_sharded_or_replicated_beside_ep(pools, moe, tmp_path, folding, fsdp) -> None:
    corpus = text_corpus(tmp_path)
    [one] = pools.get(1).run(run_with_norms, hf_args(moe, corpus, tmp_path / "one"))
    four = pools.get(4).run(run_with_norms, hf_args(moe, corpus, tmp_path / "four", *folding, "--parallelism.ep=2"))
    for got in four:
        assert got["experts"] == 4 and got["fsdp"] == {fsdp}, got  # 2 layers x 2 projections, on the mesh said
        assert got["losses"] == pytest.approx(one["losses"], rel=RTOL), (got["losses"], one["losses"])
        assert got["norms"] == pytest.approx(one["norms"], rel=NORM_RTOL), (got["norms"], one["norms"])
