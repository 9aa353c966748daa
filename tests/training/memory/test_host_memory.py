"""Host memory in the plan, the dry run and the pre-launch check (issue 40, item 3).

A CUDA rank keeps checkpointed block inputs (`activation_checkpoint.offload`) and, with
`training.offload_params`, its float32 parameter shards, their gradients and AdamW's moments in host
memory; the ranks of a node share its RAM, `job.host_memory_gib` or this node's. The plan and the checks
are pure functions of the config: no GPU and no process group here (a CUDA plan is asked for by
`device_type="cuda"`, and `torch.cuda.is_available` is patched where the config says cuda).
"""

from __future__ import annotations

import pytest
import torch

from cpcompose.config import ConfigError, load_config
from cpcompose.distributed import activation_checkpoint
from cpcompose.distributed.host_offload import HostCopy
from cpcompose.models.llama.model import Llama, LlamaConfig
from cpcompose.training.launcher.dry_run import describe_plan
from cpcompose.training.memory import budget
from cpcompose.training.memory.plan import GiB, HOST_PARTS, plan_memory

MODEL = ["--model.vocab_size=320", "--model.dim=48", "--model.n_layers=3", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_hidden_dim=96", "--training.fused_loss=true"]
OFFLOAD = ["--activation_checkpoint.mode=full", "--activation_checkpoint.offload=true"]
# Two ranks over cp = 2 (FSDP over them, so training.offload_params applies), both on one node.
CUDA_TWO_RANKS = [*MODEL, *OFFLOAD, "--training.device=cuda", "--training.memory_budget_gib=80", "--parallelism.cp=2",
                  "--training.seq_len=4000", "--training.batch_size=1", "--training.offload_params=true"]


def test_the_plans_block_inputs_are_what_offload_copies_to_host_memory(monkeypatch) -> None:
    """The own Llama's checkpointed blocks under offload, through the model's real `HostOffload` in its CPU form
    (ordinary memory, the same pieces and dedupe): the plan's "checkpointed block inputs" are the bytes it copied
    (each block's input, the rotary cos and sin once a forward), its "pinned-memory rounding" the pieces' total
    beyond them. Counted, not estimated: equal exactly."""
    rows, seq = 2, 100  # two unpacked rows share one row's rotary tables; 100 tokens: no size a power of two
    config = load_config([*MODEL, *OFFLOAD, f"--training.seq_len={seq}", f"--training.batch_size={rows}",
                          "--training.device=cpu"])
    m = config.model
    model = Llama(LlamaConfig(vocab_size=m.vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                              n_kv_heads=m.n_kv_heads, ffn_hidden_dim=m.ffn_hidden_dim, max_seq_len=seq))
    activation_checkpoint.apply_activation_checkpointing(model.layers.values(), offload=True)
    host = next(iter(model.layers.values()))._host_offload
    host.pin_memory = False
    monkeypatch.setattr(activation_checkpoint, "offloaded_saved_inputs", lambda *args, host: host.hooks())
    copies: list[HostCopy] = []
    copy_out = host._copy_out
    monkeypatch.setattr(host, "_copy_out", lambda t: copies.append(copy_out(t)) or copies[-1])
    model(torch.randint(0, m.vocab_size, (rows, seq))).sum().backward()

    host_parts = dict(plan_memory(config, 1, device_type="cuda").host_parts)
    assert len(copies) == m.n_layers + 2  # each block's input; cos and sin once
    copied = sum(c.nbytes for c in copies)
    assert host_parts["checkpointed block inputs"] == copied
    assert host_parts["pinned-memory rounding"] == sum(p.numel() for c in copies for p in c.pieces) - copied > 0
    assert dict(plan_memory(config, 1, device_type="cpu").host_parts)["checkpointed block inputs"] == 0


def test_offload_params_puts_shards_gradients_and_moments_in_host_memory_by_part(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = load_config(CUDA_TWO_RANKS)
    plan = plan_memory(config, 2, device_type="cuda")
    parts = dict(plan.host_parts)
    assert tuple(parts) == HOST_PARTS and plan.host_bytes == sum(parts.values())
    kept = plan_memory(load_config([*CUDA_TWO_RANKS, "--training.offload_params=false"]), 2, device_type="cuda")
    assert parts["parameter shards"] == parts["gradient shards"] == kept.part("parameters") > 0
    assert parts["AdamW moments"] == kept.part("optimizer state")


def test_a_node_whose_host_memory_cannot_hold_its_ranks_offload_is_refused_before_launch(monkeypatch) -> None:
    """`job.host_memory_gib` (the target's node) below what the node's 2 ranks keep: refused in one line naming
    the options that put the bytes there, the node's figure and where it comes from; above it: passes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = plan_memory(load_config(CUDA_TWO_RANKS), 2, device_type="cuda")
    need = plan.host_bytes * 2
    # short of the node's need by half of what offload_params puts there (the smaller share): either option off fits
    params = sum(b for name, b in plan.host_parts if name in ("parameter shards", "gradient shards", "AdamW moments"))
    small = (need - params) / GiB
    with pytest.raises(ConfigError) as refused:
        budget.check_memory(load_config([*CUDA_TWO_RANKS, f"--job.host_memory_gib={small}"]), 2)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("activation_checkpoint.offload, training.offload_params: the 2 ranks of this node "
                              f"would keep {need / GiB:.1f} GiB in host memory")
    assert f"but a node has {small:.1f} GiB (job.host_memory_gib {small:g} GiB)" in message
    # the 80 GiB GPU holds the tiny model without either: each is offered
    assert "try --activation_checkpoint.offload=false or --training.offload_params=false" in message
    budget.check_memory(load_config([*CUDA_TWO_RANKS, f"--job.host_memory_gib={need / GiB * 1.1}"]), 2)


def test_offload_is_suggested_only_where_the_node_can_hold_it(monkeypatch) -> None:
    """A CUDA run over its device budget, which checkpoint offload alone would fit on the device: offered when
    the node holds what its 2 ranks then keep on the host (0.94 GiB), not when a node has 0.5 GiB."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = [*MODEL, "--training.tiled_mlp=4", "--training.device=cuda", "--parallelism.cp=2",
            "--training.seq_len=1048576", "--training.batch_size=1", "--activation_checkpoint.mode=full"]
    kept = plan_memory(load_config(args), 2, device_type="cuda")
    offloaded = plan_memory(load_config([*args, "--activation_checkpoint.offload=true"]), 2, device_type="cuda")
    assert offloaded.total < kept.total and 0.5 * GiB < 2 * offloaded.host_bytes < 64 * GiB
    between = f"--training.memory_budget_gib={(kept.total + offloaded.total) / 2 / GiB}"
    roomy = budget.suggestions(load_config([*args, between, "--job.host_memory_gib=64"]), 2)
    assert roomy.startswith("try --activation_checkpoint.offload=true or ")
    assert "offload" not in budget.suggestions(load_config([*args, between, "--job.host_memory_gib=0.5"]), 2)


def test_the_dry_run_shows_host_memory_per_rank_by_part_and_per_node(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = load_config([*CUDA_TWO_RANKS, "--job.host_memory_gib=0.001"])
    plan = plan_memory(config, 2, device_type="cuda")
    text = describe_plan(config, 2)
    assert (f"offloaded to host memory: {plan.host_bytes / GiB:.3f} GiB per rank, {2 * plan.host_bytes / GiB:.3f} GiB "
            "for the 2 ranks of a node: DOES NOT FIT the node's 0.0 GiB (job.host_memory_gib 0.001 GiB)") in text
    for name, option in [("checkpointed block inputs", "activation_checkpoint.offload"),
                         ("pinned-memory rounding", "activation_checkpoint.offload"),
                         ("parameter shards", "training.offload_params"),
                         ("gradient shards", "training.offload_params"),
                         ("AdamW moments", "training.offload_params")]:
        assert f"    {name:<26} {dict(plan.host_parts)[name] / GiB:8.3f} GiB  ({option})" in text


def test_on_cpu_host_memory_gib_is_the_nodes_ram_in_the_one_budget(monkeypatch) -> None:
    """On CPU host and device are one memory: `job.host_memory_gib` divided by the node's ranks is the per-rank
    budget (unless training.memory_budget_gib), checked once, and the CUDA host check does nothing."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = [*MODEL, *OFFLOAD, "--training.device=cpu", "--parallelism.cp=2", "--training.seq_len=256",
            "--training.batch_size=1"]
    config = load_config([*args, "--job.host_memory_gib=0.5"])
    assert budget.memory_budget(config, 2) == budget.Budget(GiB // 4, "job.host_memory_gib 0.5 GiB / 2 ranks")
    assert plan_memory(config, 2, device_type="cpu").host_bytes == 0
    with pytest.raises(ConfigError, match=r"^memory: predicted .* > budget 0\.2 GiB \(job.host_memory_gib 0\.5 GiB"):
        budget.check_memory(config, 2)
    budget.check_memory(load_config([*args, "--job.host_memory_gib=64"]), 2)
    with pytest.raises(ConfigError, match=r"^job.host_memory_gib: must be a number of GiB >= 0"):
        load_config([*args, "--job.host_memory_gib=-1"])
