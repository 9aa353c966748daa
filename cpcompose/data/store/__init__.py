"""Token stores: a corpus tokenized once into memory-mapped files, read by every rank without loading it.

The default way to read data.source = "text": kept in data.store_dir, else the per-user cache (:func:`store_dir`).
A store per source (tokens, document offsets, origins, loss masks, and a manifest of how it was made); a sample
index per store and row length (best-fit packed rows); sources mixed by weight. See :func:`store_mixture`.
"""

from cpcompose.data.store.cache import store_dir, user_cache_folder
from cpcompose.data.store.ensure import StoreOutcome, cached_store_folder, source_store
from cpcompose.data.store.index import PackPlan, RowIndex, row_index
from cpcompose.data.store.mixture import MixtureSource, apportion, schedule
from cpcompose.data.store.packed import PackedSource
from cpcompose.data.store.packing import best_fit_rows, pieces_of
from cpcompose.data.store.sources import StoreMixture, source_tables, store_mixture, uses_store
from cpcompose.data.store.tokens import TokenStore

__all__ = [
    "MixtureSource", "PackPlan", "PackedSource", "RowIndex", "StoreMixture", "StoreOutcome", "TokenStore",
    "apportion", "best_fit_rows", "cached_store_folder", "pieces_of", "row_index", "schedule", "source_store",
    "source_tables", "store_dir", "store_mixture", "user_cache_folder", "uses_store",
]
