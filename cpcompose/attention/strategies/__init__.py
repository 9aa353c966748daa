"""The CP strategies (ring, all-gather, all-to-all, 2-D): how K/V (or heads) move between ranks and which
local blocks each rank runs; `registry.py` names them. Indexer-selected rows live in `attention/sparse/`."""

__all__: list[str] = []
