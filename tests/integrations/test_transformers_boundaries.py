"""Hugging Face inputs at the edges of CP: a padded attention_mask as a buffer, and a model CP cannot reach.

* A right-padded batch under a causal model, its attention_mask given to
  `context_parallel` as a buffer: the region keeps the mask's full contents, so every
  rank knows where the padding lies; no real token attends to a later padding key, so
  every real token's result, the loss and every gradient equal transformers' own
  (each row's real tokens alone), to float64's derived bound (tests/support/tolerance.py).
* Left or inner padding under a causal model, and any padding under a bidirectional one
  (ModernBERT), mask keys per row: the mask's shard travels with each rank's K/V as a
  key mask (`cp_attention`'s `key_padding`), and the loss, logits and every gradient
  equal transformers' own sdpa on the whole padded batch, to float64's derived bound.
* MPT computes attention in its own code (ALiBi): refused where its mask is built, on
  one process and in a region alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import cpcompose.integrations.transformers as cphf
from cpcompose import allreduce_gradients, context_parallel, cp_cross_entropy, cp_unshard
from tests.support.tolerance import assert_close

VOCAB, SEQ, ROWS = 64, 32, (29, 18, 32)  # real tokens per row of a right-padded batch
# Derived (tests/support/tolerance.py), float64: a weight gradient sums over rows x tokens x width 32.
TOL = dict(terms=len(ROWS) * SEQ * 32)


def _build(state=None, impl="cpcompose"):
    torch.manual_seed(0)
    config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float64)
    if state is not None:
        model.load_state_dict(state)
    return model


def _batch(left: bool = False, inner: bool = False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (len(ROWS), SEQ), generator=g)
    real = torch.arange(SEQ)[None] < torch.tensor(ROWS)[:, None]
    if left:
        real = real.flip(1)
    if inner:  # row 0's positions 3..8 are padding between real tokens
        real[0, 3:9] = False
    labels = cphf.shift_labels(ids.masked_fill(~real, -100))
    return ids.masked_fill(~real, 0), real.long(), labels


def reference():
    model = _build(impl="sdpa")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, labels = _batch()
    total = sum(F.cross_entropy(model(input_ids=ids[r:r + 1, :n]).logits[0], labels[r, :n], ignore_index=-100,
                                reduction="sum") for r, n in enumerate(ROWS))
    loss = total / (labels != -100).sum()
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, state


def cp_padded(mesh, state, strategy):
    model = _build(state)
    ids, mask, labels = _batch()
    positions = torch.arange(SEQ)[None].expand(len(ROWS), -1).clone()
    with context_parallel(mesh, buffers=[ids, mask, labels, positions], buffer_seq_dims=[1] * 4, strategy=strategy):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        loss = cp_cross_entropy(logits, labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return {"loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world,strategy", [(2, "ring"), (2, "alltoall"), (4, "allgather")])
def test_right_padding_as_a_buffer_is_exact(pools, world: int, strategy: str) -> None:
    want, state = reference()
    for rank, got in enumerate(pools.get(world).run(cp_padded, state, strategy)):
        assert_close(got["loss"], want["loss"], **TOL)
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


ENCODER_REAL = [  # per row of the encoder's batch: which of the SEQ positions are real tokens
    torch.arange(SEQ) < 29,  # right padding
    torch.arange(SEQ) >= 14,  # left padding
    torch.arange(SEQ) < 5,  # real tokens in zigzag chunk 0 only: at P = 2, rank 1 holds this row's padding only
    (torch.arange(SEQ) < 10) | (torch.arange(SEQ) >= 21),  # inner padding
]


def _encoder_batch():
    g = torch.Generator().manual_seed(5)
    real = torch.stack(ENCODER_REAL)
    ids = torch.randint(2, VOCAB, real.shape, generator=g).masked_fill(~real, 0)
    labels = torch.where(real & (torch.rand(real.shape, generator=g) < 0.5), ids, -100)
    return ids, real.long(), labels, torch.arange(SEQ)[None].expand(len(real), -1).clone()


def _encoder(impl: str, state=None):
    torch.manual_seed(0)
    # local_attention=8: layer 1 is a sliding-window layer (|i - j| <= 4), layer 0 global
    config = hf.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                                 cls_token_id=1, sep_token_id=1, local_attention=8, global_attn_every_n_layers=2)
    model = hf.AutoModelForMaskedLM.from_config(config, attn_implementation=impl, dtype=torch.float64)
    if state is not None:
        model.load_state_dict(state)
    return model


def encoder_reference():
    """transformers' own sdpa on one process: the whole padded batch, its attention_mask, masked-LM loss."""
    model = _encoder("sdpa")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, labels, positions = _encoder_batch()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # float64 (transformers' is 32)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "logits": logits.detach(), "grads": grads}, state


