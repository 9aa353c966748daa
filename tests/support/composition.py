"""A tiny Llama, its batches, meshes and gathered results: shared by the composition and DCP tests.

Every rank builds the same model (same seed) and takes its share of one global
batch: dp ranks different rows, cp ranks their rows' sequence (zigzag). Results
come back as full tensors by FQN, gathered from DTensors, for comparison with
one process (tests/distributed/test_composition.py, test_dcp_resharding.py).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpcompose import cp_position_ids, cp_shard
from cpcompose.distributed import ParallelDims, flat_mesh
from cpcompose.models import Llama, LlamaConfig
from tests.support.tolerance import relative_bound

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=128)
SEED = 3
BATCH, SEQ = 4, 32  # SEQ splits into 2 x cp zigzag chunks for cp <= 4 (and 16)
LR, WEIGHT_DECAY = 1e-2, 0.1
# Derived (tests/support/tolerance.py), float64 both sides, relative to each tensor's largest entry: the longest
# sum is a weight gradient over tokens x width (tests/distributed/test_composition.py says why).
F64_TOL = relative_bound(terms=BATCH * SEQ * CFG.dim)
IGNORE = -100


def global_batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of the whole batch, with an uneven number of ignored labels per row."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :5] = IGNORE
    labels[1, 20:] = IGNORE
    labels[3, 7:9] = IGNORE
    return tokens, labels


def build_model(dtype: torch.dtype) -> Llama:
    model = Llama(CFG)
    model.init_weights(seed=SEED)
    return model.to(dtype)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


_MESHES: dict[tuple[int | str, ...], DeviceMesh] = {}


def root_mesh(dims: ParallelDims, device: str = "cpu") -> DeviceMesh:
    """One mesh per set of degrees and device per worker process (creating groups costs time)."""
    key = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, device)
    if key not in _MESHES:
        _MESHES[key] = dims.build_mesh(device)
    return _MESHES[key]


def local_batch(
    mesh: DeviceMesh, dims: ParallelDims, step: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens, labels and global positions `[batch, seq_local]` on `device`.

    The batch moves before it is sharded: sharding checks agreement with a tensor on the
    input's device, which an NCCL group must be able to carry.
    """
    tokens, labels = (t.to(device) for t in global_batch(step))
    dp_rank = flat_mesh(mesh, "dp").get_local_rank()
    rows = BATCH // dims.dp_size
    tokens, labels = (t[dp_rank * rows : (dp_rank + 1) * rows] for t in (tokens, labels))
    positions = torch.arange(SEQ)
    if dims.cp_enabled:
        tokens, labels = (cp_shard(t, mesh["cp"], seq_dim=1, layout="zigzag") for t in (tokens, labels))
        positions = cp_position_ids(SEQ, mesh["cp"], layout="zigzag")
    return tokens, labels, positions.to(device).expand(rows, -1).contiguous()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (every rank calls it), on the host for CUDA DTensors.

    DTensor's own gather (`full_tensor`, a functional all-gather) segfaults in torch 2.11
    on CUDA tensors over gloo (the one-GPU runs share the GPU over gloo): the first GPU
    run crashed both workers there. So a CUDA DTensor sharded over a 1-D mesh is gathered
    as host copies of the shards (uneven ones too), which is all the checks need.
    """
    if not isinstance(t, DTensor):
        return t.detach().clone()
    local = t.to_local().detach()
    if local.device.type != "cuda" or t.device_mesh.ndim != 1:
        return t.full_tensor().detach().clone()
    (placement,) = t.placements
    if placement.is_replicate():
        return local.cpu()
    assert placement.is_shard(), placement
    parts: list[torch.Tensor | None] = [None] * t.device_mesh.size()
    torch.distributed.all_gather_object(parts, local.cpu(), group=t.device_mesh.get_group())
    return torch.cat(parts, dim=placement.dim)  # type: ignore[arg-type]


def parallel_dims(world: int, **degrees: int) -> ParallelDims:
    kw = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1}
    kw.update(degrees)
    return ParallelDims(**kw, world_size=world)


def global_loss(loss: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of the ranks' loss shares over dp x cp: the single-process mean."""
    loss = loss.detach().to(torch.float64)
    torch.distributed.all_reduce(loss, group=flat_mesh(mesh, "dp_cp").get_group())
    return loss


def gathered(model: torch.nn.Module, what: str) -> dict[str, torch.Tensor]:
    """Full parameters or gradients by FQN (collective over each DTensor's mesh, same order on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        t = p if what == "params" else p.grad
        assert t is not None, f"{name} has no gradient"
        out[name] = full(t)
    return out
