"""`cp_attention`: context-parallel attention on local sequence shards."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.attention.call.key_padding import key_padding_error, unseen_to_zero, with_key_bias
from cpcompose.attention.call.orchestrate import checked_call, tensor_error
from cpcompose.attention.call.op import CPContext, compiled_attention
from cpcompose.attention.call.options import CPOptions
from cpcompose.attention.strategies.registry import STRATEGIES

__all__ = ["attend", "cp_attention"]


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: DeviceMesh | CPContext,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    options: CPOptions | None = None,
    return_lse: bool = False,
    sinks: Tensor | None = None,
    key_padding: Tensor | None = None,
    **overrides: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over the global sequence, given this rank's shards.

    Args:
        q, k, v: local shards `(batch, heads, seq_local, head_dim)`, cut by the
            layout (see `cp_shard`, `cp_shard_packed`). K/V may have fewer heads (GQA/MQA).
        mesh: the 1-D CP mesh (`mesh["cp"]` of a larger one), or a `CPContext` (the mesh
            with its options, made outside compiled code), which `torch.compile` needs.
        is_causal: causal mask by global position.
        scale: softmax scale; default `1/sqrt(head_dim)` (of q and k; v's may differ, as in MLA).
        softcap: cap the logits at +-softcap (`softcap * tanh(scores / softcap)`, as in
            Gemma 2); None = no cap.
        options: a `CPOptions` (strategy, layout, window_size, backend, meter, validate).
        return_lse: also return the float32 log-sum-exp `(batch, heads, seq_local)`.
        sinks: attention sinks (gpt-oss): one logit per query head `(heads,)` that joins
            every row's softmax with no value; the LSE returned then includes it. Its
            gradient is this rank's share (sum it over the CP ranks, as every replicated
            parameter's: `allreduce_gradients` or FSDP over the CP mesh do).
        key_padding: a per-row key mask `(batch, seq_local)`, bool, True = a real key: this
            rank's rows of each batch row's padding mask, cut by the same layout as k
            (`cp_shard` of the full mask). Combined with the causal, window and document
            masks; a query that sees no real key gets output 0 and LSE -inf, as SDPA gives
            for a fully masked row. Not with float16 or softcap (see `call.key_padding`).
        **overrides: any `CPOptions` field by name, e.g. `strategy="alltoall"`,
            `strategy="alltoall_ring", alltoall_size=2` (2-D), `strategy="auto"` (the
            cost model picks per call signature, `cpcompose.attention.call.auto`),
            `layout=shard.layout` (a `PackedLayout` for packed documents: the very
            object the shards were cut by), `window_size=512` (causal) or
            `window_size=(left, right)` (bidirectional local attention).

    Returns:
        The local output shard (same layout as `q`), and the LSE if asked for.

    Raises:
        ValueError: on every rank, if any rank's input is invalid or the ranks disagree
            on shapes, dtypes, options or layout: before any K/V moves on a call the
            ranks did not all expect (the first, or a new signature everywhere); for a
            rank deviating alone after warm-up, on CPU after the expected call's
            exchange (its result discarded), on CUDA only with `validate="every_call"`
            (see `cpcompose.agreement`).
        TypeError: an override that is not a `CPOptions` field, or options given with a `CPContext`.
    """
    if isinstance(mesh, CPContext):
        if options is not None or overrides:
            raise TypeError("cp_attention got a CPContext and options: give the options to the CPContext")
        if torch.compiler.is_compiling():  # dynamo cannot trace the agreement: hide it in the custom op
            return compiled_attention(
                q, k, v, context=mesh, is_causal=is_causal, scale=scale, softcap=softcap, return_lse=return_lse,
                caller_error=_COMPILED_SINKS if sinks is not None else _COMPILED_KEY_PADDING if key_padding is not None
                else None,
            )
        mesh, opts = mesh.mesh, mesh.options()
    elif torch.compiler.is_compiling():
        raise ValueError(
            "cp_attention inside torch.compile needs mesh=CPContext(mesh, options), made outside the "
            "compiled code (dynamo cannot create one); SDPA inside a ContextParallel or context_parallel "
            "region needs nothing"
        )
    else:
        opts = (options or CPOptions()).replace(**overrides)
    return attend(
        q, k, v, mesh=mesh, is_causal=is_causal, scale=scale, softcap=softcap, options=opts, return_lse=return_lse,
        sinks=sinks, key_padding=key_padding,
    )


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: DeviceMesh,
    is_causal: bool,
    scale: float | None,
    options: CPOptions,
    softcap: float | None = None,
    return_lse: bool = False,
    caller_error: str | None = None,
    sinks: Tensor | None = None,
    key_padding: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`cp_attention` for callers that checked inputs of their own (`caller_error`: their complaint).

    The caller's complaint joins this rank's verdict in the one cross-rank agreement,
    so every rank raises it, or none does. A `key_padding` mask becomes a bias column
    of K (`call.key_padding`), which each strategy then moves as part of K.
    """
    run_q, run_k = q, k
    if key_padding is not None and tensor_error(q, k, v) is None and not key_padding_error(key_padding, q, k, softcap):
        run_q, run_k = with_key_bias(q, k, key_padding)  # a rank with an error runs nothing: the agreement raises
    out, lse = checked_call(
        q, k, v, mesh=mesh, is_causal=is_causal, scale=scale, options=options, softcap=softcap,
        return_lse=return_lse, caller_error=caller_error, sinks=sinks, key_padding=key_padding,
        run=lambda setup: STRATEGIES[setup.strategy].apply(run_q, run_k, v, setup),
    )
    if key_padding is not None:
        out, lse = unseen_to_zero(out, lse, scale if scale is not None else q.shape[-1] ** -0.5)
    if sinks is not None:
        out = SinkGradient.apply(out, sinks, lse)
    return (out, lse) if return_lse else out


_COMPILED_KEY_PADDING = (
    "key_padding is not supported inside torch.compile yet (the compiled op takes no key mask); run this "
    "attention eagerly, or pack the rows as documents (a PackedLayout)"
)

_COMPILED_SINKS = (
    "attention sinks are not supported inside torch.compile yet (they would need the compiled op's own "
    "gradient); run this model eagerly"
)


class SinkGradient(torch.autograd.Function):
    """The output unchanged; the sinks' gradient in backward.

    The strategy folded the sinks into the `(out, lse)` its backward reads
    (`merge.fold_sinks`), so q, k and v get the gradients of the softmax with the sink.
    The sink, a logit with no value, gets `-sum_i exp(sink - lse_i) * (dout_i . out_i)`
    over this rank's rows (the flash-attention backward's `D_i` term of a key whose value is 0).
    """

    @staticmethod
    def forward(ctx: Any, out: Tensor, sinks: Tensor, lse: Tensor) -> Tensor:
        ctx.save_for_backward(out, sinks, lse)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, None]:
        out, sinks, lse = ctx.saved_tensors
        acc = lse.dtype
        d = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, H, S)
        weight = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
        return dout, (-(weight * d).sum(dim=(0, 2))).to(sinks.dtype), None
