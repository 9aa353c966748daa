"""Hugging Face inputs at the edges of CP: a padded attention_mask as a buffer, and a model CP cannot reach.

* A right-padded batch under a causal model, its attention_mask given to
  `context_parallel` as a buffer: the region keeps the mask's full contents, so every
  rank knows where the padding lies; no real token attends to a later padding key, so
  every real token's result, the loss and every gradient equal transformers' own
  (each row's real tokens alone), to float64's derived bound (tests/support/tolerance.py).
* Left padding, or padding under a bidirectional model, would need keys masked per row,
  which one layout for the whole batch cannot do: refused on every rank, naming pack_batch.
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
from cpcompose import allreduce_gradients, context_parallel, cp_cross_entropy
from tests.support.tolerance import assert_close

VOCAB, SEQ, ROWS = 64, 32, (29, 18, 32)  # real tokens per row of a right-padded batch
# Derived (tests/support/tolerance.py), float64: a weight gradient sums over rows x tokens x width 32.
TOL = dict(terms=len(ROWS) * SEQ * 32)


def _build(state=None, impl="cpcompose", bidirectional=False):
    torch.manual_seed(0)
    if bidirectional:  # an encoder: every token attends to the whole row
        config = hf.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                                     cls_token_id=1, sep_token_id=1)
        return hf.AutoModelForMaskedLM.from_config(config, attn_implementation=impl, dtype=torch.float64)
    config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float64)
    if state is not None:
        model.load_state_dict(state)
    return model


def _batch(left: bool = False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (len(ROWS), SEQ), generator=g)
    real = torch.arange(SEQ)[None] < torch.tensor(ROWS)[:, None]
    if left:
        real = real.flip(1)
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


def refused_padding(mesh, case: str) -> str:
    model = _build(bidirectional=case == "bidirectional")
    ids, mask, _ = _batch(left=case == "left")
    positions = torch.arange(SEQ)[None].expand(len(ROWS), -1).clone()
    try:
        with context_parallel(mesh, buffers=[ids, mask, positions], buffer_seq_dims=[1] * 3, verify=False):
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
        message = "no error"
    except ValueError as e:
        message = str(e)
    ok_ids, _, _ = _batch()  # then a valid step in the same group
    ok_positions = torch.arange(SEQ)[None].expand(len(ROWS), -1).clone()
    with context_parallel(mesh, buffers=[ok_ids, ok_positions], buffer_seq_dims=[1, 1], verify=False):
        model(input_ids=ok_ids, position_ids=ok_positions)
    return message


@pytest.mark.parametrize("case,reason", [("left", "left (or inner) padding"),
                                         ("bidirectional", "padding in a bidirectional model")])
def test_padding_one_layout_cannot_mask_is_refused_on_every_rank(pools, case: str, reason: str) -> None:
    for message in pools.get(2).run(refused_padding, case):
        assert reason in message and "pack_batch" in message, message


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
