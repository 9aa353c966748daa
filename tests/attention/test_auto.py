"""`strategy="auto"`: the same choice on every rank, the one the cost model predicts, and exact.

Three machine models steer the choice on this CPU (the calibration is only constants,
so a GPU cluster's can be used here): this machine's (the ring wins), one node of
H100s (all-to-all wins at P=4) and two-GPU nodes on a slow network (the 2-D strategy
with the all-to-all inside a node wins; a causal sliding window there goes back to
the ring, so two layers of one model get different strategies). Each case runs through the parity rule of
tests/attention/test_parity.py against the float64 reference, and every rank reports
what its `CommMeter` recorded `auto` choosing. The agreement covers the machine
model: one rank with another calibration raises on every rank.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cpcompose import CommMeter, cp_attention, cp_shard
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.layouts import resolve_layout
import dataclasses

from cpcompose.attention.call.choose import choose_strategy
from cpcompose.attention.cost import CPU_DEFAULT, H100_CLUSTER, INTER, INTRA, AttentionCall, Link, Topology
from tests.support.attention_cases import Case, assert_matches_single_process, make_inputs

SLOW_NETWORK = dataclasses.replace(H100_CLUSTER, links=((INTRA, Link(450e9, 2e-6)), (INTER, Link(5e9, 1e-4))))
MODELS = {"this-cpu": (CPU_DEFAULT, Topology()), "h100-node": (H100_CLUSTER, Topology()),
          "2-per-node-slow-network": (SLOW_NETWORK, Topology(2))}


def run_auto(mesh, case: Case, model: str, calibration=None) -> dict:
    calibration_, topology = MODELS[model]
    full = make_inputs(case)
    local = {n: cp_shard(t, mesh, seq_dim=2, layout=case.layout).detach() for n, t in full.items()}
    q, k, v = (local[n].requires_grad_() for n in ("q", "k", "v"))
    meter = CommMeter()
    out, lse = cp_attention(q, k, v, mesh=mesh, is_causal=case.causal, strategy="auto", layout=case.layout,
                            window_size=case.window, return_lse=True, meter=meter,
                            calibration=calibration or calibration_, topology=topology)
    chosen = dict(meter.strategies)
    out.backward(local["dout"])
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, "chosen": chosen}


def expected(case: Case, model: str) -> str:
    calibration, topology = MODELS[model]
    call = AttentionCall(case.batch, case.heads, case.kv_heads, case.head_dim, case.seq,
                         resolve_layout(case.layout, case.world), MaskSpec(case.causal, *_window(case)),
                         need_lse=True)
    return choose_strategy(call, topology, calibration, case.world).costs_label


def _window(case: Case) -> tuple:
    if case.window is None:
        return (None, None)
    return (case.window, None) if isinstance(case.window, int) else case.window


CASES = [
    (Case("auto", "zigzag", True, 8, 2, 2, seq=96), "this-cpu", "ring"),
    (Case("auto", "zigzag", True, 4, 4, 4, seq=96), "h100-node", "alltoall"),
    (Case("auto", "zigzag", True, 8, 2, 4, seq=96), "2-per-node-slow-network", "alltoall_ring(a=2)"),
    (Case("auto", "zigzag", False, 8, 2, 4, seq=96, window=(5, 3)), "2-per-node-slow-network", "alltoall_ring(a=2)"),
    (Case("auto", "contiguous", True, 8, 2, 4, seq=96, window=7), "2-per-node-slow-network", "ring"),
]


@pytest.mark.parametrize("case,model,want", CASES, ids=lambda x: str(x))
def test_auto_is_exact_and_chosen_alike(pools, case: Case, model: str, want: str | None) -> None:
    per_rank = pools.get(case.world).run(run_auto, case, model)
    label = expected(case, model)
    assert want is None or label == want, f"the cost model now picks {label} for {case} on {model}"
    assert all(r["chosen"] == {label: 1} for r in per_rank), [r["chosen"] for r in per_rank]
    assert_matches_single_process(case, per_rank)


def run_one_rank_other_calibration(mesh, case: Case) -> str:
    other = dataclasses.replace(CPU_DEFAULT, kernel_call_s=CPU_DEFAULT.kernel_call_s * 2)
    try:
        run_auto(mesh, case, "this-cpu", calibration=other if mesh.get_local_rank() == 1 else None)
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    run_auto(mesh, case, "this-cpu")  # the group still works
    return message


def test_one_rank_with_another_calibration_raises_everywhere(pools) -> None:
    case = Case("auto", "zigzag", True, 4, 2, 2, seq=48)
    messages = pools.get(2).run(run_one_rank_other_calibration, case)
    assert all("calibration" in m and "differ" in m for m in messages), messages


def test_the_choice_is_logged_once_per_signature(caplog) -> None:
    """One line per new call signature on CP rank 0 (here a one-rank group: world 1 is refused, so pure)."""
    from cpcompose.attention.call import auto

    case = Case("auto", "zigzag", True, 8, 2, 2, seq=96)
    layout = resolve_layout("zigzag", 2)
    q, k, v = torch.zeros(1, 8, 48, 16), torch.zeros(1, 2, 48, 16), torch.zeros(1, 2, 48, 16)
    caplog.set_level(logging.INFO, logger="cpcompose.auto")
    for _ in range(3):
        options, choice = auto.resolve(
            auto.CPOptions(strategy="auto", topology=Topology(3)), q, k, v, layout=layout, mask=MaskSpec(True),
            need_lse=False, rank=0,
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "cpcompose.auto"]
    assert len(lines) == 1 and lines[0].startswith("cp strategy auto -> "), lines
    assert options.strategy == choice.strategy and case.world == 2
