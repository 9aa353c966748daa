"""flash-linear-attention's and mamba-ssm's kernel APIs called through `cpcompose.mixers` directly.

No transformers routing and no `context_parallel` block: a `MixerRegion` names the mesh and
the layout, and the CP versions run the kernel they are given on this rank's stretches. On the
CPU the kernels are transformers' module-level torch functions for those APIs
(`torch_chunk_gated_delta_rule`, `mamba2_chunk_scan`), in float32 as they compute; on a GPU
(`gpu` marker) fla's `chunk_gated_delta_rule` and mamba-ssm's Triton `mamba_chunk_scan_combined`
where importable (`cpcompose.mixers.triton_scans`), else the same torch functions: the test
prints and records (junit property `kernel`) which ran, and prints every comparison's error
against its tolerance (one GPU run shows all the margins). Each rank's outputs and input
gradients are compared with its shard of the same kernel run on each document of the full
sequence on one process, at P = 2 under zigzag (one document, both of rank 1's runs one
stretch) and a pack.

Tolerance: CP differs from the reference only in rounding (chunks aligned to the stretches,
states composed across ranks). On the CPU each value is a chain of at most L float32 steps,
so `eps32 * L` relative to the reference's largest value bounds it. The CUDA kernels' Triton
dots round to tf32 (10-bit mantissa), whose errors add like a random walk over the chain:
`2**-10 * sqrt(L)`. Dropping the correction (the true state's contribution) misses by far
more, checked on the same data. And each rank's kernel sees each of its tokens once: no rerun
(scan work 1.0 per rank).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from cpcompose.agreement import agreement_cache
from cpcompose.layouts import Layout, Run
from cpcompose.mixers import MixerOptions, MixerRegion, cp_causal_conv1d
from cpcompose.mixers.triton_scans import FoundKernel, fla_chunk_gated_delta_rule, mamba_chunk_scan_combined
from cpcompose.mixers.fla import cp_chunk_gated_delta_rule
from cpcompose.mixers.mamba_ssm import cp_mamba2_chunk_scan
from cpcompose.mixers.states import continued_runs
from cpcompose.mixers.stretch_plan import phased_stretches, stretches
from tests.support.mixer_cases import make_layout, randn, value_errors

SPECS = ("zigzag", "packed")
SIZES = {"cpu": (12, 4, 4), "cuda": (128, 64, 32)}
"""Per device: tokens per rank, chunk size, key/value head dim (the CUDA kernels want dims of 16 or more and
chunks of 64)."""


def _inputs(api: str, seq: int, dim: int) -> dict[str, torch.Tensor]:
    if api == "fla":
        return {"q": randn(1, seq, 2, dim, seed=1), "k": randn(1, seq, 2, dim, seed=2),
                "v": randn(1, seq, 4, dim, seed=3),
                "g": -torch.rand(1, seq, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64),
                "beta": torch.sigmoid(randn(1, seq, 4, seed=5))}
    return {"x": randn(1, seq, 4, dim, seed=1), "dt": 0.5 * randn(1, seq, 4, seed=2) - 1.0,
            "B": randn(1, seq, 2, dim, seed=4), "C": randn(1, seq, 2, dim, seed=5)}


def kernels(device: str) -> dict[str, FoundKernel]:
    """Per API, the kernel the test runs on `device`: the CUDA one where importable on CUDA, else transformers'
    torch function (its name, and why the CUDA one is absent, in the answer)."""
    torch_ones = {"fla": FoundKernel(torch_chunk_gated_delta_rule, "transformers torch_chunk_gated_delta_rule"),
                  "mamba_ssm": FoundKernel(mamba2_chunk_scan, "transformers mamba2_chunk_scan")}
    if device != "cuda":
        return torch_ones
    found = {"fla": fla_chunk_gated_delta_rule(), "mamba_ssm": mamba_chunk_scan_combined()}
    return {api: f if f.kernel is not None else FoundKernel(torch_ones[api].kernel, torch_ones[api].name, f.reason)
            for api, f in found.items()}


def _prepared(api: str, seq: int, dim: int, device: str) -> dict[str, torch.Tensor]:
    return {k: v.float().to(device) for k, v in _inputs(api, seq, dim).items()}


class Counted:
    """A kernel that counts the tokens it is given (dim 1 of its first argument), call by call, and of those the
    tokens it ran widened (values wider than `value_dim`: the delta rule's correction pass) and the tokens it ran
    from a given initial state (the stretches a first gather settled, or the delta rule's widened ones)."""

    def __init__(self, kernel: Callable[..., Any], value_dim: int | None = None) -> None:
        self.kernel, self.value_dim, self.tokens, self.widened, self.from_state = kernel, value_dim, 0, 0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tokens += args[0].shape[1]
        if self.value_dim is not None and args[2].shape[-1] > self.value_dim:
            self.widened += args[0].shape[1]
        if kwargs.get("initial_states", kwargs.get("initial_state")) is not None:
            self.from_state += args[0].shape[1]
        return self.kernel(*args, **kwargs)


def _call(api: str, kernel: Callable[..., Any], t: dict[str, torch.Tensor], region: MixerRegion | None,
          chunk: int) -> torch.Tensor:
    """The API on `t`: through its CP version under `region`, running `kernel` on the stretches, or `kernel`
    itself when `region` is None."""
    if api == "fla":
        args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
        if region is None:
            return kernel(*args, chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0]
        return cp_chunk_gated_delta_rule(kernel, region, *args, chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0]
    A = -torch.tensor([0.5, 1.0, 1.5, 2.0], device=t["x"].device)
    args = (t["x"], t["dt"], A, t["B"], t["C"])
    if region is None:
        return kernel(*args, chunk_size=chunk, dt_softplus=True)
    return cp_mamba2_chunk_scan(kernel, region, *args, chunk_size=chunk, dt_softplus=True)


def api_cases(mesh, device: str, api: str) -> dict:
    rank, world, results = mesh.get_local_rank(), mesh.size(), {}
    s_local, chunk, dim = SIZES[device]
    found = kernels(device)[api]
    for spec in SPECS:
        layout = make_layout(spec, world, s_local)
        region = MixerRegion(mesh, MixerOptions(layout=layout))
        full = _prepared(api, world * s_local, dim, device)
        local = {k: layout.shard(v, 1, rank).requires_grad_() for k, v in full.items()}
        counted = Counted(found.kernel, local["v"].shape[-1] if api == "fla" else None)
        out = _call(api, counted, local, region, chunk)
        out.sum().backward()
        results[spec] = {"out": out.detach().cpu(), "grads": {k: v.grad.cpu() for k, v in local.items()},
                         "tokens": counted.tokens, "widened": counted.widened, "from_state": counted.from_state,
                         "kernel": found.name}
    return results


def _reference(api: str, layout: Layout, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The kernel on each document alone (a pack's documents restart), outputs in global order."""
    s_local, chunk, dim = SIZES[device]
    seq = layout.world * s_local
    full = {k: v.requires_grad_() for k, v in _prepared(api, seq, dim, device).items()}
    docs, kernel = layout.global_runs(seq), kernels(device)[api].kernel
    out = torch.cat([_call(api, kernel, {k: v[:, d.pos:d.pos + d.length] for k, v in full.items()}, None, chunk)
                     for d in docs], 1)
    out.sum().backward()
    return out.detach().cpu(), {k: v.grad.cpu() for k, v in full.items()}


def _error(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """The largest difference relative to the reference's largest value (what `atol = tol * scale` bounds)."""
    return (got - want).abs().max().item() / max(scale, torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("api", ["fla", "mamba_ssm"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernel_apis_through_cpcompose_directly(pools, record_property, device: str, api: str) -> None:
    world = 2
    s_local, chunk, dim = SIZES[device]
    seq = world * s_local
    found = kernels(device)[api]
    ran = found.name + (f" (CUDA kernel not importable: {found.reason})" if found.reason else "")
    record_property("kernel", ran)
    print(f"\nmixer kernel on {device} for {api}: {ran}")
    results = pools.get(world, device).run(api_cases, device, api)
    # rounding chains of at most `seq` steps, relative to the largest value (module docstring)
    tol = torch.finfo(torch.float32).eps * seq if device == "cpu" else 2.0 ** -10 * seq ** 0.5
    misses = []  # every comparison is made and printed before any fails: one GPU run shows all the margins
    for spec in SPECS:
        layout = make_layout(spec, world, s_local)
        want, grads = _reference(api, layout, device)
        zero_state = []  # every document restarting at every run: what the CP version would give uncorrected
        for rank in range(world):
            got = results[rank][spec]
            assert got["kernel"] == found.name, f"rank {rank} ran {got['kernel']}, this process {found.name}"
            assert got["tokens"] == s_local, f"{spec} {api} rank {rank}: the kernel saw {got['tokens']} tokens " \
                f"for a shard of {s_local}: one pass per token, no rerun"
            if spec == "zigzag" and api == "fla":  # chunk 0 plain + 3 widened; 1 widened + 2 plain from its state
                assert got["widened"] == s_local // 2, f"rank {rank} widened {got['widened']} of {s_local} " \
                    "tokens: the middle rank's second chunk should run plainly after the first gather"
            if spec == "zigzag" and api == "mamba_ssm":  # one gather: every stretch from zero, then corrected
                assert got["from_state"] == 0, f"rank {rank} ran {got['from_state']} tokens from a state: " \
                    "the SSD runs each stretch once from zero and adds what its true state contributes"
            pairs = {"out": (got["out"], layout.shard(want, 1, rank), want.abs().max().item())}
            pairs.update({f"grad {name}": (got["grads"][name], layout.shard(grad, 1, rank), grad.abs().max().item())
                          for name, grad in grads.items()})
            for name, (mine, ref, scale) in pairs.items():
                error = _error(mine, ref, scale)
                print(f"{device} {api} {spec} rank {rank} {name}: max error {error:.2e} of the largest value "
                      f"(tolerance {tol:.2e})")
                if error > tol:
                    misses.append(f"{spec} rank {rank} {name}: {error:.2e} > {tol:.2e}")
            runs = layout.runs(rank, seq)
            local = {k: layout.shard(v, 1, rank) for k, v in _prepared(api, seq, dim, device).items()}
            zero_state.append(torch.cat([_call(api, found.kernel, {k: v[:, r.row:r.row + r.length]
                                                                  for k, v in local.items()}, None, chunk)
                                         for r in runs], 1).cpu())
        missed = max(_error(z, layout.shard(want, 1, r), want.abs().max().item()) for r, z in enumerate(zero_state))
        print(f"{device} {api} {spec}: dropping the carried state would miss by {missed:.2e}")
        assert missed > 10 * tol, f"{spec} {api}: the check cannot tell a dropped state"
    assert not misses, f"{api} on {device} ({found.name}): " + "; ".join(misses)


def test_mixer_region_reports_a_bad_layout() -> None:
    assert MixerOptions(layout="no-such-layout").error(2) is not None
    assert MixerOptions(layout="zigzag").error(2) is None


def test_stretches_merge_a_ranks_consecutive_runs_of_one_document() -> None:
    """Zigzag's middle pair is one kernel call; runs of different documents, or apart, stay separate."""
    seq = 16
    zigzag = make_layout("zigzag", 2, seq // 2)
    runs = zigzag.runs(1, seq)  # chunks 1 and 2: one document, consecutive positions and rows
    starts = {run.doc: run.pos for run in zigzag.global_runs(seq)}
    merged = stretches(runs, starts, continued={0, 1})
    assert [(s.rows, s.runs, s.continues, s.continued) for s in merged] == [(slice(0, 8), (0, 1), True, True)]
    apart = stretches(zigzag.runs(0, seq), starts, continued={0})  # chunks 0 and 3
    assert [(s.rows, s.runs, s.continues, s.continued) for s in apart] == [
        (slice(0, 4), (0,), False, True), (slice(4, 8), (1,), True, False)]
    packed, seq = make_layout("packed", 2, 12), 24  # the pack of tests/support: documents shorter and longer
    for rank in range(2):
        every = packed.runs(rank, seq)
        for s in stretches(every, {run.doc: run.pos for run in packed.global_runs(seq)}, continued=set()):
            assert len({every[i].doc for i in s.runs}) == 1  # never across a document boundary


def direct_refusals(mesh) -> dict:
    """Bad input on rank 0 only, through a `MixerRegion`: every rank raises the same error; then a valid call."""
    rank, world = mesh.get_local_rank(), mesh.size()
    s_local, chunk, dim = SIZES["cpu"]
    layout = make_layout("zigzag", world, s_local)
    region = MixerRegion(mesh, MixerOptions(layout=layout))
    t = {k: layout.shard(v, 1, rank) for k, v in _prepared("fla", world * s_local, dim, "cpu").items()}
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    state = torch.zeros(1, 4, dim, dim) if rank == 0 else None

    def cache() -> object:
        return cp_chunk_gated_delta_rule(torch_chunk_gated_delta_rule, region, *args, chunk_size=chunk,
                                         initial_state=state)

    def short() -> object:  # rank 0's shard one token short: it does not fit the layout
        cut = [a[:, :-1] if rank == 0 else a for a in args]
        return cp_chunk_gated_delta_rule(torch_chunk_gated_delta_rule, region, *cut, chunk_size=chunk)

    messages = value_errors({"cache": cache, "short": short})
    good = cp_chunk_gated_delta_rule(torch_chunk_gated_delta_rule, region, *args, chunk_size=chunk)[0]
    return {"messages": messages, "shape": tuple(good.shape)}


def test_direct_calls_refuse_on_every_rank(pools) -> None:
    results = pools.get(2).run(direct_refusals)
    for name, needle in (("cache", "generation cache"), ("short", "rank 0: global length (local 11 x 2 ranks)")):
        messages = [r["messages"][name] for r in results]
        assert messages[0] is not None and needle in messages[0], messages
        assert all(m == messages[0] for m in messages), f"{name}: ranks disagree: {messages}"
    assert all(r["shape"] == results[0]["shape"] for r in results)


def test_phased_stretches_defer_what_the_first_gather_settles() -> None:
    """Zigzag's middle pair splits (its second chunk waits for the first gather); nothing else changes."""
    def phased(spec: str, world: int, seq: int) -> list[list[tuple]]:
        layout = make_layout(spec, world, seq // world)
        every = [layout.runs(r, seq) for r in range(world)]
        starts = {run.doc: run.pos for run in layout.global_runs(seq)}
        return [[(s.rows, s.runs, s.continues, s.continued, s.deferred) for s in spans]
                for spans in phased_stretches(every, starts, continued_runs(every))]

    two = phased("zigzag", 2, 16)  # chunks of 4: rank 0 holds 0 and 3, rank 1 holds 1 and 2
    assert two[0] == [(slice(0, 4), (0,), False, True, False), (slice(4, 8), (1,), True, False, False)]
    assert two[1] == [(slice(0, 4), (0,), True, True, False), (slice(4, 8), (1,), True, True, True)]
    three = phased("zigzag", 3, 24)  # rank 2 holds 2 and 3; chunk 4 (rank 1) follows chunk 3: not settled
    assert three[2] == [(slice(0, 4), (0,), True, True, False), (slice(4, 8), (1,), True, True, True)]
    assert [s[4] for s in three[0] + three[1]] == [False] * 4
    assert not any(s[4] for spans in phased("contiguous", 3, 24) for s in spans)
    # By hand: document 0 over [0, 16) on ranks 0, 1, 2 (rank 2 holds [8, 16) as two runs), document 1 on rank 1.
    # Rank 1's [4, 8) follows rank 0's first stretch only: settled. Rank 2's [12, 16) also follows [4, 8), which is
    # no rank's first stretch: splitting rank 2's pair would defer nothing, so it stays one call.
    every = [[Run(0, 0, 4, 0)], [Run(0, 16, 4, 1), Run(4, 4, 4, 0)], [Run(0, 8, 4, 0), Run(4, 12, 4, 0)]]
    hand = phased_stretches(every, {0: 0, 1: 16}, continued_runs(every))
    assert [(s.rows, s.runs, s.continues, s.continued, s.deferred) for s in hand[1]] == [
        (slice(0, 4), (0,), False, False, False), (slice(4, 8), (1,), True, True, True)]
    assert [(s.rows, s.runs, s.deferred) for s in hand[2]] == [(slice(0, 8), (0, 1), False)]


def test_cuda_kernel_lookups_name_the_kernel_or_say_why_not() -> None:
    """Each look-up gives a callable and no reason, or None and the import's error (never both, never neither)."""
    for found in (fla_chunk_gated_delta_rule(), mamba_chunk_scan_combined()):
        assert (found.kernel is None) == bool(found.reason), found
        assert found.name.endswith(("chunk_gated_delta_rule", "mamba_chunk_scan_combined"))
    assert "mamba_ssm" not in sys.modules or hasattr(sys.modules["mamba_ssm"], "__version__"), \
        "the look-up left its bare mamba_ssm package registered"


def cached_agreement_cases(mesh) -> dict:
    """Repeated calls of the conv and of a recurrence skip the blocking agreement (the library's agreement cache);
    then bad input on rank 1 alone (its peers run the expected call, it replays that call's collectives on zeros)
    still raises the same error on every rank, and a valid call runs after it."""
    rank, world = mesh.get_local_rank(), mesh.size()
    s_local, chunk, dim = SIZES["cpu"]
    layout = make_layout("packed", world, s_local)  # documents that cross ranks: the calls move halos and states
    region = MixerRegion(mesh, MixerOptions(layout=layout))
    t = {k: layout.shard(v, 1, rank) for k, v in _prepared("mamba_ssm", world * s_local, dim, "cpu").items()}
    conv_x, conv_w = t["x"].flatten(2), randn(4 * dim, 3, seed=7).float()
    cache = agreement_cache(mesh.get_group())

    def conv(x: torch.Tensor = conv_x, w: torch.Tensor = conv_w) -> torch.Tensor:
        return cp_causal_conv1d(x, w, mesh=mesh, layout=layout, activation="silu")

    def ssd(x: torch.Tensor = t["x"]) -> torch.Tensor:
        return _call("mamba_ssm", mamba2_chunk_scan, {**t, "x": x}, region, chunk)

    first = {"conv": conv(), "ssd": ssd()}
    for _ in range(2):  # the tape learns the pair
        conv(), ssd()
    agreements, skipped = cache.agreements, cache.skipped
    again = {"conv": conv(), "ssd": ssd()}
    out = {"skipped": cache.skipped - skipped, "agreements": cache.agreements - agreements,
           "same": all(torch.equal(first[k], again[k]) for k in first)}
    deviations = cache.deviations
    wide = randn(4 * dim, 5, seed=8).float()  # a width only rank 1 uses: its halo differs from the expected call's
    def warm_then(bad: Callable[[], object], *before: Callable[[], object]) -> Callable[[], object]:
        """A refusal forgets the tape: learn it again, make the calls `before` the bad one, then the bad one (so
        the one every rank expects is the call rank 1 deviates from)."""
        def call() -> object:
            for f in (conv, ssd, conv, ssd, *before):
                f()
            return bad()
        return call

    out["messages"] = value_errors({
        "conv": warm_then(lambda: conv(w=wide if rank == 1 else conv_w)),
        "ssd": warm_then(lambda: ssd(t["x"][:, :-1] if rank == 1 else t["x"]), conv),
    })
    out["deviations"] = cache.deviations - deviations  # each refusal came through the flags, not a full agreement
    out["after"] = all(torch.equal(first[k], v) for k, v in {"conv": conv(), "ssd": ssd()}.items())
    return out


def test_repeated_calls_skip_the_agreement_and_a_late_deviation_is_still_refused(pools) -> None:
    results = pools.get(2).run(cached_agreement_cases)
    for r in results:
        assert (r["skipped"], r["agreements"], r["same"], r["after"], r["deviations"]) == (2, 0, True, True, 2), r
    for name, needle in (("conv", "inputs differ between CP ranks"), ("ssd", "rank 1: global length")):
        messages = [r["messages"][name] for r in results]
        assert messages[0] is not None and needle in messages[0], messages
        assert all(m == messages[0] for m in messages), f"{name}: ranks disagree: {messages}"
