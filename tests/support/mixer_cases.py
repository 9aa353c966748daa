"""Inputs, references and per-rank cases for tests/mixers/test_mixers.py.

Workers build the full inputs from a seed on every rank, run a CP primitive on
their shard, and backpropagate a probe loss `sum(out * probe)`; the parent
recomputes the same loss over the full sequence with the references here: plain
sequential loops with resets at document starts.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from cpcompose.comm import CommMeter
from cpcompose.layouts import Layout, PackedLayout, ZigzagLayout, resolve_layout
from cpcompose.mixers import cp_causal_conv1d, cp_delta_rule, cp_initial_states, cp_linear_scan

B, C, S_LOCAL, STATE, H, DK, DV = 2, 3, 24, 3, 2, 3, 2
LAYOUTS = ("zigzag", "contiguous", "packed")
F64 = 8  # bytes per float64


def pack_bounds(total: int) -> list[int]:
    """Documents shorter than the conv widths (1, 2, 3 tokens) and long ones that span every rank."""
    lengths = [1, 3, total * 2 // 5, 2, 5]
    return [0, *itertools.accumulate(lengths + [total - sum(lengths)])]


def make_layout(spec: str, world: int, seq_local: int = S_LOCAL) -> Layout:
    if spec == "packed":
        return PackedLayout.build(pack_bounds(world * seq_local), world)
    return resolve_layout(spec, world)


def doc_starts(layout: Layout, seq_len: int) -> list[int]:
    """The start of each token's document."""
    starts = [0] * seq_len
    for run in layout.global_runs(seq_len):
        starts[run.pos:run.pos + run.length] = [run.pos] * run.length
    return starts


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- single-process references: sequential loops over the full sequence ----

def conv_ref(x, w, b, starts, activation):
    width, out = w.shape[1], []
    for t in range(x.shape[1]):
        lo = max(starts[t], t - width + 1)
        out.append((x[:, lo:t + 1] * w[:, width - (t + 1 - lo):].T).sum(1))
    y = torch.stack(out, 1) + b
    return F.silu(y) if activation == "silu" else y


def scan_ref(a, u, starts):
    h, out = torch.zeros_like(u[:, 0]), []
    for t in range(u.shape[1]):
        h = (0 if starts[t] == t else a[:, t] * h) + u[:, t]
        out.append(h)
    return torch.stack(out, 1)


