"""`training.compile` for a Hugging Face causal LM: which families compile, and compiling their decoder layers.

Each decoder layer is compiled whole with `fullgraph=True`, as the own Llama's blocks are
(`cpcompose.distributed.apply_compile`); with activation checkpointing, each layer's parts instead, inside
the checkpoint (dynamo cannot trace the checkpoint's `context_fn`, which re-enters the CP region around the
recomputation). CP attention is one custom op in the graph (`cpcompose::attention`): the `cpcompose`
attention function reads the region and its options while dynamo traces, passes a layer's sliding window
as a constant of the op call, and hands what it checks from tensor values (the positions) to the op, which
checks them at run time inside the cross-rank agreement.

What does not compile is refused before launch, by family: `COMPILED_FAMILIES` are the model types whose
layers compile without a graph break and train exactly under CP (tests/training/families/hf/test_compile.py
tries every family the trainer trains and asserts this list, and the refusals, exactly). Within them,
expert parallelism and pipeline stages are refused by flag (not shown exact compiled). Families outside the list fail for reasons of their own: the hybrids'
mixers and the sparse-attention indexers run cpcompose's checks in Python; transformers records MoE router
logits (the router loss) through a ContextVar that dynamo cannot read inside a compiled layer; attention
sinks (gpt-oss) do not pass through the compiled op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from cpcompose.distributed import apply_compile

__all__ = ["COMPILED_FAMILIES", "apply_hf_compile", "compile_refusal"]

COMPILED_FAMILIES = ("deepseek_v3", "gemma2", "gemma3_text", "gpt_neox", "llama", "mistral", "olmo2", "phi3", "qwen2",
                     "qwen3")
"""The model types whose decoder layers compile whole (fullgraph) and equal eager under CP."""


def compile_refusal(model: nn.Module, hf_config: Any, *, ep: int = 1, pp: int = 1) -> str | None:
    """Why `training.compile` cannot compile `model`'s decoder layers (naming the family or the flag), or None."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in COMPILED_FAMILIES:
        return (f"model type {model_type!r} ({type(model).__name__}) is not one whose decoder layers compile "
                f"under CP ({', '.join(COMPILED_FAMILIES)}): {_family_reason(model_type)}")
    if ep > 1:
        return f"not with parallelism.ep = {ep}: the expert-parallel exchange is not compiled (set it to 1)"
    if pp > 1:
        return f"not with parallelism.pp = {pp}: compiled layers in pipeline stages are not shown exact yet"
    return None


def _family_reason(model_type: object) -> str:
    from cpcompose.integrations.transformers.indexer import INDEXED_FAMILIES
    from cpcompose.integrations.transformers.mixer_routes import METHOD_ROUTES, MODELING_MODULES

    if model_type in MODELING_MODULES or any(path.split(".")[0] == model_type for path in METHOD_ROUTES):
        return ("its token mixers outside attention (convolutions, scans, recurrences) run cpcompose's CP "
                "versions in Python (checks, agreement, halo exchange), which dynamo cannot trace")
    if model_type in INDEXED_FAMILIES:
        return "its sparse-attention indexer runs cpcompose's selection in Python, which dynamo cannot trace"
    return "its layers were not shown to compile whole and exactly under CP"


def apply_hf_compile(layers: list[nn.Module], *, checkpointed: bool, backend: str | Callable[..., Any] = "inductor") \
        -> None:
    """Compile each decoder layer (fullgraph), or with activation checkpointing each layer's parts.

    Lazy: each compiles at its first forward. Called before FSDP, as the own Llama does.
    """
    apply_compile(layers if not checkpointed else [part for layer in layers for part in layer.children()],
                  backend=backend)
