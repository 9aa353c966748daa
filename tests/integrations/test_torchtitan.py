"""torchtitan's own Llama3, Qwen3 and DeepSeek-V3 models with cpcompose as their CP.

Each model is built tiny from torchtitan's model configs in float64, its flex inner
attention replaced by `CPComposeAttention` (`use_cpcompose_attention`). One training
step (forward, torchtitan's loss: a token sum over the global count of valid
tokens, backward) runs under cpcompose CP on P = 2 and 4, for ring, allgather and
alltoall, on a dense batch (zigzag split, torchtitan's "headtail") and on packed
documents (positions restarting at 0, split by the balanced `PackedLayout`). Loss
and every parameter gradient (summed over the CP ranks) must equal the
single-process step: the whole batch for dense rows; for packed rows, every document
run through the model on its own, so document masking is checked against a run that
needs no mask at all.

Tolerances are derived (tests/support/tolerance.py): ULPS x the dtype's epsilon x the
longest sum (`TERMS`: a weight gradient sums over the batch's tokens and a matmul's width)
x the reference tensor's largest entry. Float64 wherever the model computes in float64
(what is left is summation order). torchtitan computes two things in lower precision by
design: RoPE (float32 caches, identical per token in both runs: no difference), and
DeepSeek-V3's routed experts, whose grouped matmuls run in bfloat16 on however many tokens
reach each expert on this rank, so their roundings differ under CP. Their weight gradients
(`BF16_GRADS`) are held to 2 bfloat16 epsilons of the tensor's largest gradient (measured
<= 0.5% of it); that rounding also flows into every DeepSeek-V3 gradient upstream of the
experts (measured 1.9e-10 of the largest on an Intel Xeon: over float64's bound, which
failed there), so DeepSeek-V3's other gradients are held to float32's epsilon over a
matmul's width (`DIM` terms): still ~1e-5 relative, far below any real defect.
"""

from __future__ import annotations

import pytest
import torch

from cpcompose.layouts import PackedLayout
from tests.support import titan_cases as cases  # first of torchtitan: it installs the CPU stand-in for triton's kernels
from tests.support.tolerance import tolerance as derived

# torchtitan's MoE router asks for float32 autocast, which CPU autocast cannot do (the router then runs as is).
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")

BF16_EPS = torch.finfo(torch.bfloat16).eps
BF16_GRADS = ("w1_EFD", "w2_EDF", "w3_EFD")  # DeepSeek-V3's routed experts: bfloat16 grouped matmuls
TERMS = cases.BATCH * cases.DENSE_SEQ * cases.DIM  # the longest sum: a weight gradient over tokens x width


def tolerance(name: str, param: str, reference: torch.Tensor, float32: bool = False) -> dict:
    """The module docstring's rules; `float32`: torchtitan's FSDP computes in float32 at best
    (mixed_precision_param)."""
    if param.endswith(BF16_GRADS):
        return {"rtol": 0.0, "atol": 2 * BF16_EPS * reference.abs().max().item()}
    if name == "deepseek_v3":  # upstream of the bfloat16 experts
        return derived(reference, terms=cases.DIM, dtype=torch.float32)
    return derived(reference, terms=TERMS, dtype=torch.float32 if float32 else None)


def assert_matches(want: dict, per_rank: list[dict], where: str, float32: bool = False) -> None:
    """`where` begins with the model's name (its tolerance depends on it)."""
    name = where.split()[0]
    loss_tol = tolerance(name, "loss", want["loss"], float32)
    for rank, by_strategy in enumerate(per_rank):
        for strategy, got in by_strategy.items():
            at = f"{where} rank {rank} {strategy}"
            torch.testing.assert_close(got["loss"], want["loss"], **loss_tol, msg=lambda m, at=at: f"{at} loss: {m}")
            assert got["grads"].keys() == want["grads"].keys()
            for param, grad in want["grads"].items():
                torch.testing.assert_close(got["grads"][param], grad, **tolerance(name, param, grad, float32),
                                           msg=lambda m, at=at, param=param: f"{at} {param}: {m}")


