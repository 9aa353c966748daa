"""Cut a :class:`Llama` down to the pipeline stages one rank runs.

Only module surgery happens here; the ``PipelineStage`` and the schedule, which
need process groups, are built by ``cpcompose.distributed.pipeline``.

A rank of a multi-stage schedule (Interleaved1F1B, ZBVZeroBubble, ...) runs several
stages that are not neighbours (rank 0 of pp = 2 runs stages 0 and 2, or 0 and 3 in a
V). `split_llama_for_stages` keeps ONE model holding the union of those stages' modules
under the full model's FQNs, and gives each stage a *view*: a ``Llama`` whose modules are
the same objects, holding just that stage's layers (and the embedding on stage 0, the
final norm and output on the last). Why one model and views, rather than one model copy
per stage as torchtitan keeps: the optimizer, the gradient clipping and the DCP
checkpoints see one module with the full model's names, exactly as without pipelining,
so a checkpoint loads at any pp and any stage count; and each view can be its own FSDP2
root (a ``PipelineStage`` reduces its stage's gradients by its root's state) while the
parameters are sharded once.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from cpcompose.models.llama.model import Llama

__all__ = ["split_llama_for_pipeline", "split_llama_for_stages"]


def _stage_layers(n_layers: int, num_stages: int, stage: int) -> range:
    per_stage = n_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def _check_cut(model: Llama, num_stages: int, stages: Sequence[int]) -> None:
    n_layers = model.config.n_layers
    if num_stages < 1 or n_layers % num_stages != 0:
        raise ValueError(
            f"model.n_layers ({n_layers}) must be divisible by num_stages ({num_stages}): "
            "change num_stages (the pp degree) or model.n_layers"
        )
    if not stages or any(not 0 <= s < num_stages for s in stages) or len(set(stages)) != len(stages):
        raise ValueError(f"stages must be distinct stage indices in [0, {num_stages}), got {tuple(stages)}")
    if len(model.layers) != n_layers or model.tok_embeddings is None or model.output is None:
        raise ValueError("split_llama_for_pipeline expects an uncut model")


def _view(model: Llama, layers: range, *, first: bool, last: bool) -> Llama:
    """A ``Llama`` holding ``model``'s own modules of one stage (no copy): its forward runs that stage."""
    view = Llama.__new__(Llama)
    nn.Module.__init__(view)
    view.config = model.config
    view.tok_embeddings = model.tok_embeddings if first else None
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    view.norm = model.norm if last else None
    view.output = model.output if last else None
    return view


def split_llama_for_stages(model: Llama, *, num_stages: int, stage_ids: Sequence[int]) -> tuple[Llama, tuple[Llama, ...]]:
    """Cut ``model``, in place, to the union of stages ``stage_ids``; return it and one view per stage.

    Layers are split evenly and contiguously into ``num_stages`` stages (stage ``s``: layers
    ``[s * n, (s + 1) * n)``, ``n = n_layers // num_stages``); stage 0 has ``tok_embeddings``,
    stage ``num_stages - 1`` ``norm`` and ``output``. The returned model keeps the full
    model's FQNs (what the optimizer and checkpoints use); each view, in the order of
    ``stage_ids``, shares its modules and runs one stage (what a ``PipelineStage`` runs).
    See the module docstring for why. Works on the ``meta`` device.

    Raises:
        ValueError: if ``num_stages`` does not divide ``n_layers``, a stage index is out of
            range or repeated, or ``model`` is already cut.
    """
    _check_cut(model, num_stages, stage_ids)
    keep = {i for s in stage_ids for i in _stage_layers(model.config.n_layers, num_stages, s)}
    for layer_id in [key for key in model.layers if int(key) not in keep]:
        del model.layers[layer_id]
    if 0 not in stage_ids:
        model.tok_embeddings = None
    if num_stages - 1 not in stage_ids:
        model.norm = None
        model.output = None
    views = tuple(_view(model, _stage_layers(model.config.n_layers, num_stages, s), first=s == 0,
                        last=s == num_stages - 1) for s in stage_ids)
    return model, views


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
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    return split_llama_for_stages(model, num_stages=num_stages, stage_ids=(stage_index,))[0]
