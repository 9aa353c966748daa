"""A transformers MoE model with its experts split over ranks (EP) gives one process's loss and gradients.

A tiny float64 Qwen3-MoE (4 experts, 2 per token, 2 MoE layers) is built once; its reference is transformers
on one process over the whole batch (experts "eager": the grouped GEMM refuses float64; attention "sdpa").
On 2 ranks `apply_expert_parallel` swaps both experts modules for their EP form (rank r keeps experts
`[2r, 2r + 2)`), in two splits of the tokens:

* ep = 2, cp = 1: each rank its own row of the batch (data parallel over the EP group);
* cp = 2 x ep = 2 on the same ranks (ep folded out of cp): the whole batch on both, the sequence dealt by
  `context_parallel` (zigzag), the experts by EP.

The loss is `cp_cross_entropy` (a token sum over the global count), summed over the ranks; the dense
parameters' gradients (router gates included) are summed over the ranks; each expert's gradient is read on
its owner alone (dispatch's backward already brought every rank's tokens to it) and equals the reference's
slice; with the router's load-balancing loss on, `cp_load_balancing_loss` adds its share on each rank (the
reference adds the same loss in float64, checked against transformers' own float32 `aux_loss` to 1e-6).
Loading: a float32 Qwen3-MoE folder (save_pretrained's one tensor per expert and projection, and the same
weights stored stacked) built on the meta device, swapped to its EP form, FSDP-sharded as the trainer does
(the experts over the expert mesh's `efsdp` axis, size 1 here; the rest over both ranks) and read from the
folder: each rank's experts equal rows `[2r, 2r + 2)` of `from_pretrained`'s, every other tensor equals it whole
(bit for bit: copies, no arithmetic).
A second layout, gpt-oss's experts (transposed, biased, interleaved, clamped), is checked as a module alone
against its own eager forward on each rank's tokens.

Tolerance (tests/support/tolerance.py): float64's epsilon x the longest reduction (a weight gradient sums over
batch x sequence x width <= 64 terms) x the reference's magnitude (every gradient at the model's largest
gradient: a router gate's gradient cancels far below its terms); what is left is summation order. The
router's softmax runs in float32 inside transformers' float64 model, identically in both runs (its inputs
agree to float64 rounding, which a float32 rounding almost never sees).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import cpcompose.integrations.transformers as cphf
from cpcompose import context_parallel, cp_cross_entropy
from cpcompose.comm import CPGroup
from cpcompose.distributed import ParallelDims
from cpcompose.integrations.transformers.expert_parallel import (
    ExpertParallelExperts,
    expert_blocks,
    apply_expert_parallel,
    expert_parameter_names,
)
from cpcompose.parallel import cp_load_balancing_loss
from tests.support.tolerance import assert_close

BATCH, SEQ, VOCAB, EXPERTS, TOP_K = 2, 16, 64, 4, 2
TERMS = BATCH * SEQ * 64
AUX = 0.25  # the router loss's coefficient, far above transformers' 0.001 so its gradient is visible


def _config(router_loss: bool) -> hf.Qwen3MoeConfig:
    return hf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, output_router_logits=router_loss,
        router_aux_loss_coef=AUX,
    )


def _build(attn: str, router_loss: bool, state: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(_config(router_loss), attn_implementation=attn,
                                                dtype=torch.float64, experts_implementation="eager")
    if state is None:  # transformers zeroes the router's weight at init: random, so the routing is not uniform
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5)
    else:
        model.load_state_dict(state)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid counts per rank: the global count matters
    return ids, cphf.shift_labels(labels)


def _switch_loss(router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (no mask) in float64, where transformers sums in float32."""
    probs = [F.softmax(x, dim=-1) for x in router_logits]
    chosen = torch.cat([p.topk(TOP_K, dim=-1).indices.reshape(-1) for p in probs])
    counts = torch.bincount(chosen, minlength=EXPERTS).to(torch.float64)
    prob_sum = sum(p.sum(0) for p in probs)
    rows = sum(p.shape[0] for p in probs)
    return EXPERTS * torch.sum(counts / rows * prob_sum / rows)


def _reference(router_loss: bool) -> tuple[dict, dict]:
    model = _build("sdpa", router_loss)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, targets = _batch()
    out = model(input_ids=ids, use_cache=False)
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    hf_aux = None
    if router_loss:
        aux = _switch_loss(out.router_logits)
        hf_aux = (out.aux_loss.item(), aux.item())
        loss = loss + AUX * aux
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "hf_aux": hf_aux}, state


