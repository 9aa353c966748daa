"""The module classes CP cannot make exact, and why: each raises on every rank inside a CP region.

A class lands here when it mixes tokens in a way no CP version reproduces yet: attention
whose scores need something a rank's shard cannot give (an additive bias computed per
query, a sparse selection of keys made by an indexer over every earlier token), or a
mixer with no routed CP version. The same model object still runs on one process. A
refusal is by class, so it holds whatever the config; `refused_in` names them before a
run and the integration's first-use probe raises it before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["REFUSED"]

_NO_BIAS = (
    "CP attention takes no additive score bias or per-query sink logits (it merges blocks of keys through their "
    "log-sum-exp, and the bias would have to travel with every block)"
)
_DEPTH = (
    "it attends over one token's earlier block outputs (a depth axis, not the sequence) through transformers' "
    "attention interface, whose 'cpcompose' entry would take that axis for this rank's shard of the sequence"
)


def _inkling2(prefix: str) -> dict[str, str]:
    """Inkling 2 and its looped variant share their attention and depth-residual classes."""
    name, module = ("Inkling2Loop", "inkling2_loop") if prefix == "loop" else ("Inkling2", "inkling2")
    path = f"transformers.models.{module}.modeling_{module}.{name}"
    attention = (
        "adds a relative position bias computed from each query's hidden state (over backward distances up to "
        "rel_extent) and one sink logit per query token to its scores (and its keys and values go through short "
        f"convolutions, with weights computed per token in the full layers); {_NO_BIAS}, so {name} is not "
        "supported under CP"
    )
    return {f"{path}SlidingAttention": attention, f"{path}FullAttention": attention,
            f"{path}BlockAttentionResidual": f"{_DEPTH}; {name} is not supported under CP"}


REFUSED: Mapping[str, str] = MappingProxyType({
    "transformers.models.mpt.modeling_mpt.MptAttention": (
        "it computes attention with its own explicit softmax and ALiBi bias (not through transformers' attention "
        "interface), which would see only this rank's tokens; cpcompose has no ALiBi, so MPT is not supported "
        "under CP"
    ),
    "transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextAttention": (
        "it is DeepSeek sparse attention (DSA): its indexer pools every earlier token's indexer keys into k-pools, "
        "keeps each query's top-k pools (plus the open tail) and attends through a per-query mask built from them; "
        "under CP the indexer would see only this rank's tokens, and CP attention takes no per-query sparse mask. "
        "GLM-5.3 with indexed_attention layers is not supported under CP (its KDA layers are)"
    ),
    "transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextAttention": (
        "it is QSA sparse attention: its indexer mean-pools every earlier token's keys into blocks, keeps each "
        "query's top-scoring blocks (plus the open tail) and masks the others out of the causal mask; under CP the "
        "indexer would see only this rank's tokens, and CP attention takes no per-query sparse mask. Qwen4-Exp with "
        "indexed_attention layers is not supported under CP (its Gated DeltaNet and PLE layers are)"
    ),
    "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention": (
        "its compressors pool windows of earlier tokens' K/V into compressed entries (HCA/CSA) and its indexer "
        "keeps each query's top-k of those entries; under CP the compressors and the indexer would see only this "
        "rank's tokens, and cpcompose's selected attention reads per-token rows (DeepSeek-V3.2's DSA), not pooled "
        "entries. DeepSeek-V4 is not supported under CP"
    ),
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLAttention": (
        "its indexer scores mean-pooled key blocks and keeps each query's top-k blocks plus its local blocks "
        "(block_indices= to the attention); under CP the indexer would see only this rank's tokens, and "
        "cpcompose's selected attention takes per-token indices (DeepSeek-V3.2's DSA), not blocks. MiniMax-M3-VL "
        "is not supported under CP"
    ),
    "transformers.models.inkling.modeling_inkling.InklingAttention": (
        "it adds a relative position bias computed from each query's hidden state (over backward distances up to "
        "rel_extent) to its scores, and counts the positions of that bias and of its log-scaling of queries from "
        f"0 on every call, so on a shard from the shard's start; {_NO_BIAS}, so Inkling is not supported under CP"
    ),
    **_inkling2("plain"),
    **_inkling2("loop"),
    "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopMessageAttentionResidual": (
        f"{_DEPTH}; Inkling2Loop is not supported under CP"
    ),
    "transformers.models.xlstm.modeling_xlstm.mLSTMBlock": (
        "with the xlstm package installed, transformers runs its mLSTM block, whose kernels cpcompose does not "
        "route (only transformers' own xLSTMBackend is); uninstall xlstm to train xLSTM under CP"
    ),
})
"""`module.ClassName` -> why CP cannot make it exact: refused inside a region, on every rank (a class this
transformers lacks is skipped)."""
