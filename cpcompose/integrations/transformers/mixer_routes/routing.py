"""Installing the routes: each kernel function wrapped in its modeling module, each routed method on its
class, refused classes wrapped."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from cpcompose.integrations.transformers.mixer_routes.registry import (
    METHOD_ROUTES,
    MODELING_MODULES,
    ONE_PROCESS_FIXES,
    REFUSED,
    ROUTES,
    KernelCP,
)
from cpcompose.parallel.dispatch import active_cp_region

__all__ = ["install", "refused_in", "routed_functions", "routed_methods"]


def _routed(name: str, original: Callable[..., Any], cp: KernelCP,
            fix: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """`original` outside a CP region (or `fix(original, ...)`, `ONE_PROCESS_FIXES`), `cp(original, region, ...)`
    inside one.

    Set on a class, the wrapper is a method like the original: `self` arrives as the first
    argument, so a method's CP version gets `(original, region, self, ...)`.
    """

    @functools.wraps(original)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        region = active_cp_region()
        if region is None:
            return original(*args, **kwargs) if fix is None else fix(original, *args, **kwargs)
        region.routed += 1  # a token mixer that went through CP (a pure Mamba model has no attention)
        return cp(original, region, *args, **kwargs)

    kernel.__cpcompose_route__ = name  # type: ignore[attr-defined]
    return kernel


def _module(path: str) -> ModuleType | None:
    try:
        return importlib.import_module(path)
    except ImportError:  # an older or newer transformers without this family
        return None


def _modeling(name: str) -> ModuleType | None:
    return _module(f"transformers.models.{name}.modeling_{name}")


def _refusing(cls: type[nn.Module], reason: str) -> None:
    forward = cls.forward

    @functools.wraps(forward)
    def refuse(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if active_cp_region() is not None:
            raise ValueError(f"{cls.__name__} cannot be made exact under CP: {reason}")
        return forward(self, *args, **kwargs)

    cls.forward = refuse  # type: ignore[method-assign]


def _method(path: str) -> tuple[type, str] | None:
    """`"<modeling name>.<Class>.<method>"` -> (the class, the method's name), or None where this transformers
    lacks the family or the class."""
    name, cls_name, method = path.split(".")
    cls = getattr(_modeling(name), cls_name, None)
    return (cls, method) if isinstance(cls, type) and callable(getattr(cls, method, None)) else None


def install() -> None:
    """Route the kernel functions of every module in `MODELING_MODULES` and the methods of `METHOD_ROUTES`,
    and refuse `REFUSED` (once)."""
    for name in MODELING_MODULES:
        module = _modeling(name)
        if module is None:
            continue
        for function, cp in ROUTES.items():
            original = getattr(module, function, None)
            if callable(original) and not hasattr(original, "__cpcompose_route__"):
                setattr(module, function, _routed(function, original, cp))
    for path, cp in METHOD_ROUTES.items():
        found = _method(path)
        if found is not None and not hasattr(getattr(*found), "__cpcompose_route__"):
            setattr(found[0], found[1], _routed(path, getattr(*found), cp, ONE_PROCESS_FIXES.get(path)))
    for path, reason in REFUSED.items():
        module_name, cls_name = path.rsplit(".", 1)
        cls = getattr(_module(module_name), cls_name, None)
        if isinstance(cls, type) and not getattr(cls.forward, "__cpcompose_refused__", False):
            _refusing(cls, reason)
            cls.forward.__cpcompose_refused__ = True  # type: ignore[attr-defined]


def routed_functions() -> dict[str, list[str]]:
    """Per routed modeling module, the kernel functions now routed (for tests and the README table)."""
    found: dict[str, list[str]] = {}
    for name in MODELING_MODULES:
        module = _modeling(name)
        if module is not None:
            found[name] = sorted(f for f in ROUTES if hasattr(getattr(module, f, None), "__cpcompose_route__"))
    return found


def routed_methods() -> list[str]:
    """The `METHOD_ROUTES` entries now routed (absent: this transformers has no such family or class)."""
    return [path for path in METHOD_ROUTES
            if (found := _method(path)) is not None and hasattr(getattr(*found), "__cpcompose_route__")]


def refused_in(model: nn.Module) -> list[str]:
    """The modules of `model` whose class `REFUSED` names, as `name (Class): reason` (checked before a run)."""
    refused = {path.rsplit(".", 1)[1]: reason for path, reason in REFUSED.items()}
    return [f"{name} ({type(m).__name__}): {refused[type(m).__name__]}" for name, m in model.named_modules()
            if type(m).__name__ in refused]
