"""Fused kernels that would see only this rank's shard: "not available" inside a CP region."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpcompose.parallel.dispatch import CPAttentionMode

__all__ = ["local_only"]


def local_only(original: Callable[..., Any], region: CPAttentionMode, *args: Any, **kwargs: Any) -> None:
    """A fused kernel that would see this rank's shard only: "not available" inside a CP region."""
    return None
