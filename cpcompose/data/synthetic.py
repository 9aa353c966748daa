"""A long-context associative-recall task, generated on the fly.

Ids ``0 .. num_symbols-1`` are ordinary symbols; BOS, KEY, QUERY and FILL follow them. A sample::

    BOS  .. KEY k1 v1 .. KEY k2 v2 .. (filler) ..  QUERY k2 v2  QUERY k1 v1 ...
    |<---- pairs: first key_fraction of the sequence ---->|     |<-- last 3*num_queries -->|

Keys are distinct within a sample, values are random, and each query repeats one of the keys followed
by its value. Only the answers carry a loss: ``labels[t] = v`` where ``input_ids[t]`` is a queried key
(position ``t`` predicts the next token, the value), -100 everywhere else. The value after a key in
the pairs is not supervised: it is random, so the only loss would be noise. A value is therefore
predictable only by finding ``KEY k`` far back in the sequence; with the default key_fraction 0.5 and
the zigzag layout the pairs lie in chunks held by every cp rank, so a model that learns the task
provably attends across context-parallel shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from cpcompose.data._rng import seeded_generator
from cpcompose.data.batch import IGNORE_INDEX, ParamProblem, Sample

__all__ = ["SyntheticRecall", "recall_task_problem"]


def recall_task_problem(*, seq_len: int, num_pairs: int, num_queries: int, key_fraction: float) -> ParamProblem | None:
    """Why the pairs or the queries do not fit in ``seq_len`` tokens, or None if they do.

    The pairs take three-token slots after BOS within the first ``int(key_fraction * seq_len)``
    tokens; the queries take the last ``3 * num_queries`` tokens, after the pairs.
    """
    key_end = int(key_fraction * seq_len)
    if _num_slots(key_end) < num_pairs:
        return ParamProblem("num_pairs", f"{num_pairs} triples (KEY k v) do not fit in the first {key_end} tokens")
    if seq_len - 3 * num_queries < key_end:
        return ParamProblem(
            "num_queries", f"{num_queries} triples (QUERY k v) do not fit after the first {key_end} tokens"
        )
    return None


def _num_slots(key_end: int) -> int:
    return (key_end - 1) // 3  # three-token slots after BOS


@dataclass(frozen=True)
class SyntheticRecall:
    """Sample ``i`` is a pure function of ``(seed, i)``: no state, no global RNG."""

    seq_len: int
    """Tokens per sample."""
    seed: int = 0
    """Mixed into every sample's generator."""
    num_symbols: int = 256
    """Ordinary symbols used for keys, values and random filler."""
    num_pairs: int = 16
    """KEY k v triples per sample."""
    num_queries: int = 4
    """QUERY k v triples at the end; at most num_pairs, each asks a different key."""
    key_fraction: float = 0.5
    """The pairs lie in the first ``int(key_fraction * seq_len)`` tokens."""
    filler: Literal["random", "constant"] = "random"
    """random: uniform symbols between the pairs; constant: the FILL token (an easier task)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_queries <= self.num_pairs <= self.num_symbols:
            raise ValueError(f"need 1 <= num_queries ({self.num_queries}) <= num_pairs ({self.num_pairs}) "
                             f"<= num_symbols ({self.num_symbols})")
        problem = recall_task_problem(seq_len=self.seq_len, num_pairs=self.num_pairs, num_queries=self.num_queries,
                                      key_fraction=self.key_fraction)
        if problem:
            raise ValueError(f"{problem.param}: {problem.reason}")

    @property
    def bos_id(self) -> int:
        """Begin-of-sequence token."""
        return self.num_symbols

    @property
    def key_id(self) -> int:
        """Marker before each key/value pair."""
        return self.num_symbols + 1

    @property
    def query_id(self) -> int:
        """Marker before each query."""
        return self.num_symbols + 2

    @property
    def fill_id(self) -> int:
        """Filler token when ``filler == "constant"``."""
        return self.num_symbols + 3

    @property
    def vocab_size(self) -> int:
        """Smallest model vocabulary that covers every id."""
        return self.num_symbols + 4

    @property
    def _key_end(self) -> int:
        return int(self.key_fraction * self.seq_len)

    def sample(self, index: int) -> Sample:
        """The sample at global position ``index``."""
        g = seeded_generator(self.seed, index)
        n, q = self.num_pairs, self.num_queries
        if self.filler == "random":
            ids = torch.randint(0, self.num_symbols, (self.seq_len,), generator=g)
        else:
            ids = torch.full((self.seq_len,), self.fill_id)
        ids[0] = self.bos_id
        starts = 1 + 3 * torch.randperm(_num_slots(self._key_end), generator=g)[:n].sort().values
        keys = torch.randperm(self.num_symbols, generator=g)[:n]
        values = torch.randint(0, self.num_symbols, (n,), generator=g)
        ids[starts], ids[starts + 1], ids[starts + 2] = self.key_id, keys, values

        asked = torch.randperm(n, generator=g)[:q]
        qstarts = self.seq_len - 3 * q + 3 * torch.arange(q)
        ids[qstarts], ids[qstarts + 1], ids[qstarts + 2] = self.query_id, keys[asked], values[asked]
        labels = torch.full((self.seq_len,), IGNORE_INDEX)
        labels[qstarts + 1] = values[asked]
        return Sample(input_ids=ids, labels=labels)
