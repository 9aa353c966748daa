"""Hugging Face causal LMs cut into pipeline stages and run by torch's schedules at pp = 2 x cp = 2 (rank pool cases).

`reference` is transformers on one process, float64, over the whole batch; `pipeline_case` runs every
(family, schedule) on a 4-rank pool: a (pp, cp) mesh, the model cut into this rank's stages
(`split_causal_lm`), each stage's forward inside a CP region of its own (as the trainer's `StageModule` enters
it), activation checkpointing re-entering that region in the recomputation (`recompute_context`), torch's
`PipelineStage` and schedule over the pp group with 4 microbatches, `cp_cross_entropy` over the cp group with the
batch's global token count, and the gradients summed over the cp group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers as hf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

import cpcompose.integrations.transformers  # noqa: F401  (registers attn_implementation="cpcompose")
from cpcompose import context_parallel, cp_cross_entropy
from cpcompose.comm import all_reduce
from cpcompose.distributed import apply_activation_checkpointing
from cpcompose.distributed.pipeline import PIPELINE_SCHEDULES, SINGLE_STAGE_SCHEDULES, stage_ids
from cpcompose.integrations.transformers.pipeline import split_causal_lm
from cpcompose.layouts import ZigzagLayout
from cpcompose.parallel import allreduce_gradients, recompute_context

PP, CP, ROWS, SEQ, VOCAB, LAYERS, MICROBATCHES = 2, 2, 4, 32, 64, 4, 4
SCHEDULES = PIPELINE_SCHEDULES  # every schedule by its name, torch's classes
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
CONFIGS = {
    "llama": lambda: hf.LlamaConfig(**_COMMON),
    "qwen3": lambda: hf.Qwen3Config(**_COMMON, head_dim=8),
    "qwen3_next": lambda: hf.Qwen3NextConfig(  # Gated DeltaNet and gated attention layers, alternating; MoE MLPs
        **_COMMON, head_dim=8, layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16),
}


def build(family: str, impl: str, state: dict | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=impl, dtype=torch.float64,
                                                experts_implementation="eager")
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `(ROWS, SEQ)` and their targets (some ignored, so the global count matters)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    targets[0, :5] = -100
    return ids, targets


def reference(family: str) -> tuple[dict, dict]:
    """transformers on one process (sdpa, float64): the mean loss and every gradient; and the weights."""
    model = build(family, "sdpa")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, targets = batch()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, state


class _InRegion(nn.Module):
    """A stage run inside a CP region of its own, as the trainer's `StageModule` runs it."""

    def __init__(self, body: nn.Module, cp_mesh: Any) -> None:
        super().__init__()
        self.body, self.__dict__["cp_mesh"] = body, cp_mesh

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with context_parallel(self.cp_mesh, strategy="alltoall", verify=False):
            return self.body(x, position_ids)


def pipeline_case(mesh: Any, cases: list[tuple[str, str]], states: dict[str, dict]) -> dict:
    """Every (family, schedule) of `cases` on this rank: the loss (summed over the mesh) and this rank's gradients
    summed over cp, under their full names."""
    del mesh
    grid = init_device_mesh("cpu", (PP, CP), mesh_dim_names=("pp", "cp"))
    pp_rank, cp_rank = grid["pp"].get_local_rank(), grid["cp"].get_local_rank()
    layout = ZigzagLayout(CP)
    out = {}
    for family, schedule in cases:
        model = build(family, "cpcompose", states[family])
        single = schedule in SINGLE_STAGE_SCHEDULES
        ids = stage_ids(schedule, PP, pp_rank, 1 if single else 2)
        num_stages = PP * len(ids)
        bodies = split_causal_lm(model, num_stages=num_stages, stages=ids)
        apply_activation_checkpointing([layer for body in bodies for layer in body.layers.values()],
                                       context_fn=recompute_context)
        stages = [PipelineStage(_InRegion(body, grid["cp"]), stage_index=s, num_stages=num_stages,
                                device=torch.device("cpu"), group=grid["pp"].get_group())
                  for body, s in zip(bodies, ids)]
        tokens, targets = batch()
        count = (targets != -100).sum().double()
        tokens, labels = (layout.shard(t, 1, cp_rank).contiguous() for t in (tokens, targets))
        positions = layout.position_ids(cp_rank, SEQ).expand(ROWS, -1).contiguous()

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return cp_cross_entropy(logits, labels, mesh=grid["cp"], num_tokens=count)

        run = SCHEDULES[schedule](stages[0] if single else stages, MICROBATCHES, loss_fn=loss_fn,
                                  scale_grads=False)
        losses: list[torch.Tensor] = []
        run.step(*((tokens,) if 0 in ids else ()), target=labels if num_stages - 1 in ids else None, losses=losses,
                 position_ids=positions)
        allreduce_gradients(model, grid["cp"])
        total = sum((x.detach() for x in losses), torch.zeros((), dtype=torch.float64))
        all_reduce(total)  # the last stage's shares, over cp and pp
        out[family, schedule] = {"loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                                          if p.grad is not None},
                                 "held": sorted(n for n, _ in model.named_parameters())}
    return out
