"""xLSTM's mLSTM under CP (`xLSTMBackend.forward`, transformers' own kernels), exact over the global sequence.

The mLSTM keeps per head a matrix memory `C`, a normalizer `n` and a stabilizer `m`:

    m_t = max(m_{t-1} + logsigmoid(f_t), i_t),  C_t = e^{logsig f_t + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T,
    h_t = q_t C_t / (max(|q_t n_t|, e^{-m_t}) + eps)        (n like C with k_t; m_0 = 0 at a document start),

whatever the kernel's chunking. Unscaled, `C e^m` and `n e^m` are linear in their initial
values with one decay per head, `exp(sum logsigmoid f)` over a run: they pass between runs
through `cpcompose.mixers.cp_chunked_recurrence` (kind "diagonal", float64: the soft-capped
gates keep `e^m` within range). `m` is not linear, and `h` depends on it through `eps`
(`h = q C e^m / (max(|q n e^m|, 1) + eps e^m)`), so each run restarts from the `m` the
sequential run has there: a max-plus recurrence, `m_end = max(m_start + G, M)` per run
(`G` its summed log-forget gates, `M` its `m` from minus infinity), composed from the runs
before it in its document, whose `(G, M)` are fetched from their owners (one exchange of a
few scalars per head and run, differentiable). A rerun then starts from `(C e^{-m}, n e^{-m},
m)`: the sequential run's state, so its outputs are the sequential run's.

Each run goes through transformers' backend in "inference" mode (chunkwise kernel, then its
recurrent kernel for the rest: any run length, states returned), which computes what the
"train" mode computes for the same tokens.

Dtypes: that mode keeps its states in float32 (`inference_state_dtype`), and its chunkwise
kernel multiplies them with the keys without a cast, so bfloat16 or float16 inputs fail there
("expected scalar type Float but found BFloat16"), on one process too, from `chunk_size`
tokens on (below that only the recurrent kernel runs, which casts). So each run here computes
in the states' dtype, float32 at least, and returns its outputs in the inputs' dtype; and
outside a CP region `mlstm_backend_one_process` does the same for exactly the calls that would
fail, so the probe's one-process run (and any single-process use) of a bfloat16 model runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpcompose.agreement import agree_across_ranks, dtype_code
from cpcompose.comm import CPGroup, fetch_positions
from cpcompose.mixers.api_checks import needs_grad, tensor_fields
from cpcompose.layouts import Layout
from cpcompose.mixers.chunked import cp_chunked_recurrence
from cpcompose.mixers.states import tie
from cpcompose.mixers.region import Region

__all__ = ["cp_mlstm_backend", "mlstm_backend_one_process"]

_WHAT = "xLSTMBackend"


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the inference kernels keep their states in, float32 at least: the dtype a run computes in."""
    return torch.promote_types(dtype, torch.float32)


def mlstm_backend_one_process(
    original: Callable[..., Any], self: nn.Module, query: Tensor, key: Tensor, value: Tensor, igate: Tensor,
    fgate: Tensor, c_initial: Tensor | None = None, n_initial: Tensor | None = None, m_initial: Tensor | None = None,
    return_last_states: bool | None = None, mode: str | None = None,
) -> Any:
    """`xLSTMBackend.forward` outside a CP region: transformers' own, except for the calls it fails on.

    Its "inference" mode fails on inputs below float32 from `chunk_size` tokens on, when its stabilizer state
    is float32 (its default zeros, or a float32 cache): its chunkwise kernel then multiplies float32 gated keys
    with the values. Those calls compute in float32 (states float32, as that mode keeps them) and return their
    outputs in the inputs' dtype; every other call is the original's.
    """
    states = dict(c_initial=c_initial, n_initial=n_initial, m_initial=m_initial)
    wide = _kernel_dtype(query.dtype)
    fails = ("inference" in (mode or self.config.mode) and wide != query.dtype
             and query.shape[2] >= self.config.chunk_size and (m_initial is None or m_initial.dtype != query.dtype))
    if not fails:
        return original(self, query, key, value, igate, fgate, **states, return_last_states=return_last_states,
                        mode=mode)
    inputs = (t.to(wide) for t in (query, key, value, igate, fgate))
    h, last = original(self, *inputs, **states, return_last_states=return_last_states, mode=mode)
    return h.to(query.dtype), last


