"""The pieces of a Hugging Face decoder layer, each counting its parameters and what it saves per token.

c is the compute dtype's bytes (2: bf16, 4: float32). "saved" is what autograd keeps for backward per token of
the rank's shard (checkpointing keeps the layer's input instead and recomputes it); "backward" the most its
backward holds at once beyond that (gradients in flight). See `hf_memory` for how they are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Attention", "GatedDeltaNet", "LatentAttention", "Layer", "Moe", "SwiGlu", "norm_saved"]

DELTA_CHUNK = 64
"""transformers' chunk length of the chunked delta rule (`torch_chunk_gated_delta_rule`'s default)."""


def norm_saved(width: int, c: int, *, rows: int = 1, float_scale: bool = False) -> int:
    """An RMSNorm's saved bytes per token: its float32 input, its normalized value (c; float32 where the weight
    is applied in float32, Qwen3-Next's `1 + weight`) and one float32 scale per row."""
    return 4 * width + (4 if float_scale else c) * width + 4 * rows


@dataclass(frozen=True)
class SwiGlu:
    """gate, up and down projections with SiLU (Llama's MLP, a shared expert)."""

    dim: int
    ffn: int

    def params(self) -> int:
        return 3 * self.dim * self.ffn

    def saved(self, c: int, tiles: int = 1) -> int:  # the gate's output, the SiLU's, up's and the product
        return 0 if tiles > 1 else 4 * c * self.ffn

    def backward(self, c: int, tiles: int = 1) -> float:
        return 7 * c * self.ffn / tiles if tiles > 1 else 2 * c * self.ffn

    def tile_work(self, c: int, tiles: int) -> float:
        return 7 * c * self.ffn / tiles if tiles > 1 else 0


@dataclass(frozen=True)
class Moe:
    """A router over `experts` SwiGLU experts, `top_k` of them per token (transformers' grouped_mm), and a shared
    expert: with a sigmoid gate (Qwen3-Next, Qwen2-MoE) or without one (DeepSeek-V3, `shared_gate=False`).

    The router is a float32 softmax over the experts (Qwen's), or with `groups` DeepSeek-V3's: float32 sigmoid
    scores over its input cast to float32, the best `topk_groups` of `groups` expert groups, then the top-k."""

    dim: int
    experts: int
    top_k: int
    ffn: int
    shared: SwiGlu | None
    shared_gate: bool = True
    groups: int = 0
    topk_groups: int = 0

    def params(self) -> int:
        shared = self.shared.params() + (self.dim if self.shared_gate else 0) if self.shared else 0
        return self.experts * (3 * self.dim * self.ffn + self.dim) + shared

    def expert_params(self) -> int:
        """The experts module's own (what expert parallelism splits): not the router's or the shared expert's."""
        return self.experts * 3 * self.dim * self.ffn

    def dispatch(self, c: int) -> float:
        """Under expert parallelism, beyond its forward's and backward's own: one exchange's rows in transit,
        the send buffer (the rows sorted by expert) and the receive buffer, each `top_k` rows of `dim` per token
        in the compute dtype (with every rank receiving its even share, the received rows are as many as the
        sent ones, and the grouped GEMM over them holds what it holds on one process)."""
        return self.top_k * 2 * c * self.dim

    def router_saved(self, c: int) -> int:
        """What the router saves per token, measured with `saved_tensors_hooks` (float32 throughout).

        Softmax (Qwen): its float32 probabilities (4 E), the top-k indices (8 k) and values (4 k); its input is
        the feed-forward's. Grouped sigmoid (DeepSeek-V3): its input cast to float32 (4 D, a copy unless the
        model is float32), the sigmoid's scores (4 E), the mask of the groups left out (1 E, bool), each group's
        top-2 indices (16 per group), the chosen groups' indices (8 each), the top-k indices (8 k), the chosen
        scores (4 k) and their sum (4)."""
        if not self.groups:
            return 4 * self.experts + 12 * self.top_k
        cast = 4 * self.dim if c != 4 else 0
        return cast + 5 * self.experts + 16 * self.groups + 8 * self.topk_groups + 4 + 12 * self.top_k

    def saved(self, c: int, tiles: int = 1) -> int:
        # per routed copy (measured, transformers' grouped_mm path and cpcompose's EP path alike): the gathered input
        # and the weighted output (D wide), gate/up's output, the SiLU and the product (F wide), the sort's
        # permutation, the gather's index and a third int64 index, and the float32 weight
        routed = self.top_k * (2 * c * self.dim + 4 * c * self.ffn + 28)
        shared = self.shared.saved(c) + (2 * c + c * self.dim if self.shared_gate else 0) if self.shared else 0
        return self.router_saved(c) + routed + shared

    def backward(self, c: int, tiles: int = 1) -> float:
        shared = self.shared.backward(c) if self.shared else 0
        return self.top_k * (2 * c * self.dim + 3 * c * self.ffn) + shared

    def tile_work(self, c: int, tiles: int) -> float:
        return self.backward(c) / tiles if tiles > 1 else 0


