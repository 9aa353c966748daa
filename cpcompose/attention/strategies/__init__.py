"""The CP strategies (ring, all-gather, all-to-all, 2-D, indexer-selected rows): how K/V (or heads) move
between ranks and which local blocks each rank runs; `registry.py` names them."""

__all__: list[str] = []
