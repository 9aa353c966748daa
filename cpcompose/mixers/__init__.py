"""Exact CP for the token mixers outside attention: causal convolutions and linear recurrences.

Hybrid models (Mamba, gated delta-rule layers) mix tokens with short causal
convolutions and linear recurrences. On a CP shard those read tokens other ranks
hold; run on the local shard alone they are silently wrong. Each primitive here
reads every rank's runs from the layout (no communication to learn the split),
moves only what the exact result needs, and works for any layout, packed
documents included. They are collectives: every rank of the CP group calls them
with the same options, and, if any rank needs gradients, every rank runs the
backward (which communicates too).

The CP versions of the mixer kernels' APIs live in sub-packages by API: `mamba_ssm`
(`selective_scan_fn`, `mamba_chunk_scan_combined`), `fla` (`chunk_gated_delta_rule`,
`chunk_kda`), `causal_conv1d` (`causal_conv1d_fn`) and `transformers_models` (the mixers
transformers' models write in their own code). Each is `cp(original, region, *the API's
arguments)`: `original` the kernel to run on this rank's stretches, `region` a
`MixerRegion(mesh, MixerOptions(layout=...))` (or the transformers integration's active
region). None of them imports transformers.
"""

from cpcompose.comm import fetch_positions
from cpcompose.mixers.chunked import Correction, cp_chunked_recurrence
from cpcompose.mixers.conv import cp_causal_conv1d
from cpcompose.mixers.region import MixerOptions, MixerRegion, Region
from cpcompose.mixers.scan import cp_delta_rule, cp_linear_scan
from cpcompose.mixers.states import cp_initial_states

__all__ = [
    "Correction", "MixerOptions", "MixerRegion", "Region", "cp_causal_conv1d", "cp_chunked_recurrence", "cp_delta_rule",
    "cp_initial_states", "cp_linear_scan", "fetch_positions",
]
