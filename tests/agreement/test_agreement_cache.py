"""The cross-rank agreement runs once per expected call, and a rank that deviates later is still caught.

Real gloo groups (the `pools` fixture); the workers persist between cases, so every
count below is a difference taken within one case.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpcompose import PackedLayout, cp_attention
from cpcompose.agreement.expected import AgreementCache, agreement_cache
from cpcompose.attention.local.blocks import MaskSpec, needed_rows, plan
from cpcompose.attention.local.call_setup import GLOBAL, cached_plan
from cpcompose.layouts import ZigzagLayout
from tests.support.attention_cases import Case, run_cp

STRATEGIES = ("ring", "allgather", "alltoall")


def _qkv(rank: int, seq: int, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, dim, generator=g, requires_grad=True)
    return [q, k, torch.randn(1, kv_heads, seq, dim, generator=g, requires_grad=True)]


class CountCollectives(TorchDispatchMode):
    """Counts the c10d ops that run inside it (forward and backward), by name; passes everything through.

    The agreement cache's flags (one int64 per rank, gathered around each predicted call on
    the host) are counted apart, as "flags": they are not an agreement, and the counts
    below ask how many agreement and K/V all-gathers ran.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            sent = args[1] if name == "_allgather_base_" else None
            flags = isinstance(sent, torch.Tensor) and sent.dtype == torch.int64 and sent.numel() == 1
            self.counts["flags" if flags else name] += 1
        return func(*args, **(kwargs or {}))


def _counts(mesh) -> tuple[int, int]:
    cache = agreement_cache(mesh.get_group())
    return cache.agreements, cache.skipped


def two_steps(mesh, strategy: str, validate: str, alltoall_size: int | None = None) -> dict[str, Any]:
    """Two training steps of a two-"layer" attention stack, forward and backward; count agreements and all-gathers."""
    q, k, v = _qkv(mesh.get_local_rank(), seq=20)  # a shape no other case uses: step 1 is a new call

    def step() -> tuple[int, int, int]:
        before = _counts(mesh)
        with CountCollectives() as comm:
            opts = {"strategy": strategy, "validate": validate, "alltoall_size": alltoall_size}
            h = cp_attention(q, k, v, mesh=mesh, is_causal=True, **opts)
            out = cp_attention(h, k, v, mesh=mesh, is_causal=True, **opts)
            out.sum().backward()
        after = _counts(mesh)
        return after[0] - before[0], after[1] - before[1], comm.counts["_allgather_base_"], comm.counts["flags"]

    return {"step1": step(), "step2": step()}


@pytest.mark.parametrize("strategy,world,alltoall_size", [(s, 2, None) for s in STRATEGIES] + [("alltoall_ring", 4, 2)])
def test_steady_state_does_no_agreement(pools, strategy: str, world: int, alltoall_size: int | None) -> None:
    """Step 1 agrees once (the first layer's new call), the second layer and all of step 2 skip it."""
    for rank, r in enumerate(pools.get(world).run(two_steps, strategy, "first_call", alltoall_size)):
        assert r["step1"][:2] == (1, 1), f"rank {rank}: {r}"
        assert r["step2"][:2] == (0, 2), f"rank {rank}: {r}"
        # No all-gather at all in step 2, except the all-gather strategy's own K/V (per layer: forward, backward).
        assert r["step2"][2] == (4 if strategy == "allgather" else 0), f"rank {rank}: {r}"
        assert r["step1"][2] == r["step2"][2] + 1, f"rank {rank}: step 1 had the one agreement all-gather: {r}"
        # Each call gathers one flag per rank once there is an expected call: both layers' in step 2 (in step 1,
        # the first layer's too where an earlier case in this process left an expectation).
        assert r["step2"][3] == 2 and r["step1"][3] in (1, 2), f"rank {rank}: {r}"


def test_every_call_agrees_every_call(pools) -> None:
    for rank, r in enumerate(pools.get(2).run(two_steps, "ring", "every_call")):
        assert r["step1"][:2] == (2, 0) and r["step2"][:2] == (2, 0), f"rank {rank}: {r}"
        assert r["step1"][2] == r["step2"][2] == 2, f"rank {rank}: one agreement all-gather per call: {r}"


