"""Cut a :class:`Llama` down to one pipeline stage.

Only module surgery happens here; the ``PipelineStage`` and the schedule, which
need process groups, are built by ``cpcompose.distributed.pipeline``.
"""

from __future__ import annotations

from cpcompose.models.llama.model import Llama

__all__ = ["split_llama_for_pipeline"]


def split_llama_for_pipeline(model: Llama, *, num_stages: int, stage_index: int) -> Llama:
    """Delete, in place, every module of ``model`` that stage ``stage_index`` does not own.

    Layers are split evenly and contiguously: stage ``s`` keeps layers
    ``[s * n, (s + 1) * n)`` with ``n = n_layers // num_stages``. The first stage
    keeps ``tok_embeddings``; the last keeps ``norm`` and ``output``. Kept layers
    retain their global keys in ``model.layers``, so FQNs (and therefore
    checkpoints and :meth:`Llama.init_weights`) match the full model.

    Works on a model on the ``meta`` device, which avoids materialising layers
    the stage will drop.

    Args:
        model: a full (uncut) model.
        num_stages: total number of pipeline stages.
        stage_index: this stage, in ``[0, num_stages)``.

    Returns:
        ``model`` itself, cut; its forward takes token ids on the first stage
        and hidden states otherwise, and returns logits only on the last.

    Raises:
        ValueError: if ``num_stages`` does not divide ``n_layers``, if
            ``stage_index`` is out of range, or if ``model`` is already cut.
    """
    n_layers = model.config.n_layers
    if num_stages < 1 or n_layers % num_stages != 0:
        raise ValueError(
            f"model.n_layers ({n_layers}) must be divisible by num_stages ({num_stages}): "
            "change num_stages (the pp degree) or model.n_layers"
        )
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    if len(model.layers) != n_layers or model.tok_embeddings is None or model.output is None:
        raise ValueError("split_llama_for_pipeline expects an uncut model")

    per_stage = n_layers // num_stages
    keep = range(stage_index * per_stage, (stage_index + 1) * per_stage)
    for layer_id in [key for key in model.layers if int(key) not in keep]:
        del model.layers[layer_id]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    return model
