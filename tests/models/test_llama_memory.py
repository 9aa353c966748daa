"""The Llama's memory profile against what autograd really saves, counted on the real modules.

Every tensor a forward saves for backward passes through a `saved_tensors_hooks` pack hook; the
distinct storages (views share one) are the bytes the plan must count. Parameters and the RoPE
tables are left out (the plan counts them elsewhere), and under bf16 autocast so are the weights'
bf16 copies, which must equal `block_cast_params` at 2 bytes each. The counts are exact: the
profile's arithmetic has no tolerance to hide behind.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cpcompose import cp_cross_entropy, cp_linear_cross_entropy
from cpcompose.models import get_model_spec
from cpcompose.models.llama import Llama, LlamaConfig, TransformerBlock, llama_memory, rope_cos_sin
from tests.support.cpu_kernels import NEEDS_BF16_CPU_FLASH
from tests.support.live_storages import LiveWide

SHAPE = SimpleNamespace(vocab_size=1000, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96, n_layers=2)
T = 128


def _saved(fn, *, bf16: bool, exclude: set[int]) -> tuple[int, int]:
    """(bytes of activations, bytes of bf16 weight copies) that `fn`'s forward saves for backward."""
    storages: dict[int, tuple[int, torch.Tensor]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        fn()
    kept = {p: v for p, v in storages.items() if p not in exclude}
    weights = sum(n for n, t in kept.values() if t.dim() == 2 and t.shape[0] != T and t.shape[-1] != T)
    return sum(n for n, _ in kept.values()) - weights, weights


@pytest.mark.parametrize("precision", ["float32", pytest.param("bfloat16", marks=NEEDS_BF16_CPU_FLASH)])
def test_a_block_saves_what_the_profile_counts(precision: str) -> None:
    config = LlamaConfig(vocab_size=SHAPE.vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96,
                         max_seq_len=T)
    block = TransformerBlock(config)
    x = torch.randn(1, T, 64, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(T), head_dim=16, theta=1e4)
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()}
    exclude |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    acts, weights = _saved(lambda: block(x, cos, sin), bf16=precision == "bfloat16", exclude=exclude)
    profile = llama_memory(SHAPE, tp=1, precision=precision, mlp_tiles=1)
    assert acts == profile.block_saved * T
    assert weights == (2 * profile.block_cast_params if precision == "bfloat16" else 0)
    assert profile.block_input == 4 * 64  # the float32 residual stream a checkpoint keeps


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_head_and_the_loss_save_what_the_profile_counts(precision: str) -> None:
    """Final norm, output layer and the trainer's loss: the saved part of `loss` is the float32 log-softmax."""
    model = Llama(LlamaConfig(vocab_size=SHAPE.vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                              ffn_hidden_dim=96, max_seq_len=T))
    h = torch.randn(1, T, 64, requires_grad=True)
    labels = torch.randint(0, SHAPE.vocab_size, (T,))
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def head() -> None:
        logits = model.output(model.norm(h))
        F.cross_entropy(logits.reshape(-1, SHAPE.vocab_size).float(), labels, reduction="sum")

    acts, _ = _saved(head, bf16=precision == "bfloat16", exclude=exclude)
    profile = llama_memory(SHAPE, tp=1, precision=precision, mlp_tiles=1)
    V = SHAPE.vocab_size
    assert acts == (profile.head_saved + 4 * V) * T + 4  # + the loss's scalar weight


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_losses_peak_at_what_the_profile_counts(precision: str) -> None:
    """The vocabulary-wide bytes alive at once, forward and backward, as the trainer runs each loss: unfused on
    the head's logits (peak in backward: the saved log-softmax, its gradient and the logits'), and fused, by chunks.
    """
    model = Llama(LlamaConfig(vocab_size=SHAPE.vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                              ffn_hidden_dim=96, max_seq_len=T))
    h = torch.randn(1, T, 64, requires_grad=True)
    labels = torch.randint(0, SHAPE.vocab_size, (1, T))
    profile = llama_memory(SHAPE, tp=1, precision=precision, mlp_tiles=1)
    bf16, chunk = precision == "bfloat16", 32
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            LiveWide(SHAPE.vocab_size, exclude=model.parameters()) as unfused:
        cp_cross_entropy(model.output(model.norm(h)), labels, mesh=None, num_tokens=T).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            LiveWide(SHAPE.vocab_size, exclude=model.parameters()) as fused:
        cp_linear_cross_entropy(model.norm(h), model.output.weight, labels, mesh=None, num_tokens=T,
                                chunk_tokens=chunk, kernel="torch").backward()
    assert unfused.peak == profile.loss * T
    assert fused.peak == profile.fused_loss_chunk * chunk


