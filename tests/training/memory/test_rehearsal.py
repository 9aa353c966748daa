"""The rehearsal: one real step on fake tensors and a fake process group, torch's tracker against the plan.

Runs in fresh interpreters (the fake process group must be the only one; each rehearsal makes and destroys its
own, so one interpreter runs several in turn). A small Llama with FSDP over dp_shard=2 x cp=2 and bf16 mixed
precision: the tracker must see every kind of tensor the plan counts (sharded parameters, the optimizer's state,
activations, gathered units), and the plan's tensors must be within 10% of the tracker's peak, the issue's claim
(measured: +5.6%); the same step with every offload on one rank (one GPU: `training.offload_params` makes FSDP2
over that rank, so the tracker names the host's kinds and they leave the peak; measured +0.7%). Tiny Hugging
Face Qwen3 and Qwen3-Next models (from a config.json alone) are rehearsed through the dry run's option, which
prints the tracker beside the plan; the plan must be within 10% there too; and a tiny Qwen3-MoE at
parallelism.ep = 2 (its dispatch runs on fake tensors with the routing assumed even:
`comm.rehearsing`), and a tiny DeepSeek-V3 at ep = 2 (its profile: latent attention, the grouped router, a shared
expert), and a tiny Mixtral at ep = 2. Pipelined steps (pp = 2 x cp = 2 x dp_shard = 2) are rehearsed per pipeline
rank, its stages in its schedule's order: Interleaved 1F1B and ZBV zero bubble, the plan within 10% of the
tracker for the rank with the largest planned peak (measured: +1.1% on rank 1, -1.7% on rank 0; the trainer keeps
no logits past a microbatch's backward, and the rehearsal collects the tracker's reference cycles after each "W").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as hf

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--model.vocab_size=4096", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4",
         "--model.n_kv_heads=2", "--model.ffn_hidden_dim=768", "--parallelism.cp=2", "--parallelism.dp_shard=2",
         "--training.seq_len=1024", "--training.batch_size=2", "--training.mixed_precision=bfloat16"]
SCRIPT = """
import json, sys
from cpcompose.config import load_config
from cpcompose.training.memory.rehearsal import rehearse
results = {}
for name, (args, world) in json.loads(sys.argv[1]).items():  # one interpreter: each rehearsal makes and destroys
    r = rehearse(load_config(args), world)                     # its own group
    results[name] = {"tracked": r.tracked, "planned": r.planned, "by_kind": r.by_kind}
print(json.dumps(results))
"""


# What a GPU keeps in host memory, taken out of the tracker's peak as the GPU would (4 blocks: the plan keeps two
# checkpointed inputs on the device, the one being saved and the one restored), with the tiled MLP's route-around.
OFFLOADED = ["--model.n_layers=4", "--training.tiled_mlp=4", "--activation_checkpoint.mode=full",
             "--activation_checkpoint.offload=true", "--training.offload_params=true"]


ONE_RANK = ["--parallelism.cp=1", "--parallelism.dp_shard=1", "--training.batch_size=1"]
"""One GPU: offload_params makes FSDP2 over one rank, whose tracker names the host's kinds as over many."""
SMALL_STEPS = {"on-device": (SMALL, 4), "offloaded": (SMALL + OFFLOADED, 4),
               "offloaded on one rank": (SMALL + OFFLOADED + ONE_RANK, 1)}


@pytest.fixture(scope="module")
def small_steps() -> dict:
    """Both small steps rehearsed in one fresh interpreter: {name: {tracked, planned, by_kind}}."""
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(SMALL_STEPS)], capture_output=True, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(SMALL_STEPS))
def test_the_plan_is_within_10_percent_of_torchs_tracker_on_a_small_fsdp_cp_bf16_step(name: str,
                                                                                      small_steps: dict) -> None:
    got, extra = small_steps[name], name.startswith("offloaded")
    kinds = got["by_kind"]
    if extra:  # the shards, their gradients and AdamW's state are in host memory: not in the device's peak
        assert not {"Sharded Param", "Sharded Grad", "OptState"} & kinds.keys(), kinds
        assert min(kinds["Activation"], kinds["Unsharded Param"]) > 0, kinds
    else:
        assert min(kinds["Sharded Param"], kinds["OptState"], kinds["Activation"], kinds["Unsharded Param"]) > 0, kinds
    assert abs(got["planned"] - got["tracked"]) <= 0.10 * got["tracked"], (got["planned"], got["tracked"], kinds)


