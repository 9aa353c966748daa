"""What a Hugging Face causal LM holds during a training step, from its config: the memory plan's profile.

A family is a stack of layers, each a token mixer and a feed-forward built from the config's numbers
(`_FAMILIES`: one function per `model_type` saying which pieces its layers are); each kind of piece counts
its own parameters and the bytes its modules save per token (`hf_pieces`). A family not in the table has
no profile: the plan says so instead of guessing.

Counted from transformers' modules as autograd runs them under the trainer (c: bytes of the compute dtype,
2 under FSDP2's bf16 mixed precision, 4 in float32):

* an RMSNorm of width W saves its float32 input (4 W; the input itself in float32), its normalized value
  before the weight (c W) and one float32 scale per row;
* a linear saves its input (c per element; q, k and v projections share theirs, as gate and up do);
* CP attention saves q, k, v and its output (c each) and one float32 log-sum-exp per head;
* a SwiGLU feed-forward saves its gate's output, the SiLU's, the up projection's and their product (4 c F);
* DeepSeek's latent attention (MLA) saves its input, the two latents' norms and inputs, q and k, v and the
  output, the log-sum-exp and o_proj's input (see `LatentAttention`);
* a mixture of experts saves the router's (float32 probabilities, or DeepSeek-V3's grouped sigmoid scores over
  its input cast to float32, and the indices of its choices: `Moe.router_saved`), and per routed token (top-k
  copies) the gathered input, the expert's gate/up output, its SiLU and product, and the weighted output
  (grouped_mm, transformers' default; cpcompose's expert-parallel path saves the same); its shared expert is a
  SwiGLU with a sigmoid gate (Qwen) or without one (DeepSeek-V3);
* a Gated DeltaNet saves its projections, the causal convolution's input and output, the float32 gates and
  the chunked delta rule's per-token tensors, and its gated RMSNorm (see `GatedDeltaNet`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpcompose.models.spec import MemoryProfile, loss_bytes
from cpcompose.training.families.hf.pieces import (
    Attention,
    GatedDeltaNet,
    LatentAttention,
    Layer,
    Moe,
    SwiGlu,
    norm_saved,
)

__all__ = ["hf_memory_profile", "profiled_families"]

_ATTENTION = (Attention, LatentAttention)
"""The mixers that are softmax attention (CP's K/V buffers go beside them)."""


def _attention(c: Any, *, qk_norm: bool, gated: bool = False, float_scale: bool = False,
               qkv_bias: bool | None = None, tp: int = 1) -> Attention:
    """`attention_bias` puts a bias on all four projections; `qkv_bias` (Qwen2's) on q, k and v alone. On one
    tensor-parallel rank of `tp`: its share of the heads and kv heads (o_proj's bias and the per-head norms
    replicated, as `Attention` counts them)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    bias = bool(getattr(c, "attention_bias", False))
    return Attention(dim=c.hidden_size, heads=c.num_attention_heads // tp, kv_heads=c.num_key_value_heads // tp,
                     head_dim=head_dim, qk_norm=qk_norm, gated=gated, qkv_bias=bias if qkv_bias is None else qkv_bias,
                     o_bias=bias, float_scale=float_scale)


def _dense(c: Any, *, qk_norm: bool, qkv_bias: bool | None = None, tp: int = 1) -> list[Layer]:
    """Llama's layer and its kin: attention (with Qwen3's per-head q/k norms) and a SwiGLU; on one tensor-parallel
    rank of `tp`, its share of the heads and of the feed-forward's columns (the residual stream and the layer's
    norms are whole on every rank)."""
    attention = _attention(c, qk_norm=qk_norm, qkv_bias=qkv_bias, tp=tp)
    return [Layer(attention, SwiGlu(c.hidden_size, c.intermediate_size // tp))] * c.num_hidden_layers


def _qwen3_moe(c: Any) -> list[Layer]:
    """Qwen3's attention with a mixture of experts (no shared expert), or a SwiGLU in `mlp_only_layers` / off
    the `decoder_sparse_step`."""
    attention = _attention(c, qk_norm=True)
    moe = Moe(dim=c.hidden_size, experts=c.num_experts, top_k=c.num_experts_per_tok, ffn=c.moe_intermediate_size,
              shared=None)
    dense = SwiGlu(c.hidden_size, c.intermediate_size)
    return [Layer(attention, moe if i not in (c.mlp_only_layers or []) and c.num_experts > 0
                  and (i + 1) % c.decoder_sparse_step == 0 else dense) for i in range(c.num_hidden_layers)]


def _mixtral(c: Any) -> list[Layer]:
    """Mistral's attention with a mixture of experts in every layer (no shared expert; its router a float32 softmax,
    the top-k renormalised, as Qwen3-MoE's)."""
    moe = Moe(dim=c.hidden_size, experts=c.num_local_experts, top_k=c.num_experts_per_tok, ffn=c.intermediate_size,
              shared=None)
    return [Layer(_attention(c, qk_norm=False), moe)] * c.num_hidden_layers


