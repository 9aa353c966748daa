"""ParallelDims validation and mesh construction on a one-process gloo world."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from cpcompose.distributed.parallel_dims import MESH_DIM_NAMES, ParallelDims, flat_mesh


def _dims(**overrides: int) -> ParallelDims:
    degrees = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    degrees.update(overrides)
    return ParallelDims(**degrees)


def test_product_mismatch_names_degrees_and_field() -> None:
    with pytest.raises(ValueError) as info:
        _dims(dp_shard=2, cp=2, world_size=8)
    message = str(info.value)
    assert "dp_replicate(1) * dp_shard(2) * cp(2) * tp(1) * pp(1) = 4 but the world size is 8" in message
    assert message.startswith("parallelism.dp_shard: ")


@pytest.mark.parametrize("field", ["dp_replicate", "cp", "tp", "pp"])
def test_degree_below_one_is_rejected(field: str) -> None:
    with pytest.raises(ValueError, match=f"^parallelism.{field}: must be >= 1"):
        _dims(**{field: 0})


def test_dp_shard_must_be_positive_or_minus_one() -> None:
    with pytest.raises(ValueError, match="^parallelism.dp_shard: must be >= 1 or -1"):
        _dims(dp_shard=-2)


def test_dp_shard_minus_one_takes_the_rest() -> None:
    dims = _dims(dp_replicate=2, dp_shard=-1, cp=2, tp=2, world_size=16)
    assert dims.dp_shard == 2
    with pytest.raises(ValueError, match="^parallelism.dp_shard: -1 needs world size 6"):
        _dims(dp_shard=-1, cp=4, world_size=6)


def test_derived_sizes_and_flags() -> None:
    dims = _dims(dp_replicate=2, dp_shard=1, cp=4, tp=2, pp=2, world_size=32)
    assert (dims.dp_size, dims.fsdp_size, dims.dp_cp_size, dims.non_data_parallel_size) == (2, 4, 8, 16)
    assert dims.dp_enabled and dims.dp_replicate_enabled and not dims.dp_shard_enabled
    # CP ranks share parameters, so CP alone turns FSDP on.
    assert dims.fsdp_enabled and dims.cp_enabled and dims.tp_enabled and dims.pp_enabled
    single = _dims()
    assert not (single.dp_enabled or single.fsdp_enabled or single.cp_enabled or single.tp_enabled)


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_build_mesh_requires_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        _dims().build_mesh("cpu")


@pytest.mark.usefixtures("gloo_world_of_one")
def test_build_mesh_names_and_flattened_meshes() -> None:
    mesh = _dims().build_mesh("cpu")
    assert mesh.mesh_dim_names == MESH_DIM_NAMES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert mesh.shape == (1, 1, 1, 1, 1)
    for name in ("dp_shard_cp", "dp_cp", "dp"):
        # The root mesh resolves a flattened name only if build_mesh registered it.
        assert mesh.get_group(name).size() == 1
        flat = flat_mesh(mesh, name)  # type: ignore[arg-type]
        assert flat.mesh_dim_names == (name,) and flat.size() == 1
        assert flat.get_group() is mesh.get_group(name)
    with pytest.raises(ValueError, match="unknown flattened mesh"):
        flat_mesh(mesh, "cp_tp")  # type: ignore[arg-type]


@pytest.mark.usefixtures("gloo_world_of_one")
def test_build_mesh_rejects_wrong_world_size() -> None:
    with pytest.raises(ValueError, match="world_size is 2"):
        _dims(dp_shard=2, world_size=2).build_mesh("cpu")


def test_ep_is_folded_out_of_dp_shard_times_cp() -> None:
    assert _dims(dp_shard=2, cp=2, world_size=4, ep=2).efsdp_size == 2
    assert _dims(dp_shard=2, cp=2, world_size=4, ep=4).efsdp_size == 1
    with pytest.raises(ValueError, match=r"^parallelism.ep: 3 must divide dp_shard\(2\) \* cp\(2\) = 4: .*no extra"):
        _dims(dp_shard=2, cp=2, world_size=4, ep=3)
    with pytest.raises(ValueError, match=r"^parallelism.ep: must be >= 1"):
        _dims(ep=0)
    with pytest.raises(ValueError, match=r"^parallelism.ep: 2 with parallelism.tp = 2"):
        _dims(dp_shard=2, tp=2, world_size=4, ep=2)


def _expert_mesh_ranks(mesh) -> dict:  # noqa: ANN001 (the pool's world mesh: unused, the default group is read)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, world_size=4, ep=2)
    root = dims.build_mesh("cpu")
    experts = dims.build_expert_mesh(root)
    return {name: experts[name].mesh.tolist() for name in ("dp_replicate", "efsdp", "ep")} | {
        "cp": root["cp"].mesh.tolist(), "dp_shard": root["dp_shard"].mesh.tolist(),
        "names": experts.mesh_dim_names}


def test_the_expert_mesh_takes_ep_from_consecutive_ranks_of_a_replica(pools) -> None:
    """ep innermost: at dp_shard = cp = ep = 2 an ep group is a CP group, and efsdp the dp_shard group."""
    results = pools.get(4).run(_expert_mesh_ranks)
    for rank, r in enumerate(results):
        assert r["names"] == ("dp_replicate", "efsdp", "ep")
        assert rank in r["ep"] and r["ep"] == r["cp"] and r["efsdp"] == r["dp_shard"], r