def _cp_padded_step(mesh, model, ids, mask, labels, positions, **forward):
    """One CP forward+backward of a padded batch (every input a region buffer): the summed loss, the gathered
    logits and the reduced gradients."""
    with context_parallel(mesh, buffers=[ids, mask, labels, positions], buffer_seq_dims=[1] * 4,
                          **forward.pop("region", {})):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **forward).logits
        loss = cp_cross_entropy(logits, labels, mesh=mesh)
        loss.backward()
        full = cp_unshard(logits.detach(), mesh, seq_dim=1)
    allreduce_gradients(model, mesh)
    dist.all_reduce(total := loss.detach().clone(), group=mesh.get_group())
    return {"loss": total, "logits": full, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def cp_encoder(mesh, state, strategy):
    return _cp_padded_step(mesh, _encoder("cpcompose", state), *_encoder_batch(), region={"strategy": strategy})


@pytest.mark.parametrize("world,strategy", [(2, "ring"), (2, "alltoall")])
def test_padded_encoder_batch_is_exact(pools, world: int, strategy: str) -> None:
    """ModernBERT, every row padded its own way: a per-row key mask travels with K/V; loss, logits, grads exact."""
    want, state = encoder_reference()
    real = torch.stack(ENCODER_REAL)
    for rank, got in enumerate(pools.get(world).run(cp_encoder, state, strategy)):
        assert_close(got["loss"], want["loss"], **TOL)
        # padding positions too: each sees its row's real tokens, so transformers defines them
        assert_close(got["logits"], want["logits"], **TOL, msg=lambda m: f"rank {rank} logits: {m}")
        assert torch.isfinite(got["logits"][~real]).all()
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def causal_reference(left: bool):
    """transformers' own sdpa on one process: the whole left- (or inner-) padded batch with its attention_mask."""
    model = _build(impl="sdpa")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, labels = _batch(left=left, inner=not left)
    positions = torch.arange(SEQ)[None].expand(len(ROWS), -1).clone()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, state


def cp_causal(mesh, state, left: bool):
    ids, mask, labels = _batch(left=left, inner=not left)
    positions = torch.arange(SEQ)[None].expand(len(ROWS), -1).clone()
    return _cp_padded_step(mesh, _build(state), ids, mask, labels, positions, use_cache=False)


@pytest.mark.parametrize("left", [True, False], ids=["left", "inner"])
def test_left_and_inner_padding_under_a_causal_model_are_exact(pools, left: bool) -> None:
    want, state = causal_reference(left)
    real = _batch(left=left, inner=not left)[1].bool()
    for rank, got in enumerate(pools.get(2).run(cp_causal, state, left)):
        assert_close(got["loss"], want["loss"], **TOL)
        # real tokens only: a left-padding query sees no key at all (0 in CP and in SDPA, then the layers differ)
        assert_close(got["logits"][real], want["logits"][real], **TOL, msg=lambda m: f"rank {rank} logits: {m}")
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def mpt(mesh) -> str:
    config = hf.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=SEQ)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompose", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    try:
        with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1], verify=False):
            model(input_ids=ids)
        return "no error"
    except ValueError as e:
        return str(e)


def test_mpt_is_refused_by_name_on_every_rank(pools) -> None:
    for message in pools.get(2).run(mpt):
        assert message.startswith("MPT computes attention in its own code"), message
    with pytest.raises(ValueError, match="MPT computes attention in its own code"):  # and on one process
        config = hf.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=SEQ)
        hf.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompose")(input_ids=torch.ones(1, 4).long())
