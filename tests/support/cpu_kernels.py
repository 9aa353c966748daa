"""What torch's CPU kernels can run in this process, for tests that measure or call them directly."""

from __future__ import annotations

import pytest

from cpcompose import _compat

# Under ATEN_CPU_CAPABILITY=avx2 on AVX-512 BF16 or AMX hardware torch 2.13 cannot run its fused CPU flash kernel in
# bf16 at all (`cpcompose._compat.cpu_flash_takes_bfloat16`; plain F.scaled_dot_product_attention raises there).
# cpcompose's own attention routes around it; a test of a bf16 model that calls torch's SDPA itself on one process
# (cp = 1), or that measures what that kernel saves, has nothing to run there: reported as skipped, and run
# everywhere else (CI's default capability included).
NEEDS_BF16_CPU_FLASH = pytest.mark.skipif(
    not _compat.cpu_flash_takes_bfloat16(), reason="torch's bf16 CPU flash kernel cannot run at this ATen capability")
