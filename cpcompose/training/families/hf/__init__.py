"""The Hugging Face family: a causal LM read from a save_pretrained folder."""

__all__: list[str] = []