def deviate_after_warmup(
    mesh, strategy: str, how: str, alltoall_size: int | None = None, seq: int = 12
) -> list[str]:
    """Warm up (the call is agreed and then skipped), then one rank deviates alone, then a valid call.

    `seq` differs per case: a signature this process has not seen predicts itself after
    warm-up, whereas one an earlier case ran predicts what followed it there.
    """
    rank = mesh.get_local_rank()
    q, k, v = (t.detach() for t in _qkv(rank, seq=seq))
    kwargs: dict[str, Any] = {"mesh": mesh, "is_causal": True, "strategy": strategy, "alltoall_size": alltoall_size}
    results = []
    for _ in range(3):
        cp_attention(q, k, v, **kwargs)
    bad_q, bad_k, bad_v, bad_kwargs = q, k, v, dict(kwargs)
    if how == "new_shape":
        bad_q, bad_k, bad_v = (t.detach() for t in _qkv(rank, seq=2 * seq))
    elif how == "local_error":
        bad_kwargs["softcap"] = float("nan")
    elif how == "other_option":
        bad_kwargs["scale"] = 0.5
    cache = agreement_cache(mesh.get_group())
    before, deviations = cache.skipped, cache.deviations
    try:
        cp_attention(*((bad_q, bad_k, bad_v) if rank == 1 else (q, k, v)), **(bad_kwargs if rank == 1 else kwargs))
        results.append("no error")
    except ValueError as e:
        results.append(str(e))
    assert cache.skipped == before  # nobody's result escaped
    assert cache.deviations == deviations + 1  # seen in the flags: rank 0 ran the expected call, rank 1 replayed it
    out = cp_attention(q, k, v, **kwargs)  # the group is still in step
    results.append(f"valid call: {tuple(out.shape)}")
    return results


EXPECTED = {
    "new_shape": "inputs differ between CP ranks (q, k, v)",
    "local_error": "rank 1: softcap must be a finite positive number",
    "other_option": "inputs differ between CP ranks (scale)",
}


@pytest.mark.parametrize("strategy,world,alltoall_size", [(s, 2, None) for s in STRATEGIES] + [("alltoall_ring", 4, 2)])
@pytest.mark.parametrize("how", sorted(EXPECTED))
def test_a_rank_deviating_alone_after_warmup_raises_everywhere(
    pools, strategy: str, how: str, world: int, alltoall_size: int | None
) -> None:
    """The deviating rank replays the expected call on zeros, so nobody hangs; every rank raises the same error."""
    seq = 8 * (2 + sorted(EXPECTED).index(how) + 3 * (STRATEGIES + ("alltoall_ring",)).index(strategy))
    messages = pools.get(world).run(deviate_after_warmup, strategy, how, alltoall_size, seq, timeout=60)
    for rank, (error, valid) in enumerate(messages):
        assert EXPECTED[how] in error, f"rank {rank}: {error!r}"
        assert valid == f"valid call: (1, 4, {seq}, 8)", f"rank {rank}: {valid!r}"
    assert len({error for error, _ in messages}) == 1


def packed_batches(mesh) -> list[tuple[int, int]]:
    """Each batch brings a new packed layout on every rank: one agreement per batch, then skips."""
    rank, counts = mesh.get_local_rank(), []
    for cu in ([0, 5, 24, 40], [0, 17, 31, 40], [0, 3, 9, 40]):
        layout = PackedLayout.build(cu, 2)
        q, k, v = (t.detach() for t in _qkv(rank, seq=20))
        before = _counts(mesh)
        for _ in range(3):  # three layers
            cp_attention(q, k, v, mesh=mesh, is_causal=True, layout=layout)
        after = _counts(mesh)
        counts.append((after[0] - before[0], after[1] - before[1]))
    return counts


def test_packed_layouts_agree_once_per_batch(pools) -> None:
    for rank, counts in enumerate(pools.get(2).run(packed_batches)):
        assert counts == [(1, 2)] * 3, f"rank {rank}: {counts}"


def test_exact_after_warmup(pools) -> None:
    """Skipping the agreement changes nothing in the results: the same case twice, bit for bit."""
    pool = pools.get(2)
    case = Case("ring", "zigzag", True, 4, 2, 2, seq=32)
    first, second = pool.run(run_cp, case), pool.run(run_cp, case)
    for a, b in zip(first, second):
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert torch.equal(a[name], b[name]), name


def test_plans_are_cached_tuples() -> None:
    """A cached plan is the planner's own answer, computed once, and immutable."""
    layout, mask = ZigzagLayout(4), MaskSpec(True)
    fresh = plan(layout.runs(1, 64), layout.runs(3, 64), mask)
    cached = cached_plan(layout, mask, 64, 1, 3)
    assert isinstance(cached, tuple) and list(cached) == fresh
    assert cached_plan(ZigzagLayout(4), MaskSpec(True), 64, 1, 3) is cached  # equal layouts share it
    assert needed_rows(cached_plan(layout, mask, 64, 1, GLOBAL)) == needed_rows(
        plan(layout.runs(1, 64), layout.global_runs(64), mask)
    )


