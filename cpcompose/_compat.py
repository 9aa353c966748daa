"""Every private PyTorch name (and optional third-party import) cpcompose uses.

Private ops and helpers move between PyTorch releases. Keeping them in one module
means a torch upgrade is checked, and fixed, in one place.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch._library import opaque_object as _opaque_object
from torch._library.opaque_object import MemberType

# Custom classes ("opaque objects", private): a Python object a custom op takes by reference, passed through
# torch.compile as a graph input instead of being traced. The compiled CP attention op
# (`cpcompose.attention.call.op`) carries its process group and options this way. torch 2.14 renamed the API
# (`torch._opaque_base.OpaqueBase` -> `torch._custom_class_base.CustomClassBase`, `register_opaque_type` ->
# `register_custom_class`, `typ="reference"` -> `typ="symbolic"`) and logs a deprecation line for each old
# spelling, in every process that uses one; torch 2.11-2.13 have only the old ones. Detected, not version-compared.
_CUSTOM_CLASSES_RENAMED = hasattr(_opaque_object, "register_custom_class")
CustomClassBase: Any = (
    importlib.import_module("torch._custom_class_base").CustomClassBase if _CUSTOM_CLASSES_RENAMED
    else importlib.import_module("torch._opaque_base").OpaqueBase
)
_register_custom_class = (
    _opaque_object.register_custom_class if _CUSTOM_CLASSES_RENAMED else _opaque_object.register_opaque_type
)
_BY_REFERENCE = "symbolic" if _CUSTOM_CLASSES_RENAMED else "reference"

__all__ = [
    "CustomClassBase", "all_gather_flat", "all_to_all_flat", "aten", "cpu_flash_backward",
    "cpu_flash_forward", "cpu_flash_takes_bfloat16", "cuda_cudnn_backward", "cuda_cudnn_forward", "cuda_efficient_backward",
    "cuda_efficient_forward", "cuda_flash_backward", "cuda_flash_forward", "default_store", "flash_attn_backward",
    "fake_rehearsal_tools", "flash_attn_forward", "flash_attn_varlen_backward", "flash_attn_varlen_forward",
    "flatten_mesh", "unflatten_mesh",
    "function_mode_stack", "function_modes_suspended", "group_timeout", "grouped_mm", "has_flash_attn",
    "has_flash_attn_varlen", "grouped_mm_of_any_dtype_on_fake_tensors", "import_flash_attn",
    "import_fused_linear_cross_entropy",
    "in_backward", "plain_mem_tracker", "reduce_scatter_flat", "register_by_reference",
]

aten = torch.ops.aten


def register_by_reference(cls: type, *, read_at_trace: tuple[str, ...]) -> None:
    """Let custom ops take `cls` (a `CustomClassBase` subclass) by reference: compiled code gets the very object.

    `read_at_trace` names the members compile reads once, with the real object, and bakes in as constants.
    """
    _register_custom_class(cls, typ=_BY_REFERENCE, members={name: MemberType.USE_REAL for name in read_at_trace})


# Fused CPU flash attention, the only fused CPU kernel that returns the log-sum-exp.
cpu_flash_forward = aten._scaled_dot_product_flash_attention_for_cpu.default
cpu_flash_backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@functools.cache
def cpu_flash_takes_bfloat16() -> bool:
    """Whether torch's fused CPU flash kernel runs bfloat16 in this process.

    torch 2.13 picks its bf16 brgemm path from the hardware (AVX-512 BF16 or AMX) but
    packs the operands with kernels chosen by ATen's dispatch level. With
    `ATEN_CPU_CAPABILITY=avx2` (or `default`) on such hardware every bf16 call of 64 or
    more keys raises "pack_vnni2 is only supported when avx512 is supported", plain
    `scaled_dot_product_attention` included. A real AVX2-only CPU never takes that path.
    Cached: both facts are fixed for the life of the process.
    """
    hardware_brgemm = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return not hardware_brgemm or torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")

# CUDA fused kernels. They exist in CPU builds as ops too, but only run on CUDA.
cuda_flash_forward = aten._scaled_dot_product_flash_attention.default
cuda_flash_backward = aten._scaled_dot_product_flash_attention_backward.default
cuda_efficient_forward = aten._scaled_dot_product_efficient_attention.default
cuda_efficient_backward = aten._scaled_dot_product_efficient_attention_backward.default
cuda_cudnn_forward = aten._scaled_dot_product_cudnn_attention.default
cuda_cudnn_backward = aten._scaled_dot_product_cudnn_attention_backward.default


@functools.lru_cache(maxsize=1)
def import_flash_attn() -> ModuleType | None:
    """Return flash-attn's low-level interface module, or None when not installed.

    Only flash-attn 2.x exposes `_flash_attn_forward`/`_flash_attn_backward` with
    an explicit log-sum-exp; anything else is treated as absent. Looked up once: a
    failed import searches the whole path again, and the kernel route asks per call.
    """
    try:
        from flash_attn import flash_attn_interface  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not hasattr(flash_attn_interface, "_flash_attn_forward"):
        return None
    return flash_attn_interface


def has_flash_attn() -> bool:
    """Whether flash-attn 2.x (with its explicit-LSE kernels) is importable."""
    return import_flash_attn() is not None


def has_flash_attn_varlen() -> bool:
    """Whether flash-attn's varlen kernels (many blocks in one call) are there too."""
    fa = import_flash_attn()
    return fa is not None and hasattr(fa, "_flash_attn_varlen_forward")


