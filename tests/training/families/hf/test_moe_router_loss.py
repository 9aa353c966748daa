"""The trainer's router loss (`output_router_logits = true`) is transformers' own (issue 38).

A tiny float32 Qwen3-MoE (4 experts, 2 per token, 2 MoE layers, the router randomised) with
`output_router_logits = true` and `router_aux_loss_coef = 0.1`, one step on packed text on one process: its
train/loss equals transformers' own `model(input_ids, labels=...).loss` for the same batch (the language-model loss
plus `router_aux_loss_coef x aux_loss`, its documents kept apart by their position ids, transformers'
packed-sequence mask), with the fused loss and with the model's own logits. That the router loss is the same at
cp = 2 x ep = 2 (pooled over dp x cp by `cp_load_balancing_loss`, the pack's padding left out) and logged to
TensorBoard is tests/training/families/hf/test_expert_parallel.py's, for every MoE family the trainer builds.

Tolerance, relative 1e-4 (float32): summation order only (the token sums of the cross-entropy and of the router
statistics), ~1e-7 relative on a loss of ~6 (measured: equal to the last bit with the fused loss).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpcompose.config import load_config
from cpcompose.data import build_data_source
from cpcompose.training.loop.metrics import MetricsLogger, StepMetrics
from cpcompose.training.loop.trainer import Trainer
from tests.support.hf_trainer import hf_args, make_moe, text_corpus

RTOL = 1e-4
COEF = 0.1


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp("qwen3_moe_router"), "qwen3_moe", router_aux_loss_coef=COEF)


def run_recording(mesh, args: list[str]) -> dict:  # noqa: ANN001
    """The trainer's run: per step its loss and router loss."""
    trainer = Trainer(load_config(args))
    router, step = [], trainer.train_step

    def recorded() -> float:
        loss = step()
        router.append(trainer.router_loss)
        return loss

    trainer.train_step = recorded  # type: ignore[method-assign]
    return {"losses": trainer.run(), "router": router}


def transformers_first_loss(args: list[str]) -> float:
    """Step 1's batch through transformers alone (sdpa, one process): `model(input_ids, labels=...)`.loss, which
    adds `router_aux_loss_coef x load_balancing_loss_func(...)` over every token of the batch; the documents of a
    row kept apart by position ids restarting at 0 (transformers' packed-sequence mask), the data's labels given
    as they are (already shifted: `shift_labels`)."""
    from transformers import AutoModelForCausalLM

    config = load_config(args)
    batch = next(build_data_source(config, dp_rank=0, dp_size=1))
    positions = torch.zeros_like(batch.input_ids)
    for row, cu in enumerate(batch.cu_seqlens):
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            positions[row, start:end] = torch.arange(end - start)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=positions, labels=batch.labels,
                    shift_labels=batch.labels, use_cache=False)
    assert out.aux_loss is not None and model.config.router_aux_loss_coef == COEF
    return float(out.loss)


@pytest.mark.parametrize("fused", [True, False])
def test_step_one_is_transformers_loss(pools, moe, tmp_path, fused: bool) -> None:
    """training.fused_loss = false (the model's own logits): the router logits come from the whole causal LM's
    forward instead of its body's."""
    corpus = text_corpus(tmp_path)
    args = hf_args(moe, corpus, tmp_path / "run", f"--training.fused_loss={str(fused).lower()}", steps=1)
    [one] = pools.get(1).run(run_recording, args)
    assert one["losses"][0] == pytest.approx(transformers_first_loss(args), rel=RTOL)
    assert one["router"][0] == pytest.approx(2.0, rel=0.1), one  # balanced top-2 routing gives k = 2
    assert 0.01 < COEF * one["router"][0] / one["losses"][0] < 0.1, "the router term matters"


def test_the_log_line_shows_the_router_loss(capsys) -> None:
    logger = MetricsLogger(enabled=True, total_steps=1)
    common = dict(step=1, loss=6.25, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, step_time_s=1.0,
                  peak_memory_mib=[1.0], cp_bytes_sent=0)
    logger.log(StepMetrics(**common, router_loss=2.0625), first_step=1)
    logger.log(StepMetrics(**common), first_step=1)
    with_router, without = capsys.readouterr().out.splitlines()
    assert "loss 6.2500  router_loss 2.0625  lr" in with_router and "router_loss" not in without
