"""The one place an SDPA call becomes context-parallel: a TorchFunctionMode.

While a `CPAttentionMode` is active (entered by the `ContextParallel` style around
a module's forward, or by the `context_parallel` context manager), every
`F.scaled_dot_product_attention` call is routed to `cp_attention` with the mode's
mesh, strategy and layout. The configuration lives in the mode object on the
(thread-local) mode stack, not in a global, so two models with different CP
settings in one process never see each other's.

Arguments may be plain tensors (this rank's sequence shard) or DTensors placed
`Shard(2)` on the CP mesh dimension (other mesh dims, e.g. TP's head sharding,
are kept as they are); the result has the same form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from cpcompose.attention.api import STRATEGIES, cp_attention
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layout import LAYOUTS
from cpcompose.packing import PackedLayout


@dataclass(frozen=True)
class CPConfig:
    """How SDPA calls inside a CP region are computed."""

    mesh: DeviceMesh
    strategy: str = "ring"
    layout: str | PackedLayout = "zigzag"
    meter: CommMeter | None = None
    backend: str | None = None
    window_size: int | None = None  # sliding window for the causal SDPA calls inside

    def __post_init__(self) -> None:
        cp = CPGroup.from_mesh(self.mesh)  # 1-D check
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is unknown; choose one of {tuple(STRATEGIES)}")
        if isinstance(self.layout, PackedLayout):
            if self.layout.world != cp.world:
                raise ValueError(f"the PackedLayout was built for {self.layout.world} ranks, the mesh has {cp.world}")
        elif self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is unknown; choose one of {LAYOUTS} or pass a PackedLayout")


class CPAttentionMode(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `cp_attention` under `config`."""

    def __init__(self, config: CPConfig) -> None:
        super().__init__()
        self.config = config

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def sdpa(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """`F.scaled_dot_product_attention`'s signature, computed context-parallel.

        Raises:
            ValueError: a mask tensor, dropout, GQA without `enable_gqa`, a mix of
                DTensors and plain tensors, or DTensors not sharded on the sequence.
        """
        if attn_mask is not None:
            raise ValueError(
                "context-parallel SDPA cannot honour an explicit attn_mask tensor (its rows and columns "
                "index the global sequence, which no rank holds); use is_causal=True, or cp_attention "
                "with document boundaries for packed sequences"
            )
        if dropout_p:
            raise ValueError(f"context-parallel SDPA does not support dropout (dropout_p={dropout_p}); set it to 0")
        if query.shape[1] != key.shape[1] and not enable_gqa:
            raise ValueError(
                f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True, as plain SDPA requires"
            )
        is_dtensor = [isinstance(t, DTensor) for t in (query, key, value)]
        if any(is_dtensor) and not all(is_dtensor):
            raise ValueError(
                "SDPA got a mix of DTensor and plain tensor arguments; under context parallelism pass "
                "q, k, v all as plain local shards or all as DTensors sharded Shard(2) on the CP mesh"
            )
        if all(is_dtensor):
            return self._sdpa_dtensor(query, key, value, is_causal=is_causal, scale=scale)
        return self._attend(query, key, value, is_causal=is_causal, scale=scale)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float | None) -> Tensor:
        c = self.config
        out = cp_attention(
            q, k, v, mesh=c.mesh, is_causal=is_causal, scale=scale, strategy=c.strategy,  # type: ignore[arg-type]
            layout=c.layout, backend=c.backend, meter=c.meter, window_size=c.window_size,
        )
        assert isinstance(out, Tensor)
        return out

    def _sdpa_dtensor(self, q: DTensor, k: DTensor, v: DTensor, *, is_causal: bool, scale: float | None) -> DTensor:
        cp_name = (self.config.mesh.mesh_dim_names or ("cp",))[0]
        for name, t in (("query", q), ("key", k), ("value", v)):
            names = t.device_mesh.mesh_dim_names or ()
            placement = t.placements[names.index(cp_name)] if cp_name in names else None
            if not (isinstance(placement, Shard) and placement.dim % t.ndim == 2):
                raise ValueError(
                    f"SDPA {name} is a DTensor with placements {t.placements} on mesh dims {names}; "
                    f"context parallelism needs Shard(2) (the sequence) on mesh dim {cp_name!r}"
                )
        out = self._attend(q.to_local(), k.to_local(), v.to_local(), is_causal=is_causal, scale=scale)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

