"""The name cpcompose's attention is registered under in transformers.

Its own module because two readers need it: `attention.py`, which registers the attention and
mask functions under it, and `indexer.py`, which `attention.py` imports and which refuses a DSA
model built with another implementation inside a CP region.
"""

from __future__ import annotations

__all__ = ["ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "cpcompose"
"""The name to pass as `attn_implementation=` (registered when `attention.py` is imported)."""