def cache_lifetime(mesh) -> tuple[int, int, int]:
    """A group's agreement history lives exactly as long as the group: nothing in it holds the group."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from cpcompose.agreement import expected as agreement

    group = dist.new_group(ranks=[0, 1], backend="gloo")
    sub = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    q, k, v = (t.detach() for t in _qkv(mesh.get_local_rank(), seq=8))
    before = len(agreement._CACHES)
    cp_attention(q, k, v, mesh=sub, is_causal=True)
    during = len(agreement._CACHES)
    dist.destroy_process_group(group)
    del group, sub
    gc.collect()
    return before, during, len(agreement._CACHES)


def test_history_is_owned_by_its_group(pools) -> None:
    for before, during, after in pools.get(2).run(cache_lifetime):
        assert during == before + 1 and after == before, (before, during, after)


def model_steps(mesh) -> list[tuple[int, int, int]]:
    """Three training steps of a small two-layer model through `ContextParallel` (the SDPA route)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from cpcompose import ContextParallel, cp_cross_entropy, cp_position_ids, cp_shard
    from tests.support.plain_model import SEQ, make_batch, make_model

    model = make_model(causal=True)
    parallelize_module(model, mesh, {"blocks.*": ContextParallel(strategy="ring")})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, labels = (cp_shard(t, mesh, seq_dim=1, layout="zigzag") for t in make_batch())
    positions = cp_position_ids(SEQ, mesh, layout="zigzag")
    steps = []
    for _ in range(3):
        before = _counts(mesh)
        with CountCollectives() as comm:
            logits = model(tokens, positions)
        loss = cp_cross_entropy(logits, labels, mesh=mesh)  # its own all-reduce, outside the count
        with comm:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = _counts(mesh)
        steps.append((after[0] - before[0], after[1] - before[1], comm.counts["_allgather_base_"]))
    return steps


def test_model_training_step_at_steady_state(pools) -> None:
    for rank, steps in enumerate(pools.get(2).run(model_steps)):
        # The model's signature is the compile and entry-point tests' too, and this process's history
        # predicts what followed it there: the first steps may agree more than once (a fresh
        # signature reaches the steady state in step 2: test_steady_state_does_no_agreement).
        assert all(agreed + skipped == 2 for agreed, skipped, _ in steps), f"rank {rank}: {steps}"
        assert steps[0][0] >= 1 and steps[2] == (0, 2, 0), f"rank {rank}: step 3 agreed or all-gathered: {steps}"


L, G, E, D, C = (1,), (2,), (3,), (4,), (5,)  # stand-in signatures: local window, global, encoder, decoder, cross
LAYER_PATTERNS = {
    "one signature": lambda step: [L] * 8,
    "alternating sliding/global": lambda step: [L, G] * 4,
    "5 sliding : 1 global": lambda step: ([L] * 5 + [G]) * 4,
    "3 chunked : 1 global": lambda step: ([L] * 3 + [G]) * 12,
    "5:1 with activation-checkpoint recompute": lambda step: ([L] * 5 + [G]) * 4 + ([G] + [L] * 5) * 4,
    "62 layers 5:1, recomputed in reverse": lambda step: (
        ([L] * 5 + [G]) * 10 + [L] * 2 + list(reversed(([L] * 5 + [G]) * 10 + [L] * 2))
    ),
    "encoder-decoder with cross attention": lambda step: [E] * 6 + [D, C] * 6,
    "A B A C": lambda step: [L, G, L, C] * 4,
    "two microbatches": lambda step: ([L] * 5 + [G]) * 2 * 2,
}


def drive(cache: AgreementCache, keys: list) -> int:  # type: ignore[type-arg]
    """Make `keys` as `agreed_call` does when every rank makes the same calls: a skip if predicted, else an
    agreement (counted). Returns the agreements."""
    before = cache.agreements
    for key in keys:
        if cache.expected() == key:
            cache.ran(key)
        else:
            cache.agreements += 1
            cache.agreed(key, None)  # type: ignore[arg-type]  (the spec is only read to replay a call)
    return cache.agreements - before


def agreements_per_step(pattern, steps: int = 6, cache: AgreementCache | None = None) -> list[int]:  # type: ignore[no-untyped-def]
    cache = cache or AgreementCache()
    return [drive(cache, pattern(step)) for step in range(steps)]


@pytest.mark.parametrize("pattern", sorted(LAYER_PATTERNS))
def test_repeating_layer_patterns_reach_a_steady_state(pattern: str) -> None:
    """By the third step every call of a repeating pattern is predicted, whatever the mix of signatures.

    Before, the prediction was "what followed this signature last time": under 5 sliding-window
    layers to 1 global one that flips twice per period, and each flip cost a full agreement
    (a host sync on NCCL) in every step, forever.
    """
    counts = agreements_per_step(LAYER_PATTERNS[pattern])
    assert counts[0] >= 1 and counts[2:] == [0] * 4, counts


FOREIGN_HISTORY = [L] * 9 + [E] + [L] * 4 + [G] + [L] * 12 + [C] + [L, L, E, L, L, L, G] + [D, C, G, L] * 5


@pytest.mark.parametrize("pattern", sorted(LAYER_PATTERNS))
def test_patterns_after_other_work_with_the_same_signatures(pattern: str) -> None:
    """Earlier work in the process (the same signatures in other orders) costs a few agreements, then none.

    The history predicts what followed the same recent calls last time, and other work
    may have gone on differently: each such prediction fails once and is not made again.
    """
    cache = AgreementCache()
    drive(cache, FOREIGN_HISTORY)
    counts = agreements_per_step(LAYER_PATTERNS[pattern], steps=10, cache=cache)
    assert sum(counts[2:]) <= 1 and counts[-4:] == [0] * 4, counts


def test_a_new_signature_every_step_agrees_once_per_step() -> None:
    """A new packed layout per batch: its first call agrees, the rest of the step repeats it."""
    assert agreements_per_step(lambda step: [(100 + step,)] * 8) == [1] * 6


def test_history_stays_bounded_and_still_predicts() -> None:
    cache = AgreementCache(history=64)
    pattern = ([L] * 5 + [G]) * 30
    drive(cache, pattern * 3)
    assert drive(cache, pattern) == 0 and len(cache._history) <= 2 * 64


def windowed_steps(mesh) -> list[int]:
    """Three steps of a 5:1 sliding-window/global stack of `cp_attention` calls, real group: agreements per step."""
    q, k, v = _qkv(mesh.get_local_rank(), seq=28)  # a shape no other case uses
    counts = []
    for _ in range(3):
        before = _counts(mesh)[0]
        h = q
        for layer in range(12):
            window = None if layer % 6 == 5 else 5
            h = cp_attention(h, k, v, mesh=mesh, is_causal=True, window_size=window)
        h.sum().backward()
        counts.append(_counts(mesh)[0] - before)
    return counts


def test_sliding_window_pattern_steady_state_on_a_real_group(pools) -> None:
    """The window is part of the signature, and the 5:1 pattern stops agreeing after warm-up on every rank."""
    for rank, counts in enumerate(pools.get(2).run(windowed_steps)):
        assert counts[0] >= 2 and counts[2] == 0, f"rank {rank}: agreements per step {counts}"
def cuda_steady_state_syncs(mesh, strategy: str) -> dict[str, Any]:
    """Host syncs of a steady-state step on CUDA, each with where it happened (outside comm's staging or not).

    `torch.cuda.set_sync_debug_mode("warn")` warns at every synchronizing CUDA call
    (a device-to-host copy, `.item()`, `.tolist()`, `nonzero`...); the recorded Python
    stack says who asked. On one GPU the ranks share it over gloo, whose host staging
    in `cpcompose/comm/` syncs by design (NCCL has no staging); anything else, such
    as an agreement, a plan built from device data or a kernel dispatch reading a
    tensor, would sync on NCCL too, and is what this looks for.
    """
    import traceback
    import warnings

    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(mesh.get_local_rank(), seq=20))

    def step() -> None:
        h = cp_attention(q, k, v, mesh=mesh, is_causal=True, strategy=strategy)
        cp_attention(h, k, v, mesh=mesh, is_causal=True, strategy=strategy).sum().backward()

    step()  # the first call of this signature agrees (an all-gather read on the host) and plans
    torch.cuda.synchronize()
    stacks: list[str] = []
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if "synchronizing CUDA operation" in str(message):
            stacks.append("".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.set_sync_debug_mode("default")
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    staging = [s for s in stacks if "cpcompose/comm/" in s]
    return {"syncs": len(stacks), "staging": len(staging), "elsewhere": [s for s in stacks if s not in staging]}


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_steady_state_syncs_only_to_stage_communication(pools, strategy: str) -> None:
    """No host sync at steady state except gloo's host staging (which NCCL does not have)."""
    for rank, r in enumerate(pools.get(2, "cuda").run(cuda_steady_state_syncs, strategy)):
        assert r["syncs"] > 0, f"rank {rank}: no sync seen at all, so the detector saw nothing (staging syncs): {r}"
        assert not r["elsewhere"], f"rank {rank}: {len(r['elsewhere'])} sync(s) outside staging:\n" + "\n---\n".join(
            r["elsewhere"]
        )
