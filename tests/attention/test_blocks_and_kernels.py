"""Single-process checks of the pure pieces: block plans, the LSE merge, kernels.

The uniform layouts' own checks (round trips, zigzag's chunks and balance) are in
tests/layouts/test_zigzag_and_contiguous.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cpcompose.attention.local.blocks import MaskSpec, plan
from cpcompose.attention.local.kernels import Band, attention_backward, attention_forward
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.layouts import Run
from tests.support.tolerance import assert_close


def _covered(q_runs, kv_runs, mask: MaskSpec, nq: int, nk: int) -> torch.Tensor:
    """How often the plan computes each (local query, local key) pair."""
    count = torch.zeros(nq, nk, dtype=torch.int)
    for t in plan(q_runs, kv_runs, mask):
        count[t.q, t.kv] += t.visible().int()
    return count


def _positions(runs) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.cat([torch.arange(r.pos, r.pos + r.length) for r in runs])
    doc = torch.cat([torch.full((r.length,), r.doc) for r in runs])
    return pos, doc


RUN_CASES = {
    "zigzag-early-vs-late": ([Run(0, 3, 3, 0), Run(3, 18, 3, 0)], [Run(0, 0, 3, 0), Run(3, 21, 3, 0)]),
    "zigzag-late-vs-early": ([Run(0, 0, 3, 0), Run(3, 21, 3, 0)], [Run(0, 3, 3, 0), Run(3, 18, 3, 0)]),
    "against-everything": ([Run(0, 6, 3, 0), Run(3, 15, 3, 0)], [Run(0, 0, 24, 0)]),
    "documents": ([Run(0, 2, 5, 0), Run(5, 9, 4, 1), Run(9, 30, 6, 2)],
                  [Run(0, 0, 2, 0), Run(2, 7, 2, 0), Run(4, 13, 4, 1), Run(8, 20, 10, 2), Run(18, 36, 1, 2)]),
}


MASKS = {
    "causal": MaskSpec(True), "full": MaskSpec(False), "window4": MaskSpec(True, 4), "window700": MaskSpec(True, 700),
    "two-sided-3-2": MaskSpec(False, 3, 2), "two-sided-0-0": MaskSpec(False, 0, 0),
    "left-only-5-0": MaskSpec(False, 5, 0),
    "right-only-none-1": MaskSpec(False, None, 1), "right-unbounded-2-none": MaskSpec(False, 2, None),
    "two-sided-wide-11-9": MaskSpec(False, 11, 9),
}


def _wanted(q_runs, kv_runs, mask: MaskSpec) -> torch.Tensor:
    """The visible pairs, straight from the definition (same document, -right <= i - j <= left)."""
    (qp, qd), (kp, kd) = _positions(q_runs), _positions(kv_runs)
    d = qp[:, None] - kp[None, :]
    want = qd[:, None] == kd[None, :]
    if mask.causal:
        want &= d >= 0
    if mask.window is not None:
        want &= d <= mask.window
    if not mask.causal and mask.right is not None:
        want &= d >= -mask.right
    return want


@pytest.mark.parametrize("name", sorted(RUN_CASES))
@pytest.mark.parametrize("mask", list(MASKS.values()), ids=list(MASKS))
def test_plan_covers_exactly_the_visible_pairs(name: str, mask: MaskSpec, monkeypatch) -> None:
    import cpcompose.attention.local.blocks as blocks

    monkeypatch.setattr(blocks, "BAND_TILE", 4)  # exercise tiling on small cases
    q_runs, kv_runs = RUN_CASES[name]
    want = _wanted(q_runs, kv_runs, mask)
    got = _covered(q_runs, kv_runs, mask, *want.shape)
    assert torch.equal(got, want.int())  # each visible pair exactly once, nothing else


@pytest.mark.parametrize("mask", list(MASKS.values()), ids=list(MASKS))
def test_plan_never_computes_a_fully_masked_row_or_key(mask: MaskSpec, monkeypatch) -> None:
    """Every task row sees a key, every task key is seen, and band masks stay within the tile bound.

    The CPU kernel returns lse=0 (not -inf) for a fully masked row, which would
    corrupt the merge; a key nobody sees would be sent and computed for nothing.
    """
    import cpcompose.attention.local.blocks as blocks

    monkeypatch.setattr(blocks, "BAND_TILE", 4)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):  # random documents split into random runs, as packed layouts make them
        bounds = sorted(set(torch.randint(1, 60, (4,), generator=g).tolist()) | {0, 60})
        runs, row = [], 0
        for doc, (a, b) in enumerate(zip(bounds, bounds[1:])):
            cut = int(torch.randint(a, b + 1, (1,), generator=g))
            for p0, p1 in ((a, cut), (cut, b)):
                if p0 < p1:
                    runs.append(Run(row, p0, p1 - p0, doc))
                    row += p1 - p0
        q_runs = runs[::2] or runs
        q_runs = [Run(sum(r.length for r in q_runs[:i]), r.pos, r.length, r.doc) for i, r in enumerate(q_runs)]
        want = _wanted(q_runs, runs, mask)
        assert torch.equal(_covered(q_runs, runs, mask, *want.shape), want.int())
        for t in plan(q_runs, runs, mask):
            seen = t.visible()
            assert seen.any(1).all() and seen.any(0).all(), t
            if t.kind == "band":
                assert t.q.stop - t.q.start <= 4 and t.kv.stop - t.kv.start <= 2 * 4, t


def test_merge_of_halves_equals_whole() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole, whole_lse = attention_forward(q, k, v, causal=False, scale=0.3, backend="math")
    acc = SoftmaxAccumulator(q, 8)
    for part in (slice(8, 16), slice(0, 8)):
        out, lse = attention_forward(q, k[:, :, part], v[:, :, part], causal=False, scale=0.3, backend="math")
        acc.merge(slice(0, 16), out, lse)
    assert_close(acc.out, whole, terms=16 * 8)  # derived, float64: a sum over keys x head dim
    assert_close(acc.lse, whole_lse, terms=16 * 8)


@pytest.mark.parametrize("causal", [True, False])
def test_math_kernel_matches_cpu_flash(causal: bool) -> None:
    """The two CPU kernels agree (float64: to the derived rounding bound), forward and backward, with GQA."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 20, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 6, 20, 8, generator=g, dtype=torch.float64)
    results = []
    for backend in ("math", "cpu_flash"):
        out, lse = attention_forward(q, k, v, causal=causal, scale=0.35, backend=backend)
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=0.35, backend=backend)
        results.append((out, lse, *grads))
    for a, b in zip(*results):
        assert_close(a, b, terms=2 * 20 * 8)  # derived, float64: batch x keys x head dim


