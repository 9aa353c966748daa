"""Hugging Face transformers models under CP: `attn_implementation="cpcompose"`.

Importing this package registers "cpcompose" with transformers' attention and mask
interfaces (`attention.py`) and routes the kernel functions of its hybrid models' token
mixers (`mixer_routes/`); `pack_batch` (`batch.py`) turns a batch into one packed row of
documents for CP; `verify` (`probe.py`) checks a model is exact under CP, and runs by
itself on a model's first forward in a CP region; `causal_lm_head` (`head.py`) cuts a causal LM at
its output layer for a loss that never builds the logits; `weights/` loads a checkpoint folder
straight into a sharded model and writes one back; `extend_context` (`context_length.py`) changes
the RoPE settings for a longer context; transformers' activation checkpointing recomputes in the CP
region its forward ran in (`checkpointing.py`). A user's whole change to a training step:

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
from cpcompose.integrations.transformers.checkpointing import install_checkpointing_in_region
from cpcompose.integrations.transformers.context_length import SCALED_ROPE_TYPES, extend_context
from cpcompose.integrations.transformers.head import HEADS, CausalLMHead, causal_lm_head
from cpcompose.integrations.transformers.indexer import INDEXERS, install_indexers, routed_indexers
from cpcompose.integrations.transformers.mixer_routes import install, refused_in
from cpcompose.integrations.transformers.probe import install_first_use_probe, verify
from cpcompose.integrations.transformers.weights import (
    StoredTensor,
    WeightPlan,
    export_pretrained,
    init_non_persistent_buffers,
    load_pretrained_weights,
    read_checkpoint_index,
    save_pretrained_weights,
    weight_plan,
)

install()
install_indexers()
install_first_use_probe()
install_checkpointing_in_region()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HEADS",
    "INDEXERS",
    "SCALED_ROPE_TYPES",
    "CausalLMHead",
    "PackedBatch",
    "StoredTensor",
    "WeightPlan",
    "causal_lm_head",
    "cpcompose_attention_forward",
    "cpcompose_mask",
    "cu_seqlens_from_position_ids",
    "export_pretrained",
    "extend_context",
    "hf_window",
    "init_non_persistent_buffers",
    "load_pretrained_weights",
    "pack_batch",
    "read_checkpoint_index",
    "refused_in",
    "routed_indexers",
    "save_pretrained_weights",
    "shift_labels",
    "verify",
    "weight_plan",
]
