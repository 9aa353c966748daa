"""The checks every CP attention call passes on every rank before any K/V moves.

`checked_call` is the one path every call takes, eager (`api.attend`) or compiled (the
custom op in `op.py`): this rank's local checks, the choice of `strategy="auto"`, then
the cross-rank agreement (`cpcompose.agreement`), which raises the same error on every
rank or lets the strategy run. `setup_for` rebuilds an agreed call's setup without
communication (the compiled backward needs it).
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Callable, TypeVar

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import CallSpec, Signature, agreed_call
from cpcompose.attention.call import auto
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.local.kernels import KernelArgs, select_backend
from cpcompose.attention.call.key_padding import EXTRA, key_padding_error
from cpcompose.attention.call.nonfinite import NONFINITE_V, nonfinite_note, spread_nonfinite
from cpcompose.attention.call.options import AUTO, CHOICES, VALIDATE_MODES, CPOptions
from cpcompose.attention.strategies.alltoall_chunked import head_chunks_error
from cpcompose.attention.strategies.registry import STRATEGIES
from cpcompose.attention.strategies.strategy import Strategy
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.precision import accumulation_dtype

__all__ = ["checked_call", "setup_for", "sinks_error", "tensor_error", "window_pair"]

R = TypeVar("R")


def checked_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: DeviceMesh,
    is_causal: bool,
    scale: float | None,
    options: CPOptions,
    softcap: float | None,
    return_lse: bool,
    caller_error: str | None,
    run: Callable[[AttentionSetup], R],
    sinks: Tensor | None = None,
    key_padding: Tensor | None = None,
) -> R:
    """Check one call on every rank, then `run(setup)`; the one path every CP attention takes.

    Local checks, then the cross-rank agreement (skipped for a call every rank
    expects, see `cpcompose.agreement`). `run` is the strategy's autograd
    function (`attend`) or the compiled route's custom op body (`cpcompose.attention.call.op`);
    it returns a tuple whose first item is the output (`nonfinite.spread_nonfinite` may
    set NaN in it where a single-process softmax would have them). With `key_padding`,
    `run` attends q and k widened by `key_padding.with_key_bias` (its presence is part
    of the agreed signature, so no rank runs a widened call against a plain one).

    Raises:
        ValueError: on every rank, as `cp_attention` describes.
    """
    cp = CPGroup.from_mesh(mesh)
    layout: Layout | None = None
    window, window_error = window_pair(options.window_size, is_causal)
    error = (
        caller_error or options.error(cp.world) or window_error
        or tensor_error(q, k, v) or _head_chunks_error(options, q, k, cp.world)
        or _positive_error("scale", scale) or _positive_error("softcap", softcap)
        or sinks_error(sinks, q) or key_padding_error(key_padding, q, k, softcap)
    )
    if error is None:
        layout = resolve_layout(options.layout, cp.world)
        error = layout.local_len_error(q.shape[2])
    if error is None:
        try:
            select_backend(q, options.backend)
        except ValueError as e:
            error = str(e)
    signature = _signature(q, k, v, is_causal, scale, softcap, window, options, layout, return_lse)
    signature.flag("sinks", sinks is not None)
    signature.flag("key_padding", key_padding is not None)
    _auto_fields(signature, options, q)  # on every rank, auto or not: the agreement's size is fixed
    if options.strategy == AUTO:
        options, error = _resolve_auto(options, q, k, v, layout, is_causal, window, return_lse, cp, error)
    strategy = STRATEGIES.get(options.strategy)

    def setup(meter: CommMeter | None) -> AttentionSetup:
        return setup_for(q, mesh=mesh, is_causal=is_causal, scale=scale, softcap=softcap,
                         options=options.replace(meter=meter), return_lse=return_lse or key_padding is not None,
                         sinks=sinks)

    def spec() -> CallSpec:  # what this rank replays on zeros if it deviates from this call later
        s = setup(None)  # the group stays out of it: the history it goes into is owned by the group
        widen = 0 if key_padding is None else EXTRA  # the strategy ran on q, k widened by the key bias
        shapes = ((*q.shape[:3], q.shape[3] + widen), (*k.shape[:3], k.shape[3] + widen), v.shape)
        return CallSpec(shapes, q.dtype, q.device,
                        functools.partial(_replay, strategy, s.layout, s.mask, s.kernel, s.need_lse, s.alltoall_size,
                                          s.head_chunks, s.ring_tiles))

    result, notes = agreed_call(
        cp, error, signature, what="cp_attention", device=_metadata_device(q),
        every_call=options.validate == "every_call", spec=spec, run=lambda: run(setup(options.meter)),
        note=nonfinite_note(v) if error is None else 0,
    )
    if notes is not None and notes & NONFINITE_V:  # every rank knows (the notes travelled): all spread alike
        s = setup(None)
        out = spread_nonfinite(result[0], v, s.layout, s.mask, cp)
        return type(result)((out, *result[1:]))  # type: ignore[return-value]
    return result


def _resolve_auto(
    options: CPOptions, q: Tensor, k: Tensor, v: Tensor, layout: Layout | None, is_causal: bool,
    window: tuple[int | None, int | None], return_lse: bool, cp: CPGroup, error: str | None,
) -> tuple[CPOptions, str | None]:
    """`strategy="auto"` replaced by the cost model's choice (kept as "auto" where this rank has an error).

    The choice is a function of the agreed signature, so ranks that agree chose alike;
    a failure to choose is this rank's error, raised on every rank by the agreement.
    """
    if error is not None or layout is None:
        return options, error
    try:
        resolved, _ = auto.resolve(options, q, k, v, layout=layout, mask=MaskSpec(is_causal, *window),
                                   need_lse=return_lse, rank=cp.rank)
    except ValueError as e:
        return options, f"strategy='auto' could not choose: {e}"
    return resolved, None


def _auto_fields(signature: Signature, options: CPOptions, q: Tensor) -> None:
    """What `auto` chooses from beyond the call itself: every rank must use the same machine model.

    Present in every signature (-1 unless the strategy is "auto"), so a rank asking for
    "auto" alone sends as many fields as its peers and the agreement can name the difference.
    """
    if options.strategy != AUTO or options.auto_error() is not None:  # a bad machine model is reported anyway
        signature.code("strategy='auto' calibration", -1).code("strategy='auto' ranks_per_node", -1)
        return
    calibration, topology = auto.machine_model(options, q.device if isinstance(q, Tensor) else torch.device("cpu"))
    signature.code("strategy='auto' calibration", int(calibration.fingerprint(), 16) & (2**62 - 1))
    signature.int("strategy='auto' ranks_per_node", topology.ranks_per_node)


def setup_for(
    q: Tensor, *, mesh: DeviceMesh, is_causal: bool, scale: float | None, softcap: float | None,
    options: CPOptions, return_lse: bool, sinks: Tensor | None = None,
) -> AttentionSetup:
    """The group, layout, mask and kernel of a call that was already checked (no communication).

    With sinks the LSE always comes back to the queries' rank: their gradient needs it.
    """
    cp = CPGroup.from_mesh(mesh)
    kernel = KernelArgs(
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=select_backend(q, options.backend), softcap=None if softcap is None else float(softcap),
    )
    mask = MaskSpec(is_causal, *window_pair(options.window_size, is_causal)[0])
    return AttentionSetup(
        cp, resolve_layout(options.layout, cp.world), mask, kernel, options.meter, return_lse or sinks is not None,
        options.alltoall_size, options.strategy,
        None if sinks is None else sinks.detach().to(accumulation_dtype(q.dtype)), options.head_chunks,
        options.ring_tiles,
    )


def _replay(strategy: Strategy, layout: Layout, mask: MaskSpec, kernel: KernelArgs, need_lse: bool,
            alltoall_size: int | None, head_chunks: int, ring_tiles: int, cp: CPGroup, q: Tensor, k: Tensor,
            v: Tensor) -> None:
    """An agreed call again, on other tensors, unmetered (see `agreement.CallSpec.mimic`)."""
    strategy.apply(q, k, v, AttentionSetup(cp, layout, mask, kernel, None, need_lse, alltoall_size,
                                           head_chunks=head_chunks, ring_tiles=ring_tiles))


def _head_chunks_error(options: CPOptions, q: Tensor, k: Tensor, world: int) -> str | None:
    """Whether this call's heads split into `options.head_chunks` chunks (q and k already checked), or None."""
    if options.head_chunks == 1:
        return None
    return head_chunks_error(q.shape[1], k.shape[1], options.head_chunks, world)


