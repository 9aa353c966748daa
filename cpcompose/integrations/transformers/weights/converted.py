"""Model tensors that transformers converts from stored ones: stacked experts, concatenated and split rows.

transformers 5 stacks the experts of its MoE models into one tensor per layer (`experts.gate_up_proj` of
shape `(experts, 2 x inter, hidden)`), while checkpoints keep one tensor per expert and projection
(`experts.{e}.gate_proj.weight`, ...). A few models fuse tensors stored apart into one (OLMo-Hybrid's and
Kimi-Linear's q/k/v short convs, Qwen4-Exp's numbered n-gram shards, concatenated along dim 0) or split one
stored tensor into several (LaraMini's `in_proj`). Each of these is one of transformers' converters; the
layouts it can invert are found here, from the headers and the model's shapes, so that each rank later
reads only the rows of its own shard. Anything else is a reason, returned as a string for the plan's error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor
from transformers.core_model_loading import Concatenate, MergeModulelist, Split, WeightConverter

from cpcompose.integrations.transformers.weights.index import StoredTensor
from cpcompose.integrations.transformers.weights.renaming import Renamings, is_literal, plain_pattern, stored_name

__all__ = ["ConcatenatedRows", "StackedExperts", "find_converted"]


@dataclass(frozen=True)
class StackedExperts:
    """A model tensor `(experts, rows, ...)` made of one stored tensor per expert and part (concatenated on dim 1)."""

    parts: tuple[tuple[str, ...], ...]
    """parts[j][e]: the stored name of part j of expert e."""
    rows: tuple[int, ...]
    """The size of each part along dim 1 of the model tensor."""


@dataclass(frozen=True)
class ConcatenatedRows:
    """A model tensor made of row ranges of stored tensors, concatenated along dim 0: several stored tensors
    whole (transformers' Concatenate), or one range of one stored tensor (its Split)."""

    parts: tuple[str, ...]
    """The stored names, in order."""
    starts: tuple[int, ...]
    """The first row of each part that belongs to this tensor."""
    rows: tuple[int, ...]
    """How many rows of each part."""

    def pieces(self, start: int, count: int) -> Iterator[tuple[str, int, int, int]]:
        """(stored name, first row in it, rows, first row in the model's range) covering model rows
        [start, start + count)."""
        offset = 0
        for part, first, rows in zip(self.parts, self.starts, self.rows):
            lo, hi = max(start, offset), min(start + count, offset + rows)
            if lo < hi:
                yield part, first + lo - offset, hi - lo, lo - start
            offset += rows


def find_converted(name: str, state: dict[str, Tensor], stored: dict[str, StoredTensor], renames: Renamings,
                   converters: list[WeightConverter]) -> StackedExperts | ConcatenatedRows | str | None:
    """How the model tensor `name` is stored through one of `converters` (or why it cannot be read), or None if
    no converter targets it. A Split converter is tried first: its targets are named inside a longer name."""
    return _split(name, state, stored, renames, converters) or _stacked(name, tuple(state[name].shape), stored,
                                                                        renames, converters)


def _operations(converter: WeightConverter) -> list[tuple[type, int | None]]:
    """The converter's operations as (type, dim): what tells the layouts apart."""
    return [(type(op), getattr(op, "dim", None)) for op in converter.operations]


def _stacked(name: str, shape: tuple[int, ...], stored: dict[str, StoredTensor], renames: Renamings,
             converters: list[WeightConverter]) -> StackedExperts | ConcatenatedRows | str | None:
    """How a stacked-experts tensor is stored (or why it cannot be read), or None if no converter targets it."""
    for converter in converters:
        ops = _operations(converter)
        target = converter.target_patterns[0] if len(converter.target_patterns) == 1 else None
        if target is None or not name.endswith(target):
            continue
        sources = [plain_pattern(p) for p in converter.source_patterns]
        if ops == [(Concatenate, 0)] and all(is_literal(p.replace("*", "0")) for p in sources):
            return _concatenated(name[: len(name) - len(target)], sources, shape, stored, renames)
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) or any(
                p.count("*") != 1 or not is_literal(p.replace("*", "0")) for p in sources):
            return (f"transformers converts its stored tensors with {[op.__name__ for op, _ in ops]} "
                    "(cpcompose reads experts stacked along dim 0, optionally concatenated along dim 1)")
        prefix = name[: len(name) - len(target)]
        parts = []
        for pattern in sources:
            keys = [stored_name(prefix + pattern.replace("*", str(e)), stored, renames) for e in range(shape[0])]
            if any(k is None for k in keys):
                return f"its experts' tensors ({prefix + pattern}) are not all in the checkpoint"
            parts.append(tuple(k for k in keys if k is not None))
        rows = tuple(stored[p[0]].shape[0] for p in parts)
        expected = tuple(shape[1:])
        for part, r in zip(parts, rows):
            bad = [k for k in part if stored[k].shape != (r, *expected[1:])]
            if bad:
                return f"{bad[0]} has shape {stored[bad[0]].shape}, expected ({r}, {', '.join(map(str, expected[1:]))})"
        if sum(rows) != expected[0]:
            return f"its parts have {sum(rows)} rows in all, the model's tensor {expected[0]}"
        return StackedExperts(tuple(parts), rows)
    return None


def _concatenated(prefix: str, sources: list[str], shape: tuple[int, ...], stored: dict[str, StoredTensor],
                  renames: Renamings) -> ConcatenatedRows | str:
    """A model tensor stored as parts concatenated along dim 0 (or why it cannot be read). A part with `*`
    (Qwen4-Exp's `ngram_embedding.shard_*.weight`) stands for shards 0, 1, ... as many as are stored."""
    keys: list[str | None] = []
    for pattern in sources:
        if "*" not in pattern:
            keys.append(stored_name(prefix + pattern, stored, renames))
            continue
        shards = 0
        while (key := stored_name(prefix + pattern.replace("*", str(shards)), stored, renames)) is not None:
            keys.append(key)
            shards += 1
        if not shards:
            keys.append(None)
    if any(k is None for k in keys):
        return f"its parts ({', '.join(prefix + p for p in sources)}) are not all in the checkpoint"
    parts = tuple(k for k in keys if k is not None)
    bad = [p for p in parts if stored[p].shape[1:] != shape[1:]]
    if bad:
        return f"{bad[0]} has shape {stored[bad[0]].shape}, expected (rows, {', '.join(map(str, shape[1:]))})"
    rows = tuple(stored[p].shape[0] for p in parts)
    if sum(rows) != shape[0]:
        return f"its parts have {sum(rows)} rows in all, the model's tensor {shape[0]}"
    return ConcatenatedRows(parts, (0,) * len(parts), rows)


def _split(name: str, state: dict[str, Tensor], stored: dict[str, StoredTensor], renames: Renamings,
           converters: list[WeightConverter]) -> ConcatenatedRows | str | None:
    """A model tensor that is one of the row ranges one stored tensor is split into along dim 0 (LaraMini's
    `in_proj` -> `in_proj_qkv`, `in_proj_z`, ...: each sized like its model tensor), or None if no Split
    converter targets it."""
    for converter in converters:
        ops = _operations(converter)
        targets = list(converter.target_patterns)
        found = [t for t in targets if f"{t}." in name or name.endswith(t)]  # `in_proj_qkv` in `...in_proj_qkv.weight`
        if ops != [(Split, 0)] or len(converter.source_patterns) != 1 or len(found) != 1:
            continue
        at = name.rindex(found[0])
        prefix, suffix = name[:at], name[at + len(found[0]):]
        source = prefix + plain_pattern(converter.source_patterns[0]) + suffix
        key = stored_name(source, stored, renames)
        if key is None or any(prefix + t + suffix not in state for t in targets):
            return f"its stored tensor ({source}) is not in the checkpoint"
        sizes = [state[prefix + t + suffix].shape[0] for t in targets]
        if sum(sizes) != stored[key].shape[0] or stored[key].shape[1:] != state[name].shape[1:]:
            return f"{key} has shape {stored[key].shape}, the {len(targets)} tensors split from it {sum(sizes)} rows"
        i = targets.index(found[0])
        return ConcatenatedRows((key,), (sum(sizes[:i]),), (sizes[i],))
    return None
