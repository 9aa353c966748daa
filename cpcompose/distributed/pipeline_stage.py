"""The module a ``PipelineStage`` runs, and the sequence metadata each pipeline microbatch carries.

A pipeline schedule runs microbatch ``i`` of a stage whenever its plan says, interleaved with
other microbatches' forwards and backwards (and, under activation checkpointing, their
recomputations). So nothing about a microbatch can live in a scope around ``schedule.step``:
every kwarg tensor given to ``step`` is chunked on dim 0 per microbatch and handed to the
stage with that microbatch, and that is how the microbatch's sequence metadata travels.

The interface (what the trainer and the model families build on):

* ``StageModule(body, scope)`` is called ``stage(x, position_ids, doc_bounds=None)``: ``x`` is
  token ids ``[mb, local_seq]`` on the first stage and hidden states otherwise,
  ``position_ids`` ``[mb, local_seq]`` (this CP rank's global positions, or positions within
  each document for packed rows), and the last stage returns logits ``[mb, local_seq, vocab]``.
  ``body(x, position_ids)`` is the family's stage (sharing the full model's modules).
* Packed documents: ``doc_bounds``, an int64 tensor ``[microbatches, width]`` given to
  ``schedule.step(..., doc_bounds=...)`` and chunked to ``[1, width]``: row ``i`` is
  microbatch ``i``'s pack's document bounds after padding (``PackedLayout.doc_bounds``: 0, the
  ends of its documents, the padded length, a multiple of cp), right-filled with -1 to the
  widest row of the step (`microbatch_doc_bounds`). One pipeline microbatch is one pack of its
  rows' documents, so each row's tokens and positions are ``[1, local_len]`` and stack to
  ``[microbatches, local_len]`` (every pack has the same padded length: rows x seq_len rounded
  up to cp). The stage rebuilds the ``PackedLayout`` from its row (`layout_of_doc_bounds`,
  ``PackedLayout.build(bounds, cp)``: deterministic, so it is the layout the tokens were cut
  by) and runs ``body`` inside ``scope(layout)`` (the family's ``TrainedModel.cp_scope``, e.g.
  ``ContextParallel.layout_for``). A recomputation under activation checkpointing runs in the
  backward, outside that scope: the checkpoint's ``context_fn``
  (``ContextParallel.recompute_context``) captures the layout at forward time and re-enters it
  around the recomputation, so packed data is exact under every schedule, zero-bubble split
  backward included. Without ``doc_bounds`` the scope gets None (the run's layout).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from cpcompose.layouts import PackedLayout

__all__ = ["StageModule", "layout_of_doc_bounds", "microbatch_doc_bounds"]


def microbatch_doc_bounds(layouts: Sequence[PackedLayout]) -> Tensor:
    """The ``doc_bounds`` kwarg of one pipeline step: one row per microbatch's pack, right-filled with -1."""
    width = max(len(layout.doc_bounds) for layout in layouts)
    rows = [list(layout.doc_bounds) + [-1] * (width - len(layout.doc_bounds)) for layout in layouts]
    return torch.tensor(rows, dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def _layout(bounds: tuple[int, ...], world: int) -> PackedLayout:
    return PackedLayout.build(bounds, world)


def layout_of_doc_bounds(row: Tensor, world: int) -> PackedLayout:
    """The ``PackedLayout`` of one microbatch's ``doc_bounds`` row (``[1, width]`` or ``[width]``) over ``world``
    CP ranks: the one its tokens were cut by (its bounds are already padded to a multiple of ``world``)."""
    bounds = tuple(int(b) for b in row.reshape(-1).tolist() if b >= 0)
    layout = _layout(bounds, world)
    if layout.pad:
        raise ValueError(f"doc_bounds {bounds[:4]}...: the pack's length {bounds[-1]} is not padded to a multiple of "
                         f"cp = {world}; build the row from the PackedLayout the tokens were cut by")
    return layout


class StageModule(nn.Module):
    """One pipeline stage as a ``PipelineStage`` runs it: ``body`` inside the microbatch's CP scope.

    ``body`` shares its modules with the rank's model (it holds no parameter of its own), so
    wrapping it changes no FQN of the model the optimizer and checkpoints see. With FSDP2 this
    module is made a root of its own (see `cpcompose.distributed.fsdp.apply_fsdp`'s ``roots``).
    See the module docstring for the call and the ``doc_bounds`` kwarg.
    """

    def __init__(self, body: nn.Module, scope: Callable[[PackedLayout | None], contextlib.AbstractContextManager],
                 cp_world: int) -> None:
        super().__init__()
        self.body = body
        self._scope = scope
        self._cp_world = cp_world

    def forward(self, x: Tensor, position_ids: Tensor, doc_bounds: Tensor | None = None) -> Tensor:
        """Run the stage on one microbatch (see the module docstring)."""
        layout = None if doc_bounds is None else layout_of_doc_bounds(doc_bounds, self._cp_world)
        with self._scope(layout):
            return self.body(x, position_ids)
