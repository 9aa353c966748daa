"""Packed-sequence and sliding-window cases: run on every rank, reference per document."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpcompose import CommMeter, cp_attention
from cpcompose.layouts import PackedLayout
from tests.support.attention_cases import place_shards
from tests.support.device_baseline import concat_baselines, sdpa_baseline


@dataclass(frozen=True)
class PackedCase:
    strategy: str
    docs: tuple[int, ...]
    causal: bool
    window: int | tuple[int, int] | None  # cp_attention's window_size: int (causal, left) or (left, right)
    heads: int
    kv_heads: int
    world: int
    batch: int = 2
    head_dim: int = 16
    seed: int = 0
    balance: str = "documents"
    device: str = "cpu"  # "cuda": a CUDA pool, measured against per-document SDPA on the GPU
    alltoall_size: int | None = None  # ranks per all-to-all block ("alltoall_ring" only)

    def __str__(self) -> str:
        mask = ("causal" if self.causal else "full") + (f"-w{self.window}".replace(" ", "") if self.window else "")
        on = "" if self.device == "cpu" else f"-{self.device}"
        pack = f"{len(self.docs)}docs{sum(self.docs)}"
        a2a = "" if self.alltoall_size is None else f"-a{self.alltoall_size}"
        return f"{self.strategy}{a2a}-{pack}-{mask}-h{self.heads}kv{self.kv_heads}-P{self.world}{on}"

    @property
    def cu_seqlens(self) -> list[int]:
        return torch.tensor([0, *self.docs]).cumsum(0).tolist()

    def layout(self) -> PackedLayout:
        return PackedLayout.build(self.cu_seqlens, self.world, balance=self.balance)  # type: ignore[arg-type]


def make_inputs(case: PackedCase, total: int) -> dict[str, Tensor]:
    """q, k, v, dout for `total` tokens (the pack plus any padding), float64."""
    g = torch.Generator().manual_seed(case.seed)
    b, d = case.batch, case.head_dim
    return {
        "q": torch.randn(b, case.heads, total, d, generator=g, dtype=torch.float64),
        "k": torch.randn(b, case.kv_heads, total, d, generator=g, dtype=torch.float64),
        "v": torch.randn(b, case.kv_heads, total, d, generator=g, dtype=torch.float64),
        "dout": torch.randn(b, case.heads, total, d, generator=g, dtype=torch.float64),
    }


def run_packed(mesh, case: PackedCase, dtype: torch.dtype = torch.float32) -> dict:
    """Shard the padded pack, run CP attention forward and backward; return local results.

    On CUDA, rank 0 also returns the per-document single-process baseline on that device ("baseline").
    """
    layout = case.layout()
    rank = mesh.get_local_rank()
    full = {n: t.to(case.device, dtype) for n, t in make_inputs(case, layout.seq_len).items()}
    local = {n: layout.shard(t, 2, rank) for n, t in full.items()}
    q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))
    meter = CommMeter()
    out, lse = cp_attention(
        q, k, v, mesh=mesh, is_causal=case.causal, strategy=case.strategy, layout=layout,
        window_size=case.window, return_lse=True, meter=meter, alltoall_size=case.alltoall_size,
    )
    forward_bytes = meter.total
    out.backward(local["dout"])
    result = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
              "forward_bytes": forward_bytes, "total_bytes": meter.total, "total_by_kind": dict(meter.bytes_sent)}
    if case.device != "cpu" and rank == 0:
        assert case.window is None, "the CUDA baseline has no window"
        result["baseline"] = concat_baselines([
            sdpa_baseline(*(full[n][:, :, a:b] for n in ("q", "k", "v", "dout")), causal=case.causal,
                          scale=case.head_dim**-0.5)
            for a, b in zip(case.cu_seqlens, case.cu_seqlens[1:])
        ])
    return result


def unshard(case: PackedCase, per_rank: list[dict]) -> dict[str, Tensor]:
    """Every rank's shards at their global positions, without the padding."""
    layout = case.layout()
    merged = place_shards(per_rank, layout, layout.seq_len)
    return {name: t[:, :, : sum(case.docs)] for name, t in merged.items()}


def reference(case: PackedCase, dtype: torch.dtype) -> dict[str, Tensor]:
    """One process, each document on its own, without padding.

    float64: an explicit softmax with the causal/window mask; other dtypes: PyTorch's
    SDPA (a float mask when there is a window) and the CPU kernel's LSE.
    """
    total = sum(case.docs)
    full = make_inputs(case, case.layout().seq_len)
    q, k, v = (full[n][:, :, :total].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    dout = full["dout"][:, :, :total].to(dtype)
    outs, lses = [], []
    scale = case.head_dim**-0.5
    for start, stop in zip(case.cu_seqlens, case.cu_seqlens[1:]):
        qd, kd, vd = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        n = stop - start
        i = torch.arange(n)
        visible = torch.ones(n, n, dtype=torch.bool)
        if case.causal:
            visible &= i[:, None] >= i[None, :]
        left, right = (case.window, None) if isinstance(case.window, int) else (case.window or (None, None))
        if left is not None:
            visible &= i[:, None] - i[None, :] <= left
        if right is not None:
            visible &= i[None, :] - i[:, None] <= right
        additive = torch.zeros(n, n, dtype=dtype).masked_fill(~visible, float("-inf"))
        group = case.heads // case.kv_heads
        if dtype == torch.float64:
            s = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) * scale + additive
            lses.append(torch.logsumexp(s, -1))
            outs.append(torch.softmax(s, -1) @ vd.repeat_interleave(group, 1))
        else:
            outs.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=additive, enable_gqa=True))
            with torch.no_grad():
                lses.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qd, kd, vd, 0.0, False, attn_mask=additive)[1])
    out = torch.cat(outs, dim=2)
    out.backward(dout)
    return {"out": out.detach(), "lse": torch.cat(lses, dim=2).detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
