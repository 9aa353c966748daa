"""Parallelism degrees, checked once, and the named device mesh built from them.

One mesh with five named axes, outermost first::

    ("pp", "dp_replicate", "dp_shard", "cp", "tp")

All five names exist even at degree 1, so every caller slices the same way.
Three flattened axes are derived from it:

* ``dp_shard_cp`` = dp_shard x cp: FSDP shards parameters here, because CP ranks
  hold the same parameters and must reduce their gradients together.
* ``dp_cp`` = dp_replicate x dp_shard x cp: the loss's global count of valid
  tokens is all-reduced here (a token sum over a global count, never a mean of means).
* ``dp`` = dp_replicate x dp_shard: ranks with the same ``dp`` coordinate load the same batch.

Expert parallelism needs no ranks of its own: as torchtitan folds it, the ``ep`` ranks are taken out of the
ranks that already share a model replica (dp_shard x cp), so ``ep`` must divide dp_shard x cp. The experts'
mesh (:meth:`ParallelDims.build_expert_mesh`) splits ``dp_cp`` into ``("dp_replicate", "efsdp", "ep")``:
each expert lives on one ``ep`` rank, FSDP-sharded over ``efsdp`` = dp_shard x cp / ep (and replicated over
dp_replicate), while the dense layers keep the five axes above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpcompose import _compat

__all__ = ["EXPERT_MESH_DIM_NAMES", "MESH_DIM_NAMES", "Degrees", "FlatMeshName", "ParallelDims", "flat_mesh"]

MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Axis names of the mesh returned by :meth:`ParallelDims.build_mesh`, outermost first."""

FlatMeshName = Literal["dp_shard_cp", "dp_cp", "dp"]

# Constituent axes of each flattened mesh, in mesh order (torch requires ascending slices).
_FLAT_MESH_DIMS: dict[str, tuple[str, ...]] = {
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp": ("dp_replicate", "dp_shard"),
}


EXPERT_MESH_DIM_NAMES: tuple[str, ...] = ("dp_replicate", "efsdp", "ep")
"""Axis names of the experts' mesh returned by :meth:`ParallelDims.build_expert_mesh`, outermost first."""


