"""A checkpoint folder's tensors, read from the safetensors headers: names, shapes, dtypes and files, no weights.

Every other step plans from this index, so a model on the meta device can be matched against a folder of
any size (one `model.safetensors`, or numbered shards with their `model.safetensors.index.json`) without
reading a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["INDEX_FILE", "StoredTensor", "read_checkpoint_index"]

INDEX_FILE = "model.safetensors.index.json"
"""The index transformers writes beside numbered shards (which tensor is in which file)."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint folder, from its file's header."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    """The safetensors file's name in the folder."""


def read_checkpoint_index(folder: str | Path) -> dict[str, StoredTensor]:
    """Every tensor in `folder`'s `*.safetensors` files, by name (headers only: no weight is read).

    Raises:
        ValueError: `folder` has no safetensors file, or one that does not open.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors file (pytorch_model.bin and other formats are not read; "
                         "save the model with save_pretrained(..., safe_serialization=True))")
    index: dict[str, StoredTensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    index[key] = StoredTensor(tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), torch.float32),
                                              file.name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            raise ValueError(f"{file} does not open as safetensors ({type(e).__name__}: {e})") from None
    return index
