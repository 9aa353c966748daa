"""Mixture-of-experts compute: rows sorted by expert through each expert's two projections.

`grouped_experts` runs every local expert over its rows, one grouped GEMM per projection where torch has one
for the dtype and device, a loop over the experts elsewhere (always in float64); `ExpertWeights` holds the
stacked weights in the model's own layout (no copy); `routed_experts` is a layer's routed part on one
process (sort by expert, compute, combine), the two ends an expert-parallel dispatch keeps. The layouts of
transformers' families are read by `cpcompose.integrations.transformers.experts`; the survey and the design
are in docs/design/experts.md. Nothing here communicates yet.
"""

from cpcompose.experts.grouped import ExpertKernel, grouped_experts, grouped_mm_refusal
from cpcompose.experts.routing import ExpertOrder, combine, routed_experts, sort_by_expert
from cpcompose.experts.weights import ExpertWeights

__all__ = [
    "ExpertKernel", "ExpertOrder", "ExpertWeights", "combine", "grouped_experts", "grouped_mm_refusal",
    "routed_experts", "sort_by_expert",
]
