"""A DCP checkpoint from dp_shard=2 x cp=2 resumes exactly under cp=4 and in one process.

The saving run (world 4, FSDP over dp_shard x cp) takes one AdamW step, saves
model and optimizer state with `torch.distributed.checkpoint` through
`get_state_dict` (FQN-keyed, FSDP-aware, sharded on disk), then takes a second
step. Fresh runs under cp=4 (FSDP over cp, world 4) and cp=1 (a 1-rank group,
no parallelism at all) build the model from a different seed, load the
checkpoint, and take the same second step; so does a plain model in the test
process itself, with no process group at all (DCP then reads the shards
directly). Every run's second-step loss and
parameters must match a single process that took both steps, within F64_TOL relative
(float64, derived; see tests/distributed/test_composition.py for why that bound). The second AdamW
step depends on the loaded moments and step count, so the parameter check
also covers the optimizer state (measured: loading the model alone leaves the
second-step parameters off by 1.7e-2).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh

from cpcompose import cp_cross_entropy
from cpcompose.distributed import flat_mesh
from cpcompose.models import Llama, parallelize_llama
from tests.support.composition import (
    CFG,
    F64_TOL,
    IGNORE,
    SEED,
    build_model,
    gathered,
    global_batch,
    global_loss,
    local_batch,
    make_optimizer,
    parallel_dims,
    root_mesh,
)
from tests.support.tolerance import relative_error

SAVE_DEGREES = {"dp_shard": 2, "cp": 2}


def setup(degrees: dict[str, int], *, seed: int) -> tuple[Llama, torch.optim.Optimizer, DeviceMesh, Any]:
    dims = parallel_dims(torch.distributed.get_world_size(), **degrees)
    mesh = root_mesh(dims)
    model = Llama(CFG)
    model.init_weights(seed=seed)
    model = model.to(torch.float64)
    parallelize_llama(model, parallel_dims=dims, mesh=mesh)
    return model, make_optimizer(model), mesh, dims


def train_step(model: Llama, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, dims: Any, step: int) -> torch.Tensor:
    tokens, labels, positions = local_batch(mesh, dims, step)
    loss = cp_cross_entropy(model(tokens, positions), labels, mesh=flat_mesh(mesh, "dp_cp"), ignore_index=IGNORE)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return global_loss(loss, mesh)


def save_then_step(_mesh: DeviceMesh, path: str) -> dict[str, Any]:
    model, optimizer, mesh, dims = setup(SAVE_DEGREES, seed=SEED)
    train_step(model, optimizer, mesh, dims, step=0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = gathered(model, "params")
    loss = train_step(model, optimizer, mesh, dims, step=1)
    return {"saved": saved, "loss": loss, "params": gathered(model, "params")}


def load_then_step(_mesh: DeviceMesh, path: str, degrees: dict[str, int]) -> dict[str, Any]:
    model, optimizer, mesh, dims = setup(degrees, seed=SEED + 1)  # other weights: loading must replace them
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = gathered(model, "params")
    loss = train_step(model, optimizer, mesh, dims, step=1)
    return {"saved": saved, "loss": loss, "params": gathered(model, "params")}


@functools.cache
def reference() -> dict[str, Any]:
    """One process, two AdamW steps on the whole batches."""
    model = build_model(torch.float64)
    optimizer = make_optimizer(model)
    out: dict[str, Any] = {}
    for step in (0, 1):
        if step == 1:
            out["saved"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        tokens, labels = global_batch(step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out["loss"] = loss.detach()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def assert_matches_reference(label: str, per_rank: list[dict[str, Any]]) -> None:
    ref = reference()
    worst = {"loss": 0.0, "saved": 0.0, "params": 0.0}
    for rank, got in enumerate(per_rank):
        worst["loss"] = max(worst["loss"], relative_error(got["loss"], ref["loss"]))
        for kind in ("saved", "params"):
            assert got[kind].keys() == ref[kind].keys(), f"{label} rank {rank}: {kind} FQNs differ"
            for name, value in got[kind].items():
                worst[kind] = max(worst[kind], relative_error(value, ref[kind][name]))
    print(f"{label}: " + " ".join(f"{k} {v:.2g}" for k, v in worst.items()), end=" ")
    for kind, err in worst.items():
        assert err <= F64_TOL, f"{label}: {kind} off by {err:.3g} (> {F64_TOL})"


@pytest.fixture(scope="module")
def checkpoint_dir(pools, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved once by the dp_shard=2 x cp=2 run; its own second step is checked too."""
    path = tmp_path_factory.mktemp("dcp") / "step1"
    assert_matches_reference("saving run dp_shard2xcp2", pools.get(4).run(save_then_step, str(path)))
    return path


def test_save_from_fsdp_cp_writes_sharded_checkpoint(checkpoint_dir: Path) -> None:
    assert (checkpoint_dir / ".metadata").is_file()
    assert len(list(checkpoint_dir.glob("*.distcp"))) == 4  # one shard file per saving rank


def test_resume_under_cp4(pools, checkpoint_dir: Path) -> None:
    assert_matches_reference("cp4", pools.get(4).run(load_then_step, str(checkpoint_dir), {"cp": 4}))


def test_resume_in_one_process(pools, checkpoint_dir: Path) -> None:
    assert_matches_reference("cp1", pools.get(1).run(load_then_step, str(checkpoint_dir), {}))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_resume_without_process_group(checkpoint_dir: Path) -> None:
    assert not torch.distributed.is_initialized()
    model = Llama(CFG)
    model.init_weights(seed=SEED + 1)
    model = model.to(torch.float64)
    optimizer = make_optimizer(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, labels = global_batch(1)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert_matches_reference("no process group", [{"saved": saved, "loss": loss.detach(), "params": params}])