# flash-attn's private kernel functions, called with keywords only (their positional order moves
# between releases); tensors in flash-attn's layout `(batch, seq, heads, dim)` or varlen `(tokens, heads, dim)`.


def flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """`flash_attn_interface._flash_attn_forward`: returns its tuple (out, lse, ...)."""
    fa = import_flash_attn()
    assert fa is not None, "flash-attn is not installed (select_backend checks first)"
    return fa._flash_attn_forward(q, k, v, **kwargs)


def flash_attn_backward(*tensors: torch.Tensor, **kwargs: Any) -> Any:
    """`flash_attn_interface._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, ...)`: fills dq, dk, dv."""
    fa = import_flash_attn()
    assert fa is not None, "flash-attn is not installed (select_backend checks first)"
    return fa._flash_attn_backward(*tensors, **kwargs)


def flash_attn_varlen_forward(*args: Any, **kwargs: Any) -> Any:
    """`flash_attn_interface._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, ...)`."""
    fa = import_flash_attn()
    assert fa is not None, "flash-attn is not installed (supports_varlen checks first)"
    return fa._flash_attn_varlen_forward(*args, **kwargs)


def flash_attn_varlen_backward(*args: Any, **kwargs: Any) -> Any:
    """`flash_attn_interface._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, ...)`."""
    fa = import_flash_attn()
    assert fa is not None, "flash-attn is not installed (supports_varlen checks first)"
    return fa._flash_attn_varlen_backward(*args, **kwargs)


@functools.cache
def import_fused_linear_cross_entropy(kernel: str) -> Any:
    """A CUDA fused linear cross-entropy's function, or None when its package is not installed.

    `"liger"`: liger-kernel's `liger_fused_linear_cross_entropy(input, weight, target, bias=..., ignore_index=...,
    reduction=..., softcap=...)`; `"cut_cross_entropy"`: Apple's `linear_cross_entropy(e, c, targets, bias=...,
    ignore_index=..., softcap=..., reduction=..., filter_eps=...)`. Both are called with keywords only (their
    positional order moves between releases). Looked up once per kernel: importing either loads Triton.
    """
    try:
        if kernel == "liger":
            from liger_kernel.transformers.functional import (  # type: ignore[import-not-found]
                liger_fused_linear_cross_entropy as fn,
            )
        elif kernel == "cut_cross_entropy":
            from cut_cross_entropy import linear_cross_entropy as fn  # type: ignore[import-not-found]
        else:
            raise ValueError(f"unknown fused linear cross-entropy kernel {kernel!r}")
    except ImportError:
        return None
    return fn


# Flat collectives: torch 2.13 names them `all_gather_single` / `reduce_scatter_single`;
# earlier releases (2.11 on the GPU machines this project is lent) only have the
# `*_tensor` spellings, which take the same flat buffers.
_all_gather_flat = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
_reduce_scatter_flat = (getattr(torch.distributed, "reduce_scatter_single", None)
                        or torch.distributed.reduce_scatter_tensor)


