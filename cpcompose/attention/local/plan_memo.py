"""What a kernel backend derives from a cached plan, kept as long as the plan is.

Block plans are cached tuples (`setup.cached_plan`), so a backend's rewriting of
one (flash-attn's varlen groups, the CPU path's causal tiles) can be computed once
and found again by the plan's identity. An entry holds its plan, so the identity
cannot be reused while the entry lives; plans that are not tuples (built for one
call) are never kept.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, TypeVar

__all__ = ["PLAN_MEMO_SIZE", "PlanMemo"]

T = TypeVar("T")

PLAN_MEMO_SIZE = 4096  # as many as the plan cache holds


class PlanMemo:
    """`get(tasks, extra, build)`: `build()` once per (plan identity, `extra`), oldest entries dropped first."""

    def __init__(self, size: int = PLAN_MEMO_SIZE) -> None:
        self._size = size
        self._entries: dict[tuple[int, Hashable], tuple[Sequence[Any], Any]] = {}

    def get(self, tasks: Sequence[Any], extra: Hashable, build: Callable[[], T]) -> T:
        key = (id(tasks), extra)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is tasks:
            return hit[1]
        value = build()
        if isinstance(tasks, tuple):
            if len(self._entries) >= self._size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = (tasks, value)
        return value