@dataclass(frozen=True)
class Attention:
    """CP attention with q/k/v/o projections; Qwen3's per-head q/k RMSNorms (`qk_norm`), Qwen3-Next's output
    gate (`gated`: q_proj twice as wide, a sigmoid gate on the output)."""

    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    gated: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    float_scale: bool = False

    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q * (2 if self.gated else 1) + 2 * kv if self.qkv_bias else 0) + (self.dim if self.o_bias else 0)
        return self.dim * q * (2 if self.gated else 1) + 2 * self.dim * kv + q * self.dim + bias + (
            2 * self.head_dim if self.qk_norm else 0)

    def saved(self, c: int) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        norms = (norm_saved(q, c, rows=self.heads, float_scale=self.float_scale)
                 + norm_saved(kv, c, rows=self.kv_heads, float_scale=self.float_scale)) if self.qk_norm else 0
        gate = 2 * c * q if self.gated else 0  # the sigmoid's output and the gated product (o_proj's input)
        # the projections' input, q, k, v and the output, the log-sum-exp per head, o_proj's input
        return c * self.dim + norms + c * (2 * q + 2 * kv) + 4 * self.heads + c * q + gate

    def backward(self, c: int) -> float:
        return (4 + c) * (self.heads + 2 * self.kv_heads) * self.head_dim


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA, DeepSeek-V2/V3): the query through a low-rank `q_lora` with
    its RMSNorm (or one projection where `q_lora` is 0), keys and values from one `kv_lora`-wide latent with its
    RMSNorm plus a `rope`-wide key shared by the heads; per head, `nope + rope`-wide queries and keys and `v_dim`-wide
    values. Counted with `saved_tensors_hooks` on transformers' module under CP attention:
    the projections' input (q_a and kv_a share it), the two latents' norms and the up-projections' inputs, q
    and k (`nope + rope` per head), v and the output (`v_dim` per head), the log-sum-exp per head, o_proj's input.
    (RoPE's cos and sin are saved once for the whole model: left out.)"""

    dim: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v_dim: int
    bias: bool = False

    @property
    def kv_heads(self) -> int:
        return self.heads

    @property
    def head_dim(self) -> int:
        """The query and key width per head, which CP's K/V buffers and the cost model take (the values are
        `v_dim`, narrower: counted as wide, a slight overestimate of the K/V in flight)."""
        return self.nope + self.rope

    def params(self) -> int:
        qk, H = self.nope + self.rope, self.heads
        q = (self.dim * self.q_lora + self.q_lora + self.q_lora * H * qk + (self.q_lora if self.bias else 0)
             if self.q_lora else self.dim * H * qk)
        kv = (self.dim * (self.kv_lora + self.rope) + self.kv_lora + self.kv_lora * H * (self.nope + self.v_dim)
              + (self.kv_lora + self.rope if self.bias else 0))
        return q + kv + H * self.v_dim * self.dim + (self.dim if self.bias else 0)

    def saved(self, c: int) -> int:
        qk, H = self.nope + self.rope, self.heads
        q = norm_saved(self.q_lora, c) + c * self.q_lora if self.q_lora else 0
        kv = norm_saved(self.kv_lora, c) + c * self.kv_lora
        return c * self.dim + q + kv + 2 * c * H * qk + 2 * c * H * self.v_dim + 4 * H + c * H * self.v_dim

    def backward(self, c: int) -> float:
        """As `Attention.backward`: the float32 and compute-dtype gradients of q, k and v in flight."""
        return (4 + c) * self.heads * (2 * (self.nope + self.rope) + self.v_dim)


@dataclass(frozen=True)
class GatedDeltaNet:
    """Qwen3-Next's linear attention: projections, a causal convolution, transformers' chunked gated delta
    rule (float32, under CP cpcompose's one-pass stretches) and a gated RMSNorm."""

    dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int

    def params(self) -> int:
        k, v = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        return (self.dim * (2 * k + 2 * v) + self.dim * 2 * self.v_heads + self.conv * (2 * k + v)
                + 2 * self.v_heads + self.v_dim + v * self.dim)

    def _kernel(self, v_dim: int) -> int:
        """The chunked delta rule per token of one value head: float32 q and k at each step (cast, normalized,
        scaled, beta-weighted, decayed, the triangular solve's keys: 8 k-wide), the values (cast, solved, per
        chunk: 3 v-wide), the chunk's pairwise decays and products (5 chunk-wide), the state kept per chunk."""
        k = self.k_dim
        return 4 * (8 * k + 3 * v_dim + 5 * DELTA_CHUNK + k * v_dim // DELTA_CHUNK + 8)

    def saved(self, c: int) -> int:
        k, v = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        conv = 3 * c * (2 * k + v)  # the convolution's input, its output and the SiLU's
        gates = 4 * 4 * self.v_heads  # beta, the softplus, the decay (float32)
        # under CP most stretches run with the values widened by dk zero columns: half of them, on average
        kernel = self.v_heads * (self._kernel(self.v_dim) + self._kernel(self.v_dim + self.k_dim)) // 2
        norm = norm_saved(v, c, rows=self.v_heads) + 8 * v + c * v  # the float32 gate and its SiLU, the product
        return c * self.dim + c * (2 * k + 2 * v) + conv + gates + kernel + c * v + norm + c * v

    def backward(self, c: int) -> float:
        # autograd frees the chunks' saved tensors as it walks back through them: what is in flight is the float32
        # gradients of the kernel's inputs (q and k per value head, v, beta and the decay)
        return 4 * self.v_heads * (2 * self.k_dim + self.v_dim + 2)


@dataclass(frozen=True)
class Layer:
    """A decoder layer: two RMSNorms, a token mixer and a feed-forward."""

    mixer: Attention | LatentAttention | GatedDeltaNet
    ffn: SwiGlu | Moe
    float_scale: bool = False

    def params(self) -> int:
        return 2 * self.mixer.dim + self.mixer.params() + self.ffn.params()

    def expert_params(self) -> int:
        return self.ffn.expert_params() if isinstance(self.ffn, Moe) else 0

    def dispatch(self, c: int) -> float:
        return self.ffn.dispatch(c) if isinstance(self.ffn, Moe) else 0

    def saved(self, c: int, tiles: int) -> int:
        D = self.mixer.dim
        norms = 2 * norm_saved(D, c, float_scale=self.float_scale)
        return norms + self.mixer.saved(c) + c * D + self.ffn.saved(c, tiles)  # c D: the feed-forward's input

    def forward(self, c: int) -> float:
        return 8 * self.mixer.dim

    def backward(self, c: int, tiles: int) -> float:
        return max(self.mixer.backward(c), self.ffn.backward(c, tiles)) + 3 * c * self.mixer.dim

    def tile_work(self, c: int, tiles: int) -> float:
        return self.ffn.tile_work(c, tiles)
