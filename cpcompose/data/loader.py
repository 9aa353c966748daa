"""Batches for one data-parallel rank, with an exactly resumable position."""

from __future__ import annotations

from typing import Any

from cpcompose.config import ConfigError, JobConfig
from cpcompose.data.batch import Batch, SampleSource
from cpcompose.data.copy_task import SyntheticCopy, copy_task_problem
from cpcompose.data.corpus import build_corpus_source, build_corpus_stores
from cpcompose.data.synthetic import SyntheticRecall, recall_task_problem
from cpcompose.data.tokenizer import config_tokenizer, tokenizer_choice

__all__ = ["TokenBatcher", "build_data_source", "build_token_stores", "data_config_error"]


class TokenBatcher:
    """Endless iterator of micro-batches for data-parallel rank ``dp_rank`` of ``dp_size``.

    Micro-step ``s`` covers the global sample indices ``[s*G, (s+1)*G)`` with ``G = batch_size *
    dp_size``; rank ``r`` takes the slice ``[s*G + r*batch_size, s*G + (r+1)*batch_size)``, so the dp
    ranks' shares are disjoint and together form one stream that does not depend on ``dp_size``.
    Context-, tensor- and pipeline-parallel ranks with the same dp rank get the same full sequences;
    the trainer shards them along the sequence.
    """

    def __init__(self, source: SampleSource, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        """``batch_size`` is this rank's micro-batch (sequences per ``next()``).

        Raises:
            ValueError: a non-positive size or a dp_rank outside ``[0, dp_size)``.
        """
        if batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= dp_rank < dp_size, got {batch_size=}, "
                             f"{dp_rank=}, {dp_size=}")
        self.source, self.batch_size, self.dp_rank, self.dp_size = source, batch_size, dp_rank, dp_size
        self._next_index = 0  # global index of the first sample of the next micro-step, on every rank

    @property
    def global_batch_size(self) -> int:
        """Sequences consumed by all dp ranks together per ``next()``."""
        return self.batch_size * self.dp_size

    def __iter__(self) -> TokenBatcher:
        return self

    def __next__(self) -> Batch:
        first = self._next_index + self.dp_rank * self.batch_size
        batch = Batch.stack([self.source.sample(first + i) for i in range(self.batch_size)])
        self._next_index += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position, identical on every rank, so one copy resumes them all."""
        return {"next_index": self._next_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where :meth:`state_dict` was taken, even with another dp split of the same
        global micro-batch.

        Raises:
            ValueError: the saved position is not a whole number of this loader's global micro-batches.
        """
        index = int(state["next_index"])
        if index < 0 or index % self.global_batch_size:
            raise ValueError(f"saved data position {index} is not a multiple of the global micro-batch "
                             f"{self.global_batch_size}: keep training.batch_size and grad_accum_steps when resuming")
        self._next_index = index


def data_config_error(config: JobConfig) -> ConfigError | None:
    """Why the data sources cannot serve `config` (the synthetic task's parameters), naming the key, or None."""
    t, d = config.training, config.data
    if d.source != "synthetic":
        return None
    problem = copy_task_problem(t.seq_len) if d.task == "copy" else recall_task_problem(
        seq_len=t.seq_len, num_pairs=d.num_pairs, num_queries=d.num_queries, key_fraction=d.key_fraction)
    if problem is None:
        return None
    key = "training.seq_len" if problem.param == "seq_len" else f"data.{problem.param}"
    return ConfigError(f"{key}: {problem.reason}")


def _vocab_error(config: JobConfig, vocab: int, what: str) -> ConfigError | None:
    """model.vocab_size must cover the data's ids. For a model read from a folder (model.path) it is the model's
    own vocabulary (its config.json's), so the tokenizer is what to change."""
    m = config.model
    if vocab <= m.vocab_size:
        return None
    if m.path is not None:
        choice = tokenizer_choice(config)
        return ConfigError(f"{choice.key}: the tokenizer {choice.path or '(byte-level)'} has {vocab} ids, more than the "
                           f"model's vocabulary of {m.vocab_size} ({m.path}/config.json); leave data.tokenizer unset "
                           "to use the model's own")
    return ConfigError(f"model.vocab_size: {m.vocab_size} does not cover the {vocab} ids of {what}; "
                       f"set --model.vocab_size={vocab} or more")


def build_token_stores(config: JobConfig) -> list[str]:
    """Build (or reuse) the token store of every source, before any rank starts: the tokenizer and the vocabulary
    checked first, then the files tokenized once (see :func:`cpcompose.data.corpus.build_corpus_stores`); in memory
    (data.store = false) the records are checked instead, and synthetic data checks its task and vocabulary.

    Returns:
        The lines the launch banner shows about what the check did: each token store reused, built or rebuilt.
    Raises:
        ConfigError: naming the key to change (and the file, line or row of a bad record).
    """
    if config.data.source == "synthetic":
        build_data_source(config, dp_rank=0, dp_size=1)  # cheap: checks the task and the vocabulary
        return []
    tokenizer = config_tokenizer(config)
    if (error := _vocab_error(config, tokenizer.vocab_size, "the tokenizer")) is not None:
        raise error
    return build_corpus_stores(config, tokenizer)


def build_data_source(config: JobConfig, *, dp_rank: int, dp_size: int) -> TokenBatcher:
    """The loader of one data-parallel rank, as ``config.data`` describes.

    Args:
        config: the run configuration; its ``training.batch_size`` is global (see the field's doc).
        dp_rank: this rank's coordinate on the dp (= dp_replicate x dp_shard) mesh.
        dp_size: the dp mesh size.
    Raises:
        ConfigError: the task does not fit, the batch does not split over dp, the data has a bad file or record,
            or model.vocab_size does not cover the data.
    """
    t, d = config.training, config.data
    if (error := data_config_error(config)) is not None:
        raise error
    split = dp_size * t.grad_accum_steps
    if t.batch_size % split:
        raise ConfigError(f"training.batch_size: {t.batch_size} must be divisible by "
                          f"dp_size * grad_accum_steps = {split}")
    source: SampleSource
    if d.source == "synthetic":
        if d.task == "copy":
            source = SyntheticCopy(seq_len=t.seq_len, seed=config.job.seed, num_symbols=d.num_symbols)
        else:
            source = SyntheticRecall(seq_len=t.seq_len, seed=config.job.seed, num_symbols=d.num_symbols,
                                     num_pairs=d.num_pairs, num_queries=d.num_queries,
                                     key_fraction=d.key_fraction, filler=d.filler)
        vocab, what = source.vocab_size, "data.source = 'synthetic'"
    else:
        tokenizer = config_tokenizer(config)
        vocab, what = tokenizer.vocab_size, "the tokenizer"
    if (error := _vocab_error(config, vocab, what)) is not None:
        raise error
    if d.source == "text":
        source = build_corpus_source(config, tokenizer)
    return TokenBatcher(source, batch_size=t.batch_size // split, dp_rank=dp_rank, dp_size=dp_size)