def _metadata_device(q: object) -> torch.device:
    """Where the agreement's tiny tensor lives: q's device (CUDA for NCCL), CPU if q has none."""
    return q.device if isinstance(q, Tensor) and q.device.type != "meta" else torch.device("cpu")


def _signature(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float | None,
    window: tuple[int | None, int | None], options: CPOptions, layout: Layout | None, return_lse: bool,
) -> Signature:
    """What must be equal on every rank: shapes, dtype, mask, options and the whole split."""
    signature = Signature()
    for name, t in (("q", q), ("k", k), ("v", v)):
        signature.shape(name, t.shape if isinstance(t, Tensor) else ())
    return (
        signature.dtype("dtype", getattr(q, "dtype", None))
        .flag("is_causal", causal)
        .code("strategy", CHOICES.index(options.strategy) if options.strategy in CHOICES else -1)
        .layout(layout)
        .code("window_size (left)", -1 if window[0] is None else window[0])
        .code("window_size (right)", -1 if window[1] is None else window[1])
        .float("scale", scale)
        .float("softcap", softcap)
        .code("backend", zlib.crc32(str(options.backend).encode()))
        .flag("return_lse", return_lse)
        .code("validate", VALIDATE_MODES.index(options.validate) if options.validate in VALIDATE_MODES else -1)
        .int("alltoall_size", options.alltoall_size)
        .int("head_chunks", options.head_chunks)
        .int("ring_tiles", options.ring_tiles)
    )