def all_gather_flat(out: torch.Tensor, flat: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """Every rank's `flat` concatenated into `out` (1-D buffers), in rank order; the work if `async_op`."""
    return _all_gather_flat(out, flat, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """The sum over ranks of this rank's slice of `flat` (1-D buffers) into `out`; the work if `async_op`."""
    return _reduce_scatter_flat(out, flat, op=torch.distributed.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all_flat(out: torch.Tensor, flat: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """Equal slices of `flat` to every rank; theirs for this rank into `out`, in rank order (1-D buffers)."""
    return torch.distributed.all_to_all_single(out, flat, group=group, async_op=async_op)


# Grouped GEMM (one matrix product per group of rows, the groups cut by cumulative `offs`): torch 2.13 has it
# public as `torch.nn.functional.grouped_mm`, a thin wrapper of the private `torch._grouped_mm` that earlier
# releases (2.11 on the lent GPU machines) have alone. None where neither exists (the caller loops instead).
grouped_mm: Any = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """`DeviceMesh._flatten`: a private method in torch 2.13, used to derive meshes."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """`DeviceMesh._unflatten`: `mesh`'s axis `dim` split into axes `names` of `sizes` (innermost last), a new mesh
    with a process group per new axis (a collective: every rank calls it, once). Private in torch 2.13 and 2.14."""
    return mesh._unflatten(dim, sizes, names)


def strided_shard(dim: int, split_factor: int) -> Any:
    """`_StridedShard(dim, split_factor=...)`: a placement that subdivides each of the `split_factor` chunks a later
    mesh axis's `Shard(dim)` makes (FSDP2's placement over TP's shards). Private in torch 2.13."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def group_timeout(group: Any) -> Any:
    """The timeout a process group was created with (read from its backend: private in torch 2.13)."""
    device = next(iter(group._device_types))
    return group._get_backend(device).options._timeout


def default_store() -> Any:
    """The default process group's key-value store (`_get_default_store` is private in torch 2.13)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def function_mode_stack() -> list[Any]:
    """The active TorchFunctionModes, outermost first (`torch.overrides`' private accessor in torch 2.13)."""
    return list(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def function_modes_suspended() -> Iterator[None]:
    """Run a block with no TorchFunctionMode active (the stack popped, and pushed back after; private accessors).

    The exactness probe's single-process run, started from inside a CP region, must not be routed by it.
    """
    popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


@torch.compiler.assume_constant_result
def in_backward() -> bool:
    """Whether this thread is running an autograd backward (torch.utils.checkpoint reads the same private id).

    Dynamo cannot trace the private call: while it traces, the answer is read once and baked in, unguarded. A
    graph traced in a forward runs only in forwards (its inputs require grad there); one traced during a
    checkpoint's recomputation knows it is one.
    """
    return torch._C._current_graph_task_id() != -1




def fake_rehearsal_tools() -> tuple[Any, Any, Any, Any]:
    """(FakeTensorMode, FakeStore, FSDPMemTracker, _ModMemStats): torch's private pieces of a rehearsal on fake
    tensors with a fake process group (`cpcompose.training.memory.rehearsal`); imported only when one runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _ModMemStats
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeTensorMode, FakeStore, FSDPMemTracker, _ModMemStats


@contextlib.contextmanager
def grouped_mm_of_any_dtype_on_fake_tensors() -> Iterator[None]:
    """Within the block, `aten._grouped_mm` on fake tensors takes any dtype its kernels take, float32 included.

    Its meta kernel (torch 2.13 and 2.14) checks the CUDA fast path's bfloat16 (and 16-byte strides), while the
    CPU kernel and CUDA's fallback run float32 too: a float32 mixture-of-experts model that trains was refused on
    fake tensors (a rehearsal). The meta kernel here makes the output as torch's own does (its private
    `_create_grouped_mm_output_tensor`), in the dtype the kernels give it, for any floating dtype but bfloat16,
    which torch's own meta kernel keeps. Registered over torch's for the block only.
    """
    import warnings

    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    def meta(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if mat_a.dtype == torch.bfloat16 or not mat_a.dtype.is_floating_point:
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        torch._check(mat_b.dtype == mat_a.dtype, lambda: f"mat_b's dtype {mat_b.dtype} is not mat_a's {mat_a.dtype}")
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)

    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": for this block, on purpose
            warnings.simplefilter("ignore")
            library.impl("_grouped_mm", meta, "Meta")
        yield
    finally:
        library._destroy()
        for key in list(aten._grouped_mm.default._dispatch_cache):  # the op's cached lookups still name ours
            aten._grouped_mm.default._uncache_dispatch(key)


def plain_mem_tracker() -> Any:
    """torch's MemTracker (what FSDPMemTracker is to a model without FSDP: one rank over dp x cp), for a rehearsal."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker
