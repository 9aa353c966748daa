"""transformers MoE models with their experts split over ranks (EP) give one process's loss and gradients.

The matrix (`tests/support/ep_cases.py`): five tiny float64 families, 4 experts and 2 per token in 2 MoE
layers: Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA, a shared expert, group-limited routing with n_group = 2,
topk_group = 1 and a nonzero `e_score_correction_bias`), gpt-oss (attention sinks, sliding layers, its
transposed biased clamped experts) and Qwen3-Next (Gated DeltaNet beside gated attention, a gated shared
expert). Each runs at (ep, cp) in {(2, 1), (2, 2)} on 2 ranks and {(4, 1), (4, 2)} on 4 (ep folded out of
dp_shard x cp, so dp_shard = ranks / cp; Qwen3-MoE and gpt-oss also at ep = 2, cp = 2 on 4 ranks: efsdp = 2,
the experts FSDP-sharded over the two holders of each block), made parallel as the trainer does (experts swapped, FSDP2: the dense
layers over dp_shard x cp, the experts over `efsdp`), on a plain batch (each dp rank its rows, CP's zigzag)
and on packed documents (each dp rank its documents, `pack_batch`'s layout, the pack's padding left out of the
router loss), with `cp_cross_entropy` plus `cp_load_balancing_loss` (DeepSeek-V3: none, transformers has
none). The reference is transformers on one process over the whole batch, or each document alone; its router
loss is transformers' formula in float64 over every token (checked against transformers' own float32
`aux_loss` to 1e-6). The loss and every dense gradient (routers included) equal the reference's, and each
rank's expert gradients equal its block's rows. One pool launch per size runs all its cases.

Tolerance (tests/support/tolerance.py): float64's epsilon x the longest reduction (a weight gradient sums over
tokens x width <= 64 x 64 terms) x the reference's magnitude (every gradient at the model's largest: a router
gate's gradient cancels far below its terms); for DeepSeek-V3 and Qwen3-Next float32's epsilon x the tokens
(64), since they compute in float32 inside a float64 model (DeepSeek-V3's router; Qwen3-Next's norms and
delta rule), whose weight gradients sum over the tokens there.

Also: `verify` at cp = 2 x ep = 2 on each family as the trainer builds it; a class that declares no layout
is refused by name; gpt-oss's experts module alone against its own eager forward; each rank loads its
block of experts from a folder, bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as hf
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import cpcompose.integrations.transformers as cphf
from cpcompose.comm import CPGroup
from cpcompose.distributed import ParallelDims
from cpcompose.integrations.transformers.expert_parallel import (
    ExpertParallelExperts,
    expert_blocks,
    apply_expert_parallel,
)
from tests.support import ep_cases
from tests.support.tolerance import assert_close

VOCAB, EXPERTS, TOP_K = 64, 4, 2
AUX = 0.25  # the router loss's coefficient, far above transformers' 0.001 so its gradient is visible
# (ep, cp, families: None for all) per pool, dp_shard = ranks / cp; the last on 4 ranks has efsdp = 2 (each block
# of experts FSDP-sharded over the 2 ranks that hold it), which does not depend on the family: two layouts
MATRIX_SPLITS = {2: [(2, 1, None), (2, 2, None)],
                 4: [(4, 1, None), (4, 2, None), (2, 2, ("qwen3_moe", "gpt_oss"))]}
MATRIX_TERMS = ep_cases.ROWS * ep_cases.SEQ * 64  # a weight gradient: every token x a width <= 64
TOKEN_TERMS = ep_cases.ROWS * ep_cases.SEQ  # a float32 weight gradient: a sum over the tokens
# families that compute in float32 inside the float64 model, whatever its dtype: DeepSeek-V3's router (a
# routing weight one float32 rounding apart moves its token's whole contribution), Qwen3-Next's norms and
# Gated DeltaNet kernel
FLOAT32_INSIDE = {"deepseek_v3", "qwen3_next"}


def _config(router_loss: bool) -> hf.Qwen3MoeConfig:
    return hf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, output_router_logits=router_loss,
        router_aux_loss_coef=AUX,
    )


@functools.cache
def _references() -> tuple[dict[tuple[str, str], dict], dict[str, dict]]:
    """Every family's one-process runs, plain and packed, and its weights (the same for both): computed once
    for both pools."""
    wants, states = {}, {}
    for name in ep_cases.FAMILIES:
        for kind in ep_cases.KINDS:
            wants[name, kind], states[name] = ep_cases.reference(name, kind)
    return wants, states


def _tolerance(family: str) -> dict:
    """The derived tolerance of one family's values (module docstring)."""
    if family in FLOAT32_INSIDE:
        return {"terms": TOKEN_TERMS, "dtype": torch.float32}
    return {"terms": MATRIX_TERMS}


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_expert_parallel_matrix_equals_one_process(pools, world: int) -> None:
    """Five families x (ep, cp) x plain and packed, FSDP2 on, the router loss on where transformers has one:
    the loss and every gradient (router gates included) equal one process's in float64."""
    wants, states = _references()
    splits = MATRIX_SPLITS[world]
    per_rank = pools.get(world).run(ep_cases.matrix_case, splits, states, timeout=900)
    failures = []
    for (name, kind), want in wants.items():
        if want["hf_aux"] is not None:  # the float64 formula is transformers' own (which rounds to float32)
            assert abs(want["hf_aux"] - want["aux"]) <= 1e-6 * abs(want["aux"]), (name, want["hf_aux"], want["aux"])
        largest = max(g.abs().max().item() for g in want["grads"].values())
        gates = [n for n in want["grads"] if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
        assert len(gates) == 2 and all(want["grads"][n].abs().max() > 0 for n in gates), (name, gates)
        for ep, cp, only in splits:
            if only is not None and name not in only:
                continue
            for rank, results in enumerate(per_rank):
                got = results[ep, cp, name, kind]
                at = f"{name} {kind} ep={ep} cp={cp} rank {rank}"
                assert got["swapped"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], at
                checks = [("loss", got["loss"], want["loss"], _tolerance(name))]
                first, count = (rank % ep) * EXPERTS // ep, EXPERTS // ep
                for param, grad in got["grads"].items():
                    expected = want["grads"][param]
                    if param.rpartition(".")[0] in got["blocks"]:
                        assert got["blocks"][param.rpartition(".")[0]] == (first, count), at
                        expected = expected[first:first + count]
                    checks.append((param, grad, expected, {**_tolerance(name), "scale": largest}))
                if rank == 0:
                    assert got["grads"].keys() == want["grads"].keys(), at
                for what, actual, expected, tol in checks:
                    try:
                        assert_close(actual, expected, **tol)
                    except AssertionError as e:
                        failures.append(f"{at} {what}: {str(e).splitlines()[0:4]}")
    assert not failures, "\n".join(failures)


def test_the_probe_proves_a_model_with_expert_parallel_experts(pools) -> None:
    """`verify` at cp = 2 x ep = 2 (the EP modules' exchanges run in the probe's one-process and CP runs alike, in
    one order on every rank): each family passes as the trainer builds it (its config asking for the router
    loss, whose `aux_loss` the probe leaves out: under CP it is each shard's own statistic, EP or not), and a
    token mixer that is not CP-aware is still named with the experts in their EP form."""
    per_rank = pools.get(2).run(ep_cases.probe_case)
    assert len(per_rank[0]) == len(ep_cases.FAMILIES) + 3
    for rank, got in enumerate(per_rank):
        for (name, ep, sharded, mixer), message in got.items():
            at = f"rank {rank} {name} ep={ep} fsdp={sharded}"
            if mixer:
                assert "module 'model.norm' (_SequenceSum) computes something else under CP" in message, (at, message)
            else:
                assert message == "ok", (at, message)


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