def test_parameter_counts_match_the_model() -> None:
    model = Llama(LlamaConfig(vocab_size=SHAPE.vocab_size, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                              ffn_hidden_dim=96, max_seq_len=T))
    profile = get_model_spec("llama").memory(SHAPE, tp=1, precision="float32", mlp_tiles=1)
    block = model.layers["0"]
    assert profile.block_params == sum(p.numel() for p in block.parameters())
    assert profile.block_cast_params == sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    assert profile.root_params + 3 * profile.block_params == sum(p.numel() for p in model.parameters())
    assert profile.output_params == model.output.weight.numel()


def test_tensor_parallel_and_tiles_shrink_what_they_split() -> None:
    one = llama_memory(SHAPE, tp=1, precision="float32", mlp_tiles=1)
    two = llama_memory(SHAPE, tp=2, precision="float32", mlp_tiles=1)
    tiled = llama_memory(SHAPE, tp=1, precision="float32", mlp_tiles=4)
    assert two.attention == (2, 1, 16) and two.block_cast_params * 2 == one.block_cast_params
    assert two.root_params == one.root_params and two.block_input == one.block_input  # not split by TP
    assert tiled.block_saved == one.block_saved - 16 * SHAPE.ffn_hidden_dim  # the four F-wide tensors
    assert tiled.block_backward <= one.block_backward


@NEEDS_BF16_CPU_FLASH
def test_a_bf16_block_under_fsdp_mixed_precision_saves_what_the_profile_counts() -> None:
    """"bfloat16-params": FSDP2 gathers the weights in bf16 and casts the block's inputs (x, cos, sin) to bf16;
    no autocast, so no weight copies and a bf16 residual stream (what a checkpoint keeps)."""
    config = LlamaConfig(vocab_size=SHAPE.vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96,
                         max_seq_len=T)
    block = TransformerBlock(config).to(torch.bfloat16)
    x = torch.randn(1, T, 64, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(torch.arange(T), head_dim=16, theta=1e4))
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()}
    exclude |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    acts, weights = _saved(lambda: block(x, cos, sin), bf16=False, exclude=exclude)
    profile = llama_memory(SHAPE, tp=1, precision="bfloat16-params", mlp_tiles=1)
    assert weights == 0
    assert acts == profile.block_saved * T, (acts / T, profile.block_saved)
    assert profile.block_input == 2 * 64


@pytest.mark.parametrize("precision", ["float32", pytest.param("bfloat16-params", marks=NEEDS_BF16_CPU_FLASH)])
def test_a_tiled_block_saves_what_the_profile_counts(precision: str) -> None:
    """`TransformerBlock.tile(4)`: the block keeps its input, q, k, v, the attention's output and LSE, and the
    feed-forward's input h; nothing else of the sequence's length (the RoPE tables excluded, as above)."""
    config = LlamaConfig(vocab_size=SHAPE.vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96,
                         max_seq_len=T)
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    block = TransformerBlock(config).to(dtype)
    block.tile(4)
    x = torch.randn(1, T, 64, dtype=dtype, requires_grad=True)
    cos, sin = (t.to(dtype) for t in rope_cos_sin(torch.arange(T), head_dim=16, theta=1e4))
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()}
    exclude |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    acts, weights = _saved(lambda: block(x, cos, sin), bf16=False, exclude=exclude)
    profile = llama_memory(SHAPE, tp=1, precision=precision, mlp_tiles=1, block_tiles=4)
    assert weights == 0
    assert acts == profile.block_saved * T, (acts / T, profile.block_saved)
