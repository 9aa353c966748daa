"""A stand-in for the one torchtitan module that needs `triton`, for CPU test runs only.

torchtitan 0.3.0 imports `triton` when any of its models is imported
(`models.common` -> `moe` -> `token_dispatcher` -> `distributed.minimal_async_ep`
-> `kernels.py`), without declaring it as a dependency. Those kernels serve only
the "minimal_async_ep" MoE dispatch on CUDA, which no CPU test uses. Installing
triton (about 900 MB) just to import them is not worth it, so before torchtitan is
imported the tests put this stand-in in `sys.modules` under that module's name:
the same function names, each raising if it is ever called. Nothing else of
torchtitan is replaced, and where triton is installed the stand-in is not used.
"""

from __future__ import annotations

import importlib.util
import sys
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def _unavailable(name: str):
    def kernel(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{name} is a triton kernel; this CPU test run has a stand-in without triton")

    kernel.__name__ = name
    return kernel


def install() -> None:
    """Register the stand-in unless triton is importable or the real module is already loaded."""
    if KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(KERNELS, __doc__)
    for name in _NAMES:
        setattr(module, name, _unavailable(name))
    sys.modules[KERNELS] = module
