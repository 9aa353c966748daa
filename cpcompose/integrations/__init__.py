"""Integrations with other libraries, each imported on its own (its dependency is optional).

* `cpcompose.integrations.transformers`: Hugging Face transformers models with
  `attn_implementation="cpcompose"` (install `cpcompose[hf]`).
"""