class Degrees(Protocol):
    """Anything with the five degrees, such as the config's ``parallelism`` section (``ep``, read when present,
    defaults to 1)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int


@dataclass
class ParallelDims:
    """Degrees of each parallelism; their product must equal the world size.

    Every check of the degrees lives here (the config asks this class instead of
    repeating them); each error message starts with the config key to change.
    """

    dp_replicate: int
    """Data-parallel replicas (DDP / HSDP outer axis)."""
    dp_shard: int
    """Data-parallel shards (FSDP); ``-1`` takes whatever the other degrees leave."""
    cp: int
    """Context-parallel degree: ranks that split one sequence."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline-parallel degree (number of stages)."""
    world_size: int
    """Total number of processes."""
    ep: int = 1
    """Expert-parallel degree: ranks, folded out of dp_shard x cp, that each hold a share of every MoE layer's
    experts."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name}: must be >= 1, got {getattr(self, name)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        named = f"dp_replicate({self.dp_replicate}) * cp({self.cp}) * tp({self.tp}) * pp({self.pp})"
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"parallelism.dp_shard: -1 needs world size {self.world_size} divisible by {named} "
                    f"= {others}: change those degrees or the number of processes"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ValueError(f"parallelism.dp_shard: must be >= 1 or -1, got {self.dp_shard}")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"parallelism.dp_shard: dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * "
                f"cp({self.cp}) * tp({self.tp}) * pp({self.pp}) = {product} but the world size is "
                f"{self.world_size}: set dp_shard = -1 to fill in the rest, or change the number of processes"
            )
        if self.ep < 1:
            raise ValueError(f"parallelism.ep: must be >= 1, got {self.ep}")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(f"parallelism.ep: {self.ep} with parallelism.tp = {self.tp}: experts are not split by tensor "
                             "parallelism yet; use one of the two")
        if self.fsdp_size % self.ep:
            raise ValueError(
                f"parallelism.ep: {self.ep} must divide dp_shard({self.dp_shard}) * cp({self.cp}) = {self.fsdp_size}: "
                "expert-parallel ranks are folded out of the ranks that share a model replica (no extra ranks)"
            )

    @classmethod
    def from_config(cls, degrees: Degrees, world_size: int) -> ParallelDims:
        """The degrees of ``degrees`` (e.g. ``JobConfig.parallelism``) on ``world_size`` ranks.

        ``degrees`` is only read: a ``dp_shard`` of ``-1`` is resolved in the returned object.

        Raises:
            ValueError: the degrees do not multiply to ``world_size``; the message starts with the key.
        """
        return cls(degrees.dp_replicate, degrees.dp_shard, degrees.cp, degrees.tp, degrees.pp, world_size,
                   ep=getattr(degrees, "ep", 1))

    @property
    def dp_enabled(self) -> bool:
        """Whether more than one distinct batch is processed per step."""
        return self.dp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """Whether parameters are replicated (DDP, or the outer axis of HSDP)."""
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Whether the data-parallel shard axis has more than one rank."""
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether FSDP is needed: it runs over dp_shard x cp, so CP alone enables it."""
        return self.fsdp_size > 1

    @property
    def cp_enabled(self) -> bool:
        """Whether sequences are split across ranks."""
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether tensor parallelism is on."""
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        """Whether the model is cut into pipeline stages."""
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        """Whether each rank holds a share of the experts (expert parallelism)."""
        return self.ep > 1

    @property
    def efsdp_size(self) -> int:
        """Ranks FSDP shards each expert over: dp_shard x cp / ep (size of the experts' ``efsdp`` axis)."""
        return self.fsdp_size // self.ep

    @property
    def dp_size(self) -> int:
        """Number of distinct batches per step (size of the ``dp`` mesh)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards parameters over (size of the ``dp_shard_cp`` mesh)."""
        return self.dp_shard * self.cp

    @property
    def dp_cp_size(self) -> int:
        """Ranks the loss's valid-token count is summed over (size of the ``dp_cp`` mesh)."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that together process one batch: cp x tp x pp."""
        return self.cp * self.tp * self.pp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the 5-D named mesh and its flattened ``dp_shard_cp``, ``dp_cp`` and ``dp`` axes.

        The default process group must already exist: the caller runs
        ``dist.init_process_group(..., timeout=...)`` so every collective has a
        timeout; this method never creates it (``init_device_mesh`` would, with
        no timeout chosen by us), and gives every mesh group that same timeout.

        Flattened axes are reachable as ``mesh["dp_shard_cp"]``; torch 2.13 warns
        that this slicing will be deprecated, and :func:`flat_mesh` is the
        warning-free way.

        Args:
            device_type: ``"cuda"``, ``"cpu"``, ...

        Returns:
            The root mesh, axes named :data:`MESH_DIM_NAMES`.

        Raises:
            RuntimeError: if the default process group is not initialised.
            ValueError: if its world size differs from ``self.world_size``.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "build_mesh needs the default process group: call "
                "torch.distributed.init_process_group(..., timeout=...) first"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims.world_size is {self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks: change the number of processes or the degrees"
            )
        shape = tuple(getattr(self, name) for name in MESH_DIM_NAMES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        # torch gives new subgroups its 30-minute default, not the world's timeout: pass it on.
        timeout = _compat.group_timeout(dist.group.WORLD)
        groups = [mesh[name].get_group() for name in MESH_DIM_NAMES]
        groups += [flat_mesh(mesh, name).get_group() for name in _FLAT_MESH_DIMS]
        for group in groups:
            group.set_timeout(timeout)
        return mesh

    def build_expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The experts' mesh, axes :data:`EXPERT_MESH_DIM_NAMES`: ``dp_cp`` of the root `mesh` (from
        :meth:`build_mesh`) split into dp_replicate x efsdp x ep, ep innermost (so an ``ep`` group is ep
        consecutive ranks of a replica: CP ranks first). A collective: call it once, on every rank, after
        `build_mesh`; its groups get the world's timeout like the root's.
        """
        self.check_mesh(mesh)
        experts = _compat.unflatten_mesh(flat_mesh(mesh, "dp_cp"), "dp_cp",
                                         (self.dp_replicate, self.efsdp_size, self.ep), EXPERT_MESH_DIM_NAMES)
        timeout = _compat.group_timeout(dist.group.WORLD)
        for name in EXPERT_MESH_DIM_NAMES:
            experts[name].get_group().set_timeout(timeout)
        return experts

    def check_mesh(self, mesh: DeviceMesh) -> None:
        """Check that ``mesh`` is a root mesh built from these degrees by :meth:`build_mesh`.

        Raises:
            ValueError: an axis is missing or its size differs from this object's degree.
        """
        names = mesh.mesh_dim_names or ()
        for name in MESH_DIM_NAMES:
            if name not in names:
                raise ValueError(f"mesh has axes {names}; pass the root mesh from ParallelDims.build_mesh")
            if mesh[name].size() != getattr(self, name):
                raise ValueError(
                    f"mesh axis {name!r} has {mesh[name].size()} ranks but parallel_dims.{name} is "
                    f"{getattr(self, name)}; build the mesh from the same ParallelDims"
                )


def flat_mesh(mesh: DeviceMesh, name: FlatMeshName) -> DeviceMesh:
    """Return the flattened axis ``name`` of a mesh from :meth:`ParallelDims.build_mesh`.

    Re-flattening under an existing name returns the mesh torch already holds,
    without creating process groups, so this is cheap after ``build_mesh``.

    Args:
        mesh: the root mesh.
        name: ``"dp_shard_cp"`` (FSDP), ``"dp_cp"`` (loss) or ``"dp"`` (data loading).

    Returns:
        A 1-D mesh named ``name``.

    Raises:
        ValueError: if ``name`` is not one of the flattened axes.
    """
    if name not in _FLAT_MESH_DIMS:
        raise ValueError(f"unknown flattened mesh {name!r}; choose one of {sorted(_FLAT_MESH_DIMS)}")
    return _compat.flatten_mesh(mesh[_FLAT_MESH_DIMS[name]], name)