def _step(mesh, state: dict, router_loss: bool, split: str) -> dict:
    """One forward and backward of the EP model; `split`: "batch" (rank r its row r) or "sequence" (CP)."""
    cp = split == "sequence"
    model = _build("cpcompose" if cp else "sdpa", router_loss, state)
    swapped = apply_expert_parallel(model, mesh)
    ids, targets = _batch()
    rank = mesh.get_local_rank()
    if cp:
        positions = torch.arange(SEQ)[None].expand(BATCH, -1).clone()
        region = context_parallel(mesh, buffers=[ids, targets, positions], buffer_seq_dims=[1, 1, 1], verify=False)
    else:
        ids, targets, positions = ids[rank:rank + 1], targets[rank:rank + 1], None
        region = torch.enable_grad()  # no CP region: the batch rows are split by hand
    with region:
        out = model(input_ids=ids, position_ids=positions, use_cache=False)
        loss = cp_cross_entropy(out.logits, targets, mesh=mesh)
        if router_loss:
            loss = loss + AUX * cp_load_balancing_loss(out.router_logits, num_experts=EXPERTS, top_k=TOP_K, mesh=mesh)
        loss.backward()
    experts = expert_parameter_names(model)
    dense = [p for n, p in model.named_parameters() if n not in experts]
    flat = torch.cat([p.grad.reshape(-1) for p in dense])
    dist.all_reduce(flat, group=mesh.get_group())
    for p, g in zip(dense, flat.split([p.numel() for p in dense])):
        p.grad.copy_(g.view_as(p))
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    blocks = {n: (m.first_expert, m.num_local_experts) for n, m in model.named_modules()
              if isinstance(m, ExpertParallelExperts)}
    return {"loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "experts": experts,
            "swapped": swapped, "blocks": blocks}


@pytest.mark.parametrize("router_loss", [False, True], ids=["lm-loss", "router-loss"])
@pytest.mark.parametrize("split", ["batch", "sequence"], ids=["ep2-rows", "cp2xep2"])
def test_expert_parallel_equals_one_process(pools, split: str, router_loss: bool) -> None:
    want, state = _reference(router_loss)
    if router_loss:  # the float64 formula is transformers' own (which rounds to float32)
        hf_aux, aux = want["hf_aux"]
        assert abs(hf_aux - aux) <= 1e-6 * abs(aux), (hf_aux, aux)
    largest = max(g.abs().max().item() for g in want["grads"].values())
    per_rank = pools.get(2).run(_step, state, router_loss, split)
    for rank, got in enumerate(per_rank):
        assert got["swapped"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert len(got["experts"]) == 4 and len(got["grads"]) == len(want["grads"])
        assert_close(got["loss"], want["loss"], terms=TERMS, msg=lambda m: f"rank {rank} loss: {m}")
        for name, grad in got["grads"].items():
            expected = want["grads"][name]
            if name in got["experts"]:  # this rank's block of the stacked experts
                first, count = got["blocks"][name.rpartition(".")[0]]
                assert (first, count) == (2 * rank, 2)
                expected = expected[first:first + count]
            assert_close(grad, expected, terms=TERMS, scale=largest, msg=lambda m: f"rank {rank} {name}: {m}")
    gates = [n for n in want["grads"] if n.endswith("mlp.gate.weight")]
    assert gates and all(want["grads"][n].abs().max() > 0 for n in gates), "the router gates must get a gradient"


def test_an_undeclared_layout_is_refused_by_name() -> None:
    """Refused before any communication: the class is named, and a refused model is left as it was."""
    config = hf.Llama4TextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, intermediate_size_mlp=16,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                 num_local_experts=2, moe_layers=[0])
    model = hf.AutoModelForCausalLM.from_config(config)
    before = {n: type(m).__name__ for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"^Llama4TextExperts: its layout is not declared"):
        apply_expert_parallel(model, CPGroup(group=None, rank=0, world=2))  # type: ignore[arg-type]
    assert {n: type(m).__name__ for n, m in model.named_modules()} == before


GPT_OSS_TOKENS = (6, 3)  # per rank: uneven


