"""The run's data from token stores: one source (data.path) or a weighted mixture ([[data.sources]]), each
packed by best fit (data.pack, completion, chat) or cut into windows (plain text without data.pack)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.store.build import Opener
from cpcompose.data.store.cache import store_dir
from cpcompose.data.store.ensure import StoreOutcome, source_store
from cpcompose.data.store.index import PackPlan, row_index
from cpcompose.data.store.mixture import MixtureSource, source_seed
from cpcompose.data.store.packed import PackedSource
from cpcompose.data.store.summary import save_length_histogram, summary_lines
from cpcompose.data.store.tokens import TokenStore
from cpcompose.data.text import TextSource
from cpcompose.data.tokenizer import Tokenizer

__all__ = ["StoreMixture", "source_tables", "store_mixture", "uses_store"]


def uses_store(config: JobConfig) -> bool:
    """Whether the text data is read through token stores (data.store, the default), not tokenized in memory."""
    return config.data.source == "text" and config.data.store


def source_tables(config: JobConfig) -> list[dict[str, Any]]:
    """[[data.sources]], or data.path as the one source of weight 1."""
    d = config.data
    return d.sources or [{"path": d.path, "weight": 1.0, "long_doc_tokens": None, "long_doc_repeat": 1}]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StoreMixture(MixtureSource):
    """The mixture and what the banner shows of it (:meth:`summary`)."""

    def __init__(self, sources: list, sizes: list[int], weights: list[float], stores: list[TokenStore],
                 tables: list[dict[str, Any]], outcomes: list[StoreOutcome]) -> None:
        super().__init__(sources, sizes, weights)
        self.stores, self.tables, self.outcomes = stores, tables, outcomes

    def summary(self, num_samples: int | None = None) -> list[dict[str, Any]]:
        """Per source, plain data: its path and store, documents, tokens, samples per epoch of its own, share of
        the mixture, and (given the run's ``num_samples``) how many of its own epochs the run makes."""
        rows = []
        for s, (store, table) in enumerate(zip(self.stores, self.tables)):
            share = int(self.counts[s]) / self.epoch_length
            rows.append({"path": table["path"], "store": str(store.folder), "documents": store.num_docs,
                         "tokens": store.num_tokens, "samples_per_epoch": self.sizes[s], "share": share,
                         "epochs": None if num_samples is None else num_samples * share / self.sizes[s]})
        return rows

    def report(self, num_samples: int | None, png: Path | None) -> list[str]:
        """The banner's lines about the data; with ``png``, the length histogram drawn there (named last)."""
        lines = summary_lines(self.summary(num_samples))
        if png is not None:
            save_length_histogram(self.stores, [t["path"] for t in self.tables], png)
            lines.append(f"data lengths: {png}")
        return lines


def store_mixture(config: JobConfig, tokenizer: Tokenizer, *, emit: Callable[[str], None] | None = _stderr,
                  opener: Opener | None = None) -> StoreMixture:
    """Open (building when needed) every source's store and sample index, and mix them.

    Raises:
        ConfigError: naming the key, file and line to change (see :func:`source_store` and :func:`row_index`).
    """
    d, t = config.data, config.training
    root = store_dir(d)
    tables = source_tables(config)
    sources, sizes, stores, outcomes = [], [], [], []
    for n, table in enumerate(tables):
        key = "data.path" if not d.sources else f"data.sources[{n}]"
        if table["long_doc_tokens"] is not None and not d.pack:
            raise ConfigError(f"{key}.long_doc_tokens: upsampling by length applies to packed rows; set data.pack = "
                              "true (or use completion/chat records)")
        store, outcome = source_store(table["path"], d, tokenizer, store_dir=root, wait_s=d.store_wait_s, emit=emit,
                                      opener=opener)
        seed = source_seed(config.job.seed, n) if d.sources else config.job.seed
        if d.pack:
            plan = PackPlan(t.seq_len, d.truncate, table["long_doc_tokens"], table["long_doc_repeat"])
            index = row_index(store, plan, root or store.folder, wait_s=d.store_wait_s)
            source: Any = PackedSource(store, index, seq_len=t.seq_len, seed=seed)
            size = index.num_rows
        else:
            source = TextSource(torch.from_numpy(store.tokens), torch.from_numpy(store.offsets[:-1]),
                                seq_len=t.seq_len, seed=seed, path=table["path"])
            size = source.num_windows
        sources.append(source)
        sizes.append(size)
        stores.append(store)
        outcomes.append(outcome)
    return StoreMixture(sources, sizes, [t["weight"] for t in tables], stores, tables, outcomes)
