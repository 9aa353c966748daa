"""Integrations with other libraries, each imported on its own (its dependency is optional).

* `cpcompose.integrations.transformers`: Hugging Face transformers models with
  `attn_implementation="cpcompose"` (install `cpcompose[hf]`).
* `cpcompose.integrations.torchtitan`: torchtitan's models and trainer with cpcompose
  as their CP (install `cpcompose[torchtitan]`).
"""

__all__: list[str] = []
