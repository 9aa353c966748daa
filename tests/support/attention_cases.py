"""Attention cases run on every rank of a pool, and their single-process references.

Each rank builds the same full-sequence inputs from a seed, shards them with the
layout, runs `cp_attention` forward and backward on its shard, and returns its
local output, LSE and gradients. The parent places the shards back by global
position and compares them with references computed in one process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from cpcompose import CommMeter, _compat, cp_attention, cp_shard
from cpcompose.layouts import resolve_layout
from tests.support.device_baseline import sdpa_baseline


@dataclass(frozen=True)
class Case:
    strategy: str
    layout: str
    causal: bool
    heads: int
    kv_heads: int
    world: int
    dtype: torch.dtype = torch.float32
    batch: int = 2
    seq: int = 96
    head_dim: int = 16
    seed: int = 0
    backend: str | None = None
    attend_layout: str | None = None  # attend with another layout than sharded (negative control)
    window: int | tuple[int | None, int | None] | None = None  # cp_attention's window_size
    softcap: float | None = None
    v_dim: int | None = None  # V's head dim when it differs from Q/K's (MLA)
    device: str = "cpu"  # "cuda": run on a CUDA pool, measured against a CUDA baseline (device_baseline.py)
    alltoall_size: int | None = None  # ranks per all-to-all block ("alltoall_ring" only)
    head_chunks: int = 1  # chunks of heads run one after another ("alltoall" only)
    ring_tiles: int = 1  # pieces of each ring round's dK/dV sent home ("ring", "alltoall_ring")

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window is not None:
            mask += f"-w{self.window}".replace(" ", "")
        if self.softcap is not None:
            mask += f"-cap{self.softcap:g}"
        dims = f"-d{self.head_dim}v{self.v_dim}" if self.v_dim is not None else ""
        dt = str(self.dtype).removeprefix("torch.")
        on = "" if self.device == "cpu" else f"-{self.device}"
        a2a = "" if self.alltoall_size is None else f"-a{self.alltoall_size}"
        a2a += "" if self.head_chunks == 1 else f"-chunks{self.head_chunks}"
        a2a += "" if self.ring_tiles == 1 else f"-ringtiles{self.ring_tiles}"
        return f"{self.strategy}{a2a}-{self.layout}-{mask}-h{self.heads}kv{self.kv_heads}{dims}-P{self.world}-{dt}{on}"

    def visible(self) -> Tensor:
        """The `(seq, seq)` boolean mask from the definition: -right <= i - j <= left, right = 0 if causal."""
        i = torch.arange(self.seq)
        d = i[:, None] - i[None, :]
        left, right = (self.window, 0) if isinstance(self.window, int) else (self.window or (None, None))
        if self.causal:
            right = 0
        ok = torch.ones(self.seq, self.seq, dtype=torch.bool)
        if left is not None and left >= 0:
            ok &= d <= left
        if right is not None and right >= 0:
            ok &= d >= -right
        return ok


def make_inputs(case: Case) -> dict[str, Tensor]:
    """Full-sequence q, k, v and upstream gradient, float64, identical on every rank."""
    g = torch.Generator().manual_seed(case.seed)
    b, l, d = case.batch, case.seq, case.head_dim
    dv = case.v_dim or d
    return {
        "q": torch.randn(b, case.heads, l, d, generator=g, dtype=torch.float64),
        "k": torch.randn(b, case.kv_heads, l, d, generator=g, dtype=torch.float64),
        "v": torch.randn(b, case.kv_heads, l, dv, generator=g, dtype=torch.float64),
        "dout": torch.randn(b, case.heads, l, dv, generator=g, dtype=torch.float64),
    }


def run_cp(mesh, case: Case) -> dict[str, Tensor]:
    """On each rank: shard, CP attention forward + backward; return local results.

    On CUDA, rank 0 also returns the single-process baseline on that device ("baseline").
    """
    full = {name: t.to(case.device, case.dtype) for name, t in make_inputs(case).items()}
    layout = case.layout
    local = {name: cp_shard(t, mesh, seq_dim=2, layout=layout).detach() for name, t in full.items()}
    q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))
    meter = CommMeter()
    out, lse = cp_attention(
        q, k, v, mesh=mesh, is_causal=case.causal, strategy=case.strategy,
        layout=case.attend_layout or case.layout, window_size=case.window, softcap=case.softcap,
        backend=case.backend, return_lse=True, meter=meter, alltoall_size=case.alltoall_size,
        head_chunks=case.head_chunks, ring_tiles=case.ring_tiles,
    )
    forward_bytes, forward_by_kind = meter.total, dict(meter.bytes_sent)
    out.backward(local["dout"])
    result = {
        "out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
        "forward_bytes": forward_bytes, "total_bytes": meter.total,
        "forward_by_kind": forward_by_kind, "total_by_kind": dict(meter.bytes_sent),
    }
    if case.device != "cpu" and mesh.get_local_rank() == 0:
        masked = case.window is not None
        result["baseline"] = sdpa_baseline(
            full["q"], full["k"], full["v"], full["dout"], causal=case.causal, scale=case.head_dim**-0.5,
            visible=case.visible().to(case.device) if masked else None, softcap=case.softcap,
        )
    return result


def place_shards(per_rank: list[dict[str, Tensor]], layout, seq_len: int) -> dict[str, Tensor]:
    """Every rank's local results at their global positions along dim 2 (no communication)."""
    merged: dict[str, Tensor] = {}
    for name in ("out", "lse", "dq", "dk", "dv"):
        shards = [r[name] for r in per_rank]
        shape = list(shards[0].shape)
        shape[2] = seq_len
        full = shards[0].new_empty(shape)
        for rank, shard in enumerate(shards):
            full[:, :, layout.local_indices(rank, seq_len)] = shard
        merged[name] = full
    return merged


