"""Two exact CP recurrences built on `initial_states`: a linear scan and the gated delta rule.

Both run each local run once from a zero state (its end state is the run's `final`),
with how a run maps an initial state to its end (`transition`) from the same pass, get
each run's true initial state from `initial_states`, and add its contribution to the
outputs (they are affine in it). They are readable references and building blocks
(plain loops over tokens), not fast kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout, LayoutSpec
from cpcompose.mixers._checks import agree, float_tensors_error, layout_fields, local_layout, shape_of
from cpcompose.mixers.states import initial_states

__all__ = ["cp_delta_rule", "cp_linear_scan"]


def _prepare(
    what: str, mesh: DeviceMesh, layout: LayoutSpec, error: str | None, first: object, tensors: dict[str, object],
) -> tuple[CPGroup, Layout, int]:
    """Check the split on this rank, agree across ranks; the group, layout and global length."""
    cp = CPGroup.from_mesh(mesh)
    seq_local = first.shape[1] if isinstance(first, Tensor) and first.ndim >= 2 else 0
    split, layout_error = local_layout(layout, cp, seq_local)
    grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors.values())
    shapes = [(name, shape_of(t)) for name, t in tensors.items()]
    signature = layout_fields(split, getattr(first, "dtype", None), grad, *shapes)
    device = first.device if isinstance(first, Tensor) else torch.device("cpu")
    agree(cp, layout_error or error, signature, what=what, device=device)
    assert split is not None
    return cp, split, seq_local * cp.world


def cp_linear_scan(
    a: Tensor, u: Tensor, *, mesh: DeviceMesh, layout: LayoutSpec = None, meter: CommMeter | None = None,
) -> Tensor:
    """Every `h_t = a_t * h_{t-1} + u_t` (elementwise) of the global sequence, on this rank's shard.

    `h` restarts from zero at each document start.

    Args:
        a, u: `(batch, seq_local, *state)`, this rank's shards, one shape and dtype.
        mesh: the 1-D CP mesh; layout: the split (default zigzag).
        meter: counts the bytes of the state exchange.

    Returns:
        `h`, shaped like `u`; differentiable w.r.t. `a` and `u`.

    Raises:
        ValueError: on every rank, if any rank's input is invalid or the ranks' inputs differ.
    """
    error = float_tensors_error(a=a, u=u)
    if error is None and (a.ndim < 2 or a.shape != u.shape):
        error = f"a and u must be (batch, seq_local, *state) of one shape, got {tuple(a.shape)} and {tuple(u.shape)}"
    cp, layout, seq_len = _prepare("cp_linear_scan", mesh, layout, error, u, {"a": a, "u": u})
    runs = layout.runs(cp.rank, seq_len)
    zero_start, decays = [], []
    for run in runs:
        a_run, u_run = a.narrow(1, run.row, run.length), u.narrow(1, run.row, run.length)
        h, states = torch.zeros_like(u_run[:, 0]), []
        for t in range(run.length):
            h = a_run[:, t] * h + u_run[:, t]
            states.append(h)
        zero_start.append(torch.stack(states, 1))
        decays.append(torch.cumprod(a_run, 1))  # how the run scales the state it starts from
    final = torch.stack([h[:, -1] for h in zero_start])
    transition = torch.stack([d[:, -1] for d in decays])
    init = initial_states(final, transition, cp=cp, layout=layout, seq_len=seq_len, kind="diagonal", meter=meter)
    return torch.cat([h + d * s.unsqueeze(1) for h, d, s in zip(zero_start, decays, init)], dim=1)


def _delta_run(
    k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor, q: Tensor | None = None,
) -> tuple[Tensor | None, Tensor]:
    """The gated delta rule over one run from `state` `(batch, heads, dk, dv)`: outputs (if `q`) and end state."""
    outputs = []
    for t in range(k.shape[1]):
        kt, b, decay = k[:, t], beta[:, t, :, None, None], g[:, t].exp()[..., None, None]
        # exp(g) (I - beta k k^T) S + beta k v^T, without forming the dk x dk matrix.
        state = decay * (state - b * kt.unsqueeze(-1) * (kt.unsqueeze(-2) @ state)) \
            + b * kt.unsqueeze(-1) * v[:, t].unsqueeze(-2)
        if q is not None:
            outputs.append((state.transpose(-1, -2) @ q[:, t].unsqueeze(-1)).squeeze(-1))
    return (torch.stack(outputs, 1) if q is not None else None), state


def _delta_error(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> str | None:
    error = float_tensors_error(q=q, k=k, v=v, beta=beta, g=g)
    if error:
        return error
    if q.ndim != 4 or k.shape != q.shape:
        return f"q and k must be (batch, seq_local, heads, dk) of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        return f"v must be (batch, seq_local, heads, dv) with q's {tuple(q.shape[:3])}, got {tuple(v.shape)}"
    if beta.shape != q.shape[:3] or g.shape != q.shape[:3]:
        return f"beta and g must be {tuple(q.shape[:3])}, got {tuple(beta.shape)} and {tuple(g.shape)}"
    return None


def cp_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, *, mesh: DeviceMesh, layout: LayoutSpec = None,
    meter: CommMeter | None = None,
) -> Tensor:
    """The gated delta rule over the global sequence, on this rank's shard.

    `S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T` and `o_t = S_t^T q_t`,
    with `S` `(dk, dv)` per head restarting from zero at each document start.

    Args:
        q, k: `(batch, seq_local, heads, dk)`; v: `(batch, seq_local, heads, dv)`;
        beta, g: `(batch, seq_local, heads)` (g a log-decay); one dtype.
        mesh: the 1-D CP mesh; layout: the split (default zigzag).
        meter: counts the bytes of the state exchange.

    Returns:
        `o`, `(batch, seq_local, heads, dv)`; differentiable w.r.t. every input.

    Raises:
        ValueError: on every rank, if any rank's input is invalid or the ranks' inputs differ.
    """
    tensors = {"q": q, "k": k, "v": v, "beta": beta, "g": g}
    cp, layout, seq_len = _prepare("cp_delta_rule", mesh, layout, _delta_error(q, k, v, beta, g), q, tensors)
    batch, _, heads, dk = k.shape
    zero = k.new_zeros(batch, heads, dk, v.shape[-1])
    dv = v.shape[-1]
    # One pass per run, from [0 | I] on the values widened by dk zero columns: the first dv columns are the
    # run from zero (outputs, final state), the last dk end in the transition T and read out A_t^T q_t, so the
    # true state h0 adds h0^T (A_t^T q_t) to each output (the recurrence is affine in h0).
    start = torch.cat([zero, torch.eye(dk, dtype=k.dtype, device=k.device).expand(batch, heads, dk, dk)], dim=-1)
    zeros_dk = k.new_zeros(batch, 1, heads, dk)
    outputs, readouts, finals, transitions = [], [], [], []
    for run in layout.runs(cp.rank, seq_len):
        pq, pk, pv, pbeta, pg = (t.narrow(1, run.row, run.length) for t in (q, k, v, beta, g))
        wide = torch.cat([pv, zeros_dk.expand(batch, run.length, heads, dk)], dim=-1)
        out, end = _delta_run(pk, wide, pbeta, pg, start, pq)
        assert out is not None
        outputs.append(out[..., :dv])
        readouts.append(out[..., dv:])
        finals.append(end[..., :dv])
        transitions.append(end[..., dv:])
    init = initial_states(
        torch.stack(finals), torch.stack(transitions), cp=cp, layout=layout, seq_len=seq_len, kind="matrix",
        meter=meter,
    )
    outputs = [o + torch.einsum("bthk,bhkv->bthv", r, s) for o, r, s in zip(outputs, readouts, init)]
    return torch.cat(outputs, dim=1)