def _shape_error(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor) -> str | None:
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        return (f"{_WHAT}: query/key must be (batch, heads, seq, dqk) and value (batch, heads, seq, dv), got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if i.shape != q.shape[:3] or f.shape != q.shape[:3]:
        return f"{_WHAT}: igate and fgate must be {tuple(q.shape[:3])}, got {tuple(i.shape)} and {tuple(f.shape)}"
    return None


def _starting_m(igate: Tensor, fgate: Tensor, layout: Layout, cp: CPGroup, region: Region
                ) -> tuple[dict[int, Tensor], Tensor]:
    """Per local run (by its first row), the stabilizer `m` the sequential run has at the run's start `(b, h)`;
    and the fetched summaries (the output must depend on them: every rank then joins the exchange's backward)."""
    seq_local = igate.shape[2]
    seq_len = seq_local * cp.world
    every = [layout.runs(r, seq_len) for r in range(cp.world)]
    log_f = F.logsigmoid(fgate.double())
    summaries = []
    for run in every[cp.rank]:  # (G, M): m_end = max(m_start + G, M)
        lf, gate = log_f[..., run.row:run.row + run.length], igate[..., run.row:run.row + run.length].double()
        cum = lf.cumsum(-1)
        summaries.append(torch.stack([cum[..., -1], (gate + cum[..., -1:] - cum).amax(-1)], dim=-1))
    ends = torch.tensor([run.row + run.length - 1 for run in every[cp.rank]], device=igate.device)
    table = igate.new_zeros(igate.shape[0], seq_local, igate.shape[1], 2, dtype=torch.float64)
    table = table.index_copy(1, ends, torch.stack(summaries, dim=1))  # each run's summary at its last row
    chains: dict[int, list[tuple[int, int]]] = {}  # document -> its runs' (position, last position)
    for runs in every:
        for run in runs:
            chains.setdefault(run.doc, []).append((run.pos, run.pos + run.length - 1))
    before = [[[last for pos, last in sorted(chains[run.doc]) if pos < run.pos] for run in runs] for runs in every]
    fetched = fetch_positions(table, [sum(b, []) for b in before], cp=cp, layout=layout, seq_len=seq_len,
                              meter=region.options.meter)
    starts, at = {}, 0
    for run, earlier in zip(every[cp.rank], before[cp.rank]):
        m = fetched.new_zeros(fetched.shape[0], fetched.shape[2])  # m_0 = 0 at the document's start
        for k in range(at, at + len(earlier)):
            m = torch.maximum(m + fetched[:, k, :, 0], fetched[:, k, :, 1])
        starts[run.row], at = m, at + len(earlier)
    return starts, fetched


def cp_mlstm_backend(
    original: Callable[..., Any], region: Region, self: nn.Module, query: Tensor, key: Tensor, value: Tensor,
    igate: Tensor, fgate: Tensor, c_initial: Tensor | None = None, n_initial: Tensor | None = None,
    m_initial: Tensor | None = None, return_last_states: bool | None = None, mode: str | None = None,
) -> tuple[Tensor, None]:
    """`xLSTMBackend.forward` under CP: q, k `(batch, heads, seq_local, dqk)`, v `(..., dv)`, gates
    `(batch, heads, seq_local)` (pre-activations).

    Returns:
        `(h (batch, heads, seq_local, dv), None)`: no last states (they feed a generation cache,
        which CP refuses).

    Raises:
        ValueError: on every rank, before any state moves, if any rank passes initial states
            (a cache) or shapes that differ.
    """
    error = None
    if any(s is not None for s in (c_initial, n_initial, m_initial)):
        error = (f"{_WHAT} got initial states (a generation cache, or the long-input chunked inference path): "
                 "under CP call the model with use_cache=False, in training mode or with inputs shorter than "
                 "config.max_inference_chunksize per rank")
    error = error or _shape_error(query, key, value, igate, fgate)
    cp, layout = CPGroup.from_mesh(region.mesh), region.layout()
    seq_local = query.shape[2] if query.ndim == 4 else -1
    error = error or region.options.error(cp.world) or (layout.local_len_error(seq_local) if layout else None)
    grad = needs_grad(query, key, value, igate, fgate)
    signature = [*tensor_fields("query", query), *tensor_fields("value", value), ("dtype", dtype_code(query.dtype)),
                 ("layout", -1 if layout is None else layout.identity), ("grad", int(grad))]
    agree_across_ranks(cp, error, signature, what=_WHAT, device=query.device)  # before the gates' exchange
    assert layout is not None
    m_start, fetched = _starting_m(igate, fgate, layout, cp, region)
    state_dtype = _kernel_dtype(query.dtype)  # a run computes in it (see the module's docstring: "Dtypes")
    dv = value.shape[-1]

    def kernel(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        start: dict[str, Tensor | None] = dict(c_initial=None, n_initial=None, m_initial=None)
        if init is not None:  # unscaled (C | n) -> the kernel's form at the sequential run's m
            m = m_start[rows.start]
            scaled = (init * torch.exp(-m)[..., None, None]).to(state_dtype)
            start = dict(c_initial=scaled[..., :dv], n_initial=scaled[..., dv], m_initial=m[..., None].to(state_dtype))
        inputs = (t[:, :, rows].to(state_dtype) for t in (query, key, value, igate, fgate))
        h, (c, n, m_end) = original(self, *inputs, **start, mode="inference")
        unscaled = torch.cat([c.double(), n.double()[..., None]], dim=-1) * m_end.double().exp()[..., None]
        return h.to(query.dtype), unscaled  # (batch, heads, dqk, dv + 1)

    def transition(rows: slice) -> Tensor:
        return F.logsigmoid(fgate[:, :, rows].double()).sum(-1).exp()[..., None, None]  # (batch, heads, 1, 1)

    h = cp_chunked_recurrence(
        kernel, transition, mesh=region.mesh, layout=region.options.layout, seq_local=seq_local, kind="diagonal",
        out_dim=2, what=_WHAT, device=query.device, dtype=query.dtype, grad=grad, meter=region.options.meter,
    )
    return tie(h, fetched), None
