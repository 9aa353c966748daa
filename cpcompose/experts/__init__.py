"""Mixture-of-experts layers' parts for expert parallelism (EP), above the communication layer.

`grouped_experts` runs every local expert over its rows, one grouped GEMM per projection where torch has one
for the dtype and device, a loop over the experts elsewhere (always in float64); `ExpertWeights` holds the
stacked weights in the model's own layout (no copy); `routed_experts` is a layer's routed part on one process
(sort by expert, compute, weigh and sum the choices). Under EP each routed row travels to the rank that holds
its expert and its result back: `dispatch` and `combine` are comm's token dispatch and combine, each with the
cross-rank agreement in front, for a caller that exchanges once; `parallel_routed_experts` is `routed_experts` with
the experts split over an EP group, both exchanges between the sort and the weighted sum behind one agreement. The layouts of transformers' families are read by
`cpcompose.integrations.transformers.experts`, and `cpcompose.integrations.transformers.expert_parallel` swaps a
model's experts modules for their EP form; the survey and the design are in docs/design/experts.md.
"""

from cpcompose.comm import Dispatched
from cpcompose.experts.dispatch import combine, dispatch
from cpcompose.experts.grouped import ExpertKernel, grouped_experts, grouped_mm_refusal
from cpcompose.experts.parallel import parallel_routed_experts
from cpcompose.experts.routing import ExpertOrder, routed_experts, sort_by_expert, sum_weighted_choices
from cpcompose.experts.weights import ExpertWeights

__all__ = [
    "Dispatched", "ExpertKernel", "ExpertOrder", "ExpertWeights", "combine", "dispatch", "grouped_experts",
    "grouped_mm_refusal", "parallel_routed_experts", "routed_experts", "sort_by_expert", "sum_weighted_choices",
]
