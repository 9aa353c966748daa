"""Hugging Face checkpoints straight into and out of a sharded model (being split into modules by what they do)."""

from cpcompose.integrations.transformers.weights.plan import (
    StoredTensor,
    WeightPlan,
    copy_model_files,
    export_pretrained,
    init_non_persistent_buffers,
    load_pretrained_weights,
    read_checkpoint_index,
    save_pretrained_weights,
    weight_plan,
)

__all__ = [
    "StoredTensor", "WeightPlan", "copy_model_files", "export_pretrained", "init_non_persistent_buffers",
    "load_pretrained_weights", "read_checkpoint_index", "save_pretrained_weights", "weight_plan",
]
