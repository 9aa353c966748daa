"""FSDP2 units and mixed precision as torchtitan makes them (`apply_fsdp` through `parallelize_llama`).

Units: the embedding alone, one per block, the final norm with the output layer, the root. Between
forward and backward every unit but the last holds only its shard (a DTensor parameter); the last
(norm + output, which the backward starts with) stays gathered.

Mixed precision (`param_dtype=bfloat16`): FSDP2 gathers each unit in bfloat16, keeps the sharded
float32 parameters as the optimizer's, and reduces gradients in float32. Checked on dp_shard=2 x cp=2
against float64 truth: the loss and every gradient must be within 4x the error of one bfloat16
process on the whole batch (the same bf16 roundings, in another order: CP's LSE merges are float32,
FSDP sums in float32), plus half a bfloat16 ulp of the tensor's largest entry (one rounding of it) for
tensors that process happens to get almost exactly. Measured: the worst ratio to that process's error
is 2.0 (a norm weight's gradient), most are 0.8-1.3; a missing reduction or a wrong mask is off by far more. And the run must really compute in bfloat16: its loss is further from the truth
than float32 compute could be (64 float32 ulps), and every parameter and gradient it keeps is float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpcompose import cp_cross_entropy
from cpcompose.distributed import flat_mesh, fsdp_applied
from cpcompose.models import parallelize_llama
from cpcompose.parallel import ContextParallel
from tests.support.composition import (
    IGNORE,
    build_model,
    gathered,
    global_batch,
    global_loss,
    local_batch,
    parallel_dims,
    root_mesh,
)


def _single(dtype: torch.dtype) -> dict[str, Any]:
    """One process, whole batch, all computed in `dtype` (bf16: the weights rounded as FSDP gathers them)."""
    model = build_model(torch.float32).to(dtype)
    tokens, labels = global_batch()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    return {"loss": loss.detach().double(), "grads": {n: p.grad.double() for n, p in model.named_parameters()}}


def _bf16_step(_mesh: DeviceMesh) -> dict[str, Any]:
    """dp_shard=2 x cp=2, float32 parameters gathered in bfloat16: the unit states mid-step, loss, grads."""
    dims = parallel_dims(4, dp_shard=2, cp=2)
    mesh = root_mesh(dims)
    model = build_model(torch.float32)
    parallelize_llama(model, parallel_dims=dims, mesh=mesh, cp=ContextParallel(seq_dim=1),
                      param_dtype=torch.bfloat16)
    tokens, labels, positions = local_batch(mesh, dims)
    logits = model(tokens, positions)
    sharded = {  # after the forward, before the backward: which units hold only their shard
        "tok_embeddings": isinstance(model.tok_embeddings.weight, DTensor),
        "layers": [isinstance(b.attention.wq.weight, DTensor) for b in model.layers.values()],
        "norm": isinstance(model.norm.weight, DTensor),
        "output": isinstance(model.output.weight, DTensor),
    }
    loss = cp_cross_entropy(logits, labels, mesh=flat_mesh(mesh, "dp_cp"), ignore_index=IGNORE)
    loss.backward()
    units = {name: fsdp_applied(m) for name, m in
             (("root", model), ("tok_embeddings", model.tok_embeddings), ("layer", model.layers["0"]))}
    return {"logits_dtype": logits.dtype, "sharded": sharded, "units": units,
            "param_dtypes": {p.dtype for p in model.parameters()}, "loss": global_loss(loss, mesh),
            "grads": gathered(model, "grads")}


def test_units_and_bf16_mixed_precision_within_one_bf16_process(pools) -> None:
    exact, single = _single(torch.float64), _single(torch.bfloat16)
    bf16_ulp, fp32_ulp = torch.finfo(torch.bfloat16).eps, torch.finfo(torch.float32).eps
    for rank, got in enumerate(pools.get(4).run(_bf16_step)):
        assert got["units"] == {"root": True, "tok_embeddings": True, "layer": True}, rank
        assert got["sharded"] == {"tok_embeddings": True, "layers": [True, True], "norm": False,
                                  "output": False}, f"rank {rank}: {got['sharded']}"
        assert got["logits_dtype"] == torch.bfloat16 and got["param_dtypes"] == {torch.float32}, rank
        assert all(g.dtype == torch.float32 for g in got["grads"].values()), rank
        loss_err = abs(got["loss"].item() - exact["loss"].item())
        assert loss_err > 64 * fp32_ulp * exact["loss"].item(), f"rank {rank}: loss error {loss_err:.3g}: not bf16"
        pairs = [("loss", got["loss"], single["loss"], exact["loss"])]
        pairs += [(n, got["grads"][n], single["grads"][n], exact["grads"][n]) for n in exact["grads"]]
        for name, value, base, truth in pairs:
            err = (value.double() - truth).abs().max().item()
            base_err = (base - truth).abs().max().item()
            bound = 4 * base_err + bf16_ulp / 2 * truth.abs().max().item()
            assert err <= bound, f"rank {rank} {name}: bf16 error {err:.3g} > {bound:.3g} (one process: {base_err:.3g})"
