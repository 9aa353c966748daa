"""The cross-rank signature: named integers every rank must share, built field by field.

A signature has the same fields in the same order on every rank (ranks compare them
position by position in one tiny all-gather), so a field a rank cannot compute is
still present, with a code of its own (-1 for None, ...). Codes are stable across
processes: nothing here uses Python's salted `hash()`.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Iterator, Sequence

import torch

__all__ = ["Field", "Signature", "dtype_code", "float_code", "int_code", "shape_fields"]

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

Field = tuple[str, int]
"""One named integer of a cross-rank signature."""


def dtype_code(dtype: object) -> int:
    """A small integer for a dtype, for the cross-rank signature."""
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)  # type: ignore[arg-type]
    # zlib.crc32, not hash(): Python salts str hashes per process, and ranks are processes.
    return len(_DTYPES) + zlib.crc32(str(dtype).encode()) % 1000


def float_code(x: float | None) -> int:
    """The bits of a float as an int64 (None and NaN get codes of their own), for the signature."""
    if x is None:
        return -1
    if isinstance(x, float) and math.isnan(x):
        return -2
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def shape_fields(name: str, shape: Sequence[int], ndim: int = 4) -> list[Field]:
    """A fixed-length encoding of a shape (padded with -1, then the rank)."""
    dims = list(shape[:ndim]) + [-1] * (ndim - len(shape[:ndim]))
    return [(name, int(d)) for d in dims] + [(name, len(shape))]


def int_code(x: object) -> int:
    """A non-negative int as itself; None as -1, anything else as -2 (its rank's own check names it)."""
    if x is None:
        return -1
    return x if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 else -2


class Signature:
    """A signature under construction: `Signature().shape("q", q.shape).dtype(q.dtype).flag("causal", c)`.

    Every method appends fields and returns the signature, so the ranks' signatures
    line up as long as every rank makes the same calls (the values may differ).
    """

    def __init__(self, fields: Sequence[Field] = ()) -> None:
        self.fields: list[Field] = list(fields)

    def int(self, name: str, value: object) -> Signature:
        """A non-negative int (None and anything else get codes of their own, see `int_code`)."""
        self.fields.append((name, int_code(value)))
        return self

    def code(self, name: str, value: int) -> Signature:
        """An int the caller encoded itself (e.g. an index into a list of choices, -1 for none)."""
        self.fields.append((name, int(value)))
        return self

    def flag(self, name: str, value: object) -> Signature:
        self.fields.append((name, int(bool(value))))
        return self

    def shape(self, name: str, shape: object, ndim: int = 4) -> Signature:
        """A shape padded to `ndim` dims (anything that is not a shape counts as `()`)."""
        dims = shape if isinstance(shape, (tuple, list, torch.Size)) else ()
        self.fields += shape_fields(name, dims, ndim)
        return self

    def dtype(self, name: str, dtype: object) -> Signature:
        self.fields.append((name, dtype_code(dtype)))
        return self

    def float(self, name: str, value: object) -> Signature:
        """A float's bits (None: -1, NaN: -2, not a number: -3)."""
        self.fields.append((name, float_code(value) if isinstance(value, (int, float)) else -3))
        return self

    def layout(self, layout: object) -> Signature:
        """The whole split (`Layout.identity`), or -1 when this rank has none."""
        self.fields.append(("layout", -1 if layout is None else int(getattr(layout, "identity"))))
        return self

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)