def _qwen3_next(c: Any) -> list[Layer]:
    """Gated DeltaNet layers with gated full-attention ones (`layer_types`), each with a mixture of experts
    (or a SwiGLU in `mlp_only_layers` / off the `decoder_sparse_step`)."""
    attention = _attention(c, qk_norm=True, gated=True, float_scale=True)  # its norms scale by 1 + w in float32
    delta = GatedDeltaNet(dim=c.hidden_size, k_heads=c.linear_num_key_heads, v_heads=c.linear_num_value_heads,
                          k_dim=c.linear_key_head_dim, v_dim=c.linear_value_head_dim, conv=c.linear_conv_kernel_dim)
    moe = Moe(dim=c.hidden_size, experts=c.num_experts, top_k=c.num_experts_per_tok, ffn=c.moe_intermediate_size,
              shared=SwiGlu(c.hidden_size, c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size
              else None)
    dense = SwiGlu(c.hidden_size, c.intermediate_size)
    layers = []
    for i, kind in enumerate(c.layer_types):
        sparse = i not in (c.mlp_only_layers or []) and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
        layers.append(Layer(attention if kind == "full_attention" else delta, moe if sparse else dense,
                            float_scale=True))
    return layers


def _deepseek_v3(c: Any) -> list[Layer]:
    """Multi-head latent attention in every layer; a SwiGLU in the first `first_k_dense_replace`, then a mixture
    of `n_routed_experts` with the grouped sigmoid router and `n_shared_experts` ungated shared experts (one
    SwiGLU of `n_shared_experts x moe_intermediate_size`)."""
    attention = LatentAttention(dim=c.hidden_size, heads=c.num_attention_heads, q_lora=c.q_lora_rank or 0,
                                kv_lora=c.kv_lora_rank, rope=c.qk_rope_head_dim, nope=c.qk_nope_head_dim,
                                v_dim=c.v_head_dim, bias=bool(getattr(c, "attention_bias", False)))
    shared = c.n_shared_experts * c.moe_intermediate_size if c.n_shared_experts else 0
    moe = Moe(dim=c.hidden_size, experts=c.n_routed_experts, top_k=c.num_experts_per_tok, ffn=c.moe_intermediate_size,
              shared=SwiGlu(c.hidden_size, shared) if shared else None, shared_gate=False, groups=c.n_group,
              topk_groups=c.topk_group)
    dense = SwiGlu(c.hidden_size, c.intermediate_size)
    return [Layer(attention, moe if i >= c.first_k_dense_replace else dense) for i in range(c.num_hidden_layers)]


_FAMILIES: dict[str, Callable[..., list[Layer]]] = {
    "llama": lambda c, tp=1: _dense(c, qk_norm=False, tp=tp),
    "mistral": lambda c, tp=1: _dense(c, qk_norm=False, tp=tp),
    "qwen2": lambda c, tp=1: _dense(c, qk_norm=False, qkv_bias=True, tp=tp),
    "qwen3": lambda c, tp=1: _dense(c, qk_norm=True, tp=tp),
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "qwen3_next": _qwen3_next,
    "deepseek_v3": _deepseek_v3,
}
"""model_type -> its layers. Families of the same pieces join with one line; a new kind of piece goes in
`hf_pieces` with its own count. The dense families take `tp` (their layers on one tensor-parallel rank)."""

_TENSOR_PARALLEL = ("llama", "mistral", "qwen2", "qwen3")
"""The families whose profile counts a tensor-parallel rank's share (the others' layers the trainer does not split:
experts, Gated DeltaNet, latent attention)."""


def profiled_families() -> tuple[str, ...]:
    """The model_types the plan can predict."""
    return tuple(_FAMILIES)


def hf_memory_profile(hf_config: Any, *, tp: int, precision: str, mlp_tiles: int) -> MemoryProfile:
    """The profile of a transformers config (with the trainer's overrides applied).

    Args:
        hf_config: the model's transformers config.
        tp: tensor-parallel degree: the profile is one tp rank's, its share of the heads, kv heads and
            feed-forward columns (the embedding, the output layer and the norms whole, as the trainer keeps them).
        precision: "float32", "bfloat16" (autocast) or "bfloat16-params" (FSDP2's mixed precision).
        mlp_tiles: sequence tiles of each layer's feed-forward (1: untiled).

    Raises:
        ValueError: a family the plan cannot count (named, with the ones it can), tied word embeddings, or TP of a
            family whose layers the trainer does not split.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(f"no memory profile for Hugging Face model_type {model_type!r} (the plan counts "
                         f"{', '.join(profiled_families())})")
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError("tied word embeddings (one weight in the input embedding and the output layer, kept in "
                         "FSDP's root unit): the plan does not count that unit")
    if tp != 1 and model_type not in _TENSOR_PARALLEL:
        raise ValueError(f"no memory profile for Hugging Face model_type {model_type!r} at parallelism.tp = {tp} (the "
                         f"plan counts tensor parallelism for {', '.join(_TENSOR_PARALLEL)})")
    c = 4 if precision == "float32" else 2
    layers = _FAMILIES[model_type](hf_config, tp=tp) if tp != 1 else _FAMILIES[model_type](hf_config)
    D, V = hf_config.hidden_size, hf_config.vocab_size
    saved = [layer.saved(c, mlp_tiles) for layer in layers]
    kinds = list(dict.fromkeys(layers))  # each kind of layer once, in order
    params = [layer.params() for layer in layers]
    largest = layers[params.index(max(params))]
    block_input = c * D if precision == "bfloat16-params" else 4 * D  # autocast keeps the float32 residual
    attentions = [layer.mixer for layer in kinds if isinstance(layer.mixer, _ATTENTION)]
    heads = (attentions[0].heads, attentions[0].kv_heads, attentions[0].head_dim) if attentions else (1, 1, 1)
    return MemoryProfile(
        root_params=2 * V * D + D, block_params=max(params), output_params=V * D,
        block_cast_params=max(layer.params() - 4 * D for layer in kinds),
        block_input=block_input, block_saved=max(saved),
        block_forward=max(layer.forward(c) for layer in kinds),
        block_backward=max(layer.backward(c, mlp_tiles) for layer in kinds),
        tile_work=max(layer.tile_work(c, mlp_tiles) for layer in kinds),
        head_saved=norm_saved(D, c) + c * D + 8,  # the final norm, the output layer's input, the label
        **loss_bytes(V, D, c),
        attention_backward=max((layer.mixer.backward(c) for layer in kinds if isinstance(layer.mixer, _ATTENTION)),
                               default=0) + 3 * c * D,
        attention=heads, layers=len(layers), body_params=sum(params), body_saved=sum(saved), vocab=V,
        # a block's attention runs its backward after the feed-forward's, whose saved tensors are then freed:
        # beside CP's K/V buffers, the input norm's and the mixer's alone (torch's tracker at full size: a
        # DeepSeek-V3 shape's MoE block holds 408 KB per token more in its feed-forward's saved tensors)
        attention_saved=max((norm_saved(D, c, float_scale=layer.float_scale) + layer.mixer.saved(c)
                             for layer in kinds if isinstance(layer.mixer, _ATTENTION)), default=None),
        block_expert_params=largest.expert_params(), body_expert_params=sum(layer.expert_params() for layer in layers),
        dispatch=max(layer.dispatch(c) for layer in kinds),
    )
