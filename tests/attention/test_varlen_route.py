"""The varlen route (flash-attn's many-blocks-in-one-call functions) gathers, merges and scatters exactly.

flash-attn runs only on CUDA, so here its two functions are replaced by a float64
reference with the same contract (blocks packed end to end, `cu_seqlens` bounds,
`lse` as `(heads, total rows)`, GQA by head groups, causal per block), and the
route's result is compared with one kernel call per block. What this proves is
cpcompose's side: which blocks share a call, the packing of a batch, the per-block
LSE merge and the index-add of the gradients. flash-attn's own side runs in the GPU
suite (`pytest -m gpu`, tests/attention/test_packed.py's CUDA cases), on the same plans.
Tolerance derived (tests/support/tolerance.py): float64 throughout, only summation order differs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cpcompose.attention.local import execute, kernels, varlen
from cpcompose.attention.local.blocks import MaskSpec, plan
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.kernels import KernelArgs
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.layouts import PackedLayout
from tests.support.tolerance import assert_close


def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    return list(itertools.pairwise(cu.tolist()))


def _reference_scores(q, k, causal, scale):
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def reference_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, softcap):
    assert softcap is None and max_q == max(b - a for a, b in _segments(cu_q))
    outs, lses = [], []
    for (a, b), (c, d) in zip(_segments(cu_q), _segments(cu_k)):
        s = _reference_scores(q[a:b], k[c:d], causal, scale)
        group = q.shape[1] // k.shape[1]
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[c:d].repeat_interleave(group, 1)))
        lses.append(torch.logsumexp(s, -1))
    return torch.cat(outs), torch.cat(lses, dim=1)


def reference_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, scale, softcap):
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (a, b), (c, d) in zip(_segments(cu_q), _segments(cu_k)):
        s = _reference_scores(q[a:b], k[c:d], causal, scale)
        p = torch.exp(s - lse[:, a:b, None])  # with the merged LSE: this block's share of the full softmax
        ve = v[c:d].repeat_interleave(group, 1)
        dv_e = torch.einsum("hqk,qhd->khd", p, dout[a:b])
        dp = torch.einsum("qhd,khd->hqk", dout[a:b], ve)
        ds = p * (dp - (dout[a:b] * out[a:b]).sum(-1).T[:, :, None]) * scale
        dq[a:b] += torch.einsum("hqk,khd->qhd", ds, k[c:d].repeat_interleave(group, 1))
        dk_e = torch.einsum("hqk,qhd->khd", ds, q[a:b])
        dk[c:d] += dk_e.view(d - c, k.shape[1], group, -1).sum(2)
        dv[c:d] += dv_e.view(d - c, v.shape[1], group, -1).sum(2)
    return dq, dk, dv


@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 4, 2), (2, 4, 4), (2, 6, 1)])
def test_varlen_route_matches_one_call_per_block(monkeypatch, batch: int, heads: int, kv_heads: int) -> None:
    layout = PackedLayout.build([0, 40, 47, 90, 101, 160, 170, 192], 2)  # short documents stay whole
    n, local = layout.seq_len, layout.seq_len // 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, local, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, local, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(batch, heads, local, 8, generator=g, dtype=torch.float64)
    kernel = KernelArgs(scale=0.3, backend="math")
    plans = [tuple(plan(layout.runs(0, n), layout.runs(src, n), MaskSpec(True))) for src in (0, 1)]

    def run() -> list[torch.Tensor]:
        acc = SoftmaxAccumulator(q, v.shape[-1])
        for tasks in plans:
            forward_blocks(acc, q, k, v, tasks, kernel)
        out, lse = acc.finish()
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        for tasks in plans:
            backward_blocks(grads, dout, q, k, v, out, lse, tasks, kernel)
        return [out, lse, *grads]

    per_block = run()
    calls: list[int] = []
    monkeypatch.setattr(execute, "supports_varlen", lambda backend: True)
    monkeypatch.setattr(kernels, "varlen_forward",
                        lambda *a, **kw: calls.append(1) or reference_varlen_forward(*a, **kw))
    monkeypatch.setattr(kernels, "varlen_backward", reference_varlen_backward)
    grouped = run()
    tasks = sum(len(p) for p in plans)
    assert 0 < len(calls) < tasks, f"{len(calls)} varlen calls for {tasks} blocks: nothing was grouped"
    for got, want in zip(grouped, per_block):
        assert_close(got, want, terms=want.numel())  # derived, float64: no sum is longer than the tensor


def test_groups_are_built_once_per_plan() -> None:
    """A cached plan (a tuple) gets its index tensors once; a list is regrouped each call."""
    layout = PackedLayout.build([0, 30, 64, 100, 128], 2)
    tasks = tuple(plan(layout.runs(1, 128), layout.runs(1, 128), MaskSpec(True)))
    first, _ = varlen.groups(tasks, 1, torch.device("cpu"))
    again, _ = varlen.groups(tasks, 1, torch.device("cpu"))
    assert first and all(a is b for a, b in zip(first, again))
    assert varlen.groups(list(tasks), 1, torch.device("cpu"))[0][0] is not first[0]


def _flash_attn_visible(n_q: int, n_k: int, left: int, right: int) -> torch.Tensor:
    """flash-attn's window by its documented rule: query i sees keys within (left, right) of i + n_k - n_q."""
    i = torch.arange(n_q)[:, None] + n_k - n_q
    j = torch.arange(n_k)[None, :]
    ok = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def test_band_translates_to_flash_attn_windows_exactly() -> None:
    """Every window-edge block the planner makes, in flash-attn's spelling, sees the same keys.

    The blocks come from real plans (zigzag and packed, windows on one or both sides),
    so this covers the offsets CP produces; where a band has no flash-attn spelling
    the route must send it to the efficient kernel's bias instead (checked too).
    """
    from cpcompose.layouts import resolve_layout

    seen = spelled = 0
    for world, (left, right), causal in itertools.product((2, 4), [(5, 3), (17, 30), (9, 0), (40, 2), (3, 64)],
                                                          (True, False)):
        layout = resolve_layout("zigzag", world)
        mask = MaskSpec(causal, left, right)
        for a, b in itertools.product(range(world), repeat=2):
            for t in plan(layout.runs(a, 96 * world), layout.runs(b, 96 * world), mask):
                if t.band is None:
                    continue
                seen += 1
                n_q, n_k = t.q.stop - t.q.start, t.kv.stop - t.kv.start
                window = t.band.flash_window(n_q, n_k)
                routed = route("flash_attn", t.band, None, n_q, n_k)
                if window is None:
                    assert routed[0] == "cuda_efficient"
                    continue
                spelled += 1
                assert routed == ("flash_attn", window)
                assert torch.equal(_flash_attn_visible(n_q, n_k, *window), t.visible())
    assert seen > 50 and spelled > 0.5 * seen, (seen, spelled)