def _gpt_oss_experts() -> torch.nn.Module:
    """gpt-oss's experts alone: transposed `(E, in, out)`, per-expert biases, gate and up interleaved, the
    clamped SwiGLU (limit lowered so the clamps act), random weights and biases."""
    config = hf.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=EXPERTS,
                             num_experts_per_tok=TOP_K, swiglu_limit=1.0)
    config._experts_implementation = "eager"
    module = GptOssExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return module.to(torch.float64)


def _gpt_oss_tokens(rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10 + rank)
    n = GPT_OSS_TOKENS[rank]
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
    return (torch.randn(n, 16, generator=g, dtype=torch.float64), index,
            torch.rand(n, TOP_K, generator=g, dtype=torch.float64), torch.randn(n, 16, generator=g, dtype=torch.float64))


def _experts_step(module: torch.nn.Module, rank: int) -> dict:
    hidden, index, weights, cotangent = _gpt_oss_tokens(rank)
    hidden.requires_grad_()
    weights.requires_grad_()
    out = module(hidden, index, weights)
    out.backward(cotangent)
    return {"out": out.detach(), "dhidden": hidden.grad, "dweights": weights.grad,
            **{n: p.grad for n, p in module.named_parameters()}}


def gpt_oss_case(mesh) -> dict:  # noqa: ANN001
    module = ExpertParallelExperts(_gpt_oss_experts(), mesh)
    return {"names": sorted(n for n, _ in module.named_parameters()), **_experts_step(module, mesh.get_local_rank())}


def test_a_transposed_biased_layout_keeps_its_block_and_activation(pools) -> None:
    """gpt-oss's experts module alone on 2 ranks equals its own eager forward on each rank's tokens; each
    expert's weights and biases, on their owner, get the gradient of both ranks' tokens."""
    module = _gpt_oss_experts()
    alone = []
    for rank in range(2):
        module.zero_grad(set_to_none=True)
        alone.append(_experts_step(module, rank))
    terms = 16 + 8 + sum(GPT_OSS_TOKENS) * TOP_K
    for rank, got in enumerate(pools.get(2).run(gpt_oss_case)):
        assert got["names"] == ["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"]
        for key, want in alone[rank].items():
            if key in got["names"]:
                want = (alone[0][key] + alone[1][key])[2 * rank:2 * rank + 2]
            assert_close(got[key], want, terms=terms, msg=lambda m: f"rank {rank} {key}: {m}")


def _moe_folder(root, stacked: bool):  # noqa: ANN001, ANN202
    """A float32 Qwen3-MoE folder, the router random (transformers zeroes it): save_pretrained's per-expert tensors,
    or (`stacked`) the model's own stacked tensors in their place."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(_config(False), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    folder = root / ("stacked" if stacked else "per-expert")
    model.save_pretrained(folder)
    if stacked:
        save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
    return folder


def load_expert_blocks(mesh, folder) -> dict:  # noqa: ANN001
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, world_size=2, ep=2)
    experts_mesh = dims.build_expert_mesh(dims.build_mesh("cpu"))
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(folder), dtype=torch.float32)
    plan = cphf.weight_plan(model, folder)
    apply_expert_parallel(model, experts_mesh["ep"])
    blocks = expert_blocks(model)
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=experts_mesh["efsdp"])
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    cphf.init_non_persistent_buffers(model)
    restricted = plan.of_expert_blocks(blocks)
    cphf.load_pretrained_weights(model, folder, restricted)
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return {"weights": whole, "blocks": blocks, "stacked": sorted(plan.stacked)}


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_each_rank_loads_its_block_of_experts(pools, tmp_path, stacked: bool) -> None:  # noqa: ANN001
    folder = _moe_folder(tmp_path, stacked)
    want = dict(hf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    for rank, got in enumerate(pools.get(2).run(load_expert_blocks, folder)):
        assert bool(got["stacked"]) != stacked  # save_pretrained's folder is read through the converter
        assert got["weights"].keys() == want.keys()
        assert sorted(got["blocks"]) == sorted(n for n in want if ".experts." in n) and len(got["blocks"]) == 4
        for name, tensor in got["weights"].items():
            expected = want[name][2 * rank:2 * rank + 2] if name in got["blocks"] else want[name]
            assert got["blocks"].get(name, (2 * rank, 2)) == (2 * rank, 2)
            assert torch.equal(tensor, expected), (rank, name)
        assert any(want[n].abs().max() > 0 for n in want if n.endswith("mlp.gate.weight"))
