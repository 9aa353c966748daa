"""Which kernel functions, modeling modules, methods and module classes the integration routes (one line each).

A new kernel API is a CP version in its own file plus one `ROUTES` line; a new hybrid family
whose modeling module calls routed kernels is one `MODELING_MODULES` entry; a family that
mixes tokens by its own code gets a CP version of the narrowest method that sees the
sequence and one `METHOD_ROUTES` line per method; a class CP cannot make exact is one `REFUSED` line
(`refused.py`, with its reason).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from cpcompose.integrations.transformers.mixer_routes.fused import local_only
from cpcompose.integrations.transformers.mixer_routes.refused import REFUSED
from cpcompose.mixers.causal_conv1d import cp_causal_conv1d_fn
from cpcompose.mixers.fla import cp_chunk_gated_delta_rule, cp_chunk_kimi_delta_attention
from cpcompose.mixers.mamba_ssm import cp_mamba2_chunk_scan, cp_mamba_selective_scan
from cpcompose.mixers.transformers_models import (
    cp_lightning_attention, cp_mlstm_backend, cp_ngram_embedding, cp_ple_short_conv, cp_recurrent_block,
    cp_rglru_scan, cp_rwkv_block, cp_rwkv_linear_attention, mlstm_backend_one_process,
)

__all__ = ["METHOD_ROUTES", "MODELING_MODULES", "ONE_PROCESS_FIXES", "REFUSED", "ROUTES", "KernelCP"]

KernelCP = Callable[..., Any]
"""`cp(original, region, *args, **kwargs)`: a kernel function's CP version (same arguments as the original)."""

ROUTES: Mapping[str, KernelCP] = MappingProxyType({
    "causal_conv1d_fn": cp_causal_conv1d_fn,
    "torch_chunk_gated_delta_rule": cp_chunk_gated_delta_rule,
    "chunk_kimi_delta_attention": cp_chunk_kimi_delta_attention,
    "mamba2_chunk_scan": cp_mamba2_chunk_scan,
    "mamba2_split_conv1d_scan_combined": local_only,
    "mamba_inner_fn": local_only,
    "mamba_selective_scan": cp_mamba_selective_scan,
    "rwkv_linear_attention": cp_rwkv_linear_attention,
})
"""Kernel function name -> its CP version. A name in a modeling module that is not here stays local
only if the module's mixers never reach it inside a region (the tests of each family show they do not)."""

MODELING_MODULES: tuple[str, ...] = (
    "lfm2", "lfm2_moe", "lfm3",
    "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2",
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp",
    "kimi_linear", "bailing_hybrid", "glm5_next",
    "mamba", "falcon_mamba", "jamba", "zamba", "rwkv",
)
"""The modeling modules (`transformers.models.<name>.modeling_<name>`) whose kernel functions are routed."""

METHOD_ROUTES: Mapping[str, KernelCP] = MappingProxyType({
    "recurrent_gemma.RecurrentGemmaRecurrentBlock.forward": cp_recurrent_block,  # its conv_1d call
    "recurrent_gemma.RecurrentGemmaRglru._rnn_scan": cp_rglru_scan,
    "minimax.MiniMaxLightningAttention.forward": cp_lightning_attention,  # the blockwise scan is inline
    "rwkv.RwkvSelfAttention.forward": cp_rwkv_block,  # its time_shift (its WKV is a routed kernel function)
    "rwkv.RwkvFeedForward.forward": cp_rwkv_block,  # its time_shift
    "qwen4_exp.Qwen4ExpTextNGramEmbedding.forward": cp_ngram_embedding,  # its hash of the preceding ids
    "qwen4_exp.Qwen4ExpTextPLELayer._short_conv": cp_ple_short_conv,  # a dilated conv, no kernel function
    "xlstm.xLSTMBackend.forward": cp_mlstm_backend,  # transformers' own mLSTM kernels (without the xlstm package)
})
"""`<modeling name>.<Class>.<method>` -> its CP version `cp(original, region, self, *args, **kwargs)`: the
original method outside a region, the CP version inside (for mixers written in the model's own code)."""

ONE_PROCESS_FIXES: Mapping[str, Callable[..., Any]] = MappingProxyType({
    "xlstm.xLSTMBackend.forward": mlstm_backend_one_process,  # its "inference" kernels fail below float32
})
"""`METHOD_ROUTES` entries whose transformers original fails on inputs the model otherwise takes ->
`fix(original, self, *args, **kwargs)`, which runs in the original's place outside a CP region (so the
first-use probe's one-process run, too, runs what the CP version runs). Every call the original
does not fail on stays the original's."""
