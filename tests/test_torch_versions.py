"""cpcompose on every torch release it supports: no deprecated private torch name, so nothing printed on import.

torch 2.14 renamed the custom-class ("opaque object") API that `cpcompose._compat` imports, and logs a
deprecation line for each old spelling (`torch._opaque_base`, `register_opaque_type`, `typ='reference'`) in
every process that uses one: the trainer's one-line errors got three lines above them. Those are log records,
not `warnings`, so the child's stderr is read as well as its warnings. On a release without the renames the
test passes trivially; the suite runs on the pinned torch and on the newest one (README).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Everything a user process imports: the library, the transformers integration, the trainer. A warning that
# torch or cpcompose code raises (or that is attributed to them: torch warns with the caller's frame) is an
# error; other packages' warnings are theirs.
_IMPORT_EVERYTHING = r"""
import warnings
for category in (DeprecationWarning, FutureWarning):
    warnings.filterwarnings("error", category=category, module=r"(torch|cpcompose)(\.|$)")
import cpcompose
import cpcompose.integrations.transformers
import cpcompose.train
"""


def test_importing_cpcompose_prints_no_torch_deprecation() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    deprecations = [line for line in done.stderr.splitlines() if "deprecat" in line.lower()]
    assert not deprecations, "cpcompose uses torch names this release deprecates (fix cpcompose/_compat.py):\n" + (
        "\n".join(deprecations))
