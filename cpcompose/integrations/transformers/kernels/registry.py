"""Which kernel functions, modeling modules and module classes the integration routes (one line each).

A new kernel API is a CP version in its own file plus one `ROUTES` line; a new hybrid family
whose modeling module calls routed kernels is one `MODELING_MODULES` entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from cpcompose.integrations.transformers.kernels.conv import cp_causal_conv1d_fn
from cpcompose.integrations.transformers.kernels.fused import local_only
from cpcompose.integrations.transformers.kernels.selective_scan import cp_mamba_selective_scan
from cpcompose.integrations.transformers.kernels.ssd import cp_mamba2_chunk_scan

__all__ = ["MODELING_MODULES", "REFUSED", "ROUTES", "KernelCP"]

KernelCP = Callable[..., Any]
"""`cp(original, region, *args, **kwargs)`: a kernel function's CP version (same arguments as the original)."""

ROUTES: Mapping[str, KernelCP] = MappingProxyType({
    "causal_conv1d_fn": cp_causal_conv1d_fn,
    "mamba2_chunk_scan": cp_mamba2_chunk_scan,
    "mamba2_split_conv1d_scan_combined": local_only,
    "mamba_inner_fn": local_only,
    "mamba_selective_scan": cp_mamba_selective_scan,
})
"""Kernel function name -> its CP version. A name in a modeling module that is not here stays local
only if the module's mixers never reach it inside a region (the tests of each family show they do not)."""

MODELING_MODULES: tuple[str, ...] = (
    "lfm2", "lfm2_moe", "lfm3",
    "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2",
    "mamba", "falcon_mamba", "jamba", "zamba",
)
"""The modeling modules (`transformers.models.<name>.modeling_<name>`) whose kernel functions are routed."""

REFUSED: Mapping[str, str] = MappingProxyType({})
"""`module.ClassName` -> why CP cannot make it exact yet: refused inside a region, on every rank."""