@pytest.mark.parametrize("kind", ["dense", "packed"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", cases.MODELS)
def test_training_step_is_exact(pools, name: str, world: int, kind: str) -> None:
    """Every strategy, one step: loss and every gradient equal the single-process step."""
    want, state = cases.reference(name, kind)
    per_rank = pools.get(world).run(cases.cp_steps, name, state, kind)
    assert_matches(want, per_rank, f"{name} P={world} {kind}")
    if kind == "packed":  # the balanced split of the batch's documents, padded only at the end
        expected = PackedLayout.build(cases.packed_cu_seqlens(), world)
        assert all(got["layout"] == expected for got in per_rank[0].values())


@pytest.mark.parametrize("kind,settings", [
    ("packed", {"balance": "zigzag"}),
    ("dense", {"layout": "contiguous"}),
])
def test_other_splits_are_exact(pools, kind: str, settings: dict) -> None:
    """cpcompose.balance / cpcompose.layout: the other splits are exact too, and are the ones used."""
    want, state = cases.reference("llama3", kind)
    per_rank = pools.get(4).run(cases.cp_steps, "llama3", state, kind, settings)
    assert_matches(want, per_rank, f"llama3 {settings}")
    layout = per_rank[0]["ring"]["layout"]
    if kind == "packed":
        assert layout == PackedLayout.build(cases.packed_cu_seqlens(), 4, balance="zigzag")
    else:
        assert layout.name == "contiguous"


@pytest.mark.parametrize("name", cases.MODELS)
def test_one_process_document_mask_is_exact(name: str) -> None:
    """Without CP (context_parallel_degree 1) the same attention masks documents itself."""
    want, state = cases.reference(name, "packed")
    assert_matches(want, [{"one process": cases.one_process_step(name, state)}], name)


def test_documents_are_torchtitans() -> None:
    """`document_starts` draws the boundaries of torchtitan's own flex document mask (get_document_mask_mod)."""
    from torchtitan.models.common.attention import get_document_mask_mod

    from cpcompose.integrations._titan_batch import document_starts

    _, _, positions = cases.packed_batch()
    b, q, kv = torch.meshgrid(*(torch.arange(n) for n in (cases.BATCH, cases.PACKED_SEQ, cases.PACKED_SEQ)),
                              indexing="ij")
    theirs = get_document_mask_mod(positions)(b, None, q, kv)
    ids = document_starts(positions).cumsum(dim=1)
    ours = ids[:, :, None] == ids[:, None, :]
    assert torch.equal(ours, theirs) and ours.sum() < ours.numel()


def test_sliding_window_is_exact(pools) -> None:
    """cpcompose.window on packed documents: CP equals the one-process document-and-window mask."""
    want, state = cases.reference("qwen3", "packed", window=5)
    per_rank = pools.get(2).run(cases.cp_steps, "qwen3", state, "packed", {"window": 5})
    assert_matches(want, per_rank, "qwen3 window=5")


@pytest.mark.parametrize("name,strategy", [("llama3", "ring"), ("qwen3", "allgather"), ("deepseek_v3", "alltoall")])
def test_trainer_pieces_step(pools, name: str, strategy: str) -> None:
    """A CPComposeTrainer step's pieces on CPU: the model's own torchtitan parallelize_fn through
    `cpcompose_parallelize` (ParallelDims with cp=2, full activation checkpointing: the recompute reads
    the same mask; FSDP2 over dp_shard x cp), the batch through the trainer's post_dataloading_process,
    torchtitan's CrossEntropyLoss.

    torchtitan's FSDP casts parameters to at best float32 (mixed_precision_param), so this run is
    held to float32's epsilon over `TERMS` (measured <= 3e-7 relative to the largest gradient).
    """
    want, state = cases.reference(name, "packed")
    per_rank = pools.get(2).run(cases.parallelized_step, name, state, "packed", strategy)
    assert_matches(want, per_rank, f"{name} trainer pieces", float32=True)
    assert [r[strategy]["ntokens_seen"] for r in per_rank] == [cases.BATCH * cases.PACKED_SEQ // 2] * 2


REFUSALS = [
    ("positions_one_rank", "positions must have the inputs' shape"),
    ("unsplittable", "training.seq_len (zigzag split) 30 is not divisible by 4"),
    ("score_mod_one_rank", "score_mod"),
    ("no_region", "carries no CP region"),
    ("flex_mask", "torchtitan's flex/varlen mask"),
]


@pytest.mark.parametrize("case,message", REFUSALS, ids=[c for c, _ in REFUSALS])
def test_refusal_raises_on_every_rank(pools, case: str, message: str) -> None:
    """What cannot be honoured raises on every rank (even when only one rank's input is bad), naming
    it; a valid step in the same group then runs and is exact."""
    want, state = cases.reference("llama3", "dense")
    for rank, got in enumerate(pools.get(2).run(cases.refusal, case, state)):
        assert message in got["message"], f"rank {rank}: {got['message']}"
        torch.testing.assert_close(got["after"], want["loss"], **derived(want["loss"], terms=TERMS))


@pytest.mark.parametrize("key,value", [("strategy", "bogus"), ("balance", "even"), ("layout", "packed"),
                                       ("window", -1), ("alltoall_size", 2)])
def test_bad_setting_names_its_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"cpcompose.{key}"):
        cases.CPComposeConfig(**{key: value})


def test_launch_recipe_parses() -> None:
    """The README's torchtitan command line, parsed by torchtitan's own ConfigManager: the config comes
    from torchtitan's registry, with cpcompose's attention, parallelize_fn and settings in place."""
    from torchtitan.config import ConfigManager

    from cpcompose.integrations.torchtitan import CPComposeAttention, CPComposeTrainer

    config = ConfigManager().parse_args([
        "--module", "cpcompose.integrations.torchtitan", "--config", "qwen3_debugmodel",
        "--parallelism.context_parallel_degree", "2", "--cpcompose.strategy", "alltoall", "--cpcompose.window", "64",
    ])
    assert isinstance(config, CPComposeTrainer.Config)
    assert config.cpcompose == cases.CPComposeConfig(strategy="alltoall", window=64)
    assert config.parallelism.context_parallel_degree == 2 and config.parallelism.spmd_backend == "partial_dtensor"
    layers = config.model_spec.model.layers
    assert all(isinstance(layer.attention.inner_attention, CPComposeAttention.Config) for layer in layers)
    assert config.model_spec.parallelize_fn.__wrapped__.__name__ == "parallelize_qwen3"


def test_parallelize_refuses_torchtitan_attention() -> None:
    model = cases.model_config("llama3").build()  # flex attention, not cpcompose's
    with pytest.raises(ValueError, match="use_cpcompose_attention"):
        cases.cpcompose_parallelize(lambda model, **kwargs: model)(model, parallel_dims=None)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
@pytest.mark.parametrize("kind", ["dense", "packed"])
def test_2d_and_auto_steps_are_exact(pools, name: str, kind: str) -> None:
    """`cpcompose.strategy = "alltoall_ring"` (2x2) and `"auto"` at P=4: the single-process step."""
    want, state = cases.reference(name, kind)
    twod = pools.get(4).run(cases.cp_steps, name, state, kind, {"alltoall_size": 2}, ("alltoall_ring",))
    assert_matches(want, twod, f"{name} P=4 {kind} 2x2")
    chosen = pools.get(4).run(cases.cp_steps, name, state, kind, None, ("auto",))
    assert_matches(want, chosen, f"{name} P=4 {kind} auto")
