"""The trainer trains a MoE model's router loss (`output_router_logits = true`) exactly under CP and EP (issue 38).

A tiny float32 Qwen3-MoE (4 experts, 2 per token, 2 MoE layers, the router randomised) with
`output_router_logits = true` and `router_aux_loss_coef = 0.1` (a hundred times transformers' default, so the term
is ~3% of the loss and its gradient moves the routers), trained 4 steps on packed text: at cp = 2 x ep = 2 on 2
ranks and at cp = 1 on one process. The load-balancing loss is a product of two sums over every token of the
micro-batch; each CP rank holds a quarter of the pack's tokens, so the sums are pooled over dp x cp first
(`cp_load_balancing_loss`); the pack's padding document (which one process's batch does not have, and whose
length depends on cp) is left out.

Checked: each step's train/loss (the total) and train/router_loss, logged to TensorBoard, agree between the two
runs, and step 1's total equals transformers' own `model(input_ids, labels=...).loss` on one process for the same
batch (the language-model loss plus `router_aux_loss_coef x aux_loss`, its documents kept apart by their
position ids, transformers' packed-sequence mask).

Tolerance, relative 1e-4 (float32): step 1 differs only by summation order (attention merged through its LSE,
the experts' rows, the token sums of the cross-entropy and of the router statistics, all float32), ~1e-7 relative
on a loss of ~6; later steps add AdamW's update, bounded as in test_expert_parallel.py (lr 3e-3 times the relative
error of a gradient: orders below 1e-4 here). Measured: at most 1.2e-7 relative over the 4 steps' losses and
router losses, and step 1 at cp = 1 equal to transformers' to the last bit. A top-2 choice flipped by those bits,
or a router loss over part of the batch instead of the whole micro-batch, moves the router loss by far more
(measured: the mean of the batch's two rows' own losses is 6e-3 relative off the whole batch's). Gradient norms
agree to 1e-5 relative: the router loss's gradient is in them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpcompose.config import load_config
from cpcompose.data import build_data_source
from cpcompose.training.loop.metrics import MetricsLogger, StepMetrics
from cpcompose.training.loop.trainer import Trainer
from tests.support.hf_trainer import hf_args, make_qwen3_moe, text_corpus

RTOL = 1e-4
NORM_RTOL = 1e-5
COEF = 0.1


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe_router"), output_router_logits=True,
                          router_aux_loss_coef=COEF)


def run_recording(mesh, args: list[str]) -> dict:  # noqa: ANN001
    """The trainer's run on every rank: per step its loss, router loss and gradient norm; TensorBoard's scalars."""
    trainer = Trainer(load_config(args))
    router, norms, step = [], [], trainer.train_step

    def recorded() -> float:
        loss = step()
        router.append(trainer.router_loss)
        norms.append(trainer.grad_norm)
        return loss

    trainer.train_step = recorded  # type: ignore[method-assign]
    losses = trainer.run()
    logged = {}
    if mesh.get_rank() == 0 and trainer.config.metrics.enable_tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(Path(trainer.config.job.dump_folder) / trainer.config.metrics.save_tb_folder))
        events.Reload()
        logged = {name: [e.value for e in events.Scalars(name)] for name in ("train/loss", "train/router_loss")}
    return {"losses": losses, "router": router, "norms": norms, "logged": logged}


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


def test_cp2_ep2_router_loss_matches_one_process(pools, moe, tmp_path) -> None:
    corpus = text_corpus(tmp_path)
    tb = "--metrics.enable_tensorboard=true"
    [one] = pools.get(1).run(run_recording, hf_args(moe, corpus, tmp_path / "one", tb))
    two = pools.get(2).run(run_recording, hf_args(moe, corpus, tmp_path / "two", tb, "--parallelism.cp=2",
                                                  "--parallelism.ep=2"))
    for got in two:
        assert got["losses"] == two[0]["losses"] and got["router"] == two[0]["router"] and len(got["losses"]) == 4
    got = two[0]
    for step in range(4):
        assert got["losses"][step] == pytest.approx(one["losses"][step], rel=RTOL), (step, got, one)
        assert got["router"][step] == pytest.approx(one["router"][step], rel=RTOL), (step, got, one)
        assert got["norms"][step] == pytest.approx(one["norms"][step], rel=NORM_RTOL), (step, got, one)
    for run in (one, got):  # what TensorBoard holds: the total, and the router loss beside it
        assert run["logged"]["train/loss"] == pytest.approx(run["losses"], rel=1e-6)
        assert run["logged"]["train/router_loss"] == pytest.approx(run["router"], rel=1e-6)
    assert 0.01 < COEF * one["router"][0] / one["losses"][0] < 0.1, "the router term matters"
    want = transformers_first_loss(hf_args(moe, corpus, tmp_path / "ref"))
    assert one["losses"][0] == pytest.approx(want, rel=RTOL), (one["losses"][0], want)


def test_the_unfused_loss_adds_it_too(pools, moe, tmp_path) -> None:
    """training.fused_loss = false (the model's own logits): the router logits come from the whole causal LM's
    forward instead of its body's; step 1 is transformers' loss as well."""
    corpus = text_corpus(tmp_path)
    args = hf_args(moe, corpus, tmp_path / "unfused", "--training.fused_loss=false", steps=1)
    [one] = pools.get(1).run(run_recording, args)
    assert one["losses"][0] == pytest.approx(transformers_first_loss(args), rel=RTOL)
    assert one["router"][0] == pytest.approx(2.0, rel=0.1), one  # balanced top-2 routing gives k = 2


def test_the_log_line_shows_the_router_loss(capsys) -> None:
    logger = MetricsLogger(enabled=True, total_steps=1)
    common = dict(step=1, loss=6.25, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, step_time_s=1.0,
                  peak_memory_mib=[1.0], cp_bytes_sent=0)
    logger.log(StepMetrics(**common, router_loss=2.0625), first_step=1)
    logger.log(StepMetrics(**common), first_step=1)
    with_router, without = capsys.readouterr().out.splitlines()
    assert "loss 6.2500  router_loss 2.0625  lr" in with_router and "router_loss" not in without