def delta_ref(q, k, v, beta, g, starts):
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    out = []
    for t in range(q.shape[1]):
        if starts[t] == t:
            state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        kt, bt = k[:, t].unsqueeze(-1), beta[:, t, :, None, None]
        erase = eye - bt * kt @ kt.transpose(-1, -2)
        state = g[:, t].exp()[..., None, None] * erase @ state + bt * kt @ v[:, t].unsqueeze(-2)
        out.append((state.transpose(-1, -2) @ q[:, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(out, 1)


# ---- inputs, built identically in the workers and the parent ----

def conv_inputs(world: int, width: int):
    seq = world * S_LOCAL
    return randn(B, seq, C, seed=1), randn(C, width, seed=2), randn(C, seed=3), randn(B, seq, C, seed=4)


def scan_inputs(seq: int):
    a = 0.5 + 0.5 * torch.rand(B, seq, STATE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return a, randn(B, seq, STATE, seed=6), randn(B, seq, STATE, seed=7)


def delta_inputs(seq: int):
    q, k = randn(B, seq, H, DK, seed=8), F.normalize(randn(B, seq, H, DK, seed=9), dim=-1)
    beta, g = torch.sigmoid(randn(B, seq, H, seed=11)), -0.3 * F.softplus(randn(B, seq, H, seed=12))
    return [q, k, randn(B, seq, H, DV, seed=10), beta, g], randn(B, seq, H, DV, seed=13)


def summaries(layout: Layout, seq_len: int, rank: int, kind: str):
    """Per-run (final, transition) of `rank`, with transitions broadcast over the batch dim."""
    runs = len(layout.runs(rank, seq_len))
    if kind == "diagonal":
        final, trans = randn(runs, B, STATE, seed=20 + rank), randn(runs, 1, STATE, seed=40 + rank).sigmoid()
    else:
        final, trans = randn(runs, B, DK, DV, seed=20 + rank), 0.5 * randn(runs, 1, DK, DK, seed=40 + rank)
    return final, trans, randn(*final.shape, seed=60 + rank)


# ---- worker cases (run on every rank) ----

def conv_cases(mesh, widths: list[int]) -> list[dict]:
    world, rank, results = mesh.size(), mesh.get_local_rank(), []
    for spec, width in itertools.product(LAYOUTS, widths):
        layout = make_layout(spec, world)
        x, w, b, probe = conv_inputs(world, width)
        x = layout.shard(x, 1, rank).requires_grad_()
        w, b = w.requires_grad_(), b.requires_grad_()
        weight = w.unsqueeze(1) if width == 4 else w  # nn.Conv1d's (channels, 1, width) too
        meter = CommMeter()
        y = cp_causal_conv1d(x, weight, b, mesh=mesh, layout=layout, activation="silu" if width % 2 else None,
                             meter=meter)
        forward = meter.total
        (y * layout.shard(probe, 1, rank)).sum().backward()
        results.append({"spec": spec, "width": width, "y": y.detach(), "x": x.grad, "w": w.grad, "b": b.grad,
                        "fwd": forward, "bwd": meter.total - forward})
    return results


def recurrence_cases(mesh, cases: list[tuple[str, int]]) -> list[dict]:
    world, rank, results = mesh.size(), mesh.get_local_rank(), []
    for spec, seq_local in cases:
        layout, seq = make_layout(spec, world, seq_local), world * seq_local
        out = {"spec": spec, "seq_local": seq_local}
        a, u, probe = scan_inputs(seq)
        a, u = (layout.shard(t, 1, rank).requires_grad_() for t in (a, u))
        meter = CommMeter()
        h = cp_linear_scan(a, u, mesh=mesh, layout=layout, meter=meter)
        (h * layout.shard(probe, 1, rank)).sum().backward()
        out["scan"] = {"h": h.detach(), "a": a.grad, "u": u.grad, "bytes": dict(meter.bytes_sent)}
        inputs, probe = delta_inputs(seq)
        inputs = [layout.shard(t, 1, rank).requires_grad_() for t in inputs]
        meter = CommMeter()
        o = cp_delta_rule(*inputs, mesh=mesh, layout=layout, meter=meter)
        (o * layout.shard(probe, 1, rank)).sum().backward()
        out["delta"] = {"o": o.detach(), "grads": [t.grad for t in inputs], "bytes": dict(meter.bytes_sent)}
        for kind in ("diagonal", "matrix"):
            final, trans, probe = summaries(layout, seq, rank, kind)
            final, trans = final.requires_grad_(), trans.requires_grad_()
            init = cp_initial_states(final, trans, mesh=mesh, layout=layout, seq_len=seq, kind=kind)
            (init * probe).sum().backward()
            out[kind] = {"init": init.detach(), "final": final.grad, "trans": trans.grad}
        results.append(out)
    return results


# ---- oracles the parent checks against ----

def halo_rows(layout: Layout, seq: int, width: int) -> tuple[list[int], list[int]]:
    """Per rank, the halo rows it sends and receives (oracle: an owner table and document starts)."""
    owner, starts = torch.empty(seq, dtype=torch.long), doc_starts(layout, seq)
    for r in range(layout.world):
        owner[layout.local_indices(r, seq)] = r
    sent, received = [0] * layout.world, [0] * layout.world
    for d in range(layout.world):
        for run in layout.runs(d, seq):
            for p in range(max(starts[run.pos], run.pos - width + 1), run.pos):
                if owner[p] != d:
                    sent[owner[p]] += 1
                    received[d] += 1
    return sent, received


def compose_ref(layout: Layout, seq: int, finals, transitions, kind: str) -> list[torch.Tensor]:
    """Every rank's initial states by a walk over every document's runs in global order."""
    inits = [[None] * len(f) for f in finals]
    runs = sorted((run.pos, run.doc, r, i) for r in range(layout.world) for i, run in enumerate(layout.runs(r, seq)))
    state, doc = None, None
    for _, d, r, i in runs:
        if d != doc:
            state, doc = torch.zeros_like(finals[r][i]), d
        inits[r][i] = state
        t = transitions[r][i]
        state = (t * state if kind == "diagonal" else t @ state) + finals[r][i]
    return [torch.stack(x) for x in inits]


def refusals(mesh) -> dict:
    """Bad input on one rank only must raise on every rank; the group stays usable afterwards."""
    rank = mesh.get_local_rank()
    x, w = randn(B, S_LOCAL, C, seed=1), randn(C, 4, seed=2)
    wide, short = randn(B, S_LOCAL, C + rank, seed=1), randn(B, S_LOCAL - 1 + rank, C, seed=1)
    messages = value_errors({
        "channels": lambda: cp_causal_conv1d(wide, w, mesh=mesh),
        "seq_local": lambda: cp_causal_conv1d(short, w, mesh=mesh),
        "dtype": lambda: cp_linear_scan(x.float() if rank else x, x.float() if rank else x, mesh=mesh),
        "world": lambda: cp_linear_scan(x, x, mesh=mesh, layout=ZigzagLayout(3)),
        "runs": lambda: cp_initial_states(randn(2 + rank, B, 3, seed=0), randn(2 + rank, B, 3, seed=0), mesh=mesh,
                                          layout="zigzag", seq_len=48, kind="diagonal"),
    })
    good = cp_causal_conv1d(x, w, mesh=mesh)
    return {"messages": messages, "shape": tuple(good.shape)}


def low_precision(mesh) -> dict:
    """bf16 inputs: outputs and gradients stay bf16 (states compose in float32) and track float64."""
    world, rank, out = mesh.size(), mesh.get_local_rank(), {}
    layout, seq = make_layout("packed", world), world * S_LOCAL
    x, w, b, _ = conv_inputs(world, 4)
    a, u, _ = scan_inputs(seq)
    inputs, _ = delta_inputs(seq)
    calls = {
        "conv": (lambda t: cp_causal_conv1d(t[0], t[1], t[2], mesh=mesh, layout=layout, activation="silu"),
                 [layout.shard(x, 1, rank), w, b]),
        "scan": (lambda t: cp_linear_scan(*t, mesh=mesh, layout=layout), [layout.shard(t, 1, rank) for t in (a, u)]),
        "delta": (lambda t: cp_delta_rule(*t, mesh=mesh, layout=layout), [layout.shard(t, 1, rank) for t in inputs]),
    }
    for name, (call, args) in calls.items():
        results = []
        for dtype in (torch.float64, torch.bfloat16):
            leaves = [t.detach().to(dtype).requires_grad_() for t in args]
            y = call(leaves)
            y.float().square().sum().backward()
            results.append((y.detach(), [t.grad for t in leaves]))
        out[name] = results
    return out


def float64_module(build: Callable[[], nn.Module], scale: float) -> nn.Module:
    """`build()` in float64, as `from_config(dtype=torch.float64)` builds it (MiniMax computes its decay buffers
    at construction), every parameter drawn from one seed times `scale` (direct construction leaves some empty)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        module = build()
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
    return module


def value_errors(calls: dict[str, Callable[[], object]],
                 region: Callable[[], ContextManager] = contextlib.nullcontext) -> dict[str, str | None]:
    """Each call's `ValueError` message (None when it returned), each run inside a fresh `region()`: the refusal
    cases give bad input to one rank, and every rank must get the same message."""
    messages: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            with region():
                call()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages
