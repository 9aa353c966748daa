"""`parallelize_module` that refuses a CP plan key matching no module.

PyTorch's `parallelize_module` only warns when a plan key matches nothing and goes
on. For tensor parallelism that is a lost optimisation; for context parallelism it
is a model whose attention silently runs on one rank's tokens. This is PyTorch's
function, same signature, with that one case turned into an error.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from cpcompose.parallel.style import ContextParallel

__all__ = ["matching_modules", "parallelize_module"]


def matching_modules(module: nn.Module, key: str) -> list[str]:
    """The module paths a plan key reaches, with PyTorch's rule (fnmatch per dotted atom)."""
    if key == "":
        return [""]
    found: list[str] = []

    def walk(current: nn.Module, atoms: list[str], prefix: str) -> None:
        for name, child in current.named_children():
            if fnmatch(name, atoms[0]):
                path = f"{prefix}{name}"
                if len(atoms) == 1:
                    found.append(path)
                else:
                    walk(child, atoms[1:], f"{path}.")

    walk(module, key.split("."), "")
    return found


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """PyTorch's `parallelize_module`; a `ContextParallel` key that matches no module raises.

    Raises:
        ValueError: a plan key whose style is `ContextParallel` reaches no submodule.
    """
    if isinstance(parallelize_plan, dict):
        for key, style in parallelize_plan.items():
            if isinstance(style, ContextParallel) and not matching_modules(module, key):
                children = ", ".join(name for name, _ in module.named_children()) or "none"
                raise ValueError(
                    f"parallelize_module: the ContextParallel plan key {key!r} matches no module of "
                    f"{type(module).__name__} (its children: {children}); without it the attention would run "
                    "on each rank's tokens only. Fix the key (dotted module path, '*' matches one level)"
                )
    return _torch_parallelize_module(module, device_mesh, parallelize_plan, src_data_rank=src_data_rank)