def _explicit_reference(q, k, v, dout, *, causal: bool, scale: float, mask, softcap):
    """float64 autograd of the definition: softmax(softcap * tanh(q.k * scale / softcap) + mask) v."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s + mask.double()
    out = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("softcap", [None, 0.7, 4.0])
@pytest.mark.parametrize("masking", ["none", "causal", "band"])
def test_explicit_kernel_matches_float64_definition(softcap, masking: str, monkeypatch) -> None:
    """The explicit (softcap) path, through the one dispatch point, forward and backward, GQA and Dv != Dqk.

    float64 inputs are computed in float64, so agreement is to rounding (the derived bound, tests/support/tolerance.py);
    the tiny tile size makes several row tiles, as long key blocks would.
    """
    import cpcompose.attention.local.explicit as explicit

    monkeypatch.setattr(explicit, "TILE_ELEMENTS", 2 * 6 * 23 * 3)  # 3 query rows per tile
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 23, 8, generator=g, dtype=torch.float64) * 2  # large logits: the cap matters
    k = torch.randn(2, 2, 23, 8, generator=g, dtype=torch.float64) * 2
    v = torch.randn(2, 2, 23, 5, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 6, 23, 5, generator=g, dtype=torch.float64)
    mask, band = None, None
    if masking == "band":
        d = torch.arange(23)[:, None] - torch.arange(23)[None, :]
        mask = torch.zeros(23, 23, dtype=torch.float64).masked_fill((d > 4) | (d < -2), float("-inf"))
        band = Band(0, 4, 2)
    backend = "math" if softcap is None else "cpu_flash"  # softcap must leave the fused kernel by itself
    out, lse = attention_forward(q, k, v, causal=masking == "causal", scale=0.4, backend=backend, band=band,
                                 softcap=softcap)
    grads = attention_backward(dout, q, k, v, out, lse, causal=masking == "causal", scale=0.4, backend=backend,
                               band=band, softcap=softcap)
    want = _explicit_reference(q, k, v, dout, causal=masking == "causal", scale=0.4, mask=mask, softcap=softcap)
    for got, exp in zip((out, lse, *grads), want):
        assert_close(got, exp, terms=2 * 23 * 8)  # derived, float64: batch x keys x head dim


def test_softcap_changes_the_result() -> None:
    """Negative control: the cap is applied (a kernel ignoring it would pass nothing above)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    capped, _ = attention_forward(q, k, v, causal=True, scale=0.4, backend="cpu_flash", softcap=0.7)
    plain, _ = attention_forward(q, k, v, causal=True, scale=0.4, backend="cpu_flash")
    assert (capped - plain).abs().max() > 0.05


