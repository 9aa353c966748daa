"""Every registered layout at P = 1..4, packed layouts of several packs and both balances, grouped views.

tests/layouts/test_layouts.py checks each against the `Layout` protocol (a new
layout is checked by adding it to `LAYOUTS`); its cross-process identity check
imports `CASES` from here in a fresh interpreter.
"""

from __future__ import annotations

from cpcompose.layouts import LAYOUTS, Layout, PackedLayout, resolve_layout
from cpcompose.layouts.grouped import GroupedLayout

PACKS = {
    "one-doc": [0, 48],
    "long-tailed": [0, 28, 82, 99, 117, 138, 174, 202, 256],
    "many-short": [0, *range(3, 61, 3)],
    "ragged": [0, 1, 2, 40, 41, 47],
}


def _layouts() -> list[tuple[str, Layout, int]]:
    """(id, layout, global length) for every registered layout and a set of packed ones."""
    out = []
    for world in (1, 2, 3, 4):
        for name in LAYOUTS:
            out.append((f"{name}-P{world}", resolve_layout(name, world), 24 * world))
        for pack, cu in PACKS.items():
            for balance in ("documents", "zigzag"):
                layout = PackedLayout.build(cu, world, balance=balance)
                out.append((f"packed-{pack}-{balance}-P{world}", layout, layout.seq_len))
    # The 2-D strategy's view: blocks of consecutive ranks as the places of its ring.
    for base_id, base, seq_len in [c for c in out if c[1].world == 4]:
        for size in (1, 2, 4):
            out.append((f"grouped{size}-{base_id}", GroupedLayout(base, size), seq_len))
    return out


CASES = _layouts()
