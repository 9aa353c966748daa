"""The CP mixer kernels are importable without transformers (a torchtitan or fla user needs no transformers)."""

from __future__ import annotations

import subprocess
import sys

# A child interpreter where `import transformers` raises ImportError (sys.modules entry None), importing every
# kernel-API sub-package; it prints which transformers modules got loaded anyway (none may).
_SNIPPET = """
import sys
sys.modules["transformers"] = None
import cpcompose.mixers
import cpcompose.mixers.causal_conv1d
import cpcompose.mixers.fla
import cpcompose.mixers.mamba_ssm
import cpcompose.mixers.transformers_models
loaded = sorted(m for m in sys.modules if m.startswith("transformers.") or m == "cpcompose.integrations")
print("loaded:", loaded)
"""


def test_mixers_import_without_transformers() -> None:
    done = subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded: []", done.stdout
