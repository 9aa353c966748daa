"""flash-linear-attention's and mamba-ssm's Triton scans (CUDA) for the CP mixer APIs, found where importable.

The CP versions take the kernel to run as their first argument
(`cp_chunk_gated_delta_rule(kernel, region, ...)`, `cp_mamba2_chunk_scan(kernel, region, ...)`);
these look-ups find the CUDA ones, and say why when they cannot, so that a caller (a test,
a benchmark) can fall back to transformers' torch functions and report which kernel ran.

mamba-ssm's package root imports its compiled `selective_scan_cuda` unguarded, so a wheel
built without its CUDA extensions (`MAMBA_SKIP_CUDA_BUILD=TRUE`: the only way to carry it
without compiling) cannot even import `mamba_ssm.ops.triton.ssd_combined`, although the SSD
is pure Triton and needs none of it. When the plain import fails, the look-up imports the
SSD module from the installed package with the root's `__init__` skipped: it registers a
bare package for `mamba_ssm` (its `__path__` only) while the submodules import, then removes
it again, so a later `import mamba_ssm` behaves as it would have (and transformers, which
tries that import, still falls back to its torch scan). Once the submodules are loaded (or when
another package's guarded import left the subpackages in `sys.modules`), the plain import finds
them without the root: the answer's name is the same either way, so every rank reports alike.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FoundKernel", "fla_chunk_gated_delta_rule", "mamba_chunk_scan_combined"]

FLA_GDN = "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
MAMBA_SSD = "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined"


@dataclass(frozen=True)
class FoundKernel:
    """A look-up's answer: the kernel and its dotted name, or None and why it is not importable."""

    kernel: Callable[..., Any] | None
    name: str
    reason: str = ""


def _attribute(dotted: str) -> Callable[..., Any]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def fla_chunk_gated_delta_rule() -> FoundKernel:
    """flash-linear-attention's `chunk_gated_delta_rule` (Triton; CUDA tensors only)."""
    try:
        return FoundKernel(_attribute(FLA_GDN), FLA_GDN)
    except Exception as error:  # noqa: BLE001  (a broken install raises more than ImportError: say it, fall back)
        return FoundKernel(None, FLA_GDN, f"{type(error).__name__}: {error}")


def mamba_chunk_scan_combined() -> FoundKernel:
    """mamba-ssm's `mamba_chunk_scan_combined` (Triton; CUDA tensors only), without its compiled extensions."""
    try:
        return FoundKernel(_attribute(MAMBA_SSD), MAMBA_SSD)
    except Exception as error:  # noqa: BLE001
        first = f"{type(error).__name__}: {error}"
    spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        return FoundKernel(None, MAMBA_SSD, first)
    bare = types.ModuleType("mamba_ssm")
    bare.__path__ = list(spec.submodule_search_locations)
    sys.modules["mamba_ssm"] = bare
    try:
        return FoundKernel(_attribute(MAMBA_SSD), MAMBA_SSD)
    except Exception as error:  # noqa: BLE001
        return FoundKernel(None, MAMBA_SSD, f"{first}; without the package root: {type(error).__name__}: {error}")
    finally:
        if sys.modules.get("mamba_ssm") is bare:
            del sys.modules["mamba_ssm"]