TINY_HF = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, intermediate_size=768, max_position_embeddings=4096, tie_word_embeddings=False)
TINY_CONFIGS = {
    "qwen3": lambda: hf.Qwen3Config(**TINY_HF),
    "qwen3_next": lambda: hf.Qwen3NextConfig(  # one Gated DeltaNet layer, one gated attention layer, MoE in both
        **TINY_HF, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
    # expert parallelism: ep = 2 over dp_shard x cp = 4, each rank 2 of the 4 experts (sharded over efsdp = 2), the
    # dispatch on fake tensors with its routing assumed even (measured: +0.0%, +3.5% at ep = 1)
    "qwen3_moe": lambda: hf.Qwen3MoeConfig(**TINY_HF, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
    # Mixtral: Mistral's attention, experts in every layer, at ep = 2 (measured: -4.5%; bf16 -7.8%; float32 at ep = 1
    # without checkpointing -9.5%)
    "mixtral": lambda: hf.MixtralConfig(**{**TINY_HF, "intermediate_size": 128}, num_local_experts=4,
                                        num_experts_per_tok=2),
    # DeepSeek-V3's profile (MLA, a dense layer then a MoE one with the grouped sigmoid router and a shared expert)
    # at ep = 2, bf16 as it trains (measured: -7.4%; float32 +13.9%, CP's K/V buffers counted at the keys' width for
    # the narrower values too)
    "deepseek_v3": lambda: hf.DeepseekV3Config(
        **{**{k: v for k, v in TINY_HF.items() if k != "head_dim"}, "num_key_value_heads": 4}, q_lora_rank=64,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=16, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=64),
}
EXTRA = {"qwen3_moe": ["--parallelism.ep=2"], "mixtral": ["--parallelism.ep=2"], "deepseek_v3": ["--parallelism.ep=2"]}


# The mixture of experts in float32: its grouped matmul's meta kernel takes bfloat16 only, the kernels float32 too
# (before, the rehearsal ended in a 189-line traceback where the model trains).
PRECISION = {"qwen3": "bfloat16", "qwen3_next": "float32", "qwen3_moe": "float32", "mixtral": "float32",
             "deepseek_v3": "bfloat16"}


PIPELINED_HF = "qwen3 under pp"
"""The dry run of `dry_runs` that pipelines a Hugging Face model."""
# One interpreter rehearses every family in turn (each rehearsal makes and destroys its own fake process group):
# the interpreter's start and the imports, 4 s a family on this machine, are paid once.
SCRIPT_DRY_RUNS = """
import contextlib, io, json, sys
from cpcompose.train import main
outputs = {}
for family, args in json.loads(sys.argv[1]).items():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    outputs[family] = {"code": code, "out": out.getvalue()}
print(json.dumps(outputs))
"""


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each tiny family's dry run with its rehearsal, from its config.json alone: {family: {code, out}}."""
    folder = tmp_path_factory.mktemp("tiny_hf")
    runs = {}
    for family, config in sorted(TINY_CONFIGS.items()):
        config().save_pretrained(folder / family)
        runs[family] = ["--model.name=hf", f"--model.path={folder / family}", "--parallelism.cp=2",
                        "--parallelism.dp_shard=2", "--training.seq_len=1024", "--training.batch_size=2",
                        f"--training.mixed_precision={PRECISION[family]}", "--activation_checkpoint.mode=full",
                        "--job.dry_run", "--job.rehearse", *EXTRA.get(family, [])]
    # A Hugging Face model under pp (4 = pp 2 x cp 2): the plan printed, the rehearsal said not run in one line.
    runs[PIPELINED_HF] = [*runs["qwen3"][:2], "--parallelism.cp=2", "--parallelism.pp=2",
                          "--parallelism.pp_microbatches=4", "--parallelism.pp_schedule=1F1B", "--training.seq_len=1024",
                          "--training.batch_size=8", "--job.dry_run", "--job.rehearse"]
    result = subprocess.run([sys.executable, "-c", SCRIPT_DRY_RUNS, json.dumps(runs)], capture_output=True, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "4"}, timeout=900,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_the_dry_run_rehearses_a_tiny_hf_model_and_the_plan_is_within_10_percent(family: str, dry_runs: dict) -> None:
    code, out = dry_runs[family]["code"], dry_runs[family]["out"]
    assert code == 0, out
    assert "rehearsal on 4 fake ranks: torch's FSDPMemTracker peak" in out and "Activation" in out, out
    difference = re.search(r"memory plan \(tensors, less process and slack\) [\d.]+ GiB \(([+-][\d.]+)% of the "
                           r"tracker\)", out)
    assert difference is not None, out
    assert abs(float(difference.group(1))) <= 10.0, out


PIPELINED = [*(a for a in SMALL if not a.startswith(("--model.n_layers", "--training.batch_size"))), "--model.n_layers=4",
             "--parallelism.pp=2", "--parallelism.pp_microbatches=4", "--training.batch_size=8"]
SCRIPT_PIPELINED = """
import dataclasses, json, sys
from cpcompose.config import load_config
from cpcompose.training.memory.rehearsal import rehearse
args, results = json.loads(sys.argv[1]), {}
for schedule in json.loads(sys.argv[2]):  # one interpreter: each rehearsal makes and destroys its group
    c = load_config(args)
    c = dataclasses.replace(c, parallelism=dataclasses.replace(c.parallelism, pp_schedule=schedule))
    r = rehearse(c, 8)
    results[schedule] = {"tracked": r.tracked, "planned": r.planned, "pp_rank": r.pp_rank}
print(json.dumps(results))
"""
SCHEDULES = ["Interleaved1F1B", "ZBVZeroBubble"]


@pytest.fixture(scope="module")
def pipelined() -> dict:
    """Each schedule's rehearsal of the plan's busiest pipeline rank, in one fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", SCRIPT_PIPELINED, json.dumps(PIPELINED), json.dumps(SCHEDULES)],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipelined_step_is_rehearsed_per_rank_and_the_plan_is_within_10_percent(schedule: str,
                                                                                 pipelined: dict) -> None:
    got = pipelined[schedule]
    assert got["pp_rank"] in (0, 1)
    assert abs(got["planned"] - got["tracked"]) <= 0.10 * got["tracked"], got


def test_a_pipelined_hf_model_is_not_rehearsed_and_the_dry_run_says_so_in_one_line(dry_runs: dict) -> None:
    """The rehearsal feeds the own Llama's stages; a Hugging Face model under pp gets its plan and one line."""
    code, out = dry_runs[PIPELINED_HF]["code"], dry_runs[PIPELINED_HF]["out"]
    assert code == 0, out
    assert "  rehearsal: not run (rehearse: model.name = 'hf' under parallelism.pp > 1 is not rehearsed yet" in out, out
    assert "pipeline 1F1B, 4 microbatches" in out and "Traceback" not in out