def unshard_results(case: Case, per_rank: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The CP results in global order."""
    layout = resolve_layout(case.layout, case.world)
    return place_shards(per_rank, layout, case.seq)


def reference(case: Case, dtype: torch.dtype) -> dict[str, Tensor]:
    """Single-process full-sequence attention in `dtype`.

    float64 uses an explicit softmax (independent of every kernel cpcompose calls);
    other dtypes use PyTorch's own SDPA and its CPU kernel's LSE, the baseline that
    a CP result's error is measured against. A window goes in as an additive mask;
    Dv != Dqk is zero-padded to one head dim for the CPU kernel (zero columns change
    nothing). Softcap, which no PyTorch kernel has, uses the explicit softmax in
    `dtype` through autograd: still independent of cpcompose's kernels.
    """
    full = make_inputs(case)
    q, k, v = (full[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    scale = case.head_dim**-0.5
    if dtype == torch.float64 or case.softcap is not None:
        group = case.heads // case.kv_heads
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = q @ ke.transpose(-1, -2) * scale
        if case.softcap is not None:
            s = case.softcap * torch.tanh(s / case.softcap)
        s = s.masked_fill(~case.visible(), float("-inf"))
        lse = torch.logsumexp(s, -1)
        out = torch.softmax(s, -1) @ ve
    else:
        width = max(case.head_dim, v.shape[-1])
        qp, kp, vp = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        mask = None
        if case.window is not None:
            mask = torch.zeros(case.seq, case.seq, dtype=dtype).masked_fill(~case.visible(), float("-inf"))
        causal = case.causal and mask is None
        # torch's bf16 CPU flash kernel cannot run under ATEN_CPU_CAPABILITY=avx2 on AVX-512 BF16 / AMX hardware
        # (`_compat.cpu_flash_takes_bfloat16`): the reference then takes torch's math kernel, as a real AVX2 CPU
        # would, and the LSE comes from the float32 kernel on the same bf16-rounded values.
        no_bf16_flash = dtype == torch.bfloat16 and not _compat.cpu_flash_takes_bfloat16()
        with sdpa_kernel([SDPBackend.MATH]) if no_bf16_flash else contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )[..., : v.shape[-1]]
        with torch.no_grad():
            if no_bf16_flash:
                qp, kp, vp = qp.float(), kp.float(), vp.float()
                mask = None if mask is None else mask.float()
            _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qp, kp, vp, 0.0, causal, attn_mask=mask, scale=scale
            )
    out.backward(full["dout"].to(dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def assert_matches_single_process(case: Case, per_rank: list[dict]) -> None:
    """The parity rule (tests/attention/test_parity.py's docstring): per tensor, RMS error <= 2x and max
    error <= 4x those of single-process SDPA in the case's dtype, both against the float64 reference."""
    got = unshard_results(case, per_rank)
    exact = reference(case, torch.float64)
    baseline = reference(case, case.dtype) if case.device == "cpu" else per_rank[0]["baseline"]
    for name in ("out", "lse", "dq", "dk", "dv"):
        err = got[name].double() - exact[name]
        base = baseline[name].double() - exact[name]
        rms, base_rms = err.pow(2).mean().sqrt().item(), base.pow(2).mean().sqrt().item()
        worst, base_worst = err.abs().max().item(), base.abs().max().item()
        assert rms <= 2 * base_rms, f"{case} {name}: RMS error {rms:.3g} > 2 x single-process {base_rms:.3g}"
        assert worst <= 4 * base_worst, f"{case} {name}: max error {worst:.3g} > 4 x single-process {base_worst:.3g}"
