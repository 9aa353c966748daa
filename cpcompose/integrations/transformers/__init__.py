"""Hugging Face transformers models under CP: `attn_implementation="cpcompose"`.

Importing this package registers "cpcompose" with transformers' attention and mask
interfaces (`attention.py`) and routes the kernel functions of its hybrid models' token
mixers (`kernels/`); `pack_batch` (`batch.py`) turns a batch into one packed row of
documents for CP; `verify` (`probe.py`) checks a model is exact under CP, and runs by
itself on a model's first forward in a CP region. A user's whole change to a training step:

    import cpcompose.integrations.transformers as cphf
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cpcompose")
    batch = cphf.pack_batch(input_ids, mesh, attention_mask=attention_mask)
    with context_parallel(mesh, buffers=batch.buffers, buffer_seq_dims=batch.seq_dims, layout=batch.layout):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        loss = cp_cross_entropy(logits, batch.labels, mesh=mesh)
        loss.backward()
    allreduce_gradients(model, mesh)  # or FSDP over dp x cp
"""

from cpcompose.integrations.transformers.attention import (
    ATTN_IMPLEMENTATION,
    cpcompose_attention_forward,
    cpcompose_mask,
    hf_window,
)
from cpcompose.integrations.transformers.batch import (
    PackedBatch,
    cu_seqlens_from_position_ids,
    pack_batch,
    shift_labels,
)
from cpcompose.integrations.transformers.kernels import install
from cpcompose.integrations.transformers.probe import install_first_use_probe, verify

install()
install_first_use_probe()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PackedBatch",
    "cpcompose_attention_forward",
    "cpcompose_mask",
    "cu_seqlens_from_position_ids",
    "hf_window",
    "pack_batch",
    "shift_labels",
    "verify",
]
