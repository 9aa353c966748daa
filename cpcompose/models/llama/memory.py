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
* A sequence-tiled feed-forward (``mlp_tiles`` > 1) saves only its input; one tile of its
  intermediates lives at a time, in forward and again (with gradients) in backward.
* The loss without fusion holds the logits (compute dtype; the trainer keeps them until the
  step ends), and in float32 the log-softmax, its gradient and the logits' gradient: c V + 12 V.
"""

from __future__ import annotations

from typing import Protocol

from cpcompose.models.spec import MemoryProfile

__all__ = ["llama_memory"]


class _Shape(Protocol):
    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int


def llama_memory(model: _Shape, *, tp: int, precision: str, mlp_tiles: int) -> MemoryProfile:
    """The Llama's profile on one tensor-parallel rank of ``tp`` (see the module docstring for each term).

    Args:
        model: the config's ``model`` section (vocab_size, dim, heads, kv heads, ffn_hidden_dim).
        tp: tensor-parallel degree (heads and feed-forward columns are split; the residual stream is not).
        precision: "float32", or "bfloat16" (autocast).
        mlp_tiles: sequence tiles of the feed-forward (1: untiled).

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    D, V, head_dim = model.dim, model.vocab_size, model.dim // model.n_heads
    heads, kv_heads = model.n_heads // tp, model.n_kv_heads // tp
    Dq, Dk, F = heads * head_dim, kv_heads * head_dim, model.ffn_hidden_dim // tp
    c = 4 if precision == "float32" else 2  # bytes of a compute-dtype element
    tiled = mlp_tiles > 1
    if c == 4:
        saved = 4 * (6 * D + 3 * Dq + 2 * Dk + heads + 2) + (0 if tiled else 16 * F)
        head = 4 * 3 * D + 12  # + the final norm's scale and the int64 label
    else:  # float32 residual and norms; five bf16 copies of linear inputs; bf16 attention and SwiGLU
        saved = 16 * D + 2 * 3 * D + 2 * (3 * Dq + 2 * Dk) + 4 * heads + 8
        saved += 4 * D if tiled else 2 * 2 * D + 8 * F  # tiled: its float32 input instead of w1/w3's casts
        head = 4 * 2 * D + 2 * D + 12
    tile = c * F / mlp_tiles  # one tile's F-wide tensor, per token of the whole shard
    ffn_backward = 7 * tile if tiled else 2 * c * F  # tiled: a tile's 4 saved + 3 gradients; else 2 more grads
    attn_backward = (4 + c) * (Dq + 2 * Dk)  # float32 dq/dk/dv accumulators and their compute-dtype results
    block_linear = D * Dq + 2 * D * Dk + Dq * D + 3 * D * F
    return MemoryProfile(
        root_params=2 * V * D + D, block_params=block_linear + 2 * D, output_params=V * D,
        block_cast_params=block_linear, largest_param=max(V * D, D * F),
        block_input=4 * D, block_saved=saved, block_forward=8 * D + (4 * tile if tiled else 0),
        block_backward=max(ffn_backward, attn_backward) + 12 * D, head_saved=head, loss=c * V + 12 * V,
        attention=(heads, kv_heads, head_dim),
    )
