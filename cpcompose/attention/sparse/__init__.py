"""Indexer-selected (sparse top-k) attention under CP, in one room: what the indexer sees (`selection.py`:
the global row, the per-document top-k), the selected rows' request plan for comm's row fetch
(`selected_rows.py`), their bytes and the choice between them and every row (`cost.py`), and the call
(`call.py`: `attend_selected`). It sits above `call/` (it takes `CPOptions`); nothing below imports it."""

__all__: list[str] = []