def tensor_error(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """What is wrong with this rank's q, k, v on their own, or None."""
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        return f"q, k, v must be tensors, got {type(q).__name__}, {type(k).__name__}, {type(v).__name__}"
    if any(t.ndim != 4 for t in (q, k, v)):
        return (
            f"q, k, v must be 4-D (batch, heads, seq, head_dim), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if q.device.type == "meta":
        return "q, k, v are meta tensors (no data): materialize the model (e.g. to_empty + init) before attending"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or not (q.shape[2] == k.shape[2] == v.shape[2]):
        return (
            f"q, k, v must share batch (dim 0) and local sequence length (dim 2), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[3] != k.shape[3]:
        return (
            f"q and k must share head_dim (dim 3; v may differ, as in MLA), got {q.shape[3]}, {k.shape[3]}, "
            f"and v {v.shape[3]}"
        )
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return (
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads (k: {k.shape[1]}, "
            f"v: {v.shape[1]}, which must be equal)"
        )
    sizes = (("batch", q.shape[0]), ("heads", q.shape[1]), ("head_dim", q.shape[3]), ("value head_dim", v.shape[3]))
    empty = [name for name, n in sizes if n == 0]
    if empty:
        return f"q, k, v have no {' or '.join(empty)} (size 0): attention needs at least one of each"
    return None


def sinks_error(sinks: object, q: object) -> str | None:
    """Why `sinks` are not one finite-or-not float logit per query head of `q`, on q's device, or None."""
    if sinks is None or not isinstance(q, Tensor) or q.ndim != 4:
        return None
    if not isinstance(sinks, Tensor) or sinks.ndim != 1 or sinks.numel() != q.shape[1]:
        return (f"sinks must be a 1-D tensor of one logit per query head ({q.shape[1]}), got "
                f"{getattr(sinks, 'shape', type(sinks).__name__)}")
    if not sinks.is_floating_point() or sinks.device != q.device:
        return f"sinks must be floating point on q's device ({q.device}), got {sinks.dtype} on {sinks.device}"
    return None


def _positive_error(name: str, x: object) -> str | None:
    """Why `x` (a scale or a softcap) is not a finite positive number or None."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        return f"{name} must be a finite positive number or None, got {x!r}"
    return None


def window_pair(window_size: object, causal: bool) -> tuple[tuple[int | None, int | None], str | None]:
    """`window_size` as `(left, right)` (None = unbounded), or why it is invalid.

    An int W means `(W, 0)` and needs a causal mask; a pair is flash-attn's convention
    (-1 or None = unbounded on that side), and a causal window has right = 0.
    """
    if window_size is None:
        return (None, None), None
    if not isinstance(window_size, (tuple, list)):
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            return (None, None), (
                f"window_size must be a positive number of positions or a (left, right) pair, got {window_size!r}"
            )
        if not causal:
            return (None, None), (
                "window_size needs is_causal=True (an int window is to the left of each query); "
                "pass window_size=(left, right) for bidirectional local attention"
            )
        return (window_size, 0), None
    if len(window_size) != 2 or any(
        side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < -1) for side in window_size
    ):
        return (None, None), (
            f"window_size=(left, right) needs two non-negative ints (-1 or None = unbounded), got {window_size!r}"
        )
    left, right = (None if side is None or side == -1 else side for side in window_size)
    if causal and right != 0:
        return (None, None), (
            f"window_size={tuple(window_size)!r} with is_causal=True: a causal window has right = 0 "
            "(use is_causal=False for a two-sided window)"
        )
    return (left, right), None
