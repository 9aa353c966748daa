"""Hugging Face checkpoints straight into and out of a sharded model: no full copy on any rank.

A model built on the meta device and sharded (FSDP2) holds only its own slice of every weight.
`load_pretrained_weights` reads each slice from the folder's safetensors files with
`torch.distributed.checkpoint` and its `HuggingFaceStorageReader`, which reads only the bytes of
the slices asked for; `save_pretrained_weights` writes the slices back with the
`HuggingFaceStorageWriter` and consolidates them into ordinary safetensors files.

The modules, bottom to top (each imports only those below it):
- `index`: the folder's tensors from the safetensors headers (names, shapes, dtypes, files; no weights);
- `renaming`: the name a tensor is stored under, transformers' renamings undone in turn (Bailing's
  `.attention.` -> `.self_attn.` -> `.self_attn.forget_gate.`), regex-written ones included;
- `converted`: tensors transformers converts: MoE experts stacked into one tensor per layer (stored one
  per expert and projection), tensors concatenated from several stored ones (OLMo-Hybrid's and
  Kimi-Linear's q/k/v short convs, Qwen4-Exp's numbered n-gram shards) or split from one (LaraMini's
  `in_proj`);
- `plan`: `weight_plan`, where each model tensor is stored (tied tensors once), from the headers and the
  model alone; anything not stored under the model's name is an error naming the tensors;
- `shards`: which stored tensors and rows a rank's shard holds (FSDP shards stacked experts along the
  expert dim, so each rank reads and writes its own experts' tensors only);
- `load` and `export`: the sharded read, and the write back to a folder `from_pretrained` loads;
- `buffers` (apart): the non-persistent buffers (RoPE's `inv_freq`, Gemma's `embed_scale`) that no
  checkpoint holds and `to_empty` leaves unset, recomputed with the model's own `_init_weights`.
"""

try:  # the optional dependency, checked once for every module below: say which extra brings it
    import safetensors  # noqa: F401
    import transformers.conversion_mapping  # noqa: F401
    import transformers.core_model_loading  # noqa: F401
    import transformers.initialization  # noqa: F401
except ImportError as e:
    raise ImportError(f"cpcompose.integrations.transformers needs transformers>=5 (pip install 'cpcompose[hf]'): {e}") \
        from e

from cpcompose.integrations.transformers.weights.buffers import init_non_persistent_buffers
from cpcompose.integrations.transformers.weights.export import (
    copy_model_files,
    export_pretrained,
    save_pretrained_weights,
)
from cpcompose.integrations.transformers.weights.index import StoredTensor, read_checkpoint_index
from cpcompose.integrations.transformers.weights.load import load_pretrained_weights
from cpcompose.integrations.transformers.weights.plan import WeightPlan, weight_plan

__all__ = [
    "StoredTensor", "WeightPlan", "copy_model_files", "export_pretrained", "init_non_persistent_buffers",
    "load_pretrained_weights", "read_checkpoint_index", "save_pretrained_weights", "weight_plan",
]
