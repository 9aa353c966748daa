"""mamba-ssm's kernel APIs under CP: `selective_scan_fn` (Mamba) and `mamba_chunk_scan_combined` (Mamba2's SSD).

Each is `cp(original, region, *the API's arguments)`: `original` is the kernel to run on this
rank's runs (mamba-ssm's on CUDA, transformers' torch fallback anywhere).
"""

from cpcompose.mixers.mamba_ssm.selective_scan import cp_mamba_selective_scan
from cpcompose.mixers.mamba_ssm.ssd import cp_mamba2_chunk_scan

__all__ = ["cp_mamba2_chunk_scan", "cp_mamba_selective_scan"]