@pytest.mark.parametrize("dims", [(24, 16), (16, 24)], ids=["dv<dqk", "dv>dqk"])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_flash_with_value_head_dim_of_its_own(dims: tuple[int, int], causal: bool) -> None:
    """MLA shapes: the fused CPU kernel (zero-padded inside the dispatch) agrees with the definition."""
    dqk, dv = dims
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 20, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 20, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 20, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, 20, dv, generator=g, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, causal=causal, scale=dqk**-0.5, backend="cpu_flash")
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=dqk**-0.5, backend="cpu_flash")
    want = _explicit_reference(q, k, v, dout, causal=causal, scale=dqk**-0.5, mask=None, softcap=None)
    for got, exp in zip((out, lse, *grads), want):
        assert got.shape == exp.shape
        assert_close(got, exp, terms=2 * 20 * max(dqk, dv))  # derived, float64: batch x keys x dim


_BF16_UNDER_AVX2 = """
import torch
from cpcompose import _compat
from cpcompose.attention.local.kernels import attention_backward, attention_forward
from tests.support.tolerance import relative_error
torch.manual_seed(0)
q, k, v, dout = (torch.randn(1, 2, 128, 16) for _ in range(4))
exact = {}
for dtype in (torch.float64, torch.bfloat16):
    qq, kk, vv, dd = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = attention_forward(qq, kk, vv, causal=True, scale=0.25, backend="cpu_flash")
    grads = attention_backward(dd, qq, kk, vv, out, lse, causal=True, scale=0.25, backend="cpu_flash")
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    got = dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2])
    exact = exact or got
# bf16 inputs and outputs, float32 inside: a few bf16 roundings of each value (eps 2**-8), never O(1).
print(max(relative_error(got[n], exact[n]) for n in got) <= 8 * torch.finfo(torch.bfloat16).eps,
      _compat.cpu_flash_takes_bfloat16())
"""


def test_bf16_blocks_run_where_torchs_bf16_cpu_flash_kernel_cannot() -> None:
    """Under ATEN_CPU_CAPABILITY=avx2 on AVX-512 BF16 / AMX hardware torch 2.13's bf16 CPU flash kernel raises
    ("pack_vnni2 is only supported when avx512 is supported"); the block then runs in float32 and returns bf16.
    Run in a fresh interpreter (ATen reads the variable at start-up); on other hardware it checks the plain path."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    result = subprocess.run([sys.executable, "-c", _BF16_UNDER_AVX2], env=env, capture_output=True, text=True,
                            timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    within, takes_bf16 = result.stdout.split()
    assert within == "True"
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert takes_bf16 == str(not hardware)  # the predicate names this machine's case