def route(backend: str, band, softcap, n_q: int, n_k: int, causal: bool = False):  # type: ignore[no-untyped-def]
    q, k = torch.empty(1, 2, n_q, 8, device="meta"), torch.empty(1, 2, n_k, 8, device="meta")
    return kernels._route(backend, band, softcap, q, k, causal)  # type: ignore[arg-type]


def test_route_sends_each_block_where_it_can_run() -> None:
    band = kernels.Band(offset=3, left=4, right=0)
    assert route("cuda_flash", band, None, 8, 8)[0] == "cuda_efficient"  # no mask in the flash kernel
    assert route("cuda_cudnn", band, None, 8, 8)[0] == "cuda_efficient"
    assert route("cuda_efficient", None, 2.0, 8, 8)[0] == "math"  # softcap: only flash-attn has it
    assert route("flash_attn", None, 2.0, 8, 8)[0] == "flash_attn"
    assert route("flash_attn", kernels.Band(0, 0, 5), 2.0, 8, 16)[0] == "math"  # no spelling + softcap
    assert route("cpu_flash", band, None, 8, 8) == ("cpu_flash", (-1, -1))
    assert route("cuda_fused", band, None, 8, 8)[0] == "cuda_efficient"  # a band: as for flash/cuDNN


def test_cudnn_rule_matches_the_measured_points() -> None:
    """`cudnn_is_faster` against the H100 measurements in the README's "CUDA kernels" table (bf16, fwd + bwd)."""
    hopper, ampere = (9, 0), (8, 0)
    rule = kernels.cudnn_is_faster
    assert not rule(8, 1024, 1024, 64, True, hopper)  # flash 0.22 ms, cuDNN 0.29 ms
    assert not rule(8, 1024, 1024, 64, False, hopper)  # a tie (0.226 / 0.231 ms): flash, as before
    assert rule(32, 1024, 1024, 128, True, hopper)  # cuDNN 0.32 ms, flash 0.40 ms
    assert rule(8, 4096, 4096, 64, True, hopper)  # cuDNN 0.40 ms, flash 0.54 ms
    assert rule(32, 16384, 16384, 128, False, hopper)  # cuDNN 28 ms, flash 49 ms
    assert not rule(32, 16384, 16384, 128, False, ampere)  # not measured there: flash, as before
    assert not rule(32, 16384, 16384, 192, False, hopper)  # head dim cuDNN does not take
    assert not rule(32, 16384, 16384, 100, False, hopper)


def test_half_precision_defaults_to_the_per_block_choice() -> None:
    q = torch.empty(1, 2, 8, 8, device="meta", dtype=torch.bfloat16)
    assert kernels.select_backend(q) == "math"  # not CUDA: the choice below is CUDA's
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernels.select_backend(torch.empty(1, 2, 8, 8, dtype=torch.bfloat16), "cuda_fused")


def test_half_precision_window_edges_run_in_float32_on_the_efficient_kernel() -> None:
    band = kernels.Band(offset=0, left=5, right=3)
    half, single = (torch.empty(1, 2, 8, 8, device="meta", dtype=d) for d in (torch.bfloat16, torch.float32))
    assert kernels._runs_in_float32("cuda_efficient", band, half)
    assert not kernels._runs_in_float32("cuda_efficient", band, single)
    assert not kernels._runs_in_float32("cuda_efficient", None, half)  # plain blocks keep their dtype
    assert not kernels._runs_in_float32("flash_attn", band, half)  # flash-attn's native window
