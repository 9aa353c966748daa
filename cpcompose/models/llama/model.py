"""A small reference Llama (GQA, RoPE, SwiGLU, RMSNorm) as plain ``nn.Module`` code.

Nothing here knows about process groups: parallelisms are applied from outside
(``parallelize.py`` next to this file). Two properties matter for that:

* RoPE is computed from explicit ``position_ids``. Under load-balanced context
  parallelism a rank holds chunks ``r`` and ``2P-1-r`` of the sequence, so the
  positions of its tokens are not ``arange(local_seq)``.
* Attention is a single ``F.scaled_dot_product_attention(..., is_causal=True,
  enable_gqa=True)`` call on ``(batch, heads, seq, head_dim)`` tensors, with K/V
  keeping ``n_kv_heads`` heads, so a context-parallel style can intercept it.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpcompose.distributed.tiled import tiled
from cpcompose.models.llama.norm import rms_norm

__all__ = [
    "Attention", "FeedForward", "Llama", "LlamaConfig",
    "RMSNorm", "TransformerBlock", "apply_rope", "rope_cos_sin",
]

_INIT_STD = 0.02


@dataclass
class LlamaConfig:
    """Shape of a Llama model."""

    vocab_size: int = 32000
    """Number of token ids; size of ``tok_embeddings`` and ``output``."""
    dim: int = 4096
    """Model (residual stream) width."""
    n_layers: int = 32
    """Number of transformer blocks; pipeline stages split these evenly."""
    n_heads: int = 32
    """Query heads; ``head_dim = dim // n_heads``."""
    n_kv_heads: int = 32
    """Key/value heads for grouped-query attention (``== n_heads`` is plain multi-head)."""
    ffn_hidden_dim: int = 11008
    """Hidden width of the SwiGLU feed-forward (``w1``/``w3`` output, ``w2`` input)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base; the frequency of pair ``i`` is ``rope_theta ** (-2i / head_dim)``."""
    max_seq_len: int = 2048
    """Longest global sequence the model accepts; RoPE has no table, so this is only a check."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}): "
                "change model.dim or model.n_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} must be even for RoPE: "
                "change model.dim or model.n_heads"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads "
                f"({self.n_kv_heads}): change model.n_kv_heads"
            )
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


def rope_cos_sin(position_ids: Tensor, *, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Cosine and sine of the rotary angles for the given token positions.

    Computed on the fly (no cached table) so the model has no buffers to rebuild
    after meta-device construction, and any subset of positions works.

    Args:
        position_ids: integer positions, shape ``[seq]`` or ``[batch, seq]``.
        head_dim: width of one attention head (even).
        theta: RoPE base.

    Returns:
        ``(cos, sin)`` in float32, shaped ``[1, 1, seq, head_dim // 2]`` or
        ``[batch, 1, seq, head_dim // 2]`` to broadcast over ``(batch, heads, seq, ·)``.

    Raises:
        ValueError: if ``position_ids`` is not 1-D or 2-D or is floating point.
    """
    if position_ids.dim() not in (1, 2) or position_ids.is_floating_point():
        raise ValueError(
            f"position_ids must be an integer tensor of shape [seq] or [batch, seq], "
            f"got dtype {position_ids.dtype} and shape {tuple(position_ids.shape)}"
        )
    device = position_ids.device
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    # float32 represents integer positions exactly up to 2**24 tokens.
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = angles.unsqueeze(-3) if angles.dim() == 3 else angles[None, None]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, *, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` by the RoPE angles, in float32, returning ``x``'s dtype.

    Uses the half-split pairing (dimension ``i`` rotates with ``i + head_dim/2``).

    Args:
        x: ``(batch, heads, seq, head_dim)``.
        cos: from :func:`rope_cos_sin`, broadcastable to ``(batch, heads, seq, head_dim // 2)``.
        sin: same shape as ``cos``.

    Returns:
        Tensor of ``x``'s shape and dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


def _normal_(param: Tensor, *, std: float, seed: int, name: str) -> None:
    """Fill ``param`` from a generator seeded by ``(seed, name)``.

    Seeding per fully-qualified name makes a parameter's values independent of
    which other parameters exist, so a pipeline stage initialised alone matches
    the same layers of the full model.
    """
    if param.is_meta:
        raise ValueError(f"{name} is on the meta device: call model.to_empty(device=...) first")
    generator = torch.Generator(device=param.device)
    generator.manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    nn.init.normal_(param, mean=0.0, std=std, generator=generator)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32; it saves only its input and a per-token scale
    (`cpcompose.models.llama.norm`)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension of ``x`` and scale by ``weight``."""
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """Set the scale to ones."""
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    ``tiles`` > 1 (`TransformerBlock.tile`) runs the token-wise parts (the pre-norm when given, the q/k/v
    projections, RoPE, and ``wo``) over that many sequence tiles with recompute: forward keeps only the block's
    input, q, k, v and the attention's output, not the normed input, the float32 RoPE work or ``wo``'s input copy.
    """

    tiles: int = 1

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, *, norm: nn.Module | None = None) -> Tensor:
        """Attend over the local sequence of ``x`` (``(batch, seq, dim)``), normed by ``norm`` first when given.

        ``cos``/``sin`` are positional so that forward pre-hooks without kwargs see them. The pre-norm runs
        inside this call so that tiles can cover it (its parameters stay the block's).
        """
        project = functools.partial(self._project, norm)
        if self.tiles > 1:
            weights = [*(norm.parameters() if norm is not None else ()), self.wq.weight, self.wk.weight,
                       self.wv.weight]
            q, k, v = tiled(project, [(x, 1), (cos, -2), (sin, -2)], self.tiles, out_dims=(2, 2, 2), params=weights)
        else:
            q, k, v = project(x, cos, sin)
        # The single attention call; context-parallel styles intercept it.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.tiles > 1:
            return tiled(self._output, [(out, 2)], self.tiles, out_dims=(1,), params=[self.wo.weight])
        return self._output(out)

    def _project(self, norm: nn.Module | None, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, k, v)`` as ``(batch, heads, seq, head_dim)``, q and k rotated."""
        if norm is not None:
            x = norm(x)
        batch, seq, _ = x.shape
        # -1 instead of n_heads: tensor parallelism shards heads across ranks.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos=cos, sin=sin), apply_rope(k, cos=cos, sin=sin), v

    def _output(self, out: Tensor) -> Tensor:
        batch, _, seq, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, *, seed: int, prefix: str, residual_std: float) -> None:
        """Initialise the projections; ``wo`` writes to the residual stream, so it is scaled down."""
        for name in ("wq", "wk", "wv"):
            _normal_(getattr(self, name).weight, std=_INIT_STD, seed=seed, name=f"{prefix}.{name}.weight")
        _normal_(self.wo.weight, std=residual_std, seed=seed, name=f"{prefix}.wo.weight")


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gated MLP to ``x`` (``(..., dim)``)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, *, seed: int, prefix: str, residual_std: float) -> None:
        """Initialise the projections; ``w2`` writes to the residual stream, so it is scaled down."""
        for name in ("w1", "w3"):
            _normal_(getattr(self, name).weight, std=_INIT_STD, seed=seed, name=f"{prefix}.{name}.weight")
        _normal_(self.w2.weight, std=residual_std, seed=seed, name=f"{prefix}.w2.weight")


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    With ``tile(n)``, n > 1, every token-wise part runs over n sequence tiles with recompute
    (`cpcompose.distributed.tiled`): the attention's (see `Attention`) and the feed-forward with its pre-norm,
    which then keeps only ``h``. Exact: the same arithmetic per token; parameter gradients summed over tiles.
    """

    tiles: int = 1

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(dim=config.dim, hidden_dim=config.ffn_hidden_dim)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)

    def tile(self, tiles: int) -> None:
        """Run the block's token-wise parts over ``tiles`` sequence tiles (1: untiled)."""
        if tiles < 1:
            raise ValueError(f"tiles must be >= 1, got {tiles}")
        self.tiles = self.attention.tiles = tiles

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Run the block on ``x`` (``(batch, seq, dim)``) with RoPE angles ``cos``/``sin``."""
        h = x + self.attention(x, cos, sin, norm=self.attention_norm)
        if self.tiles > 1:
            weights = [*self.ffn_norm.parameters(), *self.feed_forward.parameters()]
            return h + tiled(self._feed_forward, [(h, 1)], self.tiles, out_dims=(1,), params=weights)
        return h + self._feed_forward(h)

    def _feed_forward(self, h: Tensor) -> Tensor:
        return self.feed_forward(self.ffn_norm(h))

    def init_weights(self, *, seed: int, prefix: str, residual_std: float) -> None:
        """Initialise all parameters of the block; ``prefix`` is its FQN in the full model."""
        self.attention.init_weights(seed=seed, prefix=f"{prefix}.attention", residual_std=residual_std)
        self.feed_forward.init_weights(seed=seed, prefix=f"{prefix}.feed_forward", residual_std=residual_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Llama(nn.Module):
    """Decoder-only Llama; also serves as a pipeline stage once cut.

    ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` and ``layers`` may
    hold a subset of the blocks (see :func:`cpcompose.models.llama.pipeline.split_llama_for_pipeline`);
    forward skips whatever is absent. ``layers`` is keyed by the global layer
    index so fully-qualified names are the same in every stage.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self,
        tokens_or_hidden: Tensor,
        position_ids: Tensor | None = None,
        *,
        head: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Run the modules this stage holds.

        Args:
            tokens_or_hidden: token ids ``(batch, seq)`` if ``tok_embeddings`` is
                present, else hidden states ``(batch, seq, dim)`` from the previous stage.
            position_ids: global position of each local token, ``[seq]`` or
                ``[batch, seq]``; defaults to ``arange(seq)``. Context parallelism
                must pass the positions of the chunks this rank holds.
            head: replaces the output projection: called as ``head(hidden, output.weight)``
                on the normed hidden states, and its result returned. A fused linear
                cross-entropy goes here, so the logits are never made; it runs inside this
                forward, where FSDP has ``output.weight`` gathered. Needs ``output``.

        Returns:
            Logits ``(batch, seq, vocab_size)`` if ``output`` is present, else hidden states;
            ``head``'s result when given.

        Raises:
            ValueError: if the local sequence is longer than ``config.max_seq_len``, or
                ``head`` is given to a stage without ``output``.
        """
        if head is not None and self.output is None:
            raise ValueError("head replaces the output projection, which this pipeline stage does not hold")
        seq = tokens_or_hidden.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len ({self.config.max_seq_len})")
        h = tokens_or_hidden if self.tok_embeddings is None else self.tok_embeddings(tokens_or_hidden)
        if position_ids is None:
            position_ids = torch.arange(seq, device=h.device)
        cos, sin = rope_cos_sin(position_ids, head_dim=self.config.head_dim, theta=self.config.rope_theta)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if head is not None:
            return head(h, self.output.weight)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, *, seed: int = 0) -> None:
        """Deterministically initialise every parameter this (possibly cut) model holds.

        Each parameter draws from its own generator seeded by ``(seed, FQN)`` on
        the parameter's device, so: processes on the same device type build
        identical models; a model built on ``meta`` then ``to_empty`` matches one
        built directly; a pipeline stage matches the same layers of the full model.
        Residual-stream writers (``wo``, ``w2``) use ``0.02 / sqrt(2 * n_layers)``.

        Args:
            seed: base seed shared by all processes.

        Raises:
            ValueError: if a parameter is still on the ``meta`` device.
        """
        residual_std = _INIT_STD / math.sqrt(2 * self.config.n_layers)
        if self.tok_embeddings is not None:
            _normal_(self.tok_embeddings.weight, std=_INIT_STD, seed=seed, name="tok_embeddings.weight")
        for layer_id, layer in self.layers.items():
            layer.init_weights(seed=seed, prefix=f"layers.{layer_id}", residual_std=residual_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _normal_(self.output.weight, std=_INIT_STD, seed=seed, name="output.weight")
