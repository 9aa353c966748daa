"""What a Llama holds during a training step: the :class:`MemoryProfile` the memory plan adds up.

Counted from the modules in ``model.py`` as autograd runs them (a test checks each figure
against a ``saved_tensors_hooks`` count of the real modules). Per token of a rank's shard,
with D = dim, Dq and Dk the query and key/value widths and F the feed-forward width on this
tensor-parallel rank:

* float32, one block saves 6 D-wide tensors (its input, the two RMSNorms' normalized values
  and outputs, the residual sum), 3 Dq-wide (query, attention output, its reshaped copy for
  ``wo``), 2 Dk-wide (key, value), 4 F-wide (the SwiGLU's w1 and w3 outputs, the SiLU and the
  product), the attention's float32 LSE per head and two RMSNorm scales: 4 bytes each.
* bfloat16 autocast keeps the residual stream and the RMSNorms in float32 (4 D-wide tensors
  of 4 bytes) but casts each linear's input separately (3 + 2 D-wide copies of 2 bytes) and
  saves the attention and feed-forward tensors in bf16.
* bfloat16 parameters (FSDP2's mixed precision, no autocast): the residual stream is bf16 (a block's input,
  2 D); each RMSNorm keeps its float32 input and its bf16 normalized value (6 D), each linear its bf16 input
  (no cast copies), the attention and SwiGLU tensors as under autocast.
* A sequence-tiled feed-forward (``mlp_tiles`` > 1) saves only its input; one tile of its
  intermediates lives at a time, in forward and again (with gradients) in backward.
* The loss without fusion peaks in backward: the float32 log-softmax it saved, its gradient and
  the logits' gradient, 12 V (the logits, c V, and under bf16 their float32 copy, 4 V, are freed
  once forward has made the log-softmax: 8 V or 10 V there).
* The fused loss (`cpcompose.parallel.chunked_loss`) holds one chunk's float32 logits, in which
  it makes the log-sum-exp and the softmax gradient in place, and under bf16 the chunk's bf16
  matmul output (forward) or gradient (backward) beside them: 4 V or 6 V per chunk token; per
  token of the shard, the saved float32 log-sum-exp and the hidden states' gradient (c D).
"""

from __future__ import annotations

from typing import Protocol

from cpcompose.models.spec import MemoryProfile, loss_bytes

__all__ = ["PRECISIONS", "llama_memory"]

PRECISIONS = ("float32", "bfloat16", "bfloat16-params")
"""float32; bfloat16 under autocast (no FSDP); bfloat16 parameters gathered by FSDP2's mixed precision."""


class _Shape(Protocol):
    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    n_layers: int


def llama_memory(model: _Shape, *, tp: int, precision: str, mlp_tiles: int, block_tiles: int = 1) -> MemoryProfile:
    """The Llama's profile on one tensor-parallel rank of ``tp`` (see the module docstring for each term).

    Args:
        model: the config's ``model`` section (vocab_size, dim, heads, kv heads, ffn_hidden_dim).
        tp: tensor-parallel degree (heads and feed-forward columns are split; the residual stream is not).
        precision: one of `PRECISIONS`.
        mlp_tiles: sequence tiles of the feed-forward (1: untiled).
        block_tiles: sequence tiles of every token-wise part of a block (`TransformerBlock.tile`; 1: untiled).

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    D, V, head_dim = model.dim, model.vocab_size, model.dim // model.n_heads
    heads, kv_heads = model.n_heads // tp, model.n_kv_heads // tp
    Dq, Dk, F = heads * head_dim, kv_heads * head_dim, model.ffn_hidden_dim // tp
    c = 4 if precision == "float32" else 2  # bytes of a compute-dtype element
    tiled = mlp_tiles > 1
    if c == 4:
        saved = 4 * (4 * D + 3 * Dq + 2 * Dk + heads + 2) + (0 if tiled else 16 * F)
        head = 4 * 2 * D + 12  # + the final norm's scale and the int64 label
    elif precision == "bfloat16-params":  # FSDP2 gathers bf16 weights: a bf16 residual, no casts; norms in fp32
        saved = 8 * D + 2 * (3 * Dq + 2 * Dk) + 4 * heads + 8 + (0 if tiled else 8 * F)
        head = 4 * D + 12
    else:  # float32 residual and norms; five bf16 copies of linear inputs; bf16 attention and SwiGLU
        saved = 8 * D + 2 * 3 * D + 2 * (3 * Dq + 2 * Dk) + 4 * heads + 8
        saved += 4 * D if tiled else 2 * 2 * D + 8 * F  # tiled: its float32 input instead of w1/w3's casts
        head = 4 * D + 2 * D + 12
    tile = c * F / mlp_tiles  # one tile's F-wide tensor, per token of the whole shard
    ffn_backward = 7 * tile if tiled else 2 * c * F  # tiled: a tile's 4 saved + 3 gradients; else 2 more grads
    attn_backward = (4 + c) * (Dq + 2 * Dk)  # float32 dq/dk/dv accumulators and their compute-dtype results
    d_grads = (6 if precision == "bfloat16-params" else 12) * D
    block_linear = D * Dq + 2 * D * Dk + Dq * D + 3 * D * F
    block_forward = 8 * D + (4 * tile if tiled else 0)
    attention_saved = None
    if block_tiles > 1:
        # A tiled block keeps its input, q, k, v, the attention's output and LSE, and the residual h (the
        # feed-forward's input); every other tensor is one tile's. r: bytes of the residual stream.
        r = 2 if precision == "bfloat16-params" else 4
        block_tile = (8 * D + 7 * c * F) / block_tiles  # one tile's recompute and gradients, per token of the shard
        saved = 2 * r * D + c * (2 * Dq + 2 * Dk) + 4 * heads
        attention_saved = r * D + c * (2 * Dq + 2 * Dk) + 4 * heads  # h is gone once the feed-forward's backward ran
        block_forward = block_tile
        # the attention's backward: the residual's gradient, the output's gradient and one kernel call's gradients
        attn_backward = r * D + 2 * c * Dq
        ffn_backward = 2 * r * D + block_tile  # the residual's gradients and one tile's work
        d_grads = 0
    return MemoryProfile(
        root_params=2 * V * D + D, block_params=block_linear + 2 * D, output_params=V * D,
        block_cast_params=block_linear,
        block_input=(2 if precision == "bfloat16-params" else 4) * D, block_saved=saved,
        block_forward=block_forward, attention_saved=attention_saved,
        # + 3 D-wide gradients in flight: float32 where the residual stream is (float32, autocast), else bf16
        block_backward=max(ffn_backward, attn_backward) + d_grads, attention_backward=attn_backward + d_grads,
        tile_work=ffn_backward if tiled or block_tiles > 1 else 0,
        head_saved=head, **loss_bytes(V, D, c),
        split_backward=c * (Dq + 2 * Dk + 2 * D + 2 * F + 2 * D),  # q, k, v, wo, w1, w3, w2 and the two norms
        block_position_inputs=(2 * head_dim, 2 * head_dim),  # rotary cos and sin, float32, head_dim / 2 wide
        attention=(heads, kv_heads, head_dim), layers=model.n_layers,
        body_params=model.n_layers * (block_linear + 2 * D), body_saved=model.n_layers * saved, vocab=V,
    )
